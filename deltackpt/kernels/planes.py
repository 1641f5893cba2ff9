"""Bit planes of a symbol stream (docs/FORMAT.md 3.2, *Symbol stream*, ``bit_planes``).

The quant kernels pack each block's zigzag symbols at the block's width, so a byte holds the
bits of two or three symbols, and at widths 3, 5, 6 and 7 those bits straddle bytes. zstd codes
bytes by their order-0 statistics, which that mixing blurs. Since format 2.8 a stream is stored
as bit planes instead: plane ``k`` holds bit ``k`` of every symbol of every block wider than
``k``, eight symbols a byte, so each byte is eight like bits. On the deltas of a 305 MB TinyGPT
with AdamW that stored weights in 0.93x the bytes, second moments in 0.90x and first moments in
0.955x, as zstd then codes each plane by its own statistics.

The encode kernel writes each block's planes as it packs (:func:`pack_planes`: the block's
symbols as bytes, eight to a word, one multiply gathering a bit of each), and
:func:`compact_planes` moves them to their places; the decode kernels read them as they are
(:func:`unpack_planes`: eight symbols a word, a plane's byte spread to one bit a symbol by a
multiply).
Both are called once a block, not inlined: inlined into each of the quant kernels' variants,
they made ``deltackpt warm`` compile for 2.3 times as long (205-210 s against 88-89 on 2 cores).
The Triton kernels pack: ``kernels.quant.to_planes`` and ``from_planes`` convert on the host.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from deltackpt.kernels.spans import copy_span

MAX_WIDTH = 16


@njit(inline="always")
def _spread(byte: np.uint8) -> np.uint64:
    """``byte`` spread to one bit a byte: bit ``i`` at bit ``8 * i``. Each byte of the product
    holds ``byte``, the mask keeps bit ``i`` in byte ``i``, and the addend carries it into
    the byte's top bit. Arithmetic rather than a lookup table, so the loop over a block's
    bytes vectorizes."""
    x = (np.uint64(byte) * np.uint64(0x0101010101010101)) & np.uint64(0x8040201008040201)
    return ((x + np.uint64(0x00406070787C7E7F)) >> np.uint64(7)) & np.uint64(0x0101010101010101)


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
def _narrow_symbols(stream, at, w, q, words):
    """The symbols of a block of width ``w <= 8`` (a literal) from its planes' segments at
    ``at[k]``, un-zigzagged into ``q``: a word of eight symbols' bytes, one ``_spread`` a plane,
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
        word = _spread(stream[a0 + g])
        if w > 1:
            word |= _spread(stream[a1 + g]) << np.uint64(1)
        if w > 2:
            word |= _spread(stream[a2 + g]) << np.uint64(2)
        if w > 3:
            word |= _spread(stream[a3 + g]) << np.uint64(3)
        if w > 4:
            word |= _spread(stream[a4 + g]) << np.uint64(4)
        if w > 5:
            word |= _spread(stream[a5 + g]) << np.uint64(5)
        if w > 6:
            word |= _spread(stream[a6 + g]) << np.uint64(6)
        if w > 7:
            word |= _spread(stream[a7 + g]) << np.uint64(7)
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
            low |= _spread(stream[at[k] + g]) << np.uint64(k)
        for k in range(8, w):
            high |= _spread(stream[at[k] + g]) << np.uint64(k - 8)
        for i in range(min(8, m - 8 * g)):
            z = np.int32(((low >> np.uint64(8 * i)) & np.uint64(0xFF))
                         | (((high >> np.uint64(8 * i)) & np.uint64(0xFF)) << np.uint64(8)))
            q[8 * g + i] = (z >> np.int32(1)) ^ -(z & np.int32(1))


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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
