"""Byte-plane split and merge: the transform behind the lossless ``byteplane`` codec.

An IEEE float's exponent is far more predictable than its mantissa. Rotating
each element left by one bit puts the whole exponent into the top byte (and
the sign into bit 0); splitting the elements into byte planes, most
significant first, then gives zstd one highly compressible stream and a few
incompressible ones that can be stored raw (docs/FORMAT.md, section 3).

Kernels work on unsigned integer views of the data (uint16/32/64) and are
compiled with ``nogil=True`` so the codec can run chunks on several threads
at once. The ``numpy_*`` functions are the executable spec the tests compare
the kernels against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit


def _specialize(n_planes: int) -> tuple[Callable, Callable]:
    """Compile split and merge for ``n_planes``-byte elements.

    Numba freezes closure variables into compile-time constants, so the loop
    over planes unrolls; with ``n_planes`` as a run-time value the kernels are
    about ten times slower. Each specialization only ever sees its own word
    dtype, so its cache entry cannot be confused with another width's.
    """
    top = np.uint64(8 * n_planes - 1)
    one = np.uint64(1)
    byte = np.uint64(0xFF)

    @njit(cache=True, nogil=True)
    def split(words: np.ndarray, rotate: bool, planes: np.ndarray) -> None:
        for i in range(words.shape[0]):
            x = np.uint64(words[i])
            if rotate:
                x = (x << one) | (x >> top)
            for p in range(n_planes):
                planes[p, i] = np.uint8((x >> np.uint64(8 * (n_planes - 1 - p))) & byte)

    @njit(cache=True, nogil=True)
    def merge(planes: np.ndarray, rotate: bool, words: np.ndarray) -> None:
        for i in range(words.shape[0]):
            x = np.uint64(0)
            for p in range(n_planes):
                x |= np.uint64(planes[p, i]) << np.uint64(8 * (n_planes - 1 - p))
            if rotate:
                x = (x >> one) | (x << top)
            words[i] = x

    return split, merge


_KERNELS = {n: _specialize(n) for n in (2, 4, 8)}


def split_planes(words: np.ndarray, rotate: bool, planes: np.ndarray) -> None:
    """Write byte ``E-1-p`` of each (optionally rotated) element into ``planes[p]``.

    ``words`` is a 1-d uint16/uint32/uint64 array of E-byte elements and
    ``planes`` a preallocated C-contiguous ``(E, len(words))`` uint8 array.
    """
    _KERNELS[words.dtype.itemsize][0](words, rotate, planes)


def merge_planes(planes: np.ndarray, rotate: bool, words: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: rebuild ``words`` in place from ``planes``."""
    _KERNELS[words.dtype.itemsize][1](planes, rotate, words)


@njit(cache=True, nogil=True)
def sampled_entropy_bits(planes: np.ndarray, stride: int) -> np.ndarray:
    """Order-0 entropy, in bits per byte, of every plane over every ``stride``-th element.

    Cheap enough to run before choosing a plane's codec (0 for an empty plane).
    """
    bits = np.zeros(planes.shape[0], dtype=np.float64)
    hist = np.empty(256, dtype=np.int64)
    for p in range(planes.shape[0]):
        hist[:] = 0
        for i in range(0, planes.shape[1], stride):
            hist[planes[p, i]] += 1
        total = hist.sum()
        for count in hist:
            if count:
                bits[p] -= count / total * np.log2(count / total)
    return bits


def numpy_split_planes(words: np.ndarray, rotate: bool) -> np.ndarray:
    """Reference for :func:`split_planes`, returning the planes."""
    n_planes = words.dtype.itemsize
    bits = 8 * n_planes
    x = words.astype(np.uint64)
    if rotate:
        mask = np.uint64((1 << bits) - 1)
        x = ((x << np.uint64(1)) | (x >> np.uint64(bits - 1))) & mask
    shifts = np.array([8 * (n_planes - 1 - p) for p in range(n_planes)], dtype=np.uint64)
    return ((x[None, :] >> shifts[:, None]) & np.uint64(0xFF)).astype(np.uint8)


def numpy_entropy_bits(planes: np.ndarray, stride: int) -> np.ndarray:
    """Reference for :func:`sampled_entropy_bits`."""
    bits = np.zeros(planes.shape[0])
    for p in range(planes.shape[0]):
        counts = np.bincount(planes[p, ::stride], minlength=256)
        prob = counts[counts > 0] / max(1, counts.sum())
        bits[p] = float(-(prob * np.log2(prob)).sum())
    return bits


def numpy_merge_planes(planes: np.ndarray, rotate: bool, dtype: np.dtype) -> np.ndarray:
    """Reference for :func:`merge_planes`, returning the words."""
    n_planes = planes.shape[0]
    bits = 8 * n_planes
    x = np.zeros(planes.shape[1], dtype=np.uint64)
    for p in range(n_planes):
        x = (x << np.uint64(8)) | planes[p].astype(np.uint64)
    if rotate:
        mask = np.uint64((1 << bits) - 1)
        x = ((x >> np.uint64(1)) | (x << np.uint64(bits - 1))) & mask
    return x.astype(dtype)
