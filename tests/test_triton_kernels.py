"""The Triton kernels: the quant ones (deltackpt.kernels.gpu_quant) against the Numba ones, bit
for bit; xxh3-64 on the device (deltackpt.kernels.gpu_xxh3) against the ``xxhash`` library.

With CUDA they run compiled on the GPU (bench/gpu.sh runs this file there);
without, on the CPU in Triton's interpreter (:mod:`interpreter`), so no
other test sees it. The interpreter is slow: tensors here are small.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers import assert_state_dicts_equal, data_files
from interpreter import (
    DEVICE,
    INTERPRETER_ONLY,
    can_run_here,
    import_kernels,
    interpreter,
    only_in_a_fresh_process,
)
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.codecs import quant as quant_codec
from deltackpt.errors import ConfigError
from deltackpt.kernels.quant import (
    MAX_DITHERED_KEY_STEP,
    MAX_KEY,
    N_STATS,
    SCALED,
    SHAPED,
    STAT_BAD,
    STAT_CLIPPED,
    STAT_LOST_ZEROS,
    STAT_MAX_ABS,
    STAT_MAX_REL,
    STAT_NONZERO,
    STAT_SUM_SQ,
    STAT_SUM_SQ_ERR,
    UNSCALED,
    decode_block_stream,
    decode_step_streams,
    encode_block_stream,
    n_blocks_of,
    to_planes,
)

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
IN_PROCESS = can_run_here()
gpu = import_kernels("gpu_quant", IN_PROCESS)
gpu_xxh3 = import_kernels("gpu_xxh3", IN_PROCESS)
_ = interpreter  # the fixture: TRITON_INTERPRET=1 while the tests run

# The interpreter computes in numpy, which warns where IEEE arithmetic meets inf and NaN.
pytestmark = [pytest.mark.filterwarnings(f"ignore:{what} encountered:RuntimeWarning")
              for what in ("overflow", "invalid value", "divide by zero")]
BIG = DEVICE == "cuda"  # compiled kernels: also test sizes the interpreter would take minutes on
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (ordinal, with prediction, dithered, per-element steps): every kernel variant
VARIANTS = [(o, p, d, UNSCALED) for o in (False, True) for p in (False, True)
            for d in (False, True)] \
    + [(False, False, d, s) for d in (False, True) for s in (SCALED, SHAPED)]
SCALING = {UNSCALED: {}, SCALED: {"eps": float(np.float32(1e-8))},
           SHAPED: {"eps": float(np.float32(1e-8)), "floor": float(np.float32(1e-3))}}
NAN_INF_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000]


def _values(n: int, seed: int) -> np.ndarray:
    """``n`` finite float32 values, a segment of each kind: normal, many orders of magnitude of
    both signs, subnormals, zeros of both signs, small integers, any finite bit pattern."""
    rng = np.random.default_rng(seed)
    parts = [rng.standard_normal(n),
             rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-30, 30, n),
             (rng.integers(0, 0x800000, n, dtype=np.uint32)
              | (rng.integers(0, 2, n, dtype=np.uint32) << 31)).view(np.float32),
             np.where(rng.random(n) < 0.5, 0.0, -0.0),
             rng.integers(-5, 6, n)]
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    parts.append(np.where((bits & 0x7F800000) == 0x7F800000, bits & 0x807FFFFF, bits)
                 .astype(np.uint32).view(np.float32))
    kind = rng.integers(0, len(parts), n)
    return np.choose(kind, [p.astype(np.float32) for p in parts]).astype(np.float32)


def _near(x: np.ndarray, seed: int) -> np.ndarray:
    """A prediction of ``x``: close to it mostly, some elements equal, some unrelated."""
    rng = np.random.default_rng(seed + 1)
    close = (x * (1 + rng.standard_normal(x.size) * 1e-3)).astype(np.float32)
    pick = rng.random(x.size)
    return np.where(pick < 0.1, x, np.where(pick < 0.2, _values(x.size, seed + 2), close)) \
        .astype(np.float32)


def _tensor(a: np.ndarray | None, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a.copy()).to(DEVICE).to(dtype)


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.cpu().numpy()
    return a.view(np.uint32)


def _encode_both(x: torch.Tensor, pred: np.ndarray | None, *, in_place: bool = False,
                 **kwargs) -> tuple[tuple, tuple]:
    """Code ``x`` (a device tensor of a codec input dtype) with Numba (its float32 values, as
    the codecs pass them) and with Triton; returns ``(stream, stats, recon)`` of each."""
    x32 = x.float().cpu().numpy()
    scale = kwargs.pop("scale", None)
    results = []
    for encode, source, to in ((encode_block_stream, x32, np.copy),
                               (gpu.encode_block_stream, x, _tensor)):
        p = None if pred is None else to(pred)
        out = p if in_place else to(np.full(x32.shape[0], np.nan, np.float32))
        stream, stats = encode(source, p, out, scale=None if scale is None else to(scale),
                               **kwargs)
        results.append((stream, stats, out))
    return results[0], results[1]


def _assert_same_coding(numba: tuple, triton: tuple, n: int, block: int, ordinal: bool) -> None:
    """Same stream bytes, BAD counts and widths exactly; in the blocks that code, the same
    reconstruction bits, maxima and counts, sums to float tolerance."""
    (s1, st1, r1), (s2, st2, r2) = numba, triton
    assert st2.shape == st1.shape == (n_blocks_of(n, block), N_STATS)
    np.testing.assert_array_equal(st2[:, STAT_BAD], st1[:, STAT_BAD])
    np.testing.assert_array_equal(s2, s1)
    good = st1[:, STAT_BAD] == 0
    rows = np.repeat(good, block)[:n]
    np.testing.assert_array_equal(_bits(r2)[rows], _bits(r1)[rows])
    exact = [STAT_MAX_ABS, STAT_NONZERO, STAT_CLIPPED, STAT_LOST_ZEROS] \
        + ([STAT_MAX_REL] if ordinal else [])
    np.testing.assert_array_equal(st2[good][:, exact], st1[good][:, exact])
    np.testing.assert_allclose(st2[good][:, [STAT_SUM_SQ_ERR, STAT_SUM_SQ]],
                               st1[good][:, [STAT_SUM_SQ_ERR, STAT_SUM_SQ]], rtol=1e-12, atol=0)


def _step(ordinal: bool, dithered: bool) -> float | int:
    return (1 << 12 if dithered else 1 << 16) if ordinal else float(np.float32(0.01))


# -- encode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: "-".join(k for k, on in zip(
                             ("ordinal", "pred", "dither", ("", "scaled", "shaped")[v[3]]),
                             v, strict=True) if on)
                         or "plain")
def test_encode_matches_numba(variant: tuple[bool, bool, bool, int], dtype: torch.dtype) -> None:
    """Every kernel variant on every codec input dtype: the Numba stream bytes, reconstruction
    and statistics. The wide values clip symbols to 16 bits (STAT_CLIPPED) in the linear
    domain."""
    ordinal, use_pred, dithered, scaled = variant
    n, block = (1 << 20) + 3 if BIG else 1500, 64 if dtype == torch.float32 else 1000
    seed = 3 * VARIANTS.index(variant) + DTYPES.index(dtype)
    x = _tensor(_values(n, seed), dtype)
    x = torch.where(x.isfinite(), x, 0)  # values beyond a 16-bit dtype's range: not its values
    x32 = x.float().cpu().numpy()
    pred = _near(x32, seed) if use_pred else None
    scale = np.abs(_values(n, seed + 3)) if scaled else None
    numba, triton = _encode_both(
        x, pred, ordinal=ordinal, step=_step(ordinal, dithered), block=block,
        dither=12345 + seed if dithered else None, dither_signs=dithered and not ordinal,
        dither_groups=dithered and not ordinal and seed % 2 == 1, first=seed, scale=scale,
        **SCALING[scaled])
    _assert_same_coding(numba, triton, n, block, ordinal)
    coded = numba[1][:, STAT_BAD] == 0  # the other blocks' statistics are undefined
    assert coded.mean() > 0.5 and numba[1][coded, STAT_NONZERO].sum() > 0


@pytest.mark.parametrize(("ordinal", "grouped"), [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize(("n", "block"), [(1, 64), (63, 64), (65, 64), (1000, 7), (300, 1),
                                          (1025, 1024), (5001, 3000), (0, 64)])
def test_odd_sizes(n: int, block: int, ordinal: bool, grouped: bool) -> None:
    """Sizes that are not multiples of the block, blocks of 1, 7 and more than a tile (3000:
    a program loops over columns, and places grouped symbols from counts over them all), and
    none: in place against a prediction, dithered; the grouped streams in bit planes (Triton's
    made on the host)."""
    x = _values(n, n + block)
    numba, triton = _encode_both(_tensor(x), _near(x, n), in_place=True, ordinal=ordinal,
                                 step=_step(ordinal, True), block=block, dither=7,
                                 dither_signs=not ordinal, dither_groups=grouped, first=n,
                                 bit_planes=grouped)
    _assert_same_coding(numba, triton, n, block, ordinal)


@pytest.mark.parametrize("sign", [1, -1])
def test_ordinal_keys_clamp_at_the_largest_finite_value(sign: int) -> None:
    """Values at the largest finite float32 whose symbol rounds past it: the reconstruction
    clamps to it, as Numba's does (a compiled kernel once rounded the clamp to infinity)."""
    n, block = 256, 64
    x = np.full(n, sign * np.finfo(np.float32).max, np.float32)
    below = np.array([MAX_KEY - 40000 - k for k in range(n)], np.int32).view(np.float32)
    numba, triton = _encode_both(_tensor(x), sign * below, ordinal=True, step=1 << 16,
                                 block=block)
    _assert_same_coding(numba, triton, n, block, True)
    np.testing.assert_array_equal(_bits(triton[2]), _bits(x))


@pytest.mark.parametrize("where", ["x", "pred"])
@pytest.mark.parametrize("ordinal", [False, True])
def test_non_finite_values_make_the_same_bad_blocks(ordinal: bool, where: str) -> None:
    """NaN (any payload), +inf and -inf in x or the prediction: the same BAD count per block,
    the same widths (0) and stream; the other blocks code as Numba's."""
    n, block = 2000, 64
    rng = np.random.default_rng(5)
    x = _values(n, 3)
    pred = _near(x, 3)
    target = x if where == "x" else pred
    at = rng.choice(n, 40, replace=False)
    target[at] = np.array(NAN_INF_BITS, np.uint32)[rng.integers(0, len(NAN_INF_BITS), 40)] \
        .view(np.float32)
    numba, triton = _encode_both(_tensor(x), pred, ordinal=ordinal, step=_step(ordinal, False),
                                 block=block)
    assert 0 < (numba[1][:, STAT_BAD] > 0).sum() < n_blocks_of(n, block)
    _assert_same_coding(numba, triton, n, block, ordinal)


@pytest.mark.parametrize(("ordinal", "step", "dither"), [
    (False, float(np.float32(1e-45)), None),  # the smallest subnormal: every symbol clips
    (False, 2.0**-20, 3),
    (False, 1000.0, None),
    (False, float(np.float32(3e38)), 11),  # reconstructions overflow: BAD
    (True, 1, 5),
    (True, 3, None),
    (True, MAX_DITHERED_KEY_STEP, 9),
    (True, MAX_KEY, None),
])
def test_extreme_steps(ordinal: bool, step: float | int, dither: int | None) -> None:
    n, block = 1200, 64
    x = _values(n, 8)
    numba, triton = _encode_both(_tensor(x), _near(x, 8), ordinal=ordinal, step=step,
                                 block=block, dither=dither, first=3)
    _assert_same_coding(numba, triton, n, block, ordinal)


@pytest.mark.parametrize("ordinal", [False, True])
def test_dither_index_wraps_at_2_32(ordinal: bool) -> None:
    """Element indices past 2**32 in a huge tensor: the dither hashes ``index mod 2**32``, in
    a chunk that crosses the wrap."""
    x, pred = _values(600, 21), _near(_values(600, 21), 21)
    kwargs = {"ordinal": ordinal, "step": _step(ordinal, True), "block": 64,
              "dither": 2**32 - 1, "first": 2**32 - 300}
    numba, triton = _encode_both(_tensor(x), pred, **kwargs)
    _assert_same_coding(numba, triton, 600, 64, ordinal)
    out = _tensor(pred)
    gpu.decode_block_stream(numba[0], out, out, **kwargs)
    np.testing.assert_array_equal(_bits(out), _bits(numba[2]))


def test_scales_and_floors_where_none_apply_are_refused() -> None:
    """As the Numba kernels: a scale with a prediction or of the ordinal domain, a floor
    without a scale, a floor that is no positive float32 value."""
    x = torch.ones(8, device=DEVICE)
    out = torch.empty(8, device=DEVICE)
    with pytest.raises(ValueError, match="a scale applies to the linear domain, without prediction"):
        gpu.encode_block_stream(x, x.clone(), out, ordinal=False, step=0.5, block=4, scale=x,
                                eps=1.0)
    with pytest.raises(ValueError, match="a scale applies to one stream of the linear domain"):
        gpu.decode_step_streams([np.zeros(2, np.uint8)] * 2, out, ordinal=[False, False],
                                steps=[0.5, 0.5], block=4, zero_start=True, scale=x, eps=1.0)
    with pytest.raises(ValueError, match="floor shapes the steps of a scale"):
        gpu.encode_block_stream(x, None, out, ordinal=False, step=0.5, block=4, floor=1.0)
    with pytest.raises(ValueError, match="floor must be 0 or a positive float32"):
        gpu.decode_block_stream(np.zeros(2, np.uint8), None, out, ordinal=False, step=0.5,
                                block=4, scale=x, eps=1.0, floor=-1.0)


def test_scaled_steps_that_underflow_or_overflow() -> None:
    """Scales of 0 with a step * eps that underflows (a quotient 0 / 0: BAD), huge scales and
    infinities (steps of inf)."""
    n, block = 512, 64
    rng = np.random.default_rng(2)
    x = np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)).astype(np.float32)
    scale = np.abs(rng.standard_normal(n)).astype(np.float32)
    scale[:64] = 0.0
    scale[64:80] = np.inf
    scale[200:210] = 3e38
    tiny = float(np.float32(1e-30))
    numba, triton = _encode_both(_tensor(x), None, ordinal=False, step=tiny, block=block,
                                 scale=scale, eps=tiny)
    assert numba[1][0, STAT_BAD] > 0
    _assert_same_coding(numba, triton, n, block, False)


# -- decode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_decode_matches_numba(variant: tuple[bool, bool, bool, int]) -> None:
    """A stream decodes to the Numba decoder's values (pred kept, or in place)."""
    ordinal, use_pred, dithered, scaled = variant
    n, block = (1 << 20) + 5 if BIG else 1100, 64
    x = _values(n, 4)
    pred = _near(x, 4) if use_pred else None
    scale = np.abs(_values(n, 6)) if scaled else None
    kwargs = {"ordinal": ordinal, "step": _step(ordinal, dithered), "block": block,
              "dither": 99 if dithered else None, "dither_signs": dithered and not ordinal,
              "dither_groups": dithered and not ordinal, "first": 17, **SCALING[scaled]}
    stream, _ = encode_block_stream(x, None if pred is None else pred.copy(),
                                    np.empty(n, np.float32), scale=scale, **kwargs)
    expected = np.empty(n, np.float32)
    decode_block_stream(stream, pred, expected, scale=scale, **kwargs)
    out = _tensor(pred) if use_pred else torch.full((n,), np.nan, device=DEVICE)
    gpu.decode_block_stream(stream, out if use_pred else None, out, scale=_tensor(scale),
                            **kwargs)
    np.testing.assert_array_equal(_bits(out), _bits(expected))


def _chain(n: int, block: int, seed: int) -> tuple[list[np.ndarray], dict]:
    """Streams of consecutive steps coded closed loop by Numba: both domains, alternating, some
    dithered; the first against a prediction."""
    domains = [False, True, True, False, True, False]
    steps = [_step(o, False) if i % 2 else _step(o, True) for i, o in enumerate(domains)]
    dithers = [None if i % 3 == 1 else 40 + i for i in range(len(domains))]
    signs = [d is not None and not o and i != 3  # folded, but one
             for i, (o, d) in enumerate(zip(domains, dithers, strict=True))]
    groups = [d is not None and not o and i != 0  # grouped, but one
              for i, (o, d) in enumerate(zip(domains, dithers, strict=True))]
    rng = np.random.default_rng(seed)
    recon = _near(_values(n, seed), seed)
    streams = []
    for ordinal, step, dither, sign, group in zip(domains, steps, dithers, signs, groups,
                                                  strict=True):
        x = (recon * (1 + 1e-2 * rng.standard_normal(n))).astype(np.float32)
        streams.append(encode_block_stream(x, recon, recon, ordinal=ordinal, step=step,
                                           block=block, dither=dither, dither_signs=sign,
                                           dither_groups=group, first=seed)[0])
    return streams, {"ordinal": domains, "steps": steps, "dithers": dithers,
                     "dither_signs": signs, "dither_groups": groups, "block": block,
                     "first": seed}


@pytest.mark.parametrize("zero_start", [False, True])
@pytest.mark.parametrize(("n", "block"), [(3000, 64), (777, 1000), (50, 7), (5001, 3000)])
def test_chain_decode_matches_numba(n: int, block: int, zero_start: bool) -> None:
    """Several steps' streams applied in one pass: Numba's running values, bit for bit."""
    streams, kwargs = _chain(n, block, n)
    start = _near(_values(n, 1), 1)
    expected = start.copy()
    decode_step_streams(streams, expected, zero_start=zero_start, **kwargs)
    out = _tensor(start)
    gpu.decode_step_streams(streams, out, zero_start=zero_start, **kwargs)
    np.testing.assert_array_equal(_bits(out), _bits(expected))


def test_chain_decode_of_bit_planes_matches_numba() -> None:
    """Streams stored as bit planes (FORMAT.md 3.2, ``bit_planes``), some of the chain's, decode
    to the running values of the packed ones, as Numba decodes them."""
    n, block = 3000, 64
    streams, kwargs = _chain(n, block, 5)
    planes = [i % 2 == 0 for i in range(len(streams))]
    stored = [to_planes(s, n, block) if p else s for s, p in zip(streams, planes, strict=True)]
    start = _near(_values(n, 1), 1)
    expected = start.copy()
    decode_step_streams(streams, expected, zero_start=False, **kwargs)
    out = _tensor(start)
    gpu.decode_step_streams(stored, out, zero_start=False, bit_planes=planes, **kwargs)
    np.testing.assert_array_equal(_bits(out), _bits(expected))
    with pytest.raises(ValueError, match="stream 2: stream is"):
        gpu.decode_step_streams([*stored[:2], stored[2][:-1], *stored[3:]], out,
                                zero_start=False, bit_planes=planes, **kwargs)
    with pytest.raises(ValueError, match=f"{len(stored)} streams and 2 bit_planes"):
        gpu.decode_step_streams(stored, out, zero_start=False, bit_planes=planes[:2], **kwargs)


def test_damaged_stream_raises_before_writing() -> None:
    streams, kwargs = _chain(300, 64, 2)
    start = _tensor(_values(300, 1))
    before = start.clone()
    for damaged, problem in ((streams[3][:-1], "stream 3: stream is"),
                             (np.concatenate([[17], streams[3][1:]]).astype(np.uint8),
                              "stream 3: block width 17"),
                             (streams[3][:2], "stream 3: stream of 2 bytes")):
        with pytest.raises(ValueError, match=problem):
            gpu.decode_step_streams([*streams[:3], damaged, *streams[4:]], start,
                                    zero_start=False, **kwargs)
        np.testing.assert_array_equal(_bits(start), _bits(before))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_reconstruction_kept_on_the_host() -> None:
    """A CUDA x with the prediction and reconstruction in host memory: the same bytes, and the
    host reconstruction updated in place."""
    n = (1 << 16) + 1
    x = _values(n, 12)
    pred = _near(x, 12)
    expected = pred.copy()
    step = _step(False, True)
    stream, stats = encode_block_stream(x, expected, expected, ordinal=False, step=step,
                                        block=1024, dither=1)
    host = torch.from_numpy(pred.copy()).pin_memory()
    stream2, stats2 = gpu.encode_block_stream(_tensor(x), host, host, ordinal=False, step=step,
                                              block=1024, dither=1)
    np.testing.assert_array_equal(stream2, stream)
    coded = stats[:, STAT_BAD] == 0  # a skipped block's values and statistics are undefined
    assert coded.mean() > 0.5
    np.testing.assert_array_equal(stats2[coded, STAT_MAX_ABS], stats[coded, STAT_MAX_ABS])
    rows = np.repeat(coded, 1024)[:n]
    np.testing.assert_array_equal(_bits(host)[rows], _bits(expected)[rows])


# -- xxh3-64 on the device ------------------------------------------------------------------------

# Short-input paths (<= 240 bytes), the long one's edges: a block (1024 bytes) full or not, the
# final stripe alone or overlapping the last block, several blocks; stripes (64 bytes) +- 1.
XXH3_LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 239, 240, 241, 255, 256, 319, 320, 321,
                1023, 1024, 1025, 1088, 1089, 2047, 2048, 2049, 3 * 1024 - 1, 3 * 1024 + 1,
                16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1, 64 * 37 - 1, 64 * 37 + 1]


def _xxh3_bytes(kind: str, n: int, seed: int) -> torch.Tensor:
    """``n`` bytes (uint8, on DEVICE) of a kind: random, zeros, all 0xFF, float32 weights."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        a = rng.integers(0, 256, n, dtype=np.uint8)
    elif kind == "float32":
        a = (rng.standard_normal(n // 4 + 1) * 0.02).astype(np.float32).view(np.uint8)[:n]
    else:
        a = np.full(n, 0 if kind == "zeros" else 0xFF, np.uint8)
    return torch.from_numpy(a.copy()).to(DEVICE)


def _xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.cpu().numpy().tobytes())


@pytest.mark.parametrize(("kind", "offset"), [("random", 0), ("random", 8), ("random", 3),
                                             ("zeros", 0), ("0xff", 3), ("float32", 8)])
def test_xxh3_matches_xxhash(kind: str, offset: int) -> None:
    """Every length class, each a slice of a larger tensor from a storage offset: 0 and 8 load
    the lanes as u64, 3 byte by byte."""
    digests = []
    for i, n in enumerate(XXH3_LENGTHS):
        data = _xxh3_bytes(kind, offset + n + 5, seed=i)[offset:offset + n]
        digests.append((n, gpu_xxh3.xxh3_64_on_device(data).hexdigest(), _xxh3(data)))
    assert [(n, got) for n, got, _ in digests] == [(n, want) for n, _, want in digests]


def test_xxh3_random_lengths_and_ranges() -> None:
    """Random lengths up to a few hundred KiB, one digest each and the same bytes as ranges of
    one batch, with short, empty, overlapping and unaligned ranges among them."""
    rng = np.random.default_rng(16)
    data = _xxh3_bytes("random", (300 << 10) + 3, seed=16)
    lengths = [int(n) for n in rng.integers(241, data.shape[0] - 3, 2)] if not BIG else \
        [int(n) for n in rng.integers(241, data.shape[0] - 3, 20)]
    for n in lengths:
        assert gpu_xxh3.xxh3_64_on_device(data[:n]).hexdigest() == _xxh3(data[:n])
    ranges = [(0, data.shape[0]), (5, 5), (7, 100), (1000, 1241), (1000, 1240), (64, 64 + 4096),
              (100, 100 + 4096 * 3 + 17), (data.shape[0] - 300, data.shape[0])]
    digests = gpu_xxh3.xxh3_64_ranges_on_device(data, ranges)
    assert [d.hexdigest() for d in digests] == [_xxh3(data[a:b]) for a, b in ranges]


def test_xxh3_digests_the_bytes_when_queued() -> None:
    """Bytes written after the call do not change a digest (a short input's bytes are copied
    on the device when queued); digests of one batch asked from several threads at once."""
    data = _xxh3_bytes("random", 4000, seed=3)
    ranges = [(0, 100), (100, 4000), (0, 0), (50, 290)]
    expected = [_xxh3(data[a:b]) for a, b in ranges]
    digests = gpu_xxh3.xxh3_64_ranges_on_device(data, ranges)
    data.zero_()
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda d: d.hexdigest(), digests)) == expected


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_xxh3_queued_on_the_current_stream() -> None:
    """Queued on a side stream behind a slow write of the bytes: the digest is of the written
    bytes, asked for from the default stream without synchronising the side one."""
    data = torch.zeros(3 << 20, dtype=torch.uint8, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU cycles before the write
        data.fill_(7)
        digest = gpu_xxh3.xxh3_64_on_device(data)
    assert digest.hexdigest() == xxhash.xxh3_64_hexdigest(bytes([7]) * (3 << 20))


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: b"bytes", TypeError, "must be a torch.Tensor, got bytes"),
    (lambda: torch.zeros(300, dtype=torch.int32, device=DEVICE), ValueError,
     "torch.uint8 tensor, got torch.int32"),
    (lambda: torch.zeros((20, 20), dtype=torch.uint8, device=DEVICE), ValueError,
     r"of shape \(20, 20\)"),
    # a view made on the device: moving a view there copies it contiguous
    (lambda: torch.zeros(600, dtype=torch.uint8, device=DEVICE)[::2], ValueError,
     r"strides \(2,\)"),
    (lambda: torch.zeros((), dtype=torch.uint8, device=DEVICE), ValueError, r"of shape \(\)"),
])
def test_xxh3_rejects_bad_data(make: Callable[[], object], error: type, match: str) -> None:
    data = make()
    with pytest.raises(error, match=match):
        gpu_xxh3.xxh3_64_on_device(data)


@pytest.mark.parametrize("bad", [(-1, 10), (10, 9), (0, 301)])
def test_xxh3_rejects_ranges_outside_the_data(bad: tuple[int, int]) -> None:
    data = torch.zeros(300, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=rf"byte range \[{bad[0]}, {bad[1]}\) is not within the "
                                         "300 bytes"):
        gpu_xxh3.xxh3_64_ranges_on_device(data, [(0, 300), bad])


# -- compiled for a GPU --------------------------------------------------------------------------

# Compiles every kernel (each variant that changes its arithmetic) for an H100/H200 (sm_90) and
# reports, per kernel, the PTX's fused multiply-adds, its division and square root instructions
# and those that flush subnormals to zero. Needs no GPU: Triton and its ptxas compile for a
# target given.
COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deltackpt.kernels import gpu_quant as g, gpu_xxh3 as x

ENCODE = {"x_ptr": "*fp32", "pred_ptr": "*fp32", "out_ptr": "*fp32", "scale_ptr": "*fp32",
          "packed_ptr": "*u8", "widths_ptr": "*u8", "lengths_ptr": "*i64", "stats_ptr": "*fp64",
          "n": "i64", "n_blocks": "i64", "first": "i64", "seed": "u32", "signs": "i32",
          "step_f": "fp32", "step_i": "i32", "eps": "fp32", "floor": "fp32"}
PACK = {"packed_ptr": "*u8", "widths_ptr": "*u8", "offsets_ptr": "*i64", "stream_ptr": "*u8",
        "n": "i64", "n_blocks": "i64"}
DECODE = {"streams_ptr": "*u8", "bounds_ptr": "*i64", "offsets_ptr": "*i64",
          "ordinal_ptr": "*i32", "step_f_ptr": "*fp32", "step_i_ptr": "*i64",
          "seeds_ptr": "*i64", "n_steps": "i32", "pred_ptr": "*fp32", "out_ptr": "*fp32",
          "scale_ptr": "*fp32", "n": "i64", "n_blocks": "i64", "first": "i64", "eps": "fp32",
          "floor": "fp32"}


XXH3 = {"data_ptr": "*u8", "table_ptr": "*i64", "sums_ptr": "*i64", "acc_ptr": "*i64"}


def ptx(fn, types, **constants):
    if "BLOCK" in constants:  # a quant kernel's tile
        rows, cols = g._tile(constants["BLOCK"])
        fused = constants["BLOCK"] <= g._TILE and not constants.get("GROUPED")
        types = types if fused else {**types, "packed_ptr": "*u16"}
        constants = {"ROWS": rows, "COLS": cols, "BYTES": 2 * cols, "FUSED": fused, **constants}
    constants = {k: v for k, v in constants.items() if k in fn.arg_names}
    types = {k: v for k, v in types.items() if k in fn.arg_names}
    signature = {**types, **{k: "constexpr" for k in constants}}
    kernel = triton.compile(ASTSource(fn, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options=g._launch_options())
    code = kernel.asm["ptx"]
    return {"fma": len(re.findall(r"\bfma\.", code)),
            "ops": sorted(set(re.findall(r"\b(?:div|sqrt|rcp|rsqrt)\.[a-z0-9.]+", code))),
            "ftz": sorted(set(re.findall(r"\b[a-z0-9.]+\.ftz\.[a-z0-9.]+", code)))}


out = {}
for ordinal, pred, dither, scaled, shaped, bf16, block, grouped in [
        (False, True, True, False, False, False, 1024, False),
        (True, True, True, False, False, False, 1024, False),
        (False, False, True, True, False, False, 3000, False),
        (False, False, True, True, True, False, 1024, False),
        (True, False, False, False, False, True, 7, False),
        (False, True, True, False, False, False, 1024, True),
        (False, False, True, True, True, False, 3000, True)]:
    types = {**ENCODE, "x_ptr": "*i16"} if bf16 else ENCODE
    out[f"encode ordinal={ordinal} scaled={scaled} shaped={shaped} bf16={bf16}"
        + (f" grouped block={block}" if grouped else "")] = ptx(
        g._encode_kernel, types, BLOCK=block, ORDINAL=ordinal, USE_PRED=pred,
        DITHERED=dither, SCALED=scaled, SHAPED=shaped, X_BF16=bf16, GROUPED=grouped)
for block in (1024, 3000):
    out[f"pack block={block}"] = ptx(g._pack_kernel, PACK, BLOCK=block)
for scaled, shaped in ((False, False), (True, False), (True, True)):
    out[f"decode scaled={scaled} shaped={shaped}"] = ptx(
        g._decode_kernel, DECODE, BLOCK=64, ZERO_START=scaled, SCALED=scaled, SHAPED=shaped)
for aligned in (True, False):
    out[f"xxh3 block sums aligned={aligned}"] = ptx(x._block_sums_kernel, XXH3, RANGES=x._RANGES,
                                                    BLOCKS=x._BLOCKS, ALIGNED=aligned)
out["xxh3 chain"] = ptx(x._chain_kernel, XXH3, RANGES=x._RANGES, UNROLL=x._UNROLL)
print(json.dumps(out))
"""


def test_kernels_compile_for_a_gpu_with_ieee_rounding() -> None:
    """Compiled for sm_90 (no GPU needed), the kernels hold no fused multiply-add, only
    correctly rounded division and square root, and flush no subnormal but where it cannot
    matter: what bit identity on the device needs, and what the interpreter cannot show. The
    xxh3 kernels compile too, integer arithmetic only."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = json.loads(done.stdout.splitlines()[-1])
    assert len(kernels) == 15
    for name, code in kernels.items():
        assert code["fma"] == 0, f"{name}: {code['fma']} fused multiply-adds"
        floats = [op for op in code["ops"] if op.endswith(("f32", "f64"))]
        assert set(floats) <= {"div.rn.f32", "div.rn.f64", "sqrt.rn.f32"}, f"{name}: {floats}"
        # floor flushes subnormal inputs: harmless for _rint's non-negative ones (floor is 0)
        assert set(code["ftz"]) <= {"cvt.rmi.ftz.f32.f32"}, f"{name}: {code['ftz']}"
    assert "div.rn.f64" in kernels["encode ordinal=True scaled=False shaped=False bf16=False"]["ops"]
    assert "sqrt.rn.f32" in kernels["decode scaled=True shaped=False"]["ops"]
    for name in ("encode ordinal=False scaled=True shaped=True bf16=False",
                 "decode scaled=True shaped=True"):  # the shaped step's division and roots
        assert {"div.rn.f32", "sqrt.rn.f32"} <= set(kernels[name]["ops"]), name
    assert all(kernels[k]["ops"] == [] for k in kernels if k.startswith("xxh3"))


# -- dispatch and a whole step --------------------------------------------------------------

def test_kernels_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant_codec.KERNELS_ENV, "cuda")
    with pytest.raises(ConfigError, match="DELTACKPT_KERNELS must be one of 'auto', 'triton', got 'cuda'"):
        quant_codec.encode_quant(np.ones(64, np.float32), None, np.empty(64, np.float32),
                                 ordinal=False, step=0.5, block=64)


@pytest.mark.parametrize("switch", ["auto", pytest.param("triton", marks=INTERPRETER_ONLY)])
def test_codec_takes_tensors(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_quant and decode_quant take CPU tensors (Numba codes them, or Triton with the
    switch) as numpy arrays: the same chunk, the same reconstruction, updated in place."""
    monkeypatch.setenv(quant_codec.KERNELS_ENV, switch)
    rng = np.random.default_rng(30)
    x = rng.standard_normal(700).astype(np.float32)
    pred = (x + 0.05 * rng.standard_normal(700)).astype(np.float32)
    kwargs = {"ordinal": False, "step": _step(False, True), "block": 64, "dither": 5, "first": 64}
    expected = pred.copy()
    chunk, _ = quant_codec.encode_quant(x, expected, expected, **kwargs)
    recon = torch.from_numpy(pred.copy())
    got, _ = quant_codec.encode_quant(torch.from_numpy(x), recon, recon, **kwargs)
    assert got.params == chunk.params and bytes(got.parts[0]) == bytes(chunk.parts[0])
    np.testing.assert_array_equal(_bits(recon), _bits(expected))
    decoded = torch.from_numpy(pred.copy())
    quant_codec.decode_quant(memoryview(chunk.parts[0]), chunk.params, decoded, decoded, 64)
    np.testing.assert_array_equal(_bits(decoded), _bits(expected))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 16)
        x[:, 12:] = 0  # inputs never used: their weights' moments stay exactly zero
        loss = (model(x) - x[:, :1].sin()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class _HalfHead(nn.Module):
    """A float32 layer and a bfloat16 head, whose Adam moments are bfloat16 too (coded in scaled
    chunks since format 2.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).bfloat16()).float()


def _save_run(path: Path) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
    """A full step and two deltas of a small model trained with Adam (the same run every call);
    returns each step's restore and the kinds of the steps."""
    torch.manual_seed(0)
    model = _HalfHead()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointManager(path, full_every=10, workers=1) as mgr:
        for step in range(3):
            _train(model, optimizer, 2)
            mgr.save(step, model=model, optimizer=optimizer)
        return [mgr.restore(s).tensors for s in range(3)], [mgr.metadata(s).kind for s in range(3)]


@INTERPRETER_ONLY
def test_step_coded_by_triton_restores_through_numba(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same training run saved through the Numba kernels and, with DELTACKPT_KERNELS=triton,
    through the Triton ones: the same data files, and each step restores (through Numba, and
    through Triton) to the same tensors, bit for bit; the moments of weights whose inputs are
    always zero stay zero, through the chunks' bitmaps of zeros (FORMAT.md 3.2)."""
    calls = {"encode": 0, "decode": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(gpu, "encode_on_device", counted(gpu.encode_on_device, "encode"))
    monkeypatch.setattr(gpu, "decode_step_streams", counted(gpu.decode_step_streams, "decode"))
    numba_states, kinds = _save_run(tmp_path / "numba")
    assert kinds == ["full", "delta", "delta"] and calls == {"encode": 0, "decode": 0}
    monkeypatch.setenv(quant_codec.KERNELS_ENV, "triton")
    triton_states, _ = _save_run(tmp_path / "triton")
    assert calls["encode"] > 10 and calls["decode"] > 0
    monkeypatch.delenv(quant_codec.KERNELS_ENV)
    with CheckpointManager(tmp_path / "triton", read_only=True) as mgr:
        restored = [mgr.restore(s).tensors for s in range(3)]
        head = mgr.metadata(2).tensor("optimizer/state/head.weight/exp_avg")
        assert head.dtype == "bfloat16" and head.fragments[0].chunks[0].params["scale"] == \
            "optimizer/state/head.weight/exp_avg_sq"
        assert all(mgr.metadata(2).tensor(f"optimizer/state/body.0.weight/{key}")
                   .fragments[0].chunks[0].params["zeros"] >= 32 * 4
                   for key in ("exp_avg", "exp_avg_sq"))
    for step in range(3):
        assert [f.read_bytes() for f in data_files(tmp_path / "triton", step)] == \
            [f.read_bytes() for f in data_files(tmp_path / "numba", step)]
        assert_state_dicts_equal(restored[step], numba_states[step], f"step {step}")
        assert_state_dicts_equal(triton_states[step], numba_states[step], f"step {step}")
        for key in ("exp_avg", "exp_avg_sq"):
            idle = restored[step][f"optimizer/state/body.0.weight/{key}"]
            assert not idle[:, 12:].any() and idle[:, :12].all(), (step, key)


if not IN_PROCESS:  # the tests above run in a fresh process: not here too
    only_in_a_fresh_process(globals(), __file__)
