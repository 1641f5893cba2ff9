"""The ``patch`` chunk (FORMAT.md 3.6): RNG states as their base's bytes twisted on and XORed.

The twist kernel is checked against numpy's and Python's own Mersenne Twisters and the numpy
reference; the codec on the states torch, numpy and ``random`` hold after real draws.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deltackpt.codecs.patch import apply_patch, encode_patch
from deltackpt.encode.device import reconstruction_bytes
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.format.metadata import MAX_TWISTS
from deltackpt.kernels.mersenne import numpy_twist, twist, twists_between


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy()


def test_twist_is_that_of_numpy_and_python() -> None:
    """One twist of a state is what numpy's ``RandomState`` and Python's ``random`` do when
    their 624 words are used up; the kernel, on a strided view too, and the reference agree."""
    keys = np.random.RandomState(7).get_state()[1].copy()
    rs = np.random.RandomState()
    rs.set_state(("MT19937", keys, 624))
    rs.random_sample()  # the first draw past the end twists
    numpy_twisted = rs.get_state()[1]
    python = random.Random()
    python.setstate((3, (*map(int, keys), 624), None))
    python.getrandbits(32)
    assert np.array_equal(np.array(python.getstate()[1][:624], np.uint32), numpy_twisted)
    assert np.array_equal(numpy_twist(keys), numpy_twisted)
    words = keys.copy()
    twist(words, 1)
    assert np.array_equal(words, numpy_twisted)
    slots = np.zeros(2 * 624, np.uint32)  # torch's layout: each word in a 64-bit slot
    slots[::2] = keys
    twist(slots[::2], 3)
    expected = keys
    for _ in range(3):
        expected = numpy_twist(expected)
    assert np.array_equal(slots[::2], expected) and not slots[1::2].any()


def test_twists_between_finds_the_fewest_in_the_first_candidate_that_has_them() -> None:
    rng = np.random.default_rng(0)
    state = rng.integers(0, 2**32, 624, dtype=np.uint32)
    later = state.copy()
    twist(later, 37)
    decoy = rng.integers(0, 2**32, 624, dtype=np.uint32)
    bases = np.stack([decoy, state])
    assert twists_between(bases, np.stack([later, later]), 100) == (1, 37)
    assert twists_between(np.stack([state]), np.stack([later]), 36) == (-1, -1)


def _torch_states(draws: int) -> tuple[np.ndarray, np.ndarray]:
    torch.manual_seed(3)
    torch.rand(10)
    base = _bytes(torch.get_rng_state().numpy())
    torch.rand(draws)
    return base, _bytes(torch.get_rng_state().numpy())


@pytest.mark.parametrize("draws", [5, 700, 100_000])
def test_torch_state_patches_to_tens_of_bytes(draws: int) -> None:
    """torch's CPU generator state (5056 bytes) after a few draws (its counters alone change)
    or many (twisted on): a patch of tens of bytes that restores it bit for bit."""
    base, raw = _torch_states(draws)
    chunk = encode_patch(raw, base, integers=True)
    assert chunk.length < 64, chunk.length
    assert bool(chunk.params) == (draws > 600)
    if chunk.params:
        assert chunk.params["offset"] == 24 and chunk.params["word"] == 8
    out = base.copy()
    apply_patch(memoryview(b"".join(chunk.parts)), chunk.params, out, "test")
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("library", ["numpy", "python"])
def test_numpy_and_python_states_patch_to_nothing_or_a_few_bytes(library: str) -> None:
    """numpy's keys (624 words, its position kept apart) twisted on patch to no stored bytes;
    ``random``'s 625 words (the position last) to the position's few."""
    if library == "numpy":
        rs = np.random.RandomState(1)
        base = _bytes(rs.get_state()[1])
        rs.random_sample(5000)
        raw = _bytes(rs.get_state()[1])
    else:
        gen = random.Random(1)
        base = _bytes(np.array(gen.getstate()[1], np.uint32))
        for _ in range(5000):
            gen.random()
        raw = _bytes(np.array(gen.getstate()[1], np.uint32))
    chunk = encode_patch(raw, base, integers=True)
    assert chunk.params["word"] == 4 and chunk.params["offset"] == 0
    assert chunk.length == 0 if library == "numpy" else 0 < chunk.length < 40
    out = base.copy()
    apply_patch(memoryview(b"".join(chunk.parts)), chunk.params, out, "test")
    assert np.array_equal(out, raw)


def test_states_twisted_past_the_bound_or_not_integers_are_patched_untwisted() -> None:
    """A state more than MAX_TWISTS twists on, or bytes of floats, are XORed with their base
    untwisted (the encoder then keeps the lossless chunk where that is smaller)."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, 624, dtype=np.uint32)
    later = words.copy()
    twist(later, MAX_TWISTS + 1)
    for integers, base, raw in [(True, words, later), (False, words, numpy_twist(words))]:
        chunk = encode_patch(_bytes(raw), _bytes(base), integers=integers)
        assert chunk.params == {} and chunk.length > 2000
        out = _bytes(base)
        apply_patch(memoryview(b"".join(chunk.parts)), chunk.params, out, "test")
        assert np.array_equal(out, _bytes(raw))


def test_kept_bytes_count_in_a_writers_memory() -> None:
    """``reconstruction_bytes`` (``mgr.reconstruction_bytes``) counts the bytes a
    reconstruction keeps for patches beside its running values, each array once."""
    values, kept = np.zeros(100, np.float32), np.zeros(5056, np.uint8)
    recon = Reconstruction(1, 0, {}, {"w": values}, kept={("rng/torch", 0): kept})
    assert reconstruction_bytes(recon, recon) == {"cpu": 400 + 5056}


def test_counters_are_no_candidate_states() -> None:
    """Integers that all change but are no uniform words (a buffer of counters, each one up)
    are not searched for twists: a plain XOR patch, found at once."""
    base = np.arange(1, 2001, dtype=np.int64)
    chunk = encode_patch(_bytes(base + 1), _bytes(base), integers=True)
    assert chunk.params == {}
