"""Quantization kernels: where a tensor is quantized for a delta step (docs/FORMAT.md 3.2).

A value ``x`` is coded against a prediction ``p`` (the reconstruction a
reader already has, or zero) as an integer ``q``; the reader rebuilds
``s = p + q * step``. Two domains make that sum exact and portable:

* ``linear``: float32 arithmetic, ``s = f32(p + f32(f32(q) * step))``. The
  error ``|s - x|`` is at most ``step / 2``. Used for weight residuals and
  signed moments.
* ``ordinal``: the float's bit pattern read as an integer key that orders
  like the float (``bits`` for ``x >= 0``, ``-(bits & 0x7fffffff)`` below
  zero); ``key(s) = key(p) + q * step``. A step of ``2**k`` keys is a
  relative error of at most ``2**(k - 24)``: the right domain for Adam's
  ``exp_avg_sq``, which spans many orders of magnitude, and for optimizer
  states of unknown meaning. Pure integer arithmetic, so every
  implementation agrees bit for bit.

Symbols are zigzag-mapped (0, -1, 1, -2, ... to 0, 1, 2, 3, ...) and packed
LSB first at a width chosen per block of ``block`` elements: the width of
the block's largest symbol, 0 for an all-zero block, at most 16. The
packed stream is the block widths (one byte each) followed by every block's
bits, each block starting on a byte boundary; a dithered stream of the
linear domain may hold each block's symbols grouped by the size of their
dither offsets (``_group_lanes``). Chunks store the stream as bit planes
(since format 2.8, :mod:`deltackpt.kernels.planes`), which the decoders read
as they are.

:func:`encode_block_stream` is the fused encoder: one pass reads each
input once and computes residual, symbol, block width, packed bits, the new
reconstruction and error statistics. :func:`decode_block_stream`
unpacks, dequantizes and adds into the running reconstruction in place.
:func:`decode_step_streams` applies the streams of several consecutive
steps at once (the end of a restore chain): each block's running values stay
in a block-sized buffer through every step and are written once, instead of
one pass over the whole state per step. The ``numpy_*`` functions are the
executable spec the tests hold the kernels to, bit for bit.

The arithmetic is FORMAT.md 3.2's *Decode arithmetic*, defined there once;
:mod:`deltackpt.kernels.gpu_quant` implements it again in Triton, for CUDA
tensors, and the tests hold the two to the same bits.

Every kernel is serial and releases the GIL: a save or restore runs one
chunk (a few MB) per task on its thread pool, so chunks are coded in
parallel on every core. Parallelism across chunks needs no synchronisation
inside a kernel; Numba's parallel loops, which wait for every thread at the
end of each loop, collapsed to a third of their speed whenever another
process kept a core busy (as the training job beside a save does).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from deltackpt.kernels.planes import compact_planes, pack_planes, plane_starts, unpack_planes
from deltackpt.kernels.spans import copy_span

MAX_WIDTH = 16
Q_MIN, Q_MAX = -(1 << (MAX_WIDTH - 1)), (1 << (MAX_WIDTH - 1)) - 1
MAX_KEY = 0x7F7FFFFF  # the largest finite float32's bit pattern
MAX_DITHERED_KEY_STEP = 1 << 29  # dithered ordinal steps: key offsets exact in float64 (64 binades)
# Set in a kernel's seed (above its 32 bits, which alone the hash reads): the symbols' signs are
# folded by the dither (FORMAT.md 3.2, ``dither_signs``).
SIGNS_BIT = 1 << 32
# Likewise: each block's symbols are stored grouped by their dither offset's size
# (``dither_groups``), in N_GROUPS groups; a block of at most MAX_GROUPED_BLOCK elements.
GROUPS_BIT = 1 << 33
N_GROUPS = 4
MAX_GROUPED_BLOCK = 1 << 16
# Per-block statistics returned by the encoder, one row per block.
STAT_MAX_ABS, STAT_MAX_REL, STAT_SUM_SQ_ERR, STAT_SUM_SQ, STAT_NONZERO, STAT_CLIPPED, STAT_BAD, \
    STAT_LOST_ZEROS = range(8)
N_STATS = 8


@njit(inline="always")
def _key_of(value: np.float32) -> np.int32:
    """Order-preserving integer key of a float32 value (its bit pattern, negatives mirrored)."""
    bits = np.float32(value).view(np.int32)
    return np.int32(bits if bits >= 0 else -(bits & 0x7FFFFFFF))


@njit(inline="always")
def _clamp_key(key: np.float64) -> np.float64:
    """``key`` (an integer in float64) clamped to the keys of finite float32 values."""
    return min(max(key, np.float64(-MAX_KEY)), np.float64(MAX_KEY))


@njit(inline="always")
def _float_of_key(key: np.int32) -> np.float32:
    """The float32 whose key is ``key`` (the inverse of ``_key_of``; ``|key| <= MAX_KEY``)."""
    return np.int32(key if key >= 0 else (-key) | -0x80000000).view(np.float32)


@njit(inline="always")
def _value_of(key: np.float64) -> np.float32:
    """The float32 value of a key (an integer in float64), clamped to finite values."""
    return _float_of_key(np.int32(_clamp_key(key)))


def _dither_hash(context, builder, signature, args) -> ir.Value:
    """LLVM IR of FORMAT.md 3.2's dither hash of ``(index, seed)``: its 24 bits, an i32.

    Written in LLVM IR because Numba computes integer arithmetic in 64 bits,
    and 64-bit vector multiplies do not exist before AVX-512: in 32-bit lanes
    the hash vectorizes, twice as fast. ``numpy_dither`` is its reference.
    """
    i32 = ir.IntType(32)
    index64, seed64 = (context.cast(builder, a, t, types.int64)
                       for a, t in zip(args, signature.args, strict=True))
    x = builder.xor(builder.trunc(index64, i32), builder.trunc(seed64, i32))
    for shift, factor in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        x = builder.mul(builder.xor(x, builder.lshr(x, ir.Constant(i32, shift))),
                        ir.Constant(i32, factor))
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
    return builder.lshr(x, ir.Constant(i32, 8))


@intrinsic
def _dither_bits(typingctx, index, seed):
    """The 24-bit dither hash of element ``index`` for ``seed``, as an int32: its dither offset
    is ``_dither_of_bits`` of it."""
    def codegen(context, builder, signature, args):
        return _dither_hash(context, builder, signature, args)

    return types.int32(index, seed), codegen


@njit(inline="always")
def _dither_of_bits(bits: np.int32) -> np.float32:
    """FORMAT.md 3.2's dither offset of hash ``bits``: ``bits * 2**-24 - 0.5``, in [-0.5, 0.5),
    a multiple of 2**-24 (exact in float32)."""
    return np.float32(np.float32(bits) * np.float32(2.0**-24)) - np.float32(0.5)


@njit(inline="always")
def _folds_signs(seed: np.int64) -> bool:
    """Whether a kernel seed (``_seed``) is a dithered stream's with ``SIGNS_BIT``: its
    symbols' signs folded by the dither."""
    return seed >= 0 and seed & SIGNS_BIT != 0


@njit(inline="always")
def _fold_sign(u: np.float32, signs: bool) -> np.float32:
    """FORMAT.md 3.2's ``dither_signs`` where ``signs``: -1.0 where the dither offset ``u`` is
    at least 0, else 1.0, the factor between a value's symbol and the stored one either way.
    A dither of ``u >= 0`` rounds a small value up, to 1 rather than -1, and one below 0
    down: folded, both are -1, and small values' symbols take one sign, whose bit the coder
    no longer stores. A float factor, applied to ``f32(q)`` (exact): the same fold on 32-bit
    integers kept the kernels' loops from vectorizing (their decode took 1.5x as long)."""
    return np.float32(-1.0) if signs and u >= np.float32(0.0) else np.float32(1.0)


@njit(inline="always")
def _groups_symbols(seed: np.int64) -> bool:
    """Whether a kernel seed (``_seed``) is a dithered stream's with ``GROUPS_BIT``."""
    return seed >= 0 and seed & GROUPS_BIT != 0


@njit(inline="always")
def _group_lanes(bits, lanes) -> np.uint64:
    """FORMAT.md 3.2's ``dither_groups`` for a block of dither hashes ``bits``: its symbols are
    stored grouped by the quarter of ``[0, 0.5]`` the size of their dither offset lies in
    (``|u| * 8``, 4 taken as 3), smallest first, in element order within a group: the
    symbols of small offsets, mostly zero, come together, and the coder of the planes
    (``kernels.rans``, in one bin a group) codes each group by its own model.

    Writes each element's group as the shift of its 16-bit lane (``16 * group``) to ``lanes``
    and returns the places where the groups start, one a lane: element ``j``'s place is its
    group's lane, which then moves on by one (``_next_place``). Lanes hold places up to
    ``MAX_GROUPED_BLOCK``; no branch, no store to a counter per element (a counting sort's
    took 2.7 times as long)."""
    total = np.uint64(0)
    for j in range(bits.shape[0]):
        lane = np.uint64(min(abs(bits[j] - (1 << 23)) >> 21, N_GROUPS - 1) * 16)
        lanes[j] = lane
        total += np.uint64(1) << lane
    return (total << np.uint64(16)) + (total << np.uint64(32)) + (total << np.uint64(48))


@njit(inline="always")
def _next_place(places: np.uint64, lane: np.uint64) -> tuple[np.int64, np.uint64]:
    """The place of an element of ``lane`` (``_group_lanes``), and the places after it."""
    return np.int64((places >> lane) & np.uint64(0xFFFF)), places + (np.uint64(1) << lane)


@njit(inline="always")
def _fill_dither_bits(bits, index, seed) -> None:
    """``bits[j] = _dither_bits(index + j, seed)``. The kernels hash a block in this loop of its
    own, in 32-bit lanes (eight a vector with AVX2), before the loop that uses the hashes:
    inside a loop of float64 keys, the hash ran four lanes at a time (a 5-step dithered ordinal
    chain decoded 20% slower)."""
    for j in range(bits.shape[0]):
        bits[j] = _dither_bits(index + j, seed)


@njit(inline="always")
def _key_offset(bits: np.int32, step_k: np.float64) -> np.float64:
    """FORMAT.md 3.2's dither offset in keys of an ordinal step ``step_k`` (an integer, at most
    MAX_DITHERED_KEY_STEP) for the dither offset ``u = bits * 2**-24 - 0.5`` of hash ``bits``
    (``_dither_bits``): ``floor((u + 0.5) * step) - floor(step / 2)``, which is ``floor(bits *
    step * 2**-24) - floor(step / 2)`` exactly, 0 for ``u = 0``. In float64, as the kernels'
    keys: ``bits * step`` is below 2**53, so the product, its scaling and the floors are exact,
    and the conversions stay 32-bit (AVX2 converts int64 lanes one by one)."""
    return np.floor(np.float64(bits) * (step_k * 2.0**-24)) - np.floor(step_k * 0.5)


@njit(inline="always")
def _reconstruct(p: np.float32, q: np.int32, ordinal: bool, step_f: np.float32,
                 step_k: np.float64, u: np.float32, off: np.float64,
                 sign: np.float32) -> np.float32:
    """The running value after symbol ``q`` on prediction ``p`` (with dither offset ``u`` and
    the fold's ``sign``, ``_fold_sign``, in the linear domain, key offset ``off`` in the
    ordinal one, ``_key_offset``: 0 when undithered): FORMAT.md 3.2's one rule, shared by
    encoder and decoder so they agree by construction.

    The ordinal step ``step_k`` (an integer) is passed as a float64: ``key(p) + q * step`` plus
    the dither's key offset is below 2**47, exact in float64, and with AVX2 conversions between
    floats and 32-bit integers vectorize, those with 64-bit integers do not.
    """
    if ordinal:
        key = np.float64(_key_of(p)) + np.float64(q) * step_k + off
        return _float_of_key(np.int32(min(max(key, np.float64(-MAX_KEY)), np.float64(MAX_KEY))))
    return np.float32(p + np.float32(np.float32(np.float32(q) * sign - u) * step_f))


@njit(inline="always")
def _dither_offsets(ordinal: bool, dithered: bool, bits: np.int32,
                    step_k: np.float64) -> tuple[np.float32, np.float64]:
    """``(u, off)`` for ``_reconstruct`` of an element of dither hash ``bits`` (unread when not
    ``dithered``): its dither offset in the linear domain, its key offset in the ordinal one
    (float64, exact), zero where unused."""
    if dithered and ordinal:
        return np.float32(0.0), _key_offset(bits, step_k)
    if dithered:
        return _dither_of_bits(bits), np.float64(0.0)
    return np.float32(0.0), np.float64(0.0)


@intrinsic
def _sqrt32(typingctx, value):
    """The float32 square root, correctly rounded (IEEE), as LLVM's ``llvm.sqrt.f32``: Numba
    calls libm's ``sqrtf`` for ``np.sqrt``, which may set errno, so no loop around it
    vectorizes."""
    def codegen(context, builder, signature, args):
        sqrt = builder.module.declare_intrinsic("llvm.sqrt", [ir.FloatType()])
        return builder.call(sqrt, [args[0]])

    return types.float32(types.float32), codegen


@njit(inline="always")
def _element_step(step_f: np.float32, scale: np.float32, eps: np.float32, floor: np.float32,
                  shaped: bool) -> np.float32:
    """FORMAT.md 3.2's step of an element of a ``scale``d chunk: ``step * (sqrt(scale) + eps)``,
    ``shaped`` divided by ``sqrt(sqrt(scale) + floor)``, each operation rounded to float32
    (square roots and the division included: IEEE rounds them exactly)."""
    root = _sqrt32(np.float32(scale))
    st = np.float32(step_f * np.float32(root + eps))
    return np.float32(st / _sqrt32(np.float32(root + floor))) if shaped else st


@njit(inline="always")
def _zigzag(q: np.int32) -> np.uint32:
    return np.uint32((q << np.int32(1)) ^ (q >> np.int32(31)))


@njit(inline="always")
def _unzigzag(z: np.int64) -> np.int64:
    return (z >> 1) ^ -(z & 1)


@njit(inline="always")
def _bit_width(z: np.int64) -> np.int64:
    w = 0
    while z:
        w += 1
        z >>= 1
    return w


@njit(inline="always")
def _pack_at(sym, width, slot):
    """Pack ``sym`` at ``width`` bits each, LSB first, into ``slot`` (needs 8 spare bytes)."""
    m = sym.shape[0]
    pos = 0
    j = 0
    if width <= 8:  # eight symbols make exactly ``width`` bytes
        while j + 8 <= m:
            word = np.uint64(0)
            for k in range(8):
                word |= np.uint64(sym[j + k]) << np.uint64(k * width)
            for k in range(8):  # unconditional 8-byte store; the next group overwrites the excess
                slot[pos + k] = np.uint8((word >> np.uint64(8 * k)) & np.uint64(0xFF))
            pos += width
            j += 8
    acc = np.uint64(0)
    filled = 0
    while j < m:
        acc |= np.uint64(sym[j]) << np.uint64(filled)
        filled += width
        if filled >= 32:
            for k in range(4):
                slot[pos + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))
            acc >>= np.uint64(32)
            filled -= 32
            pos += 4
        j += 1
    for k in range((filled + 7) // 8):
        slot[pos + k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(0xFF))


@njit(inline="always")
def _pack_bytewise(sym, width, slot):
    """``_pack_at`` for a width that divides 8: each byte is built from its ``8 // width``
    symbols alone, which vectorizes."""
    per = 8 // width
    m = sym.shape[0]
    full = m // per
    for i in range(full):
        byte = np.uint32(0)
        for k in range(per):
            byte |= np.uint32(sym[i * per + k]) << np.uint32(k * width)
        slot[i] = np.uint8(byte)
    byte = np.uint32(0)  # the symbols of a partial last byte
    for j in range(full * per, m):
        byte |= np.uint32(sym[j]) << np.uint32((j - full * per) * width)
    slot[full] = np.uint8(byte)


@njit(cache=True, nogil=True)
def _pack(sym, width, slot):
    """``_pack_at`` with a literal width for the common widths (as ``_unpack``)."""
    if width == 1:
        _pack_bytewise(sym, 1, slot)
    elif width == 2:
        _pack_bytewise(sym, 2, slot)
    elif width == 3:
        _pack_at(sym, 3, slot)
    elif width == 4:
        _pack_bytewise(sym, 4, slot)
    elif width == 8:
        _pack_bytewise(sym, 8, slot)
    else:
        _pack_at(sym, width, slot)


@njit(inline="always")
def _unpack_at(stream, pos, width, q):
    """Symbols of one block (``q.shape[0]`` of them at ``width`` bits) from ``stream[pos:]``,
    un-zigzagged into ``q``. The stream must be padded by 8 bytes."""
    m = q.shape[0]
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    j = 0
    if width <= 8:
        while j + 8 <= m:
            word = np.uint64(0)
            for k in range(8):
                word |= np.uint64(stream[pos + k]) << np.uint64(8 * k)
            for k in range(8):
                q[j + k] = _unzigzag(np.int64((word >> np.uint64(k * width)) & mask))
            pos += width
            j += 8
    acc = np.uint64(0)
    filled = 0
    while j < m:
        if filled < width:
            word = np.uint64(0)
            for k in range(4):
                word |= np.uint64(stream[pos + k]) << np.uint64(8 * k)
            acc |= word << np.uint64(filled)
            pos += 4
            filled += 32
        q[j] = _unzigzag(np.int64(acc & mask))
        acc >>= np.uint64(width)
        filled -= width
        j += 1


@njit(inline="always")
def _unpack_bytewise(stream, pos, width, q):
    """``_unpack_at`` for a width that divides 8: each byte holds ``8 // width`` whole symbols,
    extracted in 32-bit lanes from the byte alone, which vectorizes."""
    per = 8 // width
    mask = np.int32((1 << width) - 1)
    m = q.shape[0]
    full = m // per
    for i in range(full):
        byte = np.int32(stream[pos + i])
        for k in range(per):
            z = (byte >> np.int32(k * width)) & mask
            q[i * per + k] = (z >> np.int32(1)) ^ -(z & np.int32(1))
    byte = np.int32(stream[pos + full])  # the symbols of a partial last byte
    for j in range(full * per, m):
        z = (byte >> np.int32((j - full * per) * width)) & mask
        q[j] = (z >> np.int32(1)) ^ -(z & np.int32(1))


@njit(cache=True, nogil=True)
def _unpack(stream, pos, width, q):
    """``_unpack_at`` with a literal width for widths up to 8, the common ones: LLVM then folds
    the shifts and masks, about 3x faster than with a variable width. Widths that divide 8
    unpack byte by byte, faster again (1.5-2.5x)."""
    if width == 1:
        _unpack_bytewise(stream, pos, 1, q)
    elif width == 2:
        _unpack_bytewise(stream, pos, 2, q)
    elif width == 3:
        _unpack_at(stream, pos, 3, q)
    elif width == 4:
        _unpack_bytewise(stream, pos, 4, q)
    elif width == 5:
        _unpack_at(stream, pos, 5, q)
    elif width == 6:
        _unpack_at(stream, pos, 6, q)
    elif width == 7:
        _unpack_at(stream, pos, 7, q)
    elif width == 8:
        _unpack_bytewise(stream, pos, 8, q)
    else:
        _unpack_at(stream, pos, width, q)


@njit(inline="always")
def _finite(v: np.float32) -> bool:
    return (np.float32(v).view(np.uint32) & np.uint32(0x7F800000)) != np.uint32(0x7F800000)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def _block_stats(x, out, sym, width, relative, clip_at, row):
    """Error statistics of one block (not part of the format: reassociated sums are fine, but
    no other fast-math flag: a reciprocal would make ``0 / tiny`` NaN).

    The relative error is only tracked where it means something (``relative``:
    the ordinal domain); symbols can only be clipped at the full 16-bit width,
    where a zigzag code ``sym`` of at least ``clip_at`` is a clamped one
    (0xFFFE: 32767 or -32768; 0xFFFD with folded signs, clamped to +-32767).
    Lost zeros are elements exactly zero that did not reconstruct as zero (a
    dithered step's fraction), which the codec then sets to zero.
    Maxima are taken over the bit patterns of the (non-negative, finite)
    errors, which order like the errors: LLVM vectorizes integer maxima, not
    float ones (2.5x faster).
    """
    max_abs, sum_sq_err, sum_sq, nonzero = np.int32(0), 0.0, 0.0, np.int32(0)
    lost = np.int32(0)
    for j in range(x.shape[0]):
        err = out[j] - x[j]
        max_abs = max(max_abs, np.float32(err).view(np.int32) & np.int32(0x7FFFFFFF))
        sum_sq_err += np.float64(err) * np.float64(err)
        sum_sq += np.float64(x[j]) * np.float64(x[j])
        nonzero += np.int32(sym[j] != 0)
        lost += np.int32((x[j] == 0) & (out[j] != 0))
    max_rel = np.int32(0)
    if relative:
        for j in range(x.shape[0]):
            ax = abs(x[j])
            rel = abs(out[j] - x[j]) / ax if ax > 0 else np.float32(0.0)
            max_rel = max(max_rel, np.float32(rel).view(np.int32))
    clipped = np.int32(0)
    if width == 16:
        for j in range(x.shape[0]):
            clipped += np.int32(sym[j] >= clip_at)
    row[STAT_MAX_ABS] = np.int32(max_abs).view(np.float32)
    row[STAT_MAX_REL] = np.int32(max_rel).view(np.float32)
    row[STAT_SUM_SQ_ERR] = sum_sq_err
    row[STAT_SUM_SQ] = sum_sq
    row[STAT_NONZERO] = nonzero
    row[STAT_CLIPPED] = clipped
    row[STAT_LOST_ZEROS] = lost


@njit(inline="always")
def _pack_block(sym, width, slot, planes, scratch):
    """A block's symbols into its slot: packed, or with ``planes`` as its bit planes' segments
    (``kernels.planes.pack_planes``)."""
    if planes:
        pack_planes(sym, width, slot, scratch)
    else:
        _pack(sym, width, slot)


def _make_encoder(ordinal: bool, use_pred: bool, dithered: bool, scaled: int):
    """The fused encode kernel for one domain, prediction, dithering and per-element scaling
    (compile-time constants; ``scaled``: ``UNSCALED``, ``SCALED`` or ``SHAPED``)."""

    # error_model="numpy": a float division by zero is inf, not Python's ZeroDivisionError,
    # whose check on every element's own step (scaled chunks) keeps the loop from vectorizing.
    @njit(cache=True, nogil=True, error_model="numpy")
    def encode(x, pred, out, step_f, step_i, block, widths, slots, stats, seed, first, scale,
               eps, floor, planes):
        n = x.shape[0]
        step_k = np.float64(step_i)
        signs = _folds_signs(seed)
        grouped = _groups_symbols(seed)
        q_min = np.float32(-Q_MAX if signs else Q_MIN)  # folded symbols are clamped to +-Q_MAX
        # A division by a power-of-two step is a multiplication by its reciprocal, bit for bit:
        # 2**-k is exact, and the quotient of the integer d (|d| < 2**33) by 2**k keeps d's
        # significand (neither rounds, nor underflows), so both give the same float64 and the
        # same rint (tests/test_quant_kernels.py: test_ordinal_power_of_two_steps_multiply).
        # The division costs the ordinal loop about a tenth of its time.
        pow2 = (step_i & (step_i - 1)) == 0
        inv_k = 1.0 / step_k
        sym_block = np.empty(block, np.uint16)
        stored_block = np.empty(block, np.uint16)  # the symbols in stream order, when grouped
        bits_block = np.empty(block, np.int32)
        lanes_block = np.empty(block, np.uint64)
        scratch = np.empty(block + 8, np.uint8)  # pack_planes' bytes of symbols
        # Values go to a block buffer, then to out: when out is pred (in place, as a delta on
        # its base's last use codes), a loop that writes out while reading pred fails LLVM's
        # runtime overlap check and runs unvectorized, at half the speed.
        out_block = np.empty(block, np.float32)
        for b in range(widths.shape[0]):
            start = b * block
            stop = min(start + block, n)
            xb = x[start:stop]
            pb = pred[start:stop]
            m = stop - start
            ob = out_block[:m]
            bad = np.int32(0)
            sym = sym_block[:m]
            bits = bits_block[:m]
            if dithered:
                _fill_dither_bits(bits, first + start, seed)
            zor = np.uint32(0)
            for j in range(m):  # branch-free and 32-bit, so that it vectorizes
                p = pb[j] if use_pred else np.float32(0.0)
                ok = _finite(xb[j]) & _finite(p)
                u, off = _dither_offsets(ordinal, dithered, bits[j], step_k)
                st = _element_step(step_f, scale[start + j], eps, floor, scaled == SHAPED) \
                    if scaled else step_f
                if ordinal:
                    kx, kp = np.float64(_key_of(xb[j])), np.float64(_key_of(p))
                    d = kx - kp - off
                    qf = np.rint(d * inv_k if pow2 else d / step_k)
                    # Never flip a sign: a positive moment (Adam's second) restored negative
                    # would be a NaN in its square root.
                    k = kp + qf * step_k + off
                    qf += np.float64((kx >= 0) & (k < 0)) - np.float64((kx < 0) & (k > 0))
                    q = np.int32(min(max(qf, np.float64(Q_MIN)), np.float64(Q_MAX)))
                else:
                    r32 = np.float32(xb[j] - p) if ok else np.float32(0.0)  # no NaN past here
                    qf32 = np.rint(np.float32(np.float32(r32 / st) + u))
                    ok &= qf32 == qf32  # NaN (0 / 0: a scaled step that underflows) has no symbol
                    q = np.int32(min(max(qf32, q_min), np.float32(Q_MAX)))
                s = _reconstruct(p, q, ordinal, st, step_k, u, off, np.float32(1.0))
                if not ordinal:  # a linear reconstruction can overflow, with absurd steps
                    ok &= _finite(s)
                bad += np.int32(not ok)
                ob[j] = s
                c = np.int32(np.float32(q) * _fold_sign(u, signs)) if dithered and not ordinal \
                    else q
                z = _zigzag(c)
                sym[j] = np.uint16(z)
                zor |= z
            copy_span(ob, 0, out, start, m)
            stats[b, STAT_BAD] = bad
            if bad:
                widths[b] = 0
                continue
            width = _bit_width(np.int64(zor))
            widths[b] = width
            if grouped and width:
                lanes = lanes_block[:m]
                places = _group_lanes(bits, lanes)
                for j in range(m):
                    at, places = _next_place(places, lanes[j])
                    stored_block[at] = sym[j]
                _pack_block(stored_block[:m], width, slots[b], planes, scratch)
            else:
                _pack_block(sym, width, slots[b], planes, scratch)
            _block_stats(xb, ob, sym, width, ordinal, 0xFFFD if signs else 0xFFFE, stats[b])

    return encode


# Per-element steps: none, scaled by sqrt(scale) + eps, or that shaped by sqrt(scale) + floor.
UNSCALED, SCALED, SHAPED = range(3)
# A scaled chunk is of the linear domain and predicts from zero.
_VARIANTS = [(ordinal, use_pred, dithered, UNSCALED) for ordinal in (False, True)
             for use_pred in (False, True) for dithered in (False, True)] + [
    (False, False, dithered, scaled) for dithered in (False, True) for scaled in (SCALED, SHAPED)]
_ENCODERS = {variant: _make_encoder(*variant) for variant in _VARIANTS}
_NO_SCALE = np.zeros(0, np.float32)


@njit(cache=True, nogil=True)
def _block_offsets(widths, n, block, base):
    """Byte offset of each block's bits in the stream, and the stream's total length."""
    offsets = np.empty(widths.shape[0] + 1, np.int64)
    pos = base
    for b in range(widths.shape[0]):
        offsets[b] = pos
        count = min(block, n - b * block)
        pos += (count * np.int64(widths[b]) + 7) // 8
    offsets[widths.shape[0]] = pos
    return offsets


@njit(cache=True, nogil=True)
def _compact(slots, widths, offsets, stream):
    n_blocks = widths.shape[0]
    for b in range(n_blocks):
        stream[b] = widths[b]
        copy_span(slots[b], 0, stream, offsets[b], offsets[b + 1] - offsets[b])


_scratch = threading.local()


def _slots(n_blocks: int, block: int) -> np.ndarray:
    """Per-block output slots of the encoder, one buffer per thread reused across calls
    (fresh pages cost page faults)."""
    size = n_blocks * (2 * block + 16)  # 16 bits a symbol, and bit planes' padding
    buffer = getattr(_scratch, "slots", None)
    if buffer is None or buffer.size < size:
        buffer = _scratch.slots = np.empty(size, np.uint8)
    return buffer[:size].reshape(n_blocks, 2 * block + 16)


def n_blocks_of(n: int, block: int) -> int:
    """Number of blocks of ``block`` elements that cover ``n`` elements."""
    return -(-n // block)


def encode_block_stream(x: np.ndarray, pred: np.ndarray | None, out: np.ndarray, *,
                        ordinal: bool, step: float | int, block: int,
                        dither: int | None = None, dither_signs: bool = False,
                        dither_groups: bool = False, first: int = 0,
                        scale: np.ndarray | None = None, eps: float = 0.0, floor: float = 0.0,
                        bit_planes: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``x`` against ``pred`` (or zero) and pack the symbols (with ``bit_planes``, as
    bit planes: FORMAT.md 3.2).

    ``dither`` is a seed: element ``i`` is then quantized on a grid shifted
    by the dither offset of index ``first + i`` (``first``: the chunk's first
    element in its tensor), which makes the error uniform and independent of
    the value coded (ordinal steps: at most ``MAX_DITHERED_KEY_STEP``);
    ``dither_signs`` (linear domain) folds the symbols' signs by it
    (``_fold_sign``) and ``dither_groups`` stores each block's symbols grouped
    by it (``_group_lanes``). An ordinal symbol never flips the value's sign.

    ``scale`` (float32, one per element; linear domain, no prediction)
    gives element ``i`` the step ``step * (sqrt(scale[i]) + eps)``: Adam's
    first moment coded relative to the second's square root. A positive
    ``floor`` divides that by ``sqrt(sqrt(scale[i]) + floor)``: finer where
    the second moment is larger (``numpy_element_steps``).

    Writes the reconstruction a reader will get into ``out`` (float32, may
    be ``pred`` itself: the encoder's reconstruction is updated in place).
    Returns the symbol stream (uint8) and per-block statistics
    (``float64[n_blocks, N_STATS]``, columns ``STAT_*``). Elements that
    cannot be coded (non-finite inputs, or a reconstruction that would
    overflow) are counted in ``STAT_BAD``; such a block is skipped, its
    ``out`` and other statistics left undefined, and the caller must store
    the chunk exactly.
    """
    n = x.shape[0]
    n_blocks = n_blocks_of(n, block)
    widths = np.empty(n_blocks, np.uint8)
    stats = np.empty((n_blocks, N_STATS), np.float64)
    step_f, step_i = _steps(ordinal, step)
    seed = _seed(ordinal, dither, step, block, dither_signs, dither_groups)
    variant, scale, eps32, floor32 = _variant(ordinal, pred is not None, seed, scale, eps, floor, n)
    slots = _slots(n_blocks, block)
    _ENCODERS[variant](x, out if pred is None else pred, out, step_f, step_i, block, widths, slots,
                       stats, seed, np.int64(first), scale, eps32, floor32, bit_planes)
    if bit_planes:
        stream = np.empty(plane_starts(widths, n, block, n_blocks)[-1], np.uint8)
        compact_planes(slots, widths, n, block, stream)
        return stream, stats
    offsets = _block_offsets(widths, n, block, n_blocks)
    stream = np.empty(offsets[-1], np.uint8)
    _compact(slots, widths, offsets, stream)
    return stream, stats


# Status of a packed stream (see _check_stream).
STREAM_OK, STREAM_SHORT, STREAM_WIDE, STREAM_LENGTH = range(4)


@njit(cache=True, nogil=True)
def _check_stream(stream, lo, hi, n, block, planes):
    """Where the blocks of the packed stream ``stream[lo:hi]`` of ``n`` elements start
    (absolute offsets, and the stream's end), or with ``planes`` where the planes of its bit
    planes start (``kernels.planes.plane_starts``), and its status: ``STREAM_OK``, or why it
    is damaged (too short for its widths, a width over ``MAX_WIDTH``, a length other than its
    widths imply). Decoding a stream whose status is ``STREAM_OK`` reads only
    ``stream[lo:hi]`` and 8 bytes past ``hi``."""
    n_blocks = (n + block - 1) // block
    if hi - lo < n_blocks:
        return np.zeros(1, np.int64), STREAM_SHORT
    widths = stream[lo : lo + n_blocks]
    for b in range(n_blocks):
        if widths[b] > MAX_WIDTH:
            return np.zeros(1, np.int64), STREAM_WIDE
    offsets = plane_starts(widths, n, block, lo + n_blocks) if planes else \
        _block_offsets(widths, n, block, lo + n_blocks)
    return offsets, STREAM_OK if offsets[offsets.shape[0] - 1] == hi else STREAM_LENGTH


def _stream_problem(status: int, stream: np.ndarray, n: int, block: int, planes: bool) -> str:
    """What is wrong with a stream whose ``_check_stream`` status is not ``STREAM_OK``."""
    n_blocks = n_blocks_of(n, block)
    if status == STREAM_SHORT:
        return f"stream of {stream.shape[0]} bytes is shorter than its {n_blocks} block widths"
    if status == STREAM_WIDE:
        return f"block width {int(stream[:n_blocks].max())} is over {MAX_WIDTH}"
    needed = _check_stream(stream, 0, stream.shape[0], n, block, planes)[0][-1]
    return f"stream is {stream.shape[0]} bytes, its block widths need {needed}"


def check_stream(stream: np.ndarray, n: int, block: int, planes: bool = False) -> None:
    """Raise ``ValueError`` unless ``stream`` (uint8) is a well-formed symbol stream of ``n``
    elements in blocks of ``block``, packed or (``planes``) in bit planes: its length must
    match its block widths, each at most 16."""
    status = _check_stream(stream, 0, stream.shape[0], n, block, planes)[1]
    if status != STREAM_OK:
        raise ValueError(_stream_problem(status, stream, n, block, planes))


@njit(cache=True, nogil=True)
def _repack(stream, offsets, n, block, into_planes, slots):
    """Each block of a checked stream (``offsets``: as ``_check_stream`` gives them) into its
    slot in the other layout: bit planes from packed bits (``into_planes``) or back."""
    q = np.empty(block, np.int32)
    sym = np.empty(block, np.uint16)
    words = np.empty((block + 7) // 8, np.uint64)
    scratch = np.empty(block + 8, np.uint8)
    for b in range((n + block - 1) // block):
        m = min(block, n - b * block)
        width = np.int64(stream[b])
        if not width:
            continue
        if into_planes:
            _unpack(stream, offsets[b], width, q[:m])
        else:
            unpack_planes(stream, offsets, width, q[:m], words)
        for j in range(m):
            sym[j] = np.uint16(_zigzag(q[j]))
        _pack_block(sym[:m], width, slots[b], into_planes, scratch)


def to_planes(stream: np.ndarray, n: int, block: int) -> np.ndarray:
    """The bit planes (FORMAT.md 3.2, ``bit_planes``) of a packed stream of ``n`` symbols in
    blocks of ``block``, as :func:`encode_block_stream` writes them with ``bit_planes``."""
    return _relaid(stream, n, block, False)


def from_planes(stream: np.ndarray, n: int, block: int) -> np.ndarray:
    """The packed stream of the bit planes ``stream``. Raises ``ValueError`` for a damaged
    stream (:func:`check_stream`'s rules), which is never indexed out of bounds."""
    return _relaid(stream, n, block, True)


def _relaid(stream: np.ndarray, n: int, block: int, planes: bool) -> np.ndarray:
    """``stream`` (in bit planes if ``planes``, else packed) in the other layout."""
    padded = np.zeros(stream.shape[0] + 8, np.uint8)  # _unpack reads up to 8 bytes past a block
    padded[: stream.shape[0]] = stream
    offsets, status = _check_stream(padded, 0, stream.shape[0], n, block, planes)
    if status != STREAM_OK:
        raise ValueError(_stream_problem(status, stream, n, block, planes))
    n_blocks = n_blocks_of(n, block)
    widths = stream[:n_blocks]
    slots = _slots(n_blocks, block)
    _repack(padded, offsets, n, block, not planes, slots)
    if planes:
        offsets = _block_offsets(widths, n, block, n_blocks)
        out = np.empty(offsets[-1], np.uint8)
        _compact(slots, widths, offsets, out)
        return out
    out = np.empty(plane_starts(widths, n, block, n_blocks)[-1], np.uint8)
    compact_planes(slots, widths, n, block, out)
    return out


@njit(inline="always")
def _ungroup(bits, stored, lanes, q) -> None:
    """Symbols of one block stored grouped by dither (``_group_lanes``; ``bits``: the block's
    dither hashes), ``stored`` in the stream's order, into ``q`` in element order (``lanes``:
    room for the block's lanes)."""
    places = _group_lanes(bits, lanes)
    for j in range(q.shape[0]):
        at, places = _next_place(places, lanes[j])
        q[j] = stored[at]


@njit(inline="always")
def _block_symbols(stream, planes, offsets, b, width, grouped, bits, stored, lanes, q, words):
    """The symbols of block ``b`` (``width`` > 0) into ``q``: from its offset ``offsets[b]``
    in a packed stream, or with ``planes`` from the plane positions ``offsets`` (advanced past
    the block); ``grouped``, in element order from the order of ``dither_groups``."""
    target = stored if grouped else q
    if planes:
        unpack_planes(stream, offsets, width, target, words)
    else:
        _unpack(stream, offsets[b], width, target)
    if grouped:
        _ungroup(bits, stored, lanes, q)


def _make_decoder(ordinal: bool, use_pred: bool, dithered: bool, scaled: int):
    """The decode kernel for one domain, prediction, dithering and per-element scaling."""

    @njit(cache=True, nogil=True, error_model="numpy")  # as the encoder's
    def decode(stream, planes, offsets, pred, out, step_f, step_i, block, seed, first, scale, eps,
               floor):
        n = out.shape[0]
        step_k = np.float64(step_i)
        signs = _folds_signs(seed)
        grouped = _groups_symbols(seed)
        q_block = np.empty(block, np.int32)
        stored_block = np.empty(block, np.int32)
        bits_block = np.empty(block, np.int32)
        lanes_block = np.empty(block, np.uint64)
        words = np.empty((block + 7) // 8, np.uint64)
        out_block = np.empty(block, np.float32)  # as in the encoder: pred may be out
        for b in range((n + block - 1) // block):
            start = b * block
            stop = min(start + block, n)
            m = stop - start
            q = q_block[:m]
            bits = bits_block[:m]
            if dithered:
                _fill_dither_bits(bits, first + start, seed)
            width = np.int64(stream[b])
            if width:
                _block_symbols(stream, planes, offsets, b, width, grouped, bits,
                               stored_block[:m], lanes_block[:m], q, words)
            else:
                q[:] = 0
            for j in range(m):
                p = pred[start + j] if use_pred else np.float32(0.0)
                u, off = _dither_offsets(ordinal, dithered, bits[j], step_k)
                st = _element_step(step_f, scale[start + j], eps, floor, scaled == SHAPED) \
                    if scaled else step_f
                sign = _fold_sign(u, signs) if dithered and not ordinal else np.float32(1.0)
                out_block[j] = _reconstruct(p, q[j], ordinal, st, step_k, u, off, sign)
            copy_span(out_block, 0, out, start, m)

    return decode


_DECODERS = {variant: _make_decoder(*variant) for variant in _VARIANTS}


def decode_block_stream(stream: np.ndarray, pred: np.ndarray | None, out: np.ndarray, *,
                        ordinal: bool, step: float | int, block: int, dither: int | None = None,
                        dither_signs: bool = False, dither_groups: bool = False, first: int = 0,
                        scale: np.ndarray | None = None, eps: float = 0.0,
                        floor: float = 0.0, bit_planes: bool = False) -> None:
    """Rebuild ``out`` (float32) from a symbol stream, packed or in ``bit_planes``, and ``pred``
    (or zero); ``out`` may be ``pred``. ``dither``, ``dither_signs``, ``dither_groups``,
    ``first``, ``scale``, ``eps`` and ``floor`` are as the encoder had them.

    Raises ``ValueError`` when the stream's length does not match its block
    widths, or a width is over 16, so damaged streams never index out of bounds.
    """
    n = out.shape[0]
    offsets, status = _check_stream(stream, 0, stream.shape[0], n, block, bit_planes)
    if status != STREAM_OK:
        raise ValueError(_stream_problem(status, stream, n, block, bit_planes))
    step_f, step_i = _steps(ordinal, step)
    seed = _seed(ordinal, dither, step, block, dither_signs, dither_groups)
    variant, scale, eps32, floor32 = _variant(ordinal, pred is not None, seed, scale, eps, floor, n)
    padded = np.zeros(stream.shape[0] + 8, np.uint8)
    padded[: stream.shape[0]] = stream
    _DECODERS[variant](padded, bit_planes, offsets, out if pred is None else pred, out, step_f,
                       step_i, block, seed, np.int64(first), scale, eps32, floor32)


@njit(inline="always")
def _linear_step(values, q, width, step_f, seed, bits):
    """``values`` after one linear step of symbols ``q`` (all 0 for a zero-width block),
    dithered if ``seed >= 0`` (``bits``: the block's dither hashes), its symbols' signs folded
    if ``seed`` has ``SIGNS_BIT``."""
    one, zero, one32 = np.float64(1), np.float32(0.0), np.float32(1.0)
    if seed >= 0:
        signs = _folds_signs(seed)
        for j in range(values.shape[0]):
            u = _dither_of_bits(bits[j])
            values[j] = _reconstruct(values[j], q[j] if width else np.int32(0), False, step_f,
                                     one, u, 0.0, _fold_sign(u, signs))
    elif width:
        for j in range(values.shape[0]):
            values[j] = _reconstruct(values[j], q[j], False, step_f, one, zero, 0.0, one32)
    else:  # no symbols to unpack, but -0.0 still becomes +0.0
        for j in range(values.shape[0]):
            values[j] = _reconstruct(values[j], np.int32(0), False, step_f, one, zero, 0.0,
                                     one32)


@njit(inline="always")
def _ordinal_step(keys, q, width, step_i, seed, bits):
    """``keys`` after one ordinal step of symbols ``q`` (all 0 for a zero-width block),
    dithered if ``seed >= 0`` (``bits``: the block's dither hashes).

    ``_reconstruct`` clamps ``key(p) + q * step`` (plus the dither's key
    offset) and converts it to a float, which the next ordinal step converts
    back to the same key: clamping alone gives the same keys, with no
    conversion between steps. Keys are integers in float64, as in
    ``_reconstruct``: below 2**47 before the clamp, so exact.
    """
    step_k = np.float64(step_i)
    if seed >= 0:
        for j in range(keys.shape[0]):
            off = _key_offset(bits[j], step_k)
            keys[j] = _clamp_key(keys[j] + np.float64(q[j] if width else 0) * step_k + off)
    elif width:
        for j in range(keys.shape[0]):
            keys[j] = _clamp_key(keys[j] + np.float64(q[j]) * step_k)
    else:
        for j in range(keys.shape[0]):
            keys[j] = _clamp_key(keys[j])


@njit(cache=True, nogil=True)
def _decode_steps(streams, bounds, planes, ordinal, step_f, step_i, seeds, first, block,
                  zero_start, values):
    """Apply the symbol streams ``streams[bounds[t]:bounds[t + 1]]`` (packed, or bit planes
    where ``planes[t]``) in turn to ``values``.

    Checks every stream first and returns the index of the first damaged one
    and its status (``-1, STREAM_OK`` when all decode), leaving ``values``
    untouched then. One block at a time, the running values stay in a
    block-sized buffer through all steps (as keys through consecutive
    ordinal steps): ``values`` is read and written once, however many steps.
    A zero-width block skips the unpack but not the reconstruction
    (``-0.0`` becomes ``+0.0``, ordinal keys are clamped), unless the step
    before was of the same domain: a linear step never yields ``-0.0`` and
    leaves NaNs quiet, so adding ``+0.0`` keeps every bit, and its keys are
    already clamped. The result is bit for bit that of one
    ``decode_block_stream`` per step.
    """
    n = values.shape[0]
    n_steps = bounds.shape[0] - 1
    n_blocks = (n + block - 1) // block
    offsets = np.empty((n_steps, max(n_blocks + 1, MAX_WIDTH + 1)), np.int64)
    for t in range(n_steps):
        o, status = _check_stream(streams, bounds[t], bounds[t + 1], n, block, planes[t])
        if status != STREAM_OK:
            return t, status
        offsets[t, : o.shape[0]] = o
    words = np.empty((block + 7) // 8, np.uint64)
    q_block = np.empty(block, np.int32)
    run_block = np.empty(block, np.float32)
    keys_block = np.empty(block, np.float64)
    bits_block = np.empty(block, np.int32)
    stored_block = np.empty(block, np.int32)
    lanes_block = np.empty(block, np.uint64)
    for b in range(n_blocks):
        start = b * block
        m = min(block, n - start)
        q, run, keys, bits = q_block[:m], run_block[:m], keys_block[:m], bits_block[:m]
        if zero_start:
            run[:] = np.float32(0.0)
        else:
            copy_span(values, start, run, 0, m)
        keyed = False  # whether ``keys`` holds the running values rather than ``run``
        for t in range(n_steps):
            width = np.int64(streams[bounds[t] + b])
            if not width and t and ordinal[t] == ordinal[t - 1] and seeds[t] < 0:
                continue  # all-zero symbols after a step of the same domain change nothing
            if seeds[t] >= 0:
                _fill_dither_bits(bits, first + start, seeds[t])
            if width:
                _block_symbols(streams, planes[t], offsets[t], b, width, _groups_symbols(seeds[t]),
                               bits, stored_block[:m], lanes_block[:m], q, words)
            if ordinal[t]:
                if not keyed:
                    for j in range(m):
                        keys[j] = np.float64(_key_of(run[j]))
                    keyed = True
                _ordinal_step(keys, q, width, step_i[t], seeds[t], bits)
            else:
                if keyed:
                    for j in range(m):
                        run[j] = _value_of(keys[j])
                    keyed = False
                _linear_step(run, q, width, step_f[t], seeds[t], bits)
        if keyed:
            for j in range(m):
                run[j] = _value_of(keys[j])
        copy_span(run, 0, values, start, m)
    return -1, STREAM_OK


def stream_layouts(n_streams: int, bit_planes: list[bool] | None) -> np.ndarray:
    """Whether each of ``n_streams`` streams is stored as bit planes (None: none is), checked
    against their count."""
    planes = np.zeros(n_streams, np.bool_) if bit_planes is None else np.array(bit_planes, np.bool_)
    if planes.shape != (n_streams,):
        raise ValueError(f"{n_streams} streams and {planes.size} bit_planes")
    return planes


def decode_step_streams(streams: list[np.ndarray], out: np.ndarray, *, ordinal: list[bool],
                        steps: list[float | int], block: int, zero_start: bool,
                        dithers: list[int | None] | None = None,
                        dither_signs: list[bool] | None = None,
                        dither_groups: list[bool] | None = None, first: int = 0,
                        bit_planes: list[bool] | None = None) -> None:
    """Apply the symbol streams of consecutive steps in order to the running values ``out``.

    The result is bit for bit that of calling :func:`decode_block_stream`
    once per stream, each against the previous result: the first against
    ``out`` itself, or against zero with ``zero_start``. ``ordinal``,
    ``steps``, ``dithers``, ``dither_signs``, ``dither_groups`` and ``bit_planes`` (default:
    none) give each stream's domain, step, dither seed, whether its signs
    are folded and its symbols grouped by the dither, and whether it is stored as bit planes;
    all share ``block`` and ``first``, the index of ``out``'s first element in its
    tensor.
    Raises ``ValueError`` naming the first damaged stream by its index
    before anything is written.
    """
    seeds = np.array(kernel_seeds(len(streams), ordinal, steps, block, dithers, dither_signs,
                                  dither_groups), np.int64)
    planes = stream_layouts(len(streams), bit_planes)
    coded = [_steps(o, s) for o, s in zip(ordinal, steps, strict=True)]
    bounds = np.zeros(len(streams) + 1, np.int64)
    np.cumsum([s.shape[0] for s in streams], out=bounds[1:])
    flat = np.empty(bounds[-1] + 8, np.uint8)  # _unpack reads up to 8 bytes past a block
    for stream, lo, hi in zip(streams, bounds[:-1], bounds[1:], strict=True):
        flat[lo:hi] = stream
    bad, status = _decode_steps(flat, bounds, planes, np.array(ordinal, np.bool_),
                                np.array([f for f, _ in coded], np.float32),
                                np.array([i for _, i in coded], np.int64), seeds,
                                np.int64(first), block, zero_start, out)
    if status != STREAM_OK:
        raise ValueError(f"stream {bad}: "
                         f"{_stream_problem(status, streams[bad], out.shape[0], block, planes[bad])}")


@functools.lru_cache(maxsize=1024)  # a restore asks once per chunk and step, for a few steps
def _steps(ordinal: bool, step: float | int) -> tuple[np.float32, np.int64]:
    if ordinal:
        if int(step) != step or not 1 <= step <= MAX_KEY:
            raise ValueError(f"ordinal step must be an integer in [1, {MAX_KEY}], got {step!r}")
        return np.float32(1), np.int64(step)
    if not (np.isfinite(step) and step > 0 and float(np.float32(step)) == step):
        raise ValueError(f"linear step must be a positive float32 value, got {step!r}")
    return np.float32(step), np.int64(1)


def _seed(ordinal: bool, dither: int | None, step: float | int, block: int,
          dither_signs: bool = False, dither_groups: bool = False) -> np.int64:
    """The kernels' dither seed of a stream of ``block``-element blocks: ``dither``, with
    ``SIGNS_BIT`` for ``dither_signs`` and ``GROUPS_BIT`` for ``dither_groups``; -1 for
    none."""
    if dither_signs and (dither is None or ordinal):
        raise ValueError("dither_signs applies to dithered streams of the linear domain")
    if dither_groups and (dither is None or ordinal):
        raise ValueError("dither_groups applies to dithered streams of the linear domain")
    if dither_groups and block > MAX_GROUPED_BLOCK:
        raise ValueError(f"dither_groups applies to blocks of at most {MAX_GROUPED_BLOCK} "
                         f"elements, got {block}")
    if dither is None:
        return np.int64(-1)
    if int(dither) != dither or not 0 <= dither < 1 << 32:
        raise ValueError(f"a dither seed is an integer in [0, 2**32), got {dither!r}")
    if ordinal and step > MAX_DITHERED_KEY_STEP:
        raise ValueError(f"a dithered ordinal step is at most {MAX_DITHERED_KEY_STEP}, got {step}")
    return np.int64(dither | (SIGNS_BIT if dither_signs else 0)
                    | (GROUPS_BIT if dither_groups else 0))


def kernel_seeds(n_streams: int, ordinal: list[bool], steps: list[float | int], block: int,
                 dithers: list[int | None] | None, dither_signs: list[bool] | None,
                 dither_groups: list[bool] | None = None) -> list[np.int64]:
    """The kernels' seed (``_seed``) of each of ``n_streams`` consecutive streams of
    ``block``-element blocks, checked against the lengths of the other lists (``dithers``,
    ``dither_signs`` and ``dither_groups``: None for none)."""
    dithers = [None] * n_streams if dithers is None else dithers
    dither_signs = [False] * n_streams if dither_signs is None else dither_signs
    dither_groups = [False] * n_streams if dither_groups is None else dither_groups
    if not n_streams == len(ordinal) == len(steps) == len(dithers) == len(dither_signs) \
            == len(dither_groups):
        raise ValueError(f"{n_streams} streams, {len(ordinal)} domains, {len(steps)} steps, "
                         f"{len(dithers)} dithers, {len(dither_signs)} dither_signs and "
                         f"{len(dither_groups)} dither_groups")
    return [_seed(o, d, s, block, f, g) for o, d, s, f, g in zip(
        ordinal, dithers, steps, dither_signs, dither_groups, strict=True)]


def _variant(ordinal: bool, use_pred: bool, seed: np.int64, scale: np.ndarray | None,
             eps: float, floor: float, n: int
             ) -> tuple[tuple[bool, bool, bool, int], np.ndarray, np.float32, np.float32]:
    """The kernel variant of a call, and its scale array, epsilon and floor as the kernels take
    them."""
    check_scaling(scale is not None, not (ordinal or use_pred),
                  "the linear domain, without prediction", eps, floor)
    if scale is None:
        return (ordinal, use_pred, bool(seed >= 0), UNSCALED), _NO_SCALE, np.float32(0), \
            np.float32(0)
    if scale.dtype != np.float32 or scale.shape != (n,):
        raise ValueError(f"scale must be float32 of shape ({n},), got {scale.dtype} {scale.shape}")
    return (False, False, bool(seed >= 0), SHAPED if floor else SCALED), scale, np.float32(eps), \
        np.float32(floor)


def check_scaling(scaled: bool, applies: bool, where: str, eps: float, floor: float) -> None:
    """Raise ``ValueError`` for a floor without a scale, a scale where none ``applies`` (only to
    ``where``), or, with a scale, an ``eps`` that is no positive float32 value or a ``floor``
    neither 0 (no shaping) nor one (FORMAT.md 3.2). Both kernels' checks."""
    if not scaled:
        if floor:
            raise ValueError("a floor shapes the steps of a scale, and there is none")
        return
    if not applies:
        raise ValueError(f"a scale applies to {where}")
    if not (np.isfinite(eps) and eps > 0 and float(np.float32(eps)) == eps):
        raise ValueError(f"eps must be a positive float32 value, got {eps!r}")
    if not (floor == 0 or (np.isfinite(floor) and floor > 0 and float(np.float32(floor)) == floor)):
        raise ValueError(f"floor must be 0 or a positive float32 value, got {floor!r}")


# -- numpy references (the executable spec) ---------------------------------------------

def numpy_keys(values: np.ndarray) -> np.ndarray:
    """Order-preserving int64 keys of float32 values."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(bits < 0x80000000, bits, -(bits & 0x7FFFFFFF))


def numpy_from_keys(keys: np.ndarray) -> np.ndarray:
    """float32 values of int64 keys, clamped to finite values."""
    keys = np.clip(keys, -MAX_KEY, MAX_KEY)
    return np.where(keys >= 0, keys, (-keys) | 0x80000000).astype(np.uint32).view(np.float32)


def numpy_dither(n: int, seed: int, first: int = 0, stride: int = 1) -> np.ndarray:
    """Dither offsets (float32) of the ``n`` elements ``first, first + stride, ...`` for
    ``seed``."""
    indices = np.arange(first, first + n * stride, stride, dtype=np.int64)
    x = (indices & 0xFFFFFFFF).astype(np.uint32) ^ np.uint32(seed)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x21F0AAAD)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x735A2D97)
    x ^= x >> np.uint32(15)
    return (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)


def numpy_key_offsets(u: np.ndarray, step: int) -> np.ndarray:
    """Key offsets (int64) of a dithered ordinal step for dither offsets ``u``."""
    d = ((u.astype(np.float64) + 0.5) * 2**24).astype(np.int64)  # the 24-bit hash part
    return (d * step >> 24) - step // 2


def numpy_element_steps(step: float, scale: np.ndarray | None, eps: float,
                        floor: float = 0.0) -> np.ndarray | np.float32:
    """The step of each element: ``step``, or ``step * (sqrt(scale) + eps)`` in float32, with a
    positive ``floor`` divided by ``sqrt(sqrt(scale) + floor)``."""
    if scale is None:
        return np.float32(step)
    root = np.sqrt(scale.astype(np.float32))
    steps = np.float32(step) * (root + np.float32(eps))
    return steps / np.sqrt(root + np.float32(floor)) if floor else steps


def numpy_fold(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``dither_signs``' stored symbols of ``q`` for dither offsets ``u``, or the reverse."""
    return np.where(u >= 0, -q, q)


def numpy_places(u: np.ndarray, block: int) -> np.ndarray:
    """``dither_groups``: where each element's symbol lies in the stream's symbol order, for
    dither offsets ``u``: in each block, grouped by ``min(floor(8 |u|), 3)``, in element order
    within a group."""
    group = np.minimum(np.floor(np.abs(u.astype(np.float64)) * 8), N_GROUPS - 1)
    places = np.empty(u.size, np.int64)
    for start in range(0, u.size, block):
        order = np.argsort(group[start : start + block], kind="stable")
        places[start + order] = start + np.arange(order.size)
    return places


def numpy_group(q: np.ndarray, u: np.ndarray, block: int) -> np.ndarray:
    """Symbols ``q`` in the order ``dither_groups`` stores them, for dither offsets ``u``."""
    stored = np.empty_like(q)
    stored[numpy_places(u, block)] = q
    return stored


def numpy_quantize(x: np.ndarray, pred: np.ndarray | None, *, ordinal: bool, step: float | int,
                   dither: int | None = None, dither_signs: bool = False, first: int = 0,
                   scale: np.ndarray | None = None, eps: float = 0.0,
                   floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Stored symbols (int64) and reconstruction of finite ``x`` against ``pred`` (or zero)."""
    p = np.zeros_like(x) if pred is None else pred
    u = np.zeros(x.shape, np.float32) if dither is None else numpy_dither(x.size, dither, first)
    if ordinal:
        kx, kp, off = numpy_keys(x), numpy_keys(p), numpy_key_offsets(u, step)
        q = np.rint((kx - kp - off).astype(np.float64) / np.float64(step)).astype(np.int64)
        k = kp + q * step + off
        q += ((kx >= 0) & (k < 0)).astype(np.int64) - ((kx < 0) & (k > 0))  # no sign flips
        q = np.clip(q, Q_MIN, Q_MAX)
        return q, numpy_dequantize(q, p, ordinal=True, step=step, dither=dither, first=first)
    r = (x - p).astype(np.float32)
    with np.errstate(over="ignore"):  # a quotient beyond float32 is clipped like any large one
        q = np.clip(np.rint(r / numpy_element_steps(step, scale, eps, floor) + u),
                    -Q_MAX if dither_signs else Q_MIN, Q_MAX).astype(np.int64)
    if dither_signs:
        q = numpy_fold(q, u)
    return q, numpy_dequantize(q, p, ordinal=False, step=step, dither=dither,
                               dither_signs=dither_signs, first=first, scale=scale, eps=eps,
                               floor=floor)


def numpy_pack(q: np.ndarray, block: int) -> np.ndarray:
    """The packed stream of symbols ``q`` (widths, then each block's bits LSB first)."""
    z = ((q << 1) ^ (q >> 63)).astype(np.int64)
    widths, bodies = [], []
    for start in range(0, z.size, block):
        zb = z[start : start + block]
        width = int(zb.max()).bit_length() if zb.size else 0
        widths.append(width)
        bits = ((zb[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
        bodies.append(np.packbits(bits, bitorder="little"))
    return np.concatenate([np.array(widths, np.uint8), *bodies]) if widths else \
        np.zeros(0, np.uint8)


def numpy_unpack(stream: np.ndarray, n: int, block: int) -> np.ndarray:
    """Symbols ``q`` (int64) of a packed stream of ``n`` elements."""
    n_blocks = n_blocks_of(n, block)
    widths, pos, out = stream[:n_blocks], n_blocks, []
    for b in range(n_blocks):
        count, width = min(block, n - b * block), int(widths[b])
        nbytes = (count * width + 7) // 8
        bits = np.unpackbits(stream[pos : pos + nbytes], bitorder="little")[: count * width]
        z = (bits.reshape(count, width).astype(np.int64) << np.arange(width)).sum(axis=1) \
            if width else np.zeros(count, np.int64)
        out.append((z >> 1) ^ -(z & 1))
        pos += nbytes
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def numpy_dequantize(q: np.ndarray, pred: np.ndarray | None, *, ordinal: bool,
                     step: float | int, dither: int | None = None, dither_signs: bool = False,
                     first: int = 0, scale: np.ndarray | None = None, eps: float = 0.0,
                     floor: float = 0.0) -> np.ndarray:
    """Reconstruction from stored symbols ``q`` and ``pred`` (or zero), dithered with seed
    ``dither`` (and its signs folded by it with ``dither_signs``), scaled per element by
    ``scale``."""
    p = np.zeros(q.shape, np.float32) if pred is None else pred
    u = np.zeros(q.shape, np.float32) if dither is None else numpy_dither(q.size, dither, first)
    if dither_signs:
        q = numpy_fold(q, u)
    if ordinal:
        return numpy_from_keys(numpy_keys(p) + q * step + numpy_key_offsets(u, step))
    return (p + (q.astype(np.float32) - u) * numpy_element_steps(step, scale, eps, floor)).astype(
        np.float32)


def numpy_decode_steps(streams: list[np.ndarray], pred: np.ndarray | None, n: int, *,
                       ordinal: list[bool], steps: list[float | int], block: int,
                       dithers: list[int | None] | None = None,
                       dither_signs: list[bool] | None = None,
                       dither_groups: list[bool] | None = None, first: int = 0) -> np.ndarray:
    """Running values after applying each packed stream in turn to ``pred`` (or zero)."""
    values = pred
    dithers = [None] * len(streams) if dithers is None else dithers
    dither_signs = [False] * len(streams) if dither_signs is None else dither_signs
    dither_groups = [False] * len(streams) if dither_groups is None else dither_groups
    for stream, o, step, dither, signs, groups in zip(streams, ordinal, steps, dithers,
                                                      dither_signs, dither_groups, strict=True):
        q = numpy_unpack(stream, n, block)
        if groups:
            q = q[numpy_places(numpy_dither(n, dither, first), block)]
        values = numpy_dequantize(q, values, ordinal=o, step=step, dither=dither,
                                  dither_signs=signs, first=first)
    return np.zeros(n, np.float32) if values is None else values
