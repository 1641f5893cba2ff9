"""The byte-plane kernels (deltackpt.kernels.byteplane) against their numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deltackpt.kernels.byteplane import (
    merge_planes,
    numpy_entropy_bits,
    numpy_merge_planes,
    numpy_split_planes,
    sampled_entropy_bits,
    split_planes,
)

WORD_DTYPES = [np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")]
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _words(dtype: np.dtype, n: int, seed: int, pattern: str) -> np.ndarray:
    """``n`` words of ``dtype`` following a named pattern (random, constants, real-looking floats)."""
    rng = np.random.default_rng(seed)
    bits = 8 * dtype.itemsize
    if pattern == "random":
        return rng.integers(0, 2**bits - 1, n, dtype=dtype, endpoint=True)
    if pattern == "zeros":
        return np.zeros(n, dtype)
    if pattern == "ones":
        return np.full(n, np.iinfo(dtype).max, dtype)
    if pattern == "sign_bits":  # only the top bit or the bottom bit set
        return np.where(rng.integers(0, 2, n).astype(bool), dtype.type(1) << dtype.type(bits - 1),
                        dtype.type(1)).astype(dtype)
    float_dtype = {2: np.float16, 4: np.float32, 8: np.float64}[dtype.itemsize]
    return (rng.standard_normal(n) * 0.02).astype(float_dtype).view(dtype)


words_strategy = st.builds(
    _words,
    dtype=st.sampled_from(WORD_DTYPES),
    n=st.one_of(st.integers(0, 16), st.integers(0, 5000)),
    seed=st.integers(0, 2**32 - 1),
    pattern=st.sampled_from(["random", "zeros", "ones", "sign_bits", "floats"]),
)
small_words_strategy = st.sampled_from(WORD_DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, st.integers(0, 40)))


def _split(words: np.ndarray, rotate: bool) -> np.ndarray:
    planes = np.empty((words.dtype.itemsize, words.size), dtype=np.uint8)
    split_planes(words, rotate, planes)
    return planes


def _merge(planes: np.ndarray, rotate: bool, dtype: np.dtype) -> np.ndarray:
    words = np.empty(planes.shape[1], dtype=dtype)
    merge_planes(planes, rotate, words)
    return words


@SETTINGS
@given(words=st.one_of(words_strategy, small_words_strategy), rotate=st.booleans())
def test_split_matches_numpy_reference(words: np.ndarray, rotate: bool) -> None:
    """split_planes writes exactly the planes numpy_split_planes computes."""
    planes = _split(words, rotate)
    expected = numpy_split_planes(words, rotate)
    assert planes.shape == expected.shape == (words.dtype.itemsize, words.size)
    np.testing.assert_array_equal(planes, expected)


@SETTINGS
@given(words=st.one_of(words_strategy, small_words_strategy), rotate=st.booleans())
def test_merge_matches_numpy_reference_and_inverts_split(words: np.ndarray, rotate: bool) -> None:
    """merge_planes equals numpy_merge_planes, and merge(split(x)) == x bit for bit."""
    planes = numpy_split_planes(words, rotate)
    merged = _merge(planes, rotate, words.dtype)
    expected = numpy_merge_planes(planes, rotate, words.dtype)
    assert merged.dtype == expected.dtype == words.dtype
    np.testing.assert_array_equal(merged, expected)
    assert merged.tobytes() == words.tobytes()
    assert _merge(_split(words, rotate), rotate, words.dtype).tobytes() == words.tobytes()


@SETTINGS
@given(planes=st.integers(1, 8).flatmap(lambda e: hnp.arrays(
    np.uint8, st.tuples(st.just(e), st.integers(0, 3000)),
    elements=st.integers(0, 255) | st.sampled_from([0, 255]))), data=st.data())
def test_sampled_entropy_matches_reference(planes: np.ndarray, data: st.DataObject) -> None:
    """sampled_entropy_bits is the order-0 entropy of bytes 0, stride, 2*stride, ... of each plane."""
    stride = data.draw(st.integers(1, planes.shape[1] + 2))
    bits = sampled_entropy_bits(planes, stride)
    assert bits.shape == (planes.shape[0],)
    np.testing.assert_allclose(bits, numpy_entropy_bits(planes, stride), atol=1e-9)
    assert ((bits >= 0) & (bits <= 8 + 1e-9)).all()


def test_sampled_entropy_known_values() -> None:
    """Constant plane: 0 bits; two equally likely bytes: 1 bit; all 256 bytes once: 8 bits."""
    planes = np.stack([np.zeros(256, np.uint8), np.tile([3, 9], 128).astype(np.uint8),
                       np.arange(256, dtype=np.uint8)])
    np.testing.assert_allclose(sampled_entropy_bits(planes, 1), [0.0, 1.0, 8.0], atol=1e-12)


@pytest.mark.parametrize(("dtype", "word", "rotate", "planes"), [
    # rotate left by one: the sign (top bit) goes to bit 0, so 0x8000_0001 -> 0x0000_0003
    ("<u4", 0x8000_0001, True, [0x00, 0x00, 0x00, 0x03]),
    ("<u4", 0x8000_0001, False, [0x80, 0x00, 0x00, 0x01]),
    # float32 1.0 = 0x3F80_0000 -> rotated 0x7F00_0000: the whole exponent in the top byte
    ("<u4", 0x3F80_0000, True, [0x7F, 0x00, 0x00, 0x00]),
    ("<u2", 0xC001, True, [0x80, 0x03]),
    ("<u2", 0x1234, False, [0x12, 0x34]),
    ("<u8", 0x8123_4567_89AB_CDEF, True, [0x02, 0x46, 0x8A, 0xCF, 0x13, 0x57, 0x9B, 0xDF]),
    ("<u8", 0x0102_0304_0506_0708, False, [1, 2, 3, 4, 5, 6, 7, 8]),
])
def test_known_planes(dtype: str, word: int, rotate: bool, planes: list[int]) -> None:
    """Hand-computed examples of the spec: rotate left by one, most significant byte first."""
    words = np.array([word], dtype=dtype)
    expected = np.array(planes, dtype=np.uint8)[:, None]
    np.testing.assert_array_equal(_split(words, rotate), expected)
    np.testing.assert_array_equal(numpy_split_planes(words, rotate), expected)
    assert int(_merge(expected, rotate, words.dtype)[0]) == word


def test_unaligned_words() -> None:
    """Word arrays that are unaligned views of a byte buffer split and merge correctly too."""
    buf = np.random.default_rng(3).integers(0, 256, 8 * 1000 + 1, dtype=np.uint8)
    for dtype in WORD_DTYPES:
        words = buf[1 : 1 + dtype.itemsize * 1000].view(dtype)
        for rotate in (False, True):
            planes = _split(words, rotate)
            np.testing.assert_array_equal(planes, numpy_split_planes(words, rotate))
            assert _merge(planes, rotate, dtype).tobytes() == words.tobytes()
