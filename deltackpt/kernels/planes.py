"""Bit planes of a packed symbol stream (docs/FORMAT.md 3.2, *Symbol stream*, ``bit_planes``).

The quant kernels pack each block's zigzag symbols at the block's width, so a byte holds the
bits of two or three symbols, and at widths 3, 5, 6 and 7 those bits straddle bytes. zstd codes
bytes by their order-0 statistics, which that mixing blurs. Since format 2.8 a stream is stored
as bit planes instead: plane ``k`` holds bit ``k`` of every symbol of every block wider than
``k``, eight symbols a byte, so each byte is eight like bits. On the deltas of a 305 MB TinyGPT
with AdamW that stored weights in 0.93x the bytes, second moments in 0.90x and first moments in
0.955x, as zstd then codes each plane by its own statistics.

:func:`to_planes` makes the planes of the packed stream the encode kernels write, on the CPU
and the GPU alike, as a permutation of its bits: eight symbols of width ``w <= 8`` take ``w``
bytes packed and one byte in each of ``w`` planes, and one table lookup a byte moves its bits
(``_TO``). The Numba decoders read the planes as they are (:func:`unpack_planes`: eight
symbols a word, one lookup a plane, no slower than packed bits); :func:`from_planes` packs
them again for the Triton decoder, which reads packed streams. Blocks wider than 8 bits, rare,
go bit by bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from deltackpt.kernels.spans import copy_span

MAX_WIDTH = 16


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """``to[w, j, v]``: where the bits of byte ``j`` (value ``v``) of eight symbols packed at
    width ``w`` go, as a word whose byte ``k`` is plane ``k``'s; ``back[w, k, v]``: where the
    bits of plane ``k``'s byte ``v`` go in the eight symbols' packed word."""
    to = np.zeros((9, 8, 256), np.uint64)
    back = np.zeros((9, 8, 256), np.uint64)
    for w in range(1, 9):
        for v in range(256):
            for t in range(8):
                if not v >> t & 1:
                    continue
                for j in range(w):  # bit t of packed byte j: symbol p // w's bit p % w
                    p = 8 * j + t
                    to[w, j, v] |= np.uint64(1 << (8 * (p % w) + p // w))
                for k in range(w):  # bit t of plane k's byte: bit k of symbol t
                    back[w, k, v] |= np.uint64(1 << (t * w + k))
    return to, back


_TO, _FROM = _tables()
# Byte ``v`` spread to one bit a byte: bit ``i`` of ``v`` at bit ``8 * i``.
_SPREAD = np.array([sum(((v >> i) & 1) << (8 * i) for i in range(8)) for v in range(256)],
                   np.uint64)


@njit(cache=True, nogil=True)
def plane_starts(widths, n, block, base):
    """Where each plane starts in a plane stream whose width bytes take ``base`` bytes (its
    17th entry: the stream's length), or an all-zero array if a width is over MAX_WIDTH."""
    sizes = np.zeros(MAX_WIDTH + 1, np.int64)
    for b in range(widths.shape[0]):
        if widths[b] > MAX_WIDTH:
            return np.zeros(MAX_WIDTH + 1, np.int64)
        segment = (min(block, n - b * block) + 7) // 8
        for k in range(widths[b]):
            sizes[k] += segment
    starts = np.empty(MAX_WIDTH + 1, np.int64)
    at = base
    for k in range(MAX_WIDTH + 1):
        starts[k] = at
        at += sizes[k]
    return starts


@njit(inline="always")
def _narrow_to_planes(packed, pos, w, m, planes, at, to, words):
    """Block ``packed[pos:]`` (``m`` symbols at width ``w <= 8``, a literal: LLVM unrolls the
    loops over bytes) into its segment of each plane, from ``at[k]``: a group of eight symbols
    is ``w`` packed bytes, one lookup each, then one byte in each plane."""
    groups = (m + 7) // 8
    whole = m // 8
    for g in range(whole):
        word = np.uint64(0)
        for j in range(w):
            word |= to[w, j, packed[pos + g * w + j]]
        words[g] = word
    if whole < groups:  # a short group: its bytes, the bits past its symbols cleared below
        rest = m - 8 * whole
        word = np.uint64(0)
        for j in range((rest * w + 7) // 8):
            word |= to[w, j, packed[pos + whole * w + j]]
        keep = np.uint64((1 << rest) - 1)
        mask = np.uint64(0)
        for k in range(w):
            mask |= keep << np.uint64(8 * k)
        words[whole] = word & mask
    for k in range(w):
        base = at[k]
        shift = np.uint64(8 * k)
        for g in range(groups):
            planes[base + g] = np.uint8((words[g] >> shift) & np.uint64(0xFF))


@njit(inline="always")
def _narrow_from_planes(planes, at, w, m, packed, pos, back, words):
    """The inverse of ``_narrow_to_planes``: block ``packed[pos:]`` from its planes' segments."""
    groups = (m + 7) // 8
    for g in range(groups):
        words[g] = np.uint64(0)
    for k in range(w):
        base = at[k]
        for g in range(groups):
            words[g] |= back[w, k, planes[base + g]]
    if groups > m // 8:  # a short group: the bits past its symbols dropped
        words[groups - 1] &= np.uint64((1 << ((m % 8) * w)) - 1)
    whole = m // 8
    for g in range(whole):
        word = words[g]
        for j in range(w):
            packed[pos + g * w + j] = np.uint8((word >> np.uint64(8 * j)) & np.uint64(0xFF))
    for j in range(((m - 8 * whole) * w + 7) // 8):
        packed[pos + whole * w + j] = np.uint8((words[whole] >> np.uint64(8 * j)) & np.uint64(0xFF))


@njit(inline="always")
def _wide_to_planes(packed, pos, w, m, planes, at):
    """A block wider than 8 bits, rare: symbol by symbol, bit by bit."""
    for k in range(w):
        for t in range((m + 7) // 8):
            planes[at[k] + t] = 0
    for i in range(m):
        for k in range(w):
            bit = i * w + k
            if (packed[pos + bit // 8] >> (bit % 8)) & 1:
                planes[at[k] + i // 8] |= np.uint8(1 << (i % 8))


@njit(inline="always")
def _wide_from_planes(planes, at, w, m, packed, pos):
    for j in range((m * w + 7) // 8):
        packed[pos + j] = 0
    for i in range(m):
        for k in range(w):
            if (planes[at[k] + i // 8] >> (i % 8)) & 1:
                bit = i * w + k
                packed[pos + bit // 8] |= np.uint8(1 << (bit % 8))


@njit(cache=True, nogil=True)
def _to_planes(packed, n, block, planes, to):
    nb = (n + block - 1) // block
    planes[:nb] = packed[:nb]
    at = plane_starts(packed[:nb], n, block, nb)
    words = np.empty((block + 7) // 8, np.uint64)
    pos = nb
    for b in range(nb):
        w = np.int64(packed[b])
        m = min(block, n - b * block)
        if w == 1:
            _narrow_to_planes(packed, pos, 1, m, planes, at, to, words)
        elif w == 2:
            _narrow_to_planes(packed, pos, 2, m, planes, at, to, words)
        elif w == 3:
            _narrow_to_planes(packed, pos, 3, m, planes, at, to, words)
        elif w == 4:
            _narrow_to_planes(packed, pos, 4, m, planes, at, to, words)
        elif w > 4 and w <= 8:
            _narrow_to_planes(packed, pos, w, m, planes, at, to, words)
        elif w > 8:
            _wide_to_planes(packed, pos, w, m, planes, at)
        for k in range(w):
            at[k] += (m + 7) // 8
        pos += (m * w + 7) // 8


@njit(cache=True, nogil=True)
def _from_planes(planes, n, block, packed, back):
    nb = (n + block - 1) // block
    packed[:nb] = planes[:nb]
    at = plane_starts(planes[:nb], n, block, nb)
    words = np.empty((block + 7) // 8, np.uint64)
    pos = nb
    for b in range(nb):
        w = np.int64(planes[b])
        m = min(block, n - b * block)
        if w == 1:
            _narrow_from_planes(planes, at, 1, m, packed, pos, back, words)
        elif w == 2:
            _narrow_from_planes(planes, at, 2, m, packed, pos, back, words)
        elif w == 3:
            _narrow_from_planes(planes, at, 3, m, packed, pos, back, words)
        elif w == 4:
            _narrow_from_planes(planes, at, 4, m, packed, pos, back, words)
        elif w > 4 and w <= 8:
            _narrow_from_planes(planes, at, w, m, packed, pos, back, words)
        elif w > 8:
            _wide_from_planes(planes, at, w, m, packed, pos)
        for k in range(w):
            at[k] += (m + 7) // 8
        pos += (m * w + 7) // 8


@njit(inline="always")
def _narrow_symbols(stream, at, w, q, words):
    """The symbols of a block of width ``w <= 8`` (a literal) from its planes' segments at
    ``at[k]``, un-zigzagged into ``q``: a word of eight symbols' bytes, one lookup a plane,
    then the bytes un-zigzagged in one pass (``words``: room for the block's words), which
    vectorizes."""
    m = q.shape[0]
    a0 = at[0]
    a1 = at[1] if w > 1 else 0
    a2 = at[2] if w > 2 else 0
    a3 = at[3] if w > 3 else 0
    a4 = at[4] if w > 4 else 0
    a5 = at[5] if w > 5 else 0
    a6 = at[6] if w > 6 else 0
    a7 = at[7] if w > 7 else 0
    for g in range((m + 7) // 8):
        word = _SPREAD[stream[a0 + g]]
        if w > 1:
            word |= _SPREAD[stream[a1 + g]] << np.uint64(1)
        if w > 2:
            word |= _SPREAD[stream[a2 + g]] << np.uint64(2)
        if w > 3:
            word |= _SPREAD[stream[a3 + g]] << np.uint64(3)
        if w > 4:
            word |= _SPREAD[stream[a4 + g]] << np.uint64(4)
        if w > 5:
            word |= _SPREAD[stream[a5 + g]] << np.uint64(5)
        if w > 6:
            word |= _SPREAD[stream[a6 + g]] << np.uint64(6)
        if w > 7:
            word |= _SPREAD[stream[a7 + g]] << np.uint64(7)
        words[g] = word
    z = words.view(np.uint8)  # little-endian: symbol 8g + i is byte i of word g
    for j in range(m):
        v = np.int32(z[j])
        q[j] = (v >> np.int32(1)) ^ -(v & np.int32(1))


@njit(inline="always")
def _wide_symbols(stream, at, w, q):
    """``_narrow_symbols`` for a block wider than 8 bits (9 to 16, rare): planes 0 to 7 make
    the low byte of eight symbols, the others the high byte."""
    m = q.shape[0]
    for g in range((m + 7) // 8):
        low = np.uint64(0)
        high = np.uint64(0)
        for k in range(8):
            low |= _SPREAD[stream[at[k] + g]] << np.uint64(k)
        for k in range(8, w):
            high |= _SPREAD[stream[at[k] + g]] << np.uint64(k - 8)
        for i in range(min(8, m - 8 * g)):
            z = np.int32(((low >> np.uint64(8 * i)) & np.uint64(0xFF))
                         | (((high >> np.uint64(8 * i)) & np.uint64(0xFF)) << np.uint64(8)))
            q[8 * g + i] = (z >> np.int32(1)) ^ -(z & np.int32(1))


@njit(inline="always")
def unpack_planes(stream, at, width, q, words):
    """The symbols of one block of a plane stream (``width`` bits, its segment of plane ``k`` at
    ``stream[at[k]:]``), un-zigzagged into ``q``; then ``at`` points past the block. With a
    literal width for widths up to 8, as ``kernels.quant._unpack``; ``words``: uint64 scratch
    of at least ``ceil(len(q) / 8)``."""
    if width == 1:
        _narrow_symbols(stream, at, 1, q, words)
    elif width == 2:
        _narrow_symbols(stream, at, 2, q, words)
    elif width == 3:
        _narrow_symbols(stream, at, 3, q, words)
    elif width == 4:
        _narrow_symbols(stream, at, 4, q, words)
    elif width == 5:
        _narrow_symbols(stream, at, 5, q, words)
    elif width == 6:
        _narrow_symbols(stream, at, 6, q, words)
    elif width == 7:
        _narrow_symbols(stream, at, 7, q, words)
    elif width == 8:
        _narrow_symbols(stream, at, 8, q, words)
    elif width > 8:
        _wide_symbols(stream, at, width, q)
    else:
        q[:] = 0
    segment = (q.shape[0] + 7) // 8
    for k in range(width):
        at[k] += segment


@njit(inline="always")
def _pack_byte_planes(scratch, m, shift, w, slot):
    """Planes ``shift .. shift + w - 1`` of a block's ``m`` symbols whose bits from ``shift`` on
    ``scratch`` holds a byte each (zero up to a multiple of 8), into ``slot`` from its plane
    ``shift``'s segment: eight bytes a word, and one multiply gathers a bit of each."""
    segment = (m + 7) // 8
    words = scratch[: 8 * segment].view(np.uint64)
    for k in range(w):
        out = (shift + k) * segment
        for g in range(segment):
            bits = (words[g] >> np.uint64(k)) & np.uint64(0x0101010101010101)
            slot[out + g] = np.uint8((bits * np.uint64(0x0102040810204080)) >> np.uint64(56))


@njit(inline="always")
def _narrow_pack(sym, w, slot, scratch):
    m = sym.shape[0]
    for j in range(m):
        scratch[j] = np.uint8(sym[j] & 0xFF)
    for j in range(m, 8 * ((m + 7) // 8)):
        scratch[j] = 0
    _pack_byte_planes(scratch, m, 0, w, slot)


@njit(inline="always")
def pack_planes(sym, width, slot, scratch):
    """The bit planes of a block's zigzag symbols ``sym`` at ``width`` bits into ``slot``: plane
    ``k``'s segment (``ceil(len(sym) / 8)`` bytes) at ``k`` segments from its start
    (``compact_planes`` moves them to their planes); ``scratch``: uint8 room for the block
    rounded up to 8. With a literal width for widths up to 8, as ``kernels.quant._pack``."""
    if width == 1:
        _narrow_pack(sym, 1, slot, scratch)
    elif width == 2:
        _narrow_pack(sym, 2, slot, scratch)
    elif width == 3:
        _narrow_pack(sym, 3, slot, scratch)
    elif width == 4:
        _narrow_pack(sym, 4, slot, scratch)
    elif width <= 8:
        _narrow_pack(sym, width, slot, scratch)
    else:  # the low byte's planes, then the high byte's
        m = sym.shape[0]
        _narrow_pack(sym, 8, slot, scratch)
        for j in range(m):
            scratch[j] = np.uint8(sym[j] >> 8)
        _pack_byte_planes(scratch, m, 8, width - 8, slot)


@njit(cache=True, nogil=True)
def compact_planes(slots, widths, n, block, stream):
    """The plane stream of blocks whose planes ``pack_planes`` wrote to ``slots[b]``."""
    nb = widths.shape[0]
    stream[:nb] = widths
    at = plane_starts(widths, n, block, nb)
    for b in range(nb):
        segment = (min(block, n - b * block) + 7) // 8
        for k in range(widths[b]):
            copy_span(slots[b], k * segment, stream, at[k], segment)
            at[k] += segment


def planes_length(widths: np.ndarray, n: int, block: int) -> int:
    """The length of the plane stream of ``n`` symbols in blocks of ``block`` with these widths
    (one byte a block, each at most MAX_WIDTH), or -1 if a width is over MAX_WIDTH."""
    if widths.size and int(widths.max()) > MAX_WIDTH:
        return -1
    return int(plane_starts(widths, n, block, widths.shape[0])[MAX_WIDTH])


def to_planes(packed: np.ndarray, n: int, block: int) -> np.ndarray:
    """The plane stream of a well-formed packed stream (``kernels.quant.check_stream``) of
    ``n`` symbols in blocks of ``block``."""
    nb = -(-n // block)
    planes = np.empty(planes_length(packed[:nb], n, block), np.uint8)
    _to_planes(packed, n, block, planes, _TO)
    return planes


def from_planes(planes: np.ndarray, n: int, block: int) -> np.ndarray:
    """The packed stream of plane stream ``planes`` (``n`` symbols in blocks of ``block``).

    Raises ``ValueError`` when ``planes`` is shorter than its block widths, a width is over
    MAX_WIDTH or its length is not what its widths imply, so damaged streams never index out
    of bounds. Bits of a short last group past its symbols are ignored."""
    nb = -(-n // block)
    if planes.shape[0] < nb:
        raise ValueError(f"stream of {planes.shape[0]} bytes is shorter than its {nb} block "
                         "widths")
    widths = planes[:nb]
    expected = planes_length(widths, n, block)
    if expected < 0:
        raise ValueError(f"block width {int(widths.max())} is over {MAX_WIDTH}")
    if planes.shape[0] != expected:
        raise ValueError(f"stream is {planes.shape[0]} bytes, its block widths need {expected}")
    lengths = (np.minimum(block, n - np.arange(nb, dtype=np.int64) * block)
               * widths.astype(np.int64) + 7) // 8
    packed = np.empty(nb + int(lengths.sum()), np.uint8)
    _from_planes(planes, n, block, packed, _FROM)
    return packed
