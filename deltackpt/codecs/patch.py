"""The ``patch`` chunk of delta steps: the bytes a tensor had in the step's base, the random
generator's state they may hold twisted on, XORed with the bytes that still differ
(docs/FORMAT.md, section 3.6).

A delta stores RNG states exactly, and every save of a run that draws numbers changes them:
torch's CPU generator, 5 KB, took 2.6 KB of each delta of a small CNN's run (12% of it).
Between two saves such a state has moved on by whole twists of its Mersenne Twister
(:mod:`deltackpt.kernels.mersenne`) and a few counters; stored as the count of twists and the
XOR of the counters, it takes tens of bytes. A state only a few numbers apart from its base's
(a run that seeds its data loader's shuffle from torch's generator once an epoch) differs in
its counters alone. A patch chunk decodes only through the restore chain
(:mod:`deltackpt.restore.chain`), which has the base's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltackpt.codecs.base import EncodedChunk
from deltackpt.codecs.lossless import zstd_compress, zstd_decompress
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import (
    MAX_PATCH_BYTES,
    MAX_TWISTS,
    MT19937_WORDS,
    PATCH_WORDS,
    TensorRecord,
)
from deltackpt.format.metadata import PATCH as NAME
from deltackpt.kernels.mersenne import twist, twists_between

MAX_WINDOWS = 4  # candidate states a writer searches for twists, at most MAX_TWISTS each


def kept_for_patches(record: TensorRecord) -> bool:
    """Whether a writer, or a restore it continues from, keeps the bytes of a tensor stored
    whole for later patches: an integer tensor (RNG states) of at most ``MAX_PATCH_BYTES``."""
    return spec_named(record.dtype).integer and record.nbytes <= MAX_PATCH_BYTES


def encode_patch(raw: np.ndarray, base: np.ndarray, integers: bool) -> EncodedChunk:
    """``raw`` (a chunk's uint8 bytes) as a patch on ``base``, the same chunk's bytes in the
    base step, which differ from them. Where the tensor holds ``integers``, the first window of
    ``base`` that twisting takes to ``raw``'s is twisted first (:func:`_twisted`)."""
    params: dict[str, Any] = {}
    moved = base
    found = _twisted(raw, base) if integers else None
    if found is not None:
        params, moved = found
    diff = np.bitwise_xor(raw, moved)
    return EncodedChunk(NAME, params, [zstd_compress(diff)] if not params or diff.any() else [])


def apply_patch(stored: memoryview, params: dict[str, Any], out: np.ndarray, what: str) -> None:
    """Patch ``out``, the chunk's bytes in the base step (uint8), into the chunk's own, in
    place; ``params`` are checked with the metadata (FORMAT.md 3.6)."""
    if params:
        twist(_state(out, params["offset"], params["word"]), params["twists"])
    if len(stored):
        out ^= np.frombuffer(zstd_decompress(stored, out.size, what), np.uint8)


def _state(data: np.ndarray, offset: int, word: int) -> np.ndarray:
    """The 624 32-bit words of a Mersenne Twister state held in words of ``word`` bytes from
    byte ``offset`` of ``data`` (uint8; little-endian, so a 64-bit word's low half first): a
    writable view."""
    return data[offset:offset + MT19937_WORDS * word].view(np.uint32)[::word // 4]


def _windows(raw: np.ndarray, base: np.ndarray) -> list[tuple[int, int]]:
    """Where ``base`` and ``raw`` may hold a Mersenne Twister state and the same state twisted
    on, as ``(offset, word)``: 624 aligned words of ``word`` bytes that all differ between them
    (a twist changes every word), none over 32 bits, and in each a quarter or more with their
    top bit set (a state's words are uniform: fewer has odds of about 1e-39), which counters
    and other small integers are not. The first :data:`MAX_WINDOWS`."""
    found: list[tuple[int, int]] = []
    for word in PATCH_WORDS:
        count = raw.size // word
        if count < MT19937_WORDS:
            continue
        dtype = np.dtype(f"<u{word}")
        a, b = raw[:count * word].view(dtype), base[:count * word].view(dtype)
        fits = a != b
        if word > 4:
            fits &= ((a | b) >> np.uint64(32)) == 0
        windows = [_window_sums(fits)]
        windows += [_window_sums((x >> x.dtype.type(31)) & 1) for x in (a, b)]
        starts = np.flatnonzero((windows[0] == MT19937_WORDS) & (windows[1] >= MT19937_WORDS // 4)
                                & (windows[2] >= MT19937_WORDS // 4))
        found += [(int(start) * word, word) for start in starts[:MAX_WINDOWS]]
    return found[:MAX_WINDOWS]


def _window_sums(x: np.ndarray) -> np.ndarray:
    """The sum of every 624 consecutive elements of ``x``, by the first's index."""
    runs = np.concatenate(([0], np.cumsum(x, dtype=np.int64)))
    return runs[MT19937_WORDS:] - runs[:-MT19937_WORDS]


def _twisted(raw: np.ndarray, base: np.ndarray) -> tuple[dict[str, Any], np.ndarray] | None:
    """The params of the fewest twists, at most :data:`MAX_TWISTS`, of a window of ``base``
    (:func:`_windows`) that give ``raw``'s, and ``base`` with that window twisted; None if no
    window's do."""
    windows = _windows(raw, base)
    if not windows:
        return None
    states = np.stack([_state(base, offset, word) for offset, word in windows])
    targets = np.stack([_state(raw, offset, word) for offset, word in windows])
    c, twists = twists_between(states, targets, MAX_TWISTS)
    if c < 0:
        return None
    offset, word = windows[c]
    moved = base.copy()
    _state(moved, offset, word)[:] = states[c]
    return {"twists": int(twists), "offset": offset, "word": word}, moved
