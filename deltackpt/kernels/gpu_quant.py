"""Triton kernels of the quant codec: the delta encode and the chain decode on torch tensors.

The same symbols, stream bytes and reconstruction as the Numba kernels of
:mod:`deltackpt.kernels.quant`, bit for bit, on the device that holds the
state: a step coded on a GPU restores on a CPU-only machine, and the
writer's running reconstruction equals what every reader decodes. Both
implementations follow the decode arithmetic of docs/FORMAT.md 3.2 ("Decode
arithmetic"): float32 operations rounded to nearest one at a time, correctly
rounded division and square root (``tl.div_rn``, ``tl.sqrt_rn``; float64
division lowers to ``div.rn.f64``), no fused multiply-add (every launch
passes ``enable_fp_fusion=False``), the ordinal key arithmetic in float64
(exact: integers below 2**53) and the dither hash in unsigned 32-bit
integers that wrap as the spec's. ``np.rint`` (half to even) is
:func:`_rint`, built from ``floor``, which is exact everywhere.

Design. A stream is coded by three launches and a few torch operations on
the device, with no host synchronisation between them:

1. ``_encode_kernel``: one program per tile of ``ROWS`` blocks by ``COLS``
   columns (several blocks per program for small blocks, a loop over
   columns for blocks over 1024 elements), loads coalesced along a block.
   It quantizes, writes the reconstruction (in place into the prediction
   buffer when they are one), each block's width and byte length, the block
   statistics (the ``STAT_*`` columns of the Numba kernel) and the symbols:
   a block of at most 1024 elements (the default block) is one tile, whose
   symbols the kernel packs in registers into the block's slot (eight
   symbols make ``width`` bytes: byte ``k`` of every group of eight at a
   time); a larger block's zigzag symbols go to device memory (uint16), as
   do those of a block grouped by dither (``dither_groups``), each at its
   place in the block (``_places``: counts of each group along the block's
   columns).
2. ``torch.cumsum`` of the byte lengths: each block's offset in the stream.
3. ``_pack_kernel``: on the same tiles, writes each block's width byte and
   its packed bits from its offset: copied from its slot, or packed from
   the symbols, each output byte gathering the (at most ``7 // width + 2``)
   symbols whose bits it holds.

The stream is packed on the device, so only the compressed stream and the
statistics cross PCIe (:func:`encode_block_stream` reads its length, the one
synchronisation, then copies exactly that many bytes). Device memory
traffic of an encode against a prediction: 12 bytes an element (read ``x``
and the prediction, write the reconstruction) and three times the packed
bytes (``width / 8`` an element); 4 more for blocks over 1024 elements and
grouped ones (the symbols written and read back).

``_decode_kernel`` decodes one stream, or the streams of consecutive steps
of a chunk (the end of a restore chain): a tile's running values stay in
registers through every step and are written once. Streams are checked on
the host (:func:`deltackpt.kernels.quant.check_stream`'s rules) as they are
uploaded (:func:`upload_streams`, only their bytes cross PCIe), so a damaged
stream never indexes out of bounds; :func:`apply_streams` decodes uploaded
streams.

Kernels run on CUDA tensors; CPU tensors run them through Triton's
interpreter, which Triton chooses when triton and this module are imported
with ``TRITON_INTERPRET=1`` in the environment, and which reads it again as
kernels run (the tests do so, to hold these kernels to the Numba ones on
machines without a GPU). The interpreter runs one kernel at a time.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from deltackpt.kernels.quant import (
    N_STATS,
    STAT_BAD,
    STAT_CLIPPED,
    STAT_LOST_ZEROS,
    STAT_MAX_ABS,
    STAT_MAX_REL,
    STAT_NONZERO,
    STAT_SUM_SQ,
    STAT_SUM_SQ_ERR,
    STREAM_OK,
    _check_stream,
    _seed,
    _steps,
    _stream_problem,
    check_scaling,
    from_planes,
    kernel_seeds,
    n_blocks_of,
    stream_layouts,
    to_planes,
)

_TILE = 1024  # elements a program codes at a time
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- element arithmetic (FORMAT.md 3.2) ---------------------------------------------------

@triton.jit
def _rint(v):
    """``v`` rounded to the nearest integer, ties to even (``np.rint``), for float32 and float64:
    ``a - floor(a)`` is exact for ``a >= 0``, so the tie test is exact too. (NVIDIA's float32
    floor flushes subnormal inputs to zero, which for ``a >= 0`` gives floor's result, 0.)"""
    a = tl.abs(v)
    f = tl.floor(a)
    d = a - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(v < 0, -r, r)


@triton.jit
def _dither(index, seed):
    """Dither offset in [-0.5, 0.5) of element ``index`` (int64) for ``seed`` (uint32): the
    lowbias32 hash of FORMAT.md 3.2, products modulo 2**32."""
    x = index.to(tl.uint32) ^ seed
    x = (x ^ (x >> 16)) * 0x21F0AAAD
    x = (x ^ (x >> 15)) * 0x735A2D97
    x = x ^ (x >> 15)
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08 - 0.5  # 2**-24: exact


@triton.jit
def _fold(q, u, signs):
    """FORMAT.md 3.2's ``dither_signs`` where ``signs``: ``-q`` where the dither offset ``u`` is
    at least 0 (``kernels.quant._fold_sign``); its own inverse."""
    return tl.where(signs & (u >= 0.0), -q, q)


@triton.jit
def _group_of(u):
    """FORMAT.md 3.2's ``dither_groups`` group of dither offset ``u``: ``min(floor(8 |u|), 3)``
    (exact: ``u`` is a multiple of 2**-24)."""
    return tl.minimum((tl.abs(u) * 8.0).to(tl.int32), 3)


@triton.jit
def _group_rank(g, k, at, counts):
    """``at`` with the elements of group ``k`` of ``g`` (a masked tile: -1 where invalid) given
    their places: ``counts`` (per row) plus their rank in the group along the row."""
    mk = g == k
    return tl.where(mk, counts[:, None] + tl.cumsum(mk.to(tl.int32), axis=1) - 1, at)


@triton.jit
def _places(rows, c0, n, first, seed, BLOCK: tl.constexpr, ROWS: tl.constexpr,
            COLS: tl.constexpr):
    """``dither_groups``' place of each element of columns ``c0 ...`` of blocks ``rows`` in its
    block's symbols (``kernels.quant._group_lanes``): the elements of smaller groups in the
    whole block and of the same group in earlier columns come first, counted again over the
    block's columns (a block of up to 1024 elements, the default, is one tile)."""
    zero = tl.zeros([ROWS], tl.int32)
    total0, total1, total2 = zero, zero, zero
    before0, before1, before2, before3 = zero, zero, zero, zero
    for c in range(0, BLOCK, COLS):
        cols = c + tl.arange(0, COLS)
        idx = rows[:, None] * BLOCK + cols[None, :]
        g = tl.where((cols[None, :] < BLOCK) & (idx < n), _group_of(_dither(first + idx, seed)),
                     -1)
        total0 += tl.sum((g == 0).to(tl.int32), axis=1)
        total1 += tl.sum((g == 1).to(tl.int32), axis=1)
        total2 += tl.sum((g == 2).to(tl.int32), axis=1)
        early = c < c0
        before0 += tl.sum(((g == 0) & early).to(tl.int32), axis=1)
        before1 += tl.sum(((g == 1) & early).to(tl.int32), axis=1)
        before2 += tl.sum(((g == 2) & early).to(tl.int32), axis=1)
        before3 += tl.sum(((g == 3) & early).to(tl.int32), axis=1)
    cols = c0 + tl.arange(0, COLS)
    idx = rows[:, None] * BLOCK + cols[None, :]
    g = tl.where((cols[None, :] < BLOCK) & (idx < n), _group_of(_dither(first + idx, seed)), -1)
    at = tl.zeros([ROWS, COLS], tl.int32)
    at = _group_rank(g, 0, at, before0)
    at = _group_rank(g, 1, at, total0 + before1)
    at = _group_rank(g, 2, at, total0 + total1 + before2)
    return _group_rank(g, 3, at, total0 + total1 + total2 + before3)


@triton.jit
def _key_of(v):
    """Order-preserving int32 key of float32 ``v`` (bit pattern, negatives mirrored)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


@triton.jit
def _float_of_key(key):
    """The float32 whose key is the int32 ``key`` (``|key| <= MAX_KEY``)."""
    bits = tl.where(key >= 0, key, (-key) | -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _finite(v):
    return (v.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _key_offset(u, step_k):
    """Dither offset in keys (float64) of an ordinal step ``step_k`` (float64) for offset ``u``."""
    return tl.floor((u + 0.5).to(tl.float64) * step_k) - tl.floor(step_k * 0.5)


@triton.jit
def _reconstruct(p, q, ORDINAL: tl.constexpr, st, step_k, u):
    """The running value after symbol ``q`` (int32) on prediction ``p``: FORMAT.md 3.2's rule,
    as ``kernels.quant._reconstruct``."""
    if ORDINAL:
        key = _key_of(p).to(tl.float64) + q.to(tl.float64) * step_k + _key_offset(u, step_k)
        # clamped to +-MAX_KEY in integers: a float literal is float32 in a compiled kernel,
        # where MAX_KEY rounds up to the key of infinity
        key = tl.minimum(tl.maximum(key.to(tl.int64), -2139095039), 2139095039)
        return _float_of_key(key.to(tl.int32))
    return p + (q.to(tl.float32) - u) * st


# The statistics' columns (the Numba kernel's STAT_*), as constants a compiled kernel may read
_N_STATS, _MAX_ABS, _MAX_REL, _SUM_SQ_ERR, _SUM_SQ, _NONZERO, _CLIPPED, _BAD, _LOST_ZEROS = (
    tl.constexpr(c) for c in (N_STATS, STAT_MAX_ABS, STAT_MAX_REL, STAT_SUM_SQ_ERR, STAT_SUM_SQ,
                              STAT_NONZERO, STAT_CLIPPED, STAT_BAD, STAT_LOST_ZEROS))


@triton.jit
def _element_step(step_f, scale, eps, floor, SHAPED: tl.constexpr):
    """A scaled element's step ``f32(step * f32(sqrt(scale) + eps))``, ``SHAPED`` divided by
    ``f32(sqrt(f32(sqrt(scale) + floor)))``."""
    root = tl.sqrt_rn(scale)
    st = step_f * (root + eps)
    if SHAPED:
        st = tl.div_rn(st, tl.sqrt_rn(root + floor))
    return st


# -- kernels -------------------------------------------------------------------------------

@triton.jit
def _byte_part(z, shift, take):
    """The bits of symbols ``z`` in an output byte, a symbol's bit 0 falling at bit ``shift`` of
    the byte (in ``(-width, 8)``); 0 where not ``take``. Symbols' bits are disjoint: a byte is
    the sum of its parts."""
    part = tl.where(shift >= 0, z << tl.maximum(shift, 0), z >> tl.maximum(-shift, 0))
    return tl.where(take, part & 0xFF, 0)


@triton.jit(do_not_specialize=["n", "n_blocks", "first", "seed", "signs", "step_f", "step_i",
                              "eps", "floor"])
def _encode_kernel(x_ptr, pred_ptr, out_ptr, scale_ptr, packed_ptr, widths_ptr, lengths_ptr,
                   stats_ptr, n, n_blocks, first, seed, signs, step_f, step_i, eps, floor,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                   ORDINAL: tl.constexpr, USE_PRED: tl.constexpr, DITHERED: tl.constexpr,
                   SCALED: tl.constexpr, SHAPED: tl.constexpr, X_BF16: tl.constexpr,
                   FUSED: tl.constexpr, GROUPED: tl.constexpr):
    """Quantize blocks ``pid * ROWS ...`` of ``x``: reconstruction, widths, byte lengths and
    statistics, as ``kernels.quant._make_encoder``'s loop, and the symbols: ``FUSED`` (a block
    is one tile), each block's packed bytes from ``packed[b * 2 * BLOCK]``; else the zigzag
    symbols (uint16) at ``packed[i]``, for ``_pack_kernel`` to pack, ``GROUPED`` in the order
    of ``dither_groups`` (``_places``). ``signs`` (0 or 1): the symbols' signs folded by the
    dither."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_blocks
    step_k = step_i.to(tl.float64)
    seed32 = seed.to(tl.uint32)
    zmax = tl.zeros([ROWS], tl.int32)
    bad = tl.zeros([ROWS], tl.int32)
    max_abs = tl.zeros([ROWS], tl.int32)
    max_rel = tl.zeros([ROWS], tl.int32)
    sum_sq_err = tl.zeros([ROWS], tl.float64)
    sum_sq = tl.zeros([ROWS], tl.float64)
    nonzero = tl.zeros([ROWS], tl.int32)
    clipped = tl.zeros([ROWS], tl.int32)
    lost = tl.zeros([ROWS], tl.int32)
    if FUSED:
        tile = tl.zeros([ROWS, COLS], tl.int32)
    for c0 in range(0, BLOCK, COLS):
        cols = c0 + tl.arange(0, COLS)
        idx = rows[:, None] * BLOCK + cols[None, :]
        valid = row_ok[:, None] & (cols[None, :] < BLOCK) & (idx < n)
        if X_BF16:  # widened by its bits (exact; the interpreter's .to flushes subnormals)
            x = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32) << 16
            x = x.to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
        p = tl.load(pred_ptr + idx, mask=valid, other=0.0) if USE_PRED else \
            tl.zeros([ROWS, COLS], tl.float32)
        ok = _finite(x) & _finite(p)
        u = _dither(first + idx, seed32) if DITHERED else tl.zeros([ROWS, COLS], tl.float32)
        if SCALED:
            st = _element_step(step_f, tl.load(scale_ptr + idx, mask=valid, other=1.0), eps, floor,
                               SHAPED)
        else:
            st = tl.zeros([ROWS, COLS], tl.float32) + step_f
        if ORDINAL:
            kx = _key_of(x).to(tl.float64)
            kp = _key_of(p).to(tl.float64)
            off = _key_offset(u, step_k)
            qf = _rint((kx - kp - off) / step_k)  # float64: div.rn.f64, correctly rounded
            k = kp + qf * step_k + off  # no sign flips
            qf += ((kx >= 0) & (k < 0)).to(tl.float64) - ((kx < 0) & (k > 0)).to(tl.float64)
            q = tl.minimum(tl.maximum(qf, -32768.0), 32767.0).to(tl.int32)
        else:
            r = tl.where(ok, x - p, 0.0)
            qf = _rint(tl.div_rn(r, st) + u)
            ok &= qf == qf  # a NaN quotient (a scaled step of 0 or inf) cannot be coded
            qf = tl.where(ok, qf, 0.0)
            q = tl.minimum(tl.maximum(qf, -32768.0 + signs), 32767.0).to(tl.int32)
        s = _reconstruct(p, q, ORDINAL, st, step_k, u)
        if not ORDINAL:  # a linear reconstruction can overflow, with absurd steps
            ok &= _finite(s)
        tl.store(out_ptr + idx, s, mask=valid)
        c = q if ORDINAL else _fold(q, u, signs != 0)
        z = tl.where(valid, (c << 1) ^ (c >> 31), 0)
        if FUSED:  # the block's symbols stay in registers, packed below
            tile = z
        elif GROUPED:
            at = _places(rows, c0, n, first, seed32, BLOCK, ROWS, COLS)
            tl.store(packed_ptr + rows[:, None] * BLOCK + at, z.to(tl.uint16), mask=valid)
        else:
            tl.store(packed_ptr + idx, z.to(tl.uint16), mask=valid)
        bad += tl.sum((valid & ~ok).to(tl.int32), axis=1)
        zmax = tl.maximum(zmax, tl.max(tl.where(ok, z, 0), axis=1))
        err = tl.where(valid, s - x, 0.0)
        max_abs = tl.maximum(max_abs, tl.max(err.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        err64 = err.to(tl.float64)
        sum_sq_err += tl.sum(err64 * err64, axis=1)
        x64 = x.to(tl.float64)
        sum_sq += tl.sum(x64 * x64, axis=1)
        nonzero += tl.sum((z != 0).to(tl.int32), axis=1)
        clipped += tl.sum((z >= 0xFFFE - signs).to(tl.int32), axis=1)
        lost += tl.sum((valid & (x == 0) & (s != 0)).to(tl.int32), axis=1)
        if ORDINAL:
            ax = tl.abs(x)
            rel = tl.where(ax > 0, tl.div_rn(tl.abs(err), tl.where(ax > 0, ax, 1.0)), 0.0)
            max_rel = tl.maximum(max_rel, tl.max(rel.to(tl.int32, bitcast=True), axis=1))
    width = tl.zeros([ROWS], tl.int32)
    for b in tl.static_range(16):
        width += ((zmax >> b) != 0).to(tl.int32)
    width = tl.where(bad == 0, width, 0)
    count = tl.minimum(n - rows * BLOCK, BLOCK)
    tl.store(widths_ptr + rows, width.to(tl.uint8), mask=row_ok)
    tl.store(lengths_ptr + rows, (count * width + 7) // 8, mask=row_ok)
    if FUSED:  # eight symbols make ``width`` bytes: byte k of each group of eight in turn
        n_bytes = ((count * width + 7) // 8).to(tl.int32)[:, None]
        groups = tl.reshape(tile, [ROWS, COLS // 8, 8])
        w3 = width[:, None, None]
        at = tl.arange(0, 8)[None, None, :] * w3  # each symbol's first bit in its group
        first_byte = tl.arange(0, COLS // 8)[None, :] * width[:, None]
        for k in range(0, tl.max(width)):
            shift = at - 8 * k
            byte = tl.sum(_byte_part(groups, shift, (shift > -w3) & (shift < 8)), axis=2)
            pos = first_byte + k
            tl.store(packed_ptr + rows[:, None] * (2 * BLOCK) + pos, byte.to(tl.uint8),
                     mask=(k < width[:, None]) & (pos < n_bytes))
    row = stats_ptr + rows * _N_STATS
    tl.store(row + _MAX_ABS, max_abs.to(tl.float32, bitcast=True).to(tl.float64), mask=row_ok)
    tl.store(row + _MAX_REL, max_rel.to(tl.float32, bitcast=True).to(tl.float64), mask=row_ok)
    tl.store(row + _SUM_SQ_ERR, sum_sq_err, mask=row_ok)
    tl.store(row + _SUM_SQ, sum_sq, mask=row_ok)
    tl.store(row + _NONZERO, nonzero.to(tl.float64), mask=row_ok)
    tl.store(row + _CLIPPED, clipped.to(tl.float64), mask=row_ok)
    tl.store(row + _BAD, bad.to(tl.float64), mask=row_ok)
    tl.store(row + _LOST_ZEROS, lost.to(tl.float64), mask=row_ok)


@triton.jit(do_not_specialize=["n", "n_blocks"])
def _pack_kernel(packed_ptr, widths_ptr, offsets_ptr, stream_ptr, n, n_blocks,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr, BYTES: tl.constexpr,
                 FUSED: tl.constexpr):
    """Blocks ``pid * ROWS ...``: each one's width byte and packed symbols, written to the
    stream from its offset. ``FUSED``: copied from where ``_encode_kernel`` packed them; else
    packed here from its zigzag symbols, LSB first at the block's width: output byte ``i`` ORs
    the bits of the symbols ``8i // w ...`` (at most ``7 // w + 2``) that overlap it."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_blocks
    w = tl.load(widths_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    tl.store(stream_ptr + rows, w.to(tl.uint8), mask=row_ok)
    count = tl.minimum(n - rows * BLOCK, BLOCK).to(tl.int32)
    n_bytes = tl.where(row_ok, (count * w + 7) // 8, 0)
    pos = tl.load(offsets_ptr + rows, mask=row_ok, other=0)
    w1 = tl.maximum(w, 1)[:, None]
    overlaps = tl.max(tl.where(w > 0, 7 // tl.maximum(w, 1) + 2, 0))
    for i0 in range(0, tl.max(n_bytes), BYTES):
        i = i0 + tl.arange(0, BYTES)[None, :]
        inside = i < n_bytes[:, None]
        if FUSED:
            byte = tl.load(packed_ptr + rows[:, None] * (2 * BLOCK) + i, mask=inside, other=0)
        else:
            j0 = i * 8 // w1
            byte = tl.zeros([ROWS, BYTES], tl.int32)
            for t in range(0, overlaps):
                j = j0 + t
                take = inside & (j < count[:, None])
                z = tl.load(packed_ptr + rows[:, None] * BLOCK + j, mask=take, other=0)
                byte |= _byte_part(z.to(tl.int32), j * w1 - i * 8, take)
        tl.store(stream_ptr + pos[:, None] + i, byte.to(tl.uint8), mask=inside)


@triton.jit(do_not_specialize=["n", "n_blocks", "n_steps", "first", "eps", "floor"])
def _decode_kernel(streams_ptr, bounds_ptr, offsets_ptr, ordinal_ptr, step_f_ptr, step_i_ptr,
                   seeds_ptr, n_steps, pred_ptr, out_ptr, scale_ptr, n, n_blocks, first, eps,
                   floor, BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                   ZERO_START: tl.constexpr, SCALED: tl.constexpr, SHAPED: tl.constexpr):
    """Apply the ``n_steps`` streams ``streams[bounds[t]:bounds[t + 1]]`` (block ``b``'s bits at
    ``offsets[t, b]``) in turn to the running values ``pred`` (or zero), into ``out``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_blocks
    for c0 in range(0, BLOCK, COLS):
        cols = c0 + tl.arange(0, COLS)
        idx = rows[:, None] * BLOCK + cols[None, :]
        valid = row_ok[:, None] & (cols[None, :] < BLOCK) & (idx < n)
        if ZERO_START:
            run = tl.zeros([ROWS, COLS], tl.float32)
        else:
            run = tl.load(pred_ptr + idx, mask=valid, other=0.0)
        for t in range(n_steps):
            w = tl.load(streams_ptr + tl.load(bounds_ptr + t) + rows, mask=row_ok, other=0)
            w = w.to(tl.int32)[:, None]
            at = tl.load(offsets_ptr + t * n_blocks + rows, mask=row_ok, other=0)[:, None]
            seed = tl.load(seeds_ptr + t)
            if (seed >= 0) & (((seed >> 33) & 1) != 0):  # kernels.quant.GROUPS_BIT
                bit = _places(rows, c0, n, first, seed.to(tl.uint32), BLOCK, ROWS, COLS) * w
            else:
                bit = cols[None, :] * w
            byte_at = at + bit // 8
            take = valid & (w > 0)
            b0 = tl.load(streams_ptr + byte_at, mask=take, other=0).to(tl.int32)
            b1 = tl.load(streams_ptr + byte_at + 1, mask=take, other=0).to(tl.int32)
            b2 = tl.load(streams_ptr + byte_at + 2, mask=take, other=0).to(tl.int32)
            z = ((b0 | (b1 << 8) | (b2 << 16)) >> (bit % 8)) & ((1 << w) - 1)
            q = (z >> 1) ^ -(z & 1)
            if seed >= 0:  # a run-time condition: a branch, not a select
                u = _dither(first + idx, seed.to(tl.uint32))
                q = _fold(q, u, ((seed >> 32) & 1) != 0)  # kernels.quant.SIGNS_BIT
            else:
                u = tl.zeros([ROWS, COLS], tl.float32)
            step_k = tl.load(step_i_ptr + t).to(tl.float64)
            if tl.load(ordinal_ptr + t) != 0:
                run = _reconstruct(run, q, True, 1.0, step_k, u)
            else:
                step_f = tl.load(step_f_ptr + t)
                if SCALED:
                    st = _element_step(step_f, tl.load(scale_ptr + idx, mask=valid, other=1.0),
                                       eps, floor, SHAPED)
                else:
                    st = tl.zeros([ROWS, COLS], tl.float32) + step_f
                run = _reconstruct(run, q, False, st, step_k, u)
        tl.store(out_ptr + idx, run, mask=valid)


# -- host side -----------------------------------------------------------------------------

def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (imported with ``TRITON_INTERPRET=1``)."""
    return isinstance(_encode_kernel, InterpretedFunction)


def _tile(block: int) -> tuple[int, int]:
    """``(ROWS, COLS)`` of a program's tile: whole blocks of up to ``_TILE`` elements (several
    to a program when small; at least 16 columns), or ``_TILE`` columns at a time of a larger
    block."""
    cols = min(max(triton.next_power_of_2(block), 16), _TILE)
    return _TILE // cols, cols


def _check_tensor(name: str, t: torch.Tensor, device: torch.device | None, n: int,
                  dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Raise ``ValueError`` unless ``t`` is a contiguous 1-d tensor of ``n`` elements of one of
    ``dtypes`` on ``device`` (any device for None)."""
    if t.dtype not in dtypes or t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-d tensor of {n} elements of "
                         f"{' or '.join(map(str, dtypes))}, got {t.dtype} {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the kernel runs on {device}")


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return t if t is None or t.device == device else t.to(device, non_blocking=True)


def _device(x: torch.Tensor) -> torch.device:
    if x.device.type == "cpu" and not interpreted():
        raise RuntimeError("Triton kernels run CPU tensors only in its interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    return x.device


def _launch_options() -> dict:
    """No fused multiply-add (FORMAT.md 3.2); 8 warps a program: 4 elements a thread, which
    keeps the kernels under 80 registers a thread on sm_90 (about 130 with 4 warps), so that
    more programs share an SM to hide memory latency."""
    return {"enable_fp_fusion": False, "num_warps": 8}


_interpreter_lock = threading.Lock()


def _launching(device: torch.device) -> contextlib.AbstractContextManager:
    """Held while kernels are launched on ``device``: a lock in the interpreter, which patches
    ``triton.language`` while a kernel runs (one at a time); on a GPU, ``device`` made the
    current one (Triton launches on the current device, whatever its arguments' device)."""
    if interpreted():
        return _interpreter_lock
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class DeviceStream:
    """A packed stream and its block statistics, still on the device: ``stream[:length]`` is
    the stream (``length`` a 0-d int64 tensor, so that reading it is the caller's choice of
    synchronisation point), ``stats`` the ``float64[n_blocks, N_STATS]`` statistics; ``done``
    (on a GPU) is recorded on the stream the work was queued on, after all of it."""

    stream: torch.Tensor
    length: torch.Tensor
    stats: torch.Tensor
    done: torch.cuda.Event | None

    def to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """The stream (uint8) and statistics as host arrays: waits for the work (from any
        thread or stream), then copies only the stream's own bytes."""
        if self.done is not None:
            self.done.synchronize()
        length = int(self.length)
        return self.stream[:length].cpu().numpy(), self.stats.cpu().numpy()


def _done(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on ``device``'s current stream (None off a GPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def encode_on_device(x: torch.Tensor, pred: torch.Tensor | None, out: torch.Tensor, *,
                     ordinal: bool, step: float | int, block: int, dither: int | None = None,
                     dither_signs: bool = False, dither_groups: bool = False, first: int = 0,
                     scale: torch.Tensor | None = None, eps: float = 0.0,
                     floor: float = 0.0) -> DeviceStream:
    """:func:`deltackpt.kernels.quant.encode_block_stream` on ``x``'s device, queued on its
    current stream without waiting (the caller orders it after the work that writes ``x``).

    ``x`` is float32, bfloat16 or float16 (its values exactly as float32);
    ``pred``, ``out`` and ``scale`` are float32, ``out`` may be ``pred``
    (updated in place). Same arguments, same stream bytes, same
    reconstruction, same statistics (sums to float tolerance: the Numba
    kernel reassociates them). ``pred``, ``out`` and ``scale`` normally live
    on ``x``'s device; those on another (the host: a running reconstruction
    kept in host memory) are copied to it, and the reconstruction back into
    ``out`` (complete once :meth:`DeviceStream.to_host` returns), at 8 bytes
    an element over PCIe.
    """
    device = _device(x)
    n = x.shape[0]
    _check_tensor("x", x, device, n, _INPUT_DTYPES)
    _check_tensor("out", out, None, n)
    if pred is not None:
        _check_tensor("pred", pred, None, n)
    step_f, step_i = _steps(ordinal, step)
    seed = _seed(ordinal, dither, step, block, dither_signs, dither_groups)
    check_scaling(scale is not None, not (ordinal or pred is not None),
                  "the linear domain, without prediction", eps, floor)
    if scale is not None:
        _check_tensor("scale", scale, None, n)
    pred_on, scale_on = _to(pred, device), _to(scale, device)
    out_on = pred_on if out is pred else out if out.device == device else \
        torch.empty(n, dtype=torch.float32, device=device)
    n_blocks = n_blocks_of(n, block)
    stats = torch.empty((n_blocks, N_STATS), dtype=torch.float64, device=device)
    stream = torch.empty(n_blocks + 2 * n, dtype=torch.uint8, device=device)
    if n == 0:
        return DeviceStream(stream, torch.zeros((), dtype=torch.int64, device=device), stats,
                            _done(device))
    # A block that is one tile is packed in the encoder, unless its symbols are grouped.
    fused = block <= _TILE and not dither_groups
    packed = torch.empty(n_blocks * 2 * block, dtype=torch.uint8, device=device) if fused \
        else torch.empty(n, dtype=torch.uint16, device=device)
    widths = torch.empty(n_blocks, dtype=torch.uint8, device=device)
    lengths = torch.empty(n_blocks, dtype=torch.int64, device=device)
    rows, cols = _tile(block)
    with _launching(device):
        bf16 = x.dtype == torch.bfloat16
        _encode_kernel[(triton.cdiv(n_blocks, rows),)](
            x.view(torch.int16) if bf16 else x, out_on if pred_on is None else pred_on, out_on,
            x if scale_on is None else scale_on, packed, widths,
            lengths, stats, n, n_blocks, first, int(seed) & 0xFFFFFFFF, int(dither_signs),
            float(step_f),
            int(step_i), float(np.float32(eps)), float(np.float32(floor)), BLOCK=block, ROWS=rows,
            COLS=cols, ORDINAL=ordinal, USE_PRED=pred is not None, DITHERED=bool(seed >= 0),
            SCALED=scale is not None, SHAPED=floor > 0, X_BF16=bf16, FUSED=fused,
            GROUPED=dither_groups, **_launch_options())
        ends = torch.cumsum(lengths, 0) + n_blocks
        _pack_kernel[(triton.cdiv(n_blocks, rows),)](
            packed, widths, ends - lengths, stream, n, n_blocks, BLOCK=block, ROWS=rows,
            BYTES=2 * cols, FUSED=fused, **_launch_options())
    if out_on is not out:
        out.copy_(out_on, non_blocking=True)
    return DeviceStream(stream, ends[-1], stats, _done(device))


def encode_block_stream(x: torch.Tensor, pred: torch.Tensor | None, out: torch.Tensor, *,
                        ordinal: bool, step: float | int, block: int, dither: int | None = None,
                        dither_signs: bool = False, dither_groups: bool = False, first: int = 0,
                        scale: torch.Tensor | None = None, eps: float = 0.0,
                        floor: float = 0.0, bit_planes: bool = False
                        ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`encode_on_device`, then the stream and statistics copied to the host: the same
    return values as :func:`deltackpt.kernels.quant.encode_block_stream` (the stream in
    ``bit_planes`` made on the host: :func:`deltackpt.kernels.quant.to_planes`)."""
    stream, stats = encode_on_device(x, pred, out, ordinal=ordinal, step=step, block=block,
                                     dither=dither, dither_signs=dither_signs,
                                     dither_groups=dither_groups, first=first, scale=scale,
                                     eps=eps, floor=floor).to_host()
    return (to_planes(stream, x.shape[0], block) if bit_planes else stream), stats


@dataclass(frozen=True)
class DeviceStreams:
    """The checked packed streams of consecutive steps of one chunk of ``n`` elements, on a
    device: ``data`` holds them one after another (and 8 spare bytes), stream ``t`` from
    ``bounds[t]``, the bits of its block ``b`` from ``offsets[t, b]``."""

    data: torch.Tensor
    bounds: torch.Tensor
    offsets: torch.Tensor
    n: int
    block: int


def upload_streams(streams: list[np.ndarray], n: int, block: int, device: torch.device,
                   bit_planes: list[bool] | None = None) -> DeviceStreams:
    """Check the host streams (uint8) of ``n`` elements, then copy them to ``device`` without
    waiting (through pinned memory on a GPU: only the streams' bytes cross PCIe). Streams in
    ``bit_planes`` are packed on the host first (:func:`deltackpt.kernels.quant.from_planes`),
    as the kernels read them.

    Raises ``ValueError`` naming the first damaged stream (the rules of
    :func:`deltackpt.kernels.quant.check_stream`), so the kernels never read
    out of bounds.
    """
    streams = list(streams)
    for t, planes in enumerate(stream_layouts(len(streams), bit_planes)):
        if planes:
            try:
                streams[t] = from_planes(streams[t], n, block)
            except ValueError as exc:
                raise ValueError(f"stream {t}: {exc}") from None
    pinned = device.type == "cuda"
    n_blocks = n_blocks_of(n, block)
    bounds = np.zeros(len(streams) + 1, np.int64)
    np.cumsum([s.shape[0] for s in streams], out=bounds[1:])
    # The kernel reads up to 2 bytes past a block.
    data = torch.zeros(int(bounds[-1]) + 8, dtype=torch.uint8, pin_memory=pinned)
    offsets = torch.empty((len(streams), n_blocks), dtype=torch.int64, pin_memory=pinned)
    flat = data.numpy()
    for t, (stream, lo, hi) in enumerate(zip(streams, bounds[:-1], bounds[1:], strict=True)):
        flat[lo:hi] = stream
        o, status = _check_stream(flat, lo, hi, n, block, False)
        if status != STREAM_OK:
            raise ValueError(f"stream {t}: {_stream_problem(status, stream, n, block, False)}")
        offsets[t] = torch.from_numpy(o[:n_blocks])
    return DeviceStreams(data.to(device, non_blocking=True),
                         torch.from_numpy(bounds).to(device, non_blocking=True),
                         offsets.to(device, non_blocking=True), n, block)


def apply_streams(streams: DeviceStreams, out: torch.Tensor, *, ordinal: list[bool],
                  steps: list[float | int], zero_start: bool,
                  dithers: list[int | None] | None = None,
                  dither_signs: list[bool] | None = None,
                  dither_groups: list[bool] | None = None, first: int = 0,
                  pred: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  eps: float = 0.0, floor: float = 0.0) -> None:
    """Apply uploaded streams in order to the float32 tensor ``out`` on their device: one pass,
    each tile's running values kept through every step.

    The running values before the first step are ``pred`` (default: ``out``
    itself) unless ``zero_start``; ``ordinal``, ``steps``, ``dithers``, ``dither_signs`` and
    ``dither_groups`` give each stream's domain, step, dither seed, folded signs and grouped
    symbols (as
    :func:`deltackpt.kernels.quant.decode_step_streams`); a single linear
    stream predicted from zero may be ``scale``d, its steps shaped by a
    positive ``floor`` (as :func:`deltackpt.kernels.quant.decode_block_stream`).
    """
    device = _device(out)
    n, n_steps = streams.n, streams.bounds.shape[0] - 1
    _check_tensor("out", out, device, n)
    if pred is not None:
        _check_tensor("pred", pred, device, n)
    seeds = kernel_seeds(n_steps, ordinal, steps, streams.block, dithers, dither_signs,
                         dither_groups)
    check_scaling(scale is not None, n_steps == 1 and not ordinal[0] and zero_start,
                  "one stream of the linear domain, without prediction", eps, floor)
    if scale is not None:
        _check_tensor("scale", scale, device, n)
    coded = [_steps(o, s) for o, s in zip(ordinal, steps, strict=True)]
    if n == 0 or not n_steps:
        return

    def upload(values: list, dtype: np.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype)).to(device, non_blocking=True)

    n_blocks = n_blocks_of(n, streams.block)
    rows, cols = _tile(streams.block)
    with _launching(device):
        _decode_kernel[(triton.cdiv(n_blocks, rows),)](
            streams.data, streams.bounds, streams.offsets, upload(ordinal, np.int32),
            upload([f for f, _ in coded], np.float32), upload([i for _, i in coded], np.int64),
            upload(seeds, np.int64), n_steps, out if pred is None else pred, out,
            out if scale is None else scale, n, n_blocks, first, float(np.float32(eps)),
            float(np.float32(floor)), BLOCK=streams.block, ROWS=rows, COLS=cols,
            ZERO_START=zero_start, SCALED=scale is not None, SHAPED=floor > 0,
            **_launch_options())


def decode_step_streams(streams: list[np.ndarray], out: torch.Tensor, *, ordinal: list[bool],
                        steps: list[float | int], block: int, zero_start: bool,
                        dithers: list[int | None] | None = None,
                        dither_signs: list[bool] | None = None,
                        dither_groups: list[bool] | None = None, first: int = 0,
                        pred: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                        eps: float = 0.0, floor: float = 0.0,
                        bit_planes: list[bool] | None = None) -> None:
    """:func:`deltackpt.kernels.quant.decode_step_streams` into the float32 tensor ``out``: the
    host streams (uint8) checked and uploaded (:func:`upload_streams`), then applied in one
    pass (:func:`apply_streams`, whose arguments the others are). Raises ``ValueError`` naming
    the first damaged stream before anything is written.
    """
    apply_streams(upload_streams(streams, out.shape[0], block, _device(out), bit_planes), out,
                  ordinal=ordinal, steps=steps, zero_start=zero_start, dithers=dithers,
                  dither_signs=dither_signs, dither_groups=dither_groups, first=first,
                  pred=pred, scale=scale, eps=eps, floor=floor)


def decode_block_stream(stream: np.ndarray, pred: torch.Tensor | None, out: torch.Tensor, *,
                        ordinal: bool, step: float | int, block: int, dither: int | None = None,
                        dither_signs: bool = False, dither_groups: bool = False, first: int = 0,
                        scale: torch.Tensor | None = None, eps: float = 0.0,
                        floor: float = 0.0, bit_planes: bool = False) -> None:
    """:func:`deltackpt.kernels.quant.decode_block_stream` into the float32 tensor ``out`` (may
    be ``pred``) from the host stream ``stream``."""
    check_scaling(scale is not None, not (ordinal or pred is not None),
                  "the linear domain, without prediction", eps, floor)
    decode_step_streams([stream], out, ordinal=[ordinal], steps=[step], block=block,
                        zero_start=pred is None, dithers=[dither], dither_signs=[dither_signs],
                        dither_groups=[dither_groups], first=first, pred=pred, scale=scale,
                        eps=eps, floor=floor, bit_planes=[bit_planes])
