"""The quantization kernels (deltackpt.kernels.quant) against their numpy references, bit for bit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit

from deltackpt.codecs.lossless import zstd_compress
from deltackpt.kernels.quant import (
    MAX_DITHERED_KEY_STEP,
    MAX_KEY,
    MAX_WIDTH,
    N_STATS,
    Q_MAX,
    Q_MIN,
    STAT_BAD,
    STAT_CLIPPED,
    STAT_LOST_ZEROS,
    STAT_MAX_ABS,
    STAT_MAX_REL,
    STAT_NONZERO,
    STAT_SUM_SQ,
    STAT_SUM_SQ_ERR,
    _dither_bits,
    _dither_of_bits,
    _key_offset,
    decode_block_stream,
    decode_step_streams,
    encode_block_stream,
    n_blocks_of,
    numpy_decode_steps,
    numpy_dequantize,
    numpy_dither,
    numpy_element_steps,
    numpy_from_keys,
    numpy_group,
    numpy_key_offsets,
    numpy_keys,
    numpy_pack,
    numpy_places,
    numpy_quantize,
    numpy_unpack,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(SETTINGS, max_examples=25)
BLOCKS = [64, 1000, 1024, 1, 7]
LINEAR_STEPS = [float(np.float32(s)) for s in (2.0**-20, 1e-4, 1e-3, 0.1, 0.5, 1.0, 3.0, 1000.0)]
ORDINAL_STEPS = [1, 2, 3, 255, 256, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 30, MAX_KEY]
PATTERNS = ["normal", "wide", "zeros", "neg_zeros", "const", "ints", "subnormal", "bits"]


# -- inputs -------------------------------------------------------------------------------

def _values(n: int, seed: int, pattern: str) -> np.ndarray:
    """``n`` finite float32 values following a named pattern."""
    rng = np.random.default_rng(seed)
    if pattern == "normal":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4)).astype(np.float32)
    if pattern == "wide":  # many orders of magnitude, both signs
        return (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    if pattern == "zeros":
        return np.zeros(n, np.float32)
    if pattern == "neg_zeros":
        return np.full(n, -0.0, np.float32)
    if pattern == "const":
        return np.full(n, rng.standard_normal(), np.float32)
    if pattern == "ints":
        return rng.integers(-5, 6, n).astype(np.float32)
    if pattern == "subnormal":  # subnormals and zeros of both signs
        bits = rng.integers(0, 0x800000, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
        return np.where(rng.random(n) < 0.1, 0, bits).astype(np.uint32).view(np.float32)
    assert pattern == "bits"  # any finite bit pattern
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return np.where((bits & 0x7F800000) == 0x7F800000, bits & 0x807FFFFF, bits).astype(np.uint32) \
        .view(np.float32)


def _pred(x: np.ndarray, seed: int, kind: str) -> np.ndarray | None:
    """A prediction for ``x``: none, close to ``x``, unrelated to it, or equal to it."""
    rng = np.random.default_rng(seed + 1)
    if kind == "none":
        return None
    if kind == "equal":
        return x.copy()
    if kind == "near":
        noise = rng.standard_normal(x.size) * 10.0 ** rng.integers(-8, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            p = (x * (1 + noise) + noise * 1e-3).astype(np.float32)
        return np.where(np.isfinite(p), p, x).astype(np.float32)
    assert kind == "far"
    return _values(x.size, seed + 2, str(rng.choice(["normal", "wide", "ints", "subnormal"])))


class Case(NamedTuple):
    x: np.ndarray
    pred: np.ndarray | None
    ordinal: bool
    step: float | int
    block: int
    inplace: bool
    dither: int | None = None  # a seed
    first: int = 0  # the index of the first element in its tensor (for the dither)
    dither_signs: bool = False  # symbols' signs folded by the dither (dithered, linear)
    dither_groups: bool = False  # each block's symbols grouped by the dither (dithered, linear)

    def dither_args(self) -> dict:
        return {"dither": self.dither, "dither_signs": self.dither_signs,
                "dither_groups": self.dither_groups, "first": self.first}

    def packed(self, q: np.ndarray) -> np.ndarray:
        """numpy_pack of symbols ``q``, in the order this case's stream stores them."""
        if self.dither_groups:
            q = numpy_group(q, numpy_dither(q.size, self.dither, self.first), self.block)
        return numpy_pack(q, self.block)


def _ditherable(ordinal: bool, step: float | int) -> bool:
    return not ordinal or step <= MAX_DITHERED_KEY_STEP


@st.composite
def cases(draw: st.DrawFn, ordinal: bool | None = None, max_n: int = 3000) -> Case:
    ordinal = draw(st.booleans()) if ordinal is None else ordinal
    block = draw(st.sampled_from(BLOCKS))
    n = draw(st.one_of(
        st.sampled_from([1, 2, 7, block - 1, block, block + 1, 3 * block + 5]),
        st.integers(0, max_n)))
    n = min(n, 5000)
    seed = draw(st.integers(0, 2**32 - 1))
    x = _values(n, seed, draw(st.sampled_from(PATTERNS)))
    pred = _pred(x, seed, draw(st.sampled_from(["none", "near", "far", "equal"])))
    step = draw(st.sampled_from(ORDINAL_STEPS if ordinal else LINEAR_STEPS))
    dither = draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))) if _ditherable(ordinal, step) \
        else None
    return Case(x, pred, ordinal, step, block, draw(st.booleans()), dither,
                draw(st.integers(0, 2**34)),
                dither is not None and not ordinal and draw(st.booleans()),
                dither is not None and not ordinal and draw(st.booleans()))


def _encode(c: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stream, stats and reconstruction; in place (``out`` is a copy of ``pred``) when asked."""
    if c.inplace and c.pred is not None:
        pred = out = c.pred.copy()
    else:
        pred, out = (None if c.pred is None else c.pred.copy()), np.full(c.x.size, np.nan, np.float32)
    stream, stats = encode_block_stream(c.x, pred, out, ordinal=c.ordinal, step=c.step, block=c.block,
                                        **c.dither_args())
    if c.pred is not None and not c.inplace:
        assert pred.tobytes() == c.pred.tobytes(), "the encoder wrote to pred"
    return stream, stats, out


def _decode(c: Case, stream: np.ndarray) -> np.ndarray:
    if c.inplace and c.pred is not None:
        pred = out = c.pred.copy()
    else:
        pred, out = (None if c.pred is None else c.pred.copy()), np.full(c.x.size, np.nan, np.float32)
    decode_block_stream(stream, pred, out, ordinal=c.ordinal, step=c.step, block=c.block,
                        **c.dither_args())
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str = "values") -> None:
    assert actual.dtype == expected.dtype == np.float32, what
    assert actual.shape == expected.shape, what
    diff = np.flatnonzero(_bits(actual) != _bits(expected))
    assert diff.size == 0, (f"{what}: {diff.size} elements differ, first at {diff[0]}: "
                            f"{actual[diff[0]]!r} != {expected[diff[0]]!r}")


def assert_stream_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.uint8
    assert np.array_equal(actual, expected), \
        f"streams differ: {actual.size} vs {expected.size} bytes, widths {actual[:8]} vs {expected[:8]}"


def _clipped(q: np.ndarray, dither_signs: bool = False) -> np.ndarray:
    """Where stored symbols ``q`` are clamped ones: at the ends of the 16-bit range, or of
    +-Q_MAX with folded signs."""
    return np.abs(q) == Q_MAX if dither_signs else (q == Q_MIN) | (q == Q_MAX)


def _expected_stats(x: np.ndarray, recon: np.ndarray, q: np.ndarray, block: int,
                    ordinal: bool, dither_signs: bool) -> np.ndarray:
    rows = []
    for start in range(0, x.size, block):
        xb, rb, qb = x[start:start + block], recon[start:start + block], q[start:start + block]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            err = np.abs(rb - xb)  # float32, as the kernel computes it
            ax = np.abs(xb)
            rel = np.where(ax > 0, err / np.where(ax > 0, ax, 1), 0)
        row = np.zeros(N_STATS)
        row[STAT_MAX_ABS] = err.max()
        row[STAT_MAX_REL] = rel.max() if ordinal else 0.0  # relative error: ordinal domain only
        row[STAT_SUM_SQ_ERR] = np.sum(err.astype(np.float64) ** 2)
        row[STAT_SUM_SQ] = np.sum(xb.astype(np.float64) ** 2)
        row[STAT_NONZERO] = np.count_nonzero(qb)
        row[STAT_CLIPPED] = np.count_nonzero(_clipped(qb, dither_signs))
        row[STAT_LOST_ZEROS] = np.count_nonzero((xb == 0) & (rb != 0))
        rows.append(row)
    return np.array(rows).reshape(-1, N_STATS)


def _check_stats(stats: np.ndarray, x: np.ndarray, recon: np.ndarray, q: np.ndarray, block: int,
                 ordinal: bool, dither_signs: bool = False) -> None:
    assert stats.shape == (n_blocks_of(x.size, block), N_STATS)
    assert stats.dtype == np.float64
    expected = _expected_stats(x, recon, q, block, ordinal, dither_signs)
    assert (stats[:, STAT_BAD] == 0).all()
    np.testing.assert_array_equal(stats[:, STAT_NONZERO], expected[:, STAT_NONZERO])
    np.testing.assert_array_equal(stats[:, STAT_CLIPPED], expected[:, STAT_CLIPPED])
    np.testing.assert_array_equal(stats[:, STAT_LOST_ZEROS], expected[:, STAT_LOST_ZEROS])
    for col in (STAT_MAX_ABS, STAT_MAX_REL, STAT_SUM_SQ_ERR, STAT_SUM_SQ):
        np.testing.assert_allclose(stats[:, col], expected[:, col], rtol=1e-6, atol=0, err_msg=f"stat {col}")


def _check_error_bound(x: np.ndarray, pred: np.ndarray | None, recon: np.ndarray, q: np.ndarray, *,
                       ordinal: bool, step: float | int, dither_signs: bool = False) -> None:
    """Unclipped elements are within half a step (linear: plus float32 rounding; ordinal: exactly,
    but for keys within a step of zero, moved up to a step further to keep their sign)."""
    ok = ~_clipped(q, dither_signs)
    if ordinal:
        kx, kr = numpy_keys(x), numpy_keys(recon)
        assert (((kr >= 0) | (kx < 0)) & ((kr <= 0) | (kx >= 0)))[ok].all(), "a sign flipped"
        d = np.abs(kr - kx)
        near_zero = np.abs(kx) < step
        assert (d[ok & ~near_zero] <= step // 2).all(), f"key error {d.max()} over {step // 2}"
        assert (d[ok & near_zero] <= step + step // 2).all(), "key error near zero"
        # relative error of normal values: at most step * 2**-23 (steps small enough not to span binades)
        if step <= 1 << 16:
            normal = ok & (np.abs(x) >= np.finfo(np.float32).tiny)
            rel = np.abs(recon[normal].astype(np.float64) - x[normal]) / np.abs(x[normal].astype(np.float64))
            assert (rel <= step * 2.0**-23).all(), f"relative error {rel.max()}"
        return
    p = np.zeros_like(x) if pred is None else pred
    mag = np.maximum(np.maximum(np.abs(x), np.abs(p)), np.abs(recon))
    bound = step / 2 * (1 + 1e-6) + 4 * np.spacing(mag).astype(np.float64)
    err = np.abs(recon.astype(np.float64) - x.astype(np.float64))
    bad = np.flatnonzero(ok & ~(err <= bound))
    assert bad.size == 0, f"error {err[bad[0]]} over {bound[bad[0]]} at x={x[bad[0]]!r}, p={p[bad[0]]!r}"


# -- 1. encoder vs numpy reference --------------------------------------------------------

@SETTINGS
@given(c=cases())
def test_encoder_matches_numpy_reference(c: Case) -> None:
    """Stream == numpy_pack(numpy_quantize symbols), grouped by the dither where the case groups
    them; reconstruction and stats match the reference."""
    stream, stats, recon = _encode(c)
    q, expected_recon = numpy_quantize(c.x, c.pred, ordinal=c.ordinal, step=c.step, dither=c.dither,
                                       dither_signs=c.dither_signs, first=c.first)
    assert_stream_equal(stream, c.packed(q))
    assert_bits_equal(recon, expected_recon, "reconstruction")
    _check_stats(stats, c.x, recon, q, c.block, c.ordinal, c.dither_signs)
    _check_error_bound(c.x, c.pred, recon, q, ordinal=c.ordinal, step=c.step,
                       dither_signs=c.dither_signs)


@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("block", [64, 1000, 1024])
def test_encoder_odd_lengths(ordinal: bool, block: int) -> None:
    """Every awkward length around the block size, with and without pred, in place and into a separate out."""
    step = (1 << 12) if ordinal else float(np.float32(1e-3))
    for k, n in enumerate([1, 2, 7, block - 1, block, block + 1, 3 * block + 5]):
        x = (np.random.default_rng(k).standard_normal(n) * 0.05).astype(np.float32)
        for j, pred_kind in enumerate(["none", "near", "far"]):
            c = Case(x, _pred(x, 100 + k, pred_kind), ordinal, step, block, inplace=(j + k) % 2 == 1)
            stream, stats, recon = _encode(c)
            q, expected_recon = numpy_quantize(c.x, c.pred, ordinal=ordinal, step=step)
            assert_stream_equal(stream, numpy_pack(q, block))
            assert_bits_equal(recon, expected_recon, f"reconstruction n={n}")
            np.testing.assert_array_equal(stats[:, STAT_NONZERO], [np.count_nonzero(q[b:b + block])
                                                                   for b in range(0, n, block)])
            assert_bits_equal(_decode(c, stream), recon, f"decoded n={n}")


# -- 2. decode(encode(x)) -----------------------------------------------------------------

@SETTINGS
@given(c=cases())
def test_decode_reproduces_encoder_reconstruction(c: Case) -> None:
    """The reader rebuilds exactly what the writer computed, and what the numpy references decode."""
    stream, _, recon = _encode(c)
    assert_bits_equal(_decode(c, stream), recon, "decoded")
    q = numpy_unpack(stream, c.x.size, c.block)
    if c.dither_groups:
        q = q[numpy_places(numpy_dither(q.size, c.dither, c.first), c.block)]
    assert_bits_equal(numpy_dequantize(q, c.pred, ordinal=c.ordinal, step=c.step, dither=c.dither,
                                       dither_signs=c.dither_signs, first=c.first), recon,
                      "numpy decoded")


@FEW
@given(c=cases(max_n=1500), steps=st.integers(2, 4))
def test_chained_in_place_updates(c: Case, steps: int) -> None:
    """Several delta steps updating one running reconstruction in place stay in lockstep with a reader."""
    writer = np.zeros(c.x.size, np.float32) if c.pred is None else c.pred.copy()
    reader = writer.copy()
    rng = np.random.default_rng(c.x.size)
    x = c.x
    for _ in range(steps):
        stream, _ = encode_block_stream(x, writer, writer, ordinal=c.ordinal, step=c.step, block=c.block,
                                        **c.dither_args())
        decode_block_stream(stream, reader, reader, ordinal=c.ordinal, step=c.step, block=c.block,
                            **c.dither_args())
        assert_bits_equal(reader, writer, "running reconstruction")
        x = np.where(rng.random(x.size) < 0.5, x, -x).astype(np.float32)



@pytest.mark.parametrize("ordinal", [False, True])
def test_chunks_coded_on_threads_at_once(ordinal: bool) -> None:
    """Saves and restores run one chunk per thread: kernels running at once (each with its own
    scratch buffer, of another size) give exactly what they give one at a time."""
    rng = np.random.default_rng(5)
    chunks = [(_values(n, n, "normal"), _values(n, n + 1, "normal"), ordinal, step, block)
              for n, step, block in [(70_000, 2, 1024), (3_001, 1 << 20, 64), (50_000, 255, 7)] * 4]
    chunks = [(x, p, o, float(np.float32(np.std(x - p) * rng.uniform(0.5, 4))) if not o else s, b)
              for x, p, o, s, b in chunks]

    def code(chunk: tuple) -> tuple[bytes, bytes, bytes]:
        x, p, o, step, block = chunk
        recon = p.copy()
        stream, _ = encode_block_stream(x, recon, recon, ordinal=o, step=step, block=block)
        decoded = p.copy()
        decode_block_stream(stream, decoded, decoded, ordinal=o, step=step, block=block)
        return stream.tobytes(), recon.tobytes(), decoded.tobytes()

    alone = [code(c) for c in chunks]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(code, chunks)) == alone
    assert all(recon == decoded for _, recon, decoded in alone)

# -- 2b. per-element steps scaled by another tensor (Adam's exp_avg by sqrt(exp_avg_sq)) ------

EPSILONS = [float(np.float32(e)) for e in (1e-8, 1e-3, 1.0)]
FLOORS = [0.0, *EPSILONS]  # 0: unshaped


@SETTINGS
@given(n=st.integers(0, 3000), block=st.sampled_from(BLOCKS), seed=st.integers(0, 2**32 - 1),
       x_pattern=st.sampled_from(PATTERNS), scale_pattern=st.sampled_from(PATTERNS),
       step=st.sampled_from(LINEAR_STEPS), eps=st.sampled_from(EPSILONS),
       floor=st.sampled_from(FLOORS), dither=st.none() | st.integers(0, 2**32 - 1),
       first=st.integers(0, 2**34), signs=st.booleans(), groups=st.booleans())
def test_scaled_steps_match_numpy_reference(n: int, block: int, seed: int, x_pattern: str,
                                            scale_pattern: str, step: float, eps: float,
                                            floor: float, dither: int | None, first: int,
                                            signs: bool, groups: bool) -> None:
    """Each element's step is ``step * (sqrt(scale) + eps)``, shaped by a positive ``floor``
    (divided by ``sqrt(sqrt(scale) + floor)``), dithered or not: encoder, decoder and the numpy
    references agree bit for bit, and every unclipped element is within half its step."""
    x = _values(n, seed, x_pattern)
    scale = np.abs(_values(n, seed + 7, scale_pattern))
    recon = np.full(n, np.nan, np.float32)
    signs, groups = signs and dither is not None, groups and dither is not None
    coding = {"ordinal": False, "step": step, "scale": scale, "eps": eps, "floor": floor,
              "dither": dither, "dither_signs": signs, "first": first}
    stream, stats = encode_block_stream(x, None, recon, block=block, dither_groups=groups,
                                        **coding)
    q, expected = numpy_quantize(x, None, **coding)
    assert_stream_equal(stream, Case(x, None, False, step, block, False, dither, first, signs,
                                     groups).packed(q))
    assert_bits_equal(recon, expected, "reconstruction")
    _check_stats(stats, x, recon, q, block, False, signs)
    decoded = np.full(n, np.nan, np.float32)
    decode_block_stream(stream, None, decoded, block=block, dither_groups=groups, **coding)
    assert_bits_equal(decoded, recon, "decoded")
    steps = numpy_element_steps(step, scale, eps, floor).astype(np.float64)
    ok = ~_clipped(q, signs)
    err = np.abs(recon.astype(np.float64) - x)
    bound = steps / 2 * (1 + 1e-6) + 4 * np.spacing(np.abs(x)).astype(np.float64)
    assert (err[ok] <= bound[ok]).all()


def test_scale_only_without_prediction_or_ordinal_domain() -> None:
    x, scale = np.ones(8, np.float32), np.ones(8, np.float32)
    out = np.empty(8, np.float32)
    for kwargs in ({"pred": x.copy()}, {"ordinal": True, "step": 4}):
        args = {"pred": None, "ordinal": False, "step": 0.5, **kwargs}
        with pytest.raises(ValueError, match="scale applies"):
            encode_block_stream(x, args.pop("pred"), out, block=4, scale=scale, eps=1.0, **args)
    with pytest.raises(ValueError, match="scale must be float32"):
        encode_block_stream(x, None, out, ordinal=False, step=0.5, block=4, scale=scale[:4], eps=1.0)
    for eps in (0.0, -1.0, 0.1, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            decode_block_stream(np.zeros(2, np.uint8), None, out, ordinal=False, step=0.5, block=4,
                                scale=scale, eps=eps)
    for floor in (-1.0, 0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="floor must be 0 or a positive float32"):
            encode_block_stream(x, None, out, ordinal=False, step=0.5, block=4, scale=scale,
                                eps=1.0, floor=floor)
    with pytest.raises(ValueError, match="floor shapes the steps of a scale"):
        encode_block_stream(x, None, out, ordinal=False, step=0.5, block=4, floor=1.0)


def test_shaped_steps_are_finer_where_the_scale_is_larger() -> None:
    """A floor divides each scaled step by ``sqrt(sqrt(scale) + floor)``: the error of an
    element whose second moment is larger is a smaller share of its update's unit, and where
    ``sqrt(scale)`` is far below the floor the steps are the unshaped ones over
    ``sqrt(floor)``."""
    scale = np.array([0.0, 1e-12, 1e-4, 1.0, 1e4], np.float32)
    unshaped = numpy_element_steps(0.5, scale, 1e-8)
    shaped = numpy_element_steps(0.5, scale, 1e-8, 1e-3)
    ratio = (shaped / unshaped).astype(np.float64)
    assert np.all(np.diff(ratio) < 0)
    np.testing.assert_allclose(ratio[:2], 1 / np.sqrt(1e-3), rtol=1e-3)
    np.testing.assert_allclose(ratio[-1], 1 / np.sqrt(100 + 1e-3), rtol=1e-5)


# -- 3. packing ---------------------------------------------------------------------------

def _symbols_of_width(n: int, width: int, seed: int) -> np.ndarray:
    """``n`` symbols whose zigzag codes need exactly ``width`` bits (at least one of them does)."""
    rng = np.random.default_rng(seed)
    z = rng.integers(0, 1 << width, n, dtype=np.int64) if width else np.zeros(n, np.int64)
    if width and n:
        z[rng.integers(0, n)] = rng.integers(1 << (width - 1), 1 << width)
    return (z >> 1) ^ -(z & 1)


@SETTINGS
@given(width=st.integers(0, MAX_WIDTH), n=st.integers(0, 2000) | st.sampled_from([1, 2, 7, 63, 65, 129]),
       block=st.sampled_from(BLOCKS), seed=st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack(width: int, n: int, block: int, seed: int) -> None:
    """numpy_unpack(numpy_pack(q)) == q, and each block's width byte is its largest code's bit length."""
    q = _symbols_of_width(n, width, seed)
    assert q.min(initial=0) >= Q_MIN and q.max(initial=0) <= Q_MAX
    stream = numpy_pack(q, block)
    n_blocks = n_blocks_of(n, block)
    z = (q << 1) ^ (q >> 63)
    widths = [int(z[b * block:(b + 1) * block].max()).bit_length() for b in range(n_blocks)]
    np.testing.assert_array_equal(stream[:n_blocks], widths)
    assert stream.size == n_blocks + sum((min(block, n - b * block) * w + 7) // 8
                                         for b, w in enumerate(widths))
    np.testing.assert_array_equal(numpy_unpack(stream, n, block), q)
    # The kernel unpacks the same symbols: step 1, no prediction, so out == float32(q).
    out = np.empty(n, np.float32)
    decode_block_stream(stream, None, out, ordinal=False, step=1.0, block=block)
    assert_bits_equal(out, q.astype(np.float32), "kernel-unpacked symbols")


@FEW
@given(n=st.integers(0, 3000), block=st.sampled_from(BLOCKS), seed=st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack_full_range(n: int, block: int, seed: int) -> None:
    """Random symbols over the whole range [-32768, 32767], extremes included."""
    rng = np.random.default_rng(seed)
    q = rng.integers(Q_MIN, Q_MAX, n, dtype=np.int64, endpoint=True)
    q[rng.random(n) < 0.05] = Q_MIN
    q[rng.random(n) < 0.05] = Q_MAX
    stream = numpy_pack(q, block)
    np.testing.assert_array_equal(numpy_unpack(stream, n, block), q)
    out = np.empty(n, np.float32)
    decode_block_stream(stream, None, out, ordinal=True, step=1, block=block)
    assert_bits_equal(out, numpy_from_keys(q), "kernel-unpacked keys")


def test_pack_known_bytes() -> None:
    """Hand-computed: zigzag 0,-1,1,-2 -> 0,1,2,3 at width 2, LSB first: 0b11_10_01_00."""
    q = np.array([0, -1, 1, -2, 2], np.int64)
    np.testing.assert_array_equal(numpy_pack(q, 4), [2, 3, 0b11100100, 0b100])
    x = q.astype(np.float32)
    out = np.empty(5, np.float32)
    stream, _ = encode_block_stream(x, None, out, ordinal=False, step=1.0, block=4)
    np.testing.assert_array_equal(stream, [2, 3, 0b11100100, 0b100])
    assert_bits_equal(out, x)


# -- 4. edge cases ------------------------------------------------------------------------

@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 3005])
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_all_zero_input(ordinal: bool, n: int, zero: float) -> None:
    """Zeros against no prediction: only zero widths in the stream, reconstruction +0.0 exactly."""
    block = 64
    x = np.full(n, zero, np.float32)
    out = np.full(n, np.nan, np.float32)
    step = 1 if ordinal else 0.5
    stream, stats = encode_block_stream(x, None, out, ordinal=ordinal, step=step, block=block)
    assert_stream_equal(stream, np.zeros(n_blocks_of(n, block), np.uint8))
    assert (_bits(out) == 0).all()
    assert (stats[:, STAT_NONZERO] == 0).all() and (stats[:, STAT_MAX_ABS] == 0).all()
    decoded = np.full(n, np.nan, np.float32)
    decode_block_stream(stream, None, decoded, ordinal=ordinal, step=step, block=block)
    assert (_bits(decoded) == 0).all()


@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("pattern", ["normal", "wide", "ints", "subnormal", "bits", "zeros"])
def test_input_equal_to_prediction(ordinal: bool, pattern: str) -> None:
    """x == pred: all symbols zero, stream is zero widths only, reconstruction == x.

    The one change: -0.0 becomes +0.0 (linear: -0.0 + 0.0; ordinal: both zeros are key 0).
    """
    x = _values(2500, 7, pattern)
    if pattern == "zeros":
        x[::2] = -0.0
    for inplace in (False, True):
        c = Case(x, x.copy(), ordinal, 256 if ordinal else 0.25, 1000, inplace)
        stream, stats, recon = _encode(c)
        assert_stream_equal(stream, np.zeros(3, np.uint8))
        assert (stats[:, STAT_NONZERO] == 0).all() and (stats[:, STAT_MAX_ABS] == 0).all()
        expected = np.where(x == 0, np.float32(0), x).astype(np.float32)
        assert_bits_equal(recon, expected)
        assert_bits_equal(_decode(c, stream), expected, "decoded")


@pytest.mark.parametrize("ordinal", [False, True])
def test_constant_input(ordinal: bool) -> None:
    """A constant tensor: every full block has the same width and the same body bytes."""
    block, n = 64, 64 * 5 + 3
    x = np.full(n, np.float32(1.2345), np.float32)
    step = 1 << 8 if ordinal else float(np.float32(2.0**-10))
    out = np.empty(n, np.float32)
    stream, stats = encode_block_stream(x, None, out, ordinal=ordinal, step=step, block=block)
    q, expected = numpy_quantize(x, None, ordinal=ordinal, step=step)
    assert_stream_equal(stream, numpy_pack(q, block))
    assert_bits_equal(out, expected)
    assert len(set(stream[: n_blocks_of(n, block)].tolist())) == 1
    assert (out == out[0]).all()
    assert stats[:, STAT_NONZERO].tolist() == [64] * 5 + [3]


@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("with_pred", [False, True])
def test_empty_input(ordinal: bool, with_pred: bool) -> None:
    x = np.zeros(0, np.float32)
    pred = x.copy() if with_pred else None
    stream, stats = encode_block_stream(x, pred, x.copy(), ordinal=ordinal, step=1, block=64)
    assert stream.dtype == np.uint8 and stream.size == 0
    assert stats.shape == (0, N_STATS)
    decode_block_stream(stream, pred, x.copy(), ordinal=ordinal, step=1, block=64)
    with pytest.raises(ValueError):
        decode_block_stream(np.zeros(1, np.uint8), pred, x.copy(), ordinal=ordinal, step=1, block=64)


@pytest.mark.parametrize(("ordinal", "step", "value", "q_expected"), [
    (False, float(np.float32(1e-3)), 1e6, Q_MAX),
    (False, float(np.float32(1e-3)), -1e6, Q_MIN),
    (False, 1.0, 3e38, Q_MAX),
    (True, 1, 1.0, Q_MAX),
    (True, 1 << 10, -1.0, Q_MIN),
    (True, 3, 3e38, Q_MAX),
])
def test_huge_residuals_are_clipped(ordinal: bool, step: float | int, value: float, q_expected: int) -> None:
    """Residuals beyond the symbol range clamp to [-32768, 32767] and are counted in STAT_CLIPPED."""
    n, block = 300, 128
    x = np.full(n, value, np.float32)
    x[::3] = 0  # some unclipped elements in every block
    out = np.empty(n, np.float32)
    stream, stats = encode_block_stream(x, None, out, ordinal=ordinal, step=step, block=block)
    q, expected = numpy_quantize(x, None, ordinal=ordinal, step=step)
    assert set(np.unique(q).tolist()) == {0, q_expected}
    assert_stream_equal(stream, numpy_pack(q, block))
    assert (stream[:3] == MAX_WIDTH).all()
    assert_bits_equal(out, expected)
    assert stats[:, STAT_CLIPPED].tolist() == [np.count_nonzero(q[b:b + block]) for b in range(0, n, block)]
    assert (stats[:, STAT_CLIPPED] > 0).all()
    if ordinal:
        np.testing.assert_array_equal(numpy_keys(out[x != 0]), q_expected * step)
    else:
        assert_bits_equal(out[x != 0], np.full(n - 100, np.float32(q_expected) * np.float32(step)))
    decoded = np.empty(n, np.float32)
    decode_block_stream(stream, None, decoded, ordinal=ordinal, step=step, block=block)
    assert_bits_equal(decoded, out)


@pytest.mark.parametrize("value", [1e6, -1e6])
def test_folded_symbols_clip_at_both_ends_of_q_max(value: float) -> None:
    """With folded signs, residuals beyond the range clamp to +-32767, so that every folded
    symbol fits 16 bits (a clamped -32768 would fold to 32768), and are counted in
    STAT_CLIPPED whatever their dither's sign."""
    n, block, step = 300, 128, float(np.float32(1e-3))
    x = np.full(n, value, np.float32)
    x[::3] = 0
    out = np.empty(n, np.float32)
    coding = {"ordinal": False, "step": step, "dither": 77, "dither_signs": True}
    stream, stats = encode_block_stream(x, None, out, block=block, **coding)
    q, expected = numpy_quantize(x, None, **coding)
    assert set(np.abs(q[x != 0]).tolist()) == {Q_MAX}
    assert len(set(q[x != 0].tolist())) == 2  # both signs, by the dither
    assert_stream_equal(stream, numpy_pack(q, block))
    assert_bits_equal(out, expected)
    assert stats[:, STAT_CLIPPED].tolist() == [np.count_nonzero(x[b:b + block])
                                               for b in range(0, n, block)]
    decoded = np.empty(n, np.float32)
    decode_block_stream(stream, None, decoded, block=block, **coding)
    assert_bits_equal(decoded, out)


def test_folded_signs_code_small_values_in_one_sign() -> None:
    """Values a small fraction of a step, dithered anew (as Adam's first moment is): a dither
    offset at or above 0 rounds them to 1, one below 0 to -1; folded, every nonzero symbol is
    -1, and the blocks pack one bit an element where they packed two, for the same
    reconstruction."""
    x = (np.random.default_rng(3).standard_normal(1 << 14) * 0.1).astype(np.float32)
    coding = {"ordinal": False, "step": 1.0, "block": 1024, "dither": 9}
    plain_out, folded_out = np.empty_like(x), np.empty_like(x)
    plain, _ = encode_block_stream(x, None, plain_out, **coding)
    folded, _ = encode_block_stream(x, None, folded_out, dither_signs=True, **coding)
    assert_bits_equal(folded_out, plain_out)
    q_plain, q_folded = (numpy_unpack(s, x.size, 1024) for s in (plain, folded))
    assert {-1, 1} <= set(q_plain.tolist()) <= {-1, 0, 1}
    assert set(q_folded.tolist()) == {-1, 0}
    assert np.array_equal(np.abs(q_folded), np.abs(q_plain))
    assert set(plain[:16].tolist()) == {2} and set(folded[:16].tolist()) == {1}


def test_grouped_symbols_follow_the_size_of_their_dither() -> None:
    """``dither_groups`` stores each block's symbols in groups of ``floor(8 |u|)`` (0-3),
    smallest first and in element order within a group: for values a fraction of a step, dithered
    anew, the small offsets' group holds almost only zeros and larger offsets' groups ever more
    symbols of 1, so the zstd frame of the stream is smaller, for the same reconstruction."""
    n, block = 1 << 16, 1024
    x = (np.random.default_rng(4).standard_normal(n) * 0.1).astype(np.float32)
    coding = {"ordinal": False, "step": 1.0, "block": block, "dither": 11, "dither_signs": True}
    plain_out, grouped_out = np.empty_like(x), np.empty_like(x)
    plain, _ = encode_block_stream(x, None, plain_out, **coding)
    grouped, _ = encode_block_stream(x, None, grouped_out, dither_groups=True, **coding)
    assert_bits_equal(grouped_out, plain_out)
    u = numpy_dither(n, 11)
    places = numpy_places(u, block)
    group = np.minimum(np.floor(np.abs(u) * 8), 3)
    for start in range(0, n, block):
        order = start + np.argsort(places[start:start + block])  # the element at each place
        assert (np.diff(group[order]) >= 0).all()  # groups in order
        assert (np.diff(order)[np.diff(group[order]) == 0] > 0).all()  # element order within
    q = numpy_unpack(grouped, n, block)
    assert np.array_equal(q[places], numpy_unpack(plain, n, block))
    nonzero = [(q[places[group == k]] != 0).mean() for k in range(4)]
    assert nonzero[0] < 0.01 and (np.diff(nonzero) > 0).all() and nonzero[3] > 0.2, nonzero
    assert len(zstd_compress(grouped, "packed")) < 0.9 * len(zstd_compress(plain, "packed"))
    decoded = np.empty_like(x)
    decode_block_stream(grouped, None, decoded, dither_groups=True, **coding)
    assert_bits_equal(decoded, plain_out)


def test_grouped_symbols_in_the_largest_block() -> None:
    """Blocks of 65536 elements, the most ``dither_groups`` allows (the kernels count places in
    16-bit lanes): the stream is the reference's, and decodes to the reconstruction."""
    n, block = (1 << 16) + 100, 1 << 16
    x = (np.random.default_rng(5).standard_normal(n) * 3).astype(np.float32)
    coding = {"ordinal": False, "step": 1.0, "block": block, "dither": 12, "dither_signs": True,
              "dither_groups": True}
    recon = np.empty_like(x)
    stream, _ = encode_block_stream(x, None, recon, **coding)
    q, expected = numpy_quantize(x, None, ordinal=False, step=1.0, dither=12, dither_signs=True)
    assert_stream_equal(stream, Case(x, None, False, 1.0, block, False, 12, 0, True,
                                     True).packed(q))
    decoded = np.empty_like(x)
    decode_block_stream(stream, None, decoded, **coding)
    assert_bits_equal(decoded, expected)


def test_ordinal_special_values() -> None:
    """Negatives, both zeros, subnormals, the normal/subnormal boundary and the largest finite values."""
    f32 = np.finfo(np.float32)
    specials = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, float(f32.tiny), -float(f32.tiny),
                float(f32.tiny) * (1 - 2**-23), 1.0, -1.0, -2.5, 3.4028235e38, -3.4028235e38, 1e-30, -7e12]
    x = np.array(specials * 9, np.float32)
    preds = [None, np.roll(x, 1), -x, x[::-1].copy(), np.zeros_like(x), np.full_like(x, -0.0)]
    for step in (1, 3, 1 << 8, 1 << 24, MAX_KEY):
        for pred in preds:
            for inplace in (False, True) if pred is not None and step == 1 << 8 else (pred is not None,):
                c = Case(x, pred, True, step, 16, inplace)
                stream, stats, recon = _encode(c)
                q, expected = numpy_quantize(x, pred, ordinal=True, step=step)
                assert_stream_equal(stream, numpy_pack(q, 16))
                assert_bits_equal(recon, expected, f"step {step}")
                assert np.isfinite(recon).all()
                _check_stats(stats, x, recon, q, 16, True)
                _check_error_bound(x, pred, recon, q, ordinal=True, step=step)
                assert_bits_equal(_decode(c, stream), recon, "decoded")


def test_keys_order_like_floats() -> None:
    """numpy_keys is order-preserving and numpy_from_keys inverts it (zeros map to +0.0)."""
    x = _values(4000, 11, "bits")
    x = np.concatenate([x, _values(1000, 12, "subnormal"), [0.0, -0.0]]).astype(np.float32)
    keys = numpy_keys(x)
    order = np.argsort(x, kind="stable")
    assert (np.diff(keys[order]) >= 0).all()
    back = numpy_from_keys(keys)
    assert_bits_equal(back, np.where(x == 0, np.float32(0), x).astype(np.float32))


# -- 5. error bounds (also checked in test_encoder_matches_numpy_reference) ---------------

@FEW
@given(c=cases())
def test_error_within_half_a_step(c: Case) -> None:
    """Unclipped: linear |s - x| <= step/2 (+rounding), ordinal keys within step//2; STAT_MAX_ABS agrees."""
    _, stats, recon = _encode(c)
    q, _ = numpy_quantize(c.x, c.pred, ordinal=c.ordinal, step=c.step, dither=c.dither,
                          dither_signs=c.dither_signs, first=c.first)
    _check_error_bound(c.x, c.pred, recon, q, ordinal=c.ordinal, step=c.step,
                       dither_signs=c.dither_signs)
    ok = ~_clipped(q, c.dither_signs)
    if not c.ordinal and c.x.size and ok.all():
        assert stats[:, STAT_MAX_ABS].max() <= c.step / 2 * (1 + 1e-6) + 4 * float(np.spacing(
            np.abs(np.concatenate([c.x, recon, c.x if c.pred is None else c.pred])).max()))


def test_linear_reconstruction_that_would_overflow_is_bad() -> None:
    """x = largest float32, step = 2e38: q = rint(1.7) = 2 and f32(2 * 2e38) = inf, so the
    block cannot be coded and is reported bad (the caller stores the chunk exactly)."""
    x = np.array([3.4028235e38], np.float32)
    step = float(np.float32(2e38))
    _, stats = encode_block_stream(x, None, np.empty(1, np.float32), ordinal=False, step=step,
                                   block=64)
    assert stats[0, STAT_BAD] == 1


def test_scaled_step_that_underflows_is_bad() -> None:
    """A scaled step that underflows to 0 makes a zero residual's quotient 0 / 0 = NaN: the
    element has no symbol and its block is bad, other blocks code normally. (The NaN used to
    become a 32-bit symbol: a width of 32 that overran the block's slot.)"""
    x = np.zeros(16, np.float32)
    scale = np.ones(16, np.float32)
    scale[:8] = 0.0  # step * (0 + eps) = 1e-30 * 1e-30: 0 in float32
    step = eps = float(np.float32(1e-30))
    stream, stats = encode_block_stream(x, None, np.empty(16, np.float32), ordinal=False, step=step,
                                        block=8, scale=scale, eps=eps)
    assert stats[:, STAT_BAD].tolist() == [8, 0]
    assert stream.tolist() == [0, 0]


# -- 6. non-finite inputs -----------------------------------------------------------------

NONFINITE_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000]


@FEW
@given(c=cases(max_n=2000), data=st.data())
def test_non_finite_inputs_are_counted_per_block(c: Case, data: st.DataObject) -> None:
    """NaN (any payload), +inf and -inf in x or pred: STAT_BAD per block; other blocks code normally."""
    n = c.x.size
    if n == 0:
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = c.x.copy()
    pred = None if c.pred is None else c.pred.copy()
    k = data.draw(st.integers(1, min(n, 20)))
    where = rng.integers(0, n, k)
    in_pred = rng.random(k) < 0.5 if pred is not None else np.zeros(k, bool)
    values = np.array(NONFINITE_BITS, np.uint32)[rng.integers(0, len(NONFINITE_BITS), k)].view(np.float32)
    x[where[~in_pred]] = values[~in_pred]
    if pred is not None:
        pred[where[in_pred]] = values[in_pred]
    bad = ~np.isfinite(x) | (False if pred is None else ~np.isfinite(pred))
    assert bad.any()
    c = c._replace(x=x, pred=pred)
    stream, stats, recon = _encode(c)
    n_blocks = n_blocks_of(n, c.block)
    bad_per_block = np.add.reduceat(bad.astype(np.int64), np.arange(0, n, c.block))
    np.testing.assert_array_equal(stats[:, STAT_BAD], bad_per_block)
    # Blocks without bad elements are coded exactly as the reference codes them; bad blocks are width 0.
    good = np.repeat(bad_per_block == 0, c.block)[:n]
    safe_x = np.where(good, x, 0).astype(np.float32)
    safe_p = None if pred is None else np.where(good, pred, 0).astype(np.float32)
    q, expected = numpy_quantize(safe_x, safe_p, ordinal=c.ordinal, step=c.step, dither=c.dither,
                                 dither_signs=c.dither_signs, first=c.first)
    q[~good] = 0
    assert_stream_equal(stream, c.packed(q))
    assert (stream[:n_blocks][bad_per_block > 0] == 0).all()
    assert_bits_equal(recon[good], expected[good], "reconstruction of good blocks")


@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("in_pred", [False, True])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_single_non_finite_value(ordinal: bool, in_pred: bool, value: float) -> None:
    block, n = 64, 64 * 4 + 10
    x = _values(n, 5, "normal")
    pred = (x * np.float32(0.9)).astype(np.float32)
    for i in (0, 64, n - 1):
        xi, pi = x.copy(), pred.copy()
        (pi if in_pred else xi)[i] = value
        _, stats = encode_block_stream(xi, pi, np.empty(n, np.float32), ordinal=ordinal,
                                       step=4 if ordinal else 0.5, block=block)
        expected = np.zeros(n_blocks_of(n, block))
        expected[i // block] = 1
        np.testing.assert_array_equal(stats[:, STAT_BAD], expected)
    # A bad value in both x and pred at the same element counts once.
    xi, pi = x.copy(), pred.copy()
    xi[5] = pi[5] = value
    _, stats = encode_block_stream(xi, pi, pi, ordinal=ordinal, step=4 if ordinal else 0.5, block=block)
    assert stats[:, STAT_BAD].tolist() == [1, 0, 0, 0, 0]


# -- 8. damaged streams -------------------------------------------------------------------

def _valid_stream(ordinal: bool, n: int = 1000, block: int = 64) -> np.ndarray:
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    stream, _ = encode_block_stream(x, None, np.empty(n, np.float32), ordinal=ordinal,
                                    step=1 << 16 if ordinal else float(np.float32(1e-3)), block=block)
    assert (stream[:n_blocks_of(n, block)] > 0).all()
    return stream


def _decode_damaged(stream: np.ndarray, ordinal: bool, n: int = 1000, block: int = 64) -> None:
    decode_block_stream(stream, None, np.empty(n, np.float32), ordinal=ordinal,
                        step=1 << 16 if ordinal else float(np.float32(1e-3)), block=block)


@pytest.mark.parametrize("ordinal", [False, True])
def test_damaged_streams_raise(ordinal: bool) -> None:
    stream = _valid_stream(ordinal)
    _decode_damaged(stream, ordinal)  # the undamaged stream decodes
    n_blocks = n_blocks_of(1000, 64)
    with pytest.raises(ValueError, match="shorter"):
        _decode_damaged(stream[: n_blocks - 1].copy(), ordinal)
    with pytest.raises(ValueError, match="shorter"):
        _decode_damaged(np.zeros(0, np.uint8), ordinal)
    for b in (0, 7, n_blocks - 1):
        for width in (17, 32, 255):
            bad = stream.copy()
            bad[b] = width
            with pytest.raises(ValueError, match="over 16"):
                _decode_damaged(bad, ordinal)
    with pytest.raises(ValueError, match="bytes"):
        _decode_damaged(stream[:-1].copy(), ordinal)
    with pytest.raises(ValueError, match="bytes"):
        _decode_damaged(np.concatenate([stream, np.zeros(1, np.uint8)]), ordinal)
    # A width changed within range no longer matches the stream's length.
    bad = stream.copy()
    bad[3] = stream[3] - 1
    with pytest.raises(ValueError, match="bytes"):
        _decode_damaged(bad, ordinal)


@pytest.mark.parametrize("ordinal", [False, True])
def test_damaged_all_zero_stream(ordinal: bool) -> None:
    """Only widths: one byte less is too short, one byte more does not match."""
    stream = np.zeros(n_blocks_of(1000, 64), np.uint8)
    _decode_damaged(stream, ordinal)
    for damaged in (stream[:-1].copy(), np.zeros(stream.size + 1, np.uint8)):
        with pytest.raises(ValueError):
            _decode_damaged(damaged, ordinal)


# -- step validation ----------------------------------------------------------------------

@pytest.mark.parametrize(("ordinal", "step"), [
    (True, 0), (True, -1), (True, 1.5), (True, MAX_KEY + 1),
    (False, 0.0), (False, -1.0), (False, float("nan")), (False, float("inf")), (False, float("-inf")),
    (False, 0.1), (False, 1 / 3), (False, 1e39), (False, 1e-46),
])
def test_invalid_steps_raise(ordinal: bool, step: float | int) -> None:
    x = np.ones(10, np.float32)
    with np.errstate(over="ignore"), pytest.raises(ValueError, match="step"):
        encode_block_stream(x, None, np.empty(10, np.float32), ordinal=ordinal, step=step, block=4)
    with np.errstate(over="ignore"), pytest.raises(ValueError, match="step"):
        decode_block_stream(np.zeros(3, np.uint8), None, np.empty(10, np.float32), ordinal=ordinal,
                            step=step, block=4)


# -- 9. several steps in one pass ---------------------------------------------------------

class StepsCase(NamedTuple):
    start: np.ndarray  # running values before the first step (unused with zero_start)
    streams: list[np.ndarray]
    ordinal: list[bool]
    steps: list[float | int]
    block: int
    zero_start: bool
    dithers: list[int | None] | None = None
    first: int = 0
    dither_signs: list[bool] | None = None
    dither_groups: list[bool] | None = None


def _symbol_stream(n: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """A stream of random symbols whose blocks take every width 0..16 (zero-width blocks often)."""
    widths = rng.choice([0, 0, 1, 2, 3, 5, 8, 9, 13, 16], n_blocks_of(n, block))
    q = np.concatenate([_symbols_of_width(min(block, n - b * block), int(w), int(rng.integers(2**32)))
                        for b, w in enumerate(widths)]) if n else np.zeros(0, np.int64)
    return numpy_pack(q, block)


@st.composite
def steps_cases(draw: st.DrawFn, max_n: int = 2500) -> StepsCase:
    """Steps of mixed domains over start values of any pattern (non-finite ones included), as the
    writer codes them (symbols quantizing new values) or as random symbols of every width."""
    block = draw(st.sampled_from(BLOCKS))
    n = min(draw(st.one_of(st.sampled_from([1, 2, 7, block - 1, block, block + 1, 3 * block + 5]),
                           st.integers(0, max_n))), 5000)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    start = _values(n, seed, draw(st.sampled_from(PATTERNS)))
    if draw(st.booleans()):  # signed zeros and non-finite running values the decoder must carry too
        bits = np.array([0x80000000, 0, *NONFINITE_BITS], np.uint32)
        where = rng.random(n) < 0.05
        start[where] = bits[rng.integers(0, bits.size, int(where.sum()))].view(np.float32)
    n_steps = draw(st.integers(1, 6))
    ordinal = [draw(st.booleans()) for _ in range(n_steps)]
    steps = [draw(st.sampled_from(ORDINAL_STEPS if o else LINEAR_STEPS)) for o in ordinal]
    zero_start = draw(st.booleans())
    dithers = [draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))) if _ditherable(o, step)
               else None for o, step in zip(ordinal, steps, strict=True)]
    signs = [dither is not None and not o and draw(st.booleans())
             for o, dither in zip(ordinal, dithers, strict=True)]
    groups = [dither is not None and not o and draw(st.booleans())
              for o, dither in zip(ordinal, dithers, strict=True)]
    first = draw(st.integers(0, 2**34))
    running = None if zero_start else start.copy()
    streams = []
    for o, step, dither, sign, group in zip(ordinal, steps, dithers, signs, groups, strict=True):
        if draw(st.booleans()) or running is None or not np.isfinite(running).all():
            streams.append(_symbol_stream(n, block, rng))
            with np.errstate(invalid="ignore", over="ignore"):
                running = numpy_decode_steps(streams[-1:], running, n, ordinal=[o], steps=[step],
                                             block=block, dithers=[dither], dither_signs=[sign],
                                             dither_groups=[group], first=first)
        else:
            target = _values(n, int(rng.integers(2**32)), str(rng.choice(PATTERNS)))
            near = np.where(rng.random(n) < 0.7, running, target).astype(np.float32)
            streams.append(encode_block_stream(near, running, running, ordinal=o, step=step,
                                               block=block, dither=dither, dither_signs=sign,
                                               dither_groups=group, first=first)[0])
    return StepsCase(start, streams, ordinal, steps, block, zero_start, dithers, first, signs,
                     groups)


def _decode_steps_case(c: StepsCase) -> np.ndarray:
    out = np.full(c.start.size, np.nan, np.float32) if c.zero_start else c.start.copy()
    decode_step_streams(c.streams, out, ordinal=c.ordinal, steps=c.steps, block=c.block,
                        zero_start=c.zero_start, dithers=c.dithers, dither_signs=c.dither_signs,
                        dither_groups=c.dither_groups, first=c.first)
    return out


@SETTINGS
@given(c=steps_cases())
def test_step_streams_match_references(c: StepsCase) -> None:
    """One pass over several steps == the numpy reference, step after step == decode_block_stream
    once per step (per-step ordinal clamping, -0.0 to +0.0 even in zero-width blocks)."""
    actual = _decode_steps_case(c)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = numpy_decode_steps(c.streams, None if c.zero_start else c.start.copy(),
                                      c.start.size, ordinal=c.ordinal, steps=c.steps, block=c.block,
                                      dithers=c.dithers, dither_signs=c.dither_signs,
                                      dither_groups=c.dither_groups, first=c.first)
    assert_bits_equal(actual, expected, "numpy reference")
    sequential = c.start.copy()
    for i, (stream, o, step, dither, signs, groups) in enumerate(zip(
            c.streams, c.ordinal, c.steps, c.dithers, c.dither_signs, c.dither_groups,
            strict=True)):
        pred = None if c.zero_start and i == 0 else sequential
        decode_block_stream(stream, pred, sequential, ordinal=o, step=step, block=c.block,
                            dither=dither, dither_signs=signs, dither_groups=groups,
                            first=c.first)
    assert_bits_equal(actual, sequential, "decode_block_stream per step")


@pytest.mark.parametrize("ordinal", [False, True])
def test_step_streams_zero_width_blocks_still_reconstruct(ordinal: bool) -> None:
    """All-zero streams: no symbol to unpack, yet -0.0 becomes +0.0 and (ordinal) non-finite
    running values are clamped to the largest finite ones, in every step as in decode_block_stream."""
    start = np.array([-0.0, 0.0, 1.5, -2.0, np.inf, -np.inf, 3.4028235e38] * 20, np.float32)
    stream = np.zeros(n_blocks_of(start.size, 64), np.uint8)
    out = start.copy()
    step = 1 << 10 if ordinal else 0.25
    decode_step_streams([stream] * 3, out, ordinal=[ordinal] * 3, steps=[step] * 3, block=64,
                        zero_start=False)
    expected = np.where(start == 0, np.float32(0), start).astype(np.float32)
    if ordinal:
        expected = np.clip(expected, -3.4028235e38, 3.4028235e38).astype(np.float32)
    assert_bits_equal(out, expected)
    assert not np.signbit(out[::7]).any()


@pytest.mark.parametrize("ordinal", [False, True])
def test_step_streams_zero_width_between_steps(ordinal: bool) -> None:
    """A zero-width block between coded ones: its reconstruction (ordinal: the clamp of keys past
    the finite range, here of infinities and NaNs) happens before the next step adds its symbols."""
    rng = np.random.default_rng(3)
    start = np.array([np.inf, -np.inf, np.nan, -0.0, 3.4028235e38, -3.4028235e38, 1.0] * 10,
                     np.float32)
    block = 7
    zero = np.zeros(n_blocks_of(start.size, block), np.uint8)
    streams = [zero, numpy_pack(rng.integers(-3, 4, start.size), block), zero,
               numpy_pack(rng.integers(-3, 4, start.size), block)]
    steps: list[float | int] = [1 << 20 if ordinal else 0.5] * len(streams)
    expected = start.copy()
    with np.errstate(invalid="ignore"):
        for stream, step in zip(streams, steps, strict=True):
            decode_block_stream(stream, expected, expected, ordinal=ordinal, step=step, block=block)
    actual = start.copy()
    decode_step_streams(streams, actual, ordinal=[ordinal] * len(streams), steps=steps,
                        block=block, zero_start=False)
    assert_bits_equal(actual, expected)


def test_step_streams_long_chain_of_alternating_domains() -> None:
    """Twelve steps over many blocks, the domain changing every few steps (keys converted to
    values and back within each block): equal to the per-step decode."""
    rng = np.random.default_rng(5)
    n, block = 10_000, 256
    start = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    ordinal = [bool(i % 3 == 0) for i in range(12)]
    steps: list[float | int] = [1 << 14 if o else float(np.float32(1e-4)) for o in ordinal]
    streams = [_symbol_stream(n, block, rng) for _ in ordinal]
    c = StepsCase(start, streams, ordinal, steps, block, zero_start=False)
    expected = start.copy()
    for stream, o, step in zip(streams, ordinal, steps, strict=True):
        decode_block_stream(stream, expected, expected, ordinal=o, step=step, block=block)
    assert_bits_equal(_decode_steps_case(c), expected)


@pytest.mark.parametrize("ordinal", [False, True])
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_step_streams_damaged_raise_before_writing(ordinal: bool, bad: int) -> None:
    """A damaged stream among several raises ValueError naming its index; nothing is written."""
    stream = _valid_stream(ordinal)
    n_blocks = n_blocks_of(1000, 64)
    wide = stream.copy()
    wide[n_blocks - 1] = 17
    for damaged, message in [(stream[: n_blocks - 1].copy(), "shorter"), (wide, "over 16"),
                             (stream[:-1].copy(), "bytes"),
                             (np.concatenate([stream, np.zeros(1, np.uint8)]), "bytes")]:
        streams = [stream] * 3
        streams[bad] = damaged
        start = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
        out = start.copy()
        with pytest.raises(ValueError, match=rf"stream {bad}: .*{message}"):
            decode_step_streams(streams, out, ordinal=[ordinal] * 3,
                                steps=[1 << 16 if ordinal else float(np.float32(1e-3))] * 3,
                                block=64, zero_start=False)
        assert_bits_equal(out, start, "values after a refused decode")


@FEW
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 600), block=st.sampled_from([1, 7, 64]),
       ordinal=st.booleans())
def test_step_streams_random_bytes(seed: int, n: int, block: int, ordinal: bool) -> None:
    """Streams of random bytes (any widths, any length): a ValueError, or the very values the numpy
    reference decodes; never a read out of bounds."""
    rng = np.random.default_rng(seed)
    streams = [_symbol_stream(n, block, rng) for _ in range(2)]
    mangled = streams[1].copy()
    if mangled.size:
        mangled[rng.integers(0, mangled.size, 3)] = rng.integers(0, 256, 3, dtype=np.uint8)
    streams.append(np.concatenate([mangled, rng.integers(0, 256, int(rng.integers(0, 3)),
                                                         dtype=np.uint8)]))
    start = _values(n, seed, "normal")
    c = StepsCase(start, streams, [ordinal] * 3, [3 if ordinal else 0.5] * 3, block, False)
    try:
        actual = _decode_steps_case(c)
    except ValueError as exc:
        assert str(exc).startswith("stream 2: ")
        with pytest.raises(ValueError):
            decode_block_stream(streams[2], start.copy(), start.copy(), ordinal=ordinal,
                                step=c.steps[2], block=block)
        return
    expected = numpy_decode_steps(streams, start.copy(), n, ordinal=c.ordinal, steps=c.steps,
                                  block=block)
    assert_bits_equal(actual, expected)


def test_step_streams_argument_checks() -> None:
    out = np.zeros(10, np.float32)
    stream = np.zeros(3, np.uint8)
    with pytest.raises(ValueError, match="2 streams, 1 domains, 2 steps, 2 dithers, 2 "
                                         "dither_signs and 2 dither_groups"):
        decode_step_streams([stream, stream], out, ordinal=[False], steps=[1.0, 1.0], block=4,
                            zero_start=False)
    for ordinal, seed in ((False, None), (True, 5)):
        with pytest.raises(ValueError, match="dither_signs applies to dithered streams of the "
                                             "linear domain"):
            decode_step_streams([stream], out, ordinal=[ordinal], steps=[1], block=4,
                                zero_start=False, dithers=[seed], dither_signs=[True])
        with pytest.raises(ValueError, match="dither_groups applies to dithered streams of the "
                                             "linear domain"):
            decode_step_streams([stream], out, ordinal=[ordinal], steps=[1], block=4,
                                zero_start=False, dithers=[seed], dither_groups=[True])
    with pytest.raises(ValueError, match="dither_groups applies to blocks of at most 65536 "
                                         "elements, got 65537"):
        decode_step_streams([stream], out, ordinal=[False], steps=[1.0], block=(1 << 16) + 1,
                            zero_start=False, dithers=[5], dither_groups=[True])
    for ordinal, seed in ((True, -1), (False, -1), (False, 2**32)):
        with pytest.raises(ValueError, match="dither seed"):
            decode_step_streams([stream], out, ordinal=[ordinal], steps=[1], block=4,
                                zero_start=False, dithers=[seed])
    with pytest.raises(ValueError, match="dithered ordinal step"):
        decode_step_streams([stream], out, ordinal=[True], steps=[MAX_DITHERED_KEY_STEP + 1],
                            block=4, zero_start=False, dithers=[5])
    with pytest.raises(ValueError, match="step"):
        decode_step_streams([stream, stream], out, ordinal=[False, True], steps=[1.0, 1.5],
                            block=4, zero_start=False)
    decode_step_streams([], out, ordinal=[], steps=[], block=4, zero_start=False)
    assert_bits_equal(out, np.zeros(10, np.float32))


# -- 6. dithered ordinal steps: unbiased, bounded, no sign flips ----------------------------

@pytest.mark.parametrize("growth", [1.02, 1.3, 0.8])
def test_dithered_ordinal_codes_slow_change_without_bias(growth: float) -> None:
    """A positive tensor that grows or decays by less than half a coarse ordinal step per save:
    undithered, every element stays at its old value (the dead zone); dithered, the elements
    are restored with a median ratio of 1 and each within half a step."""
    rng = np.random.default_rng(3)
    n, step = 20000, 1 << 23  # one binade
    base = np.exp(rng.normal(-10, 2, n)).astype(np.float32)
    x = (base * np.float32(growth)).astype(np.float32)
    for dither, expect_moved in ((None, False), (12345, True)):
        recon = base.copy()
        encode_block_stream(x, recon, recon, ordinal=True, step=step, block=1024, dither=dither)
        ratio = np.median(recon / x)
        if expect_moved:
            assert abs(np.log2(ratio)) < 0.02, ratio
            assert np.all(np.abs(numpy_keys(recon) - numpy_keys(x)) <= step // 2)
        else:
            np.testing.assert_array_equal(recon, base)


def test_ordinal_never_flips_sign() -> None:
    """Zeros and tiny values of either sign, coarsely dithered: none changes sign (a restored
    second moment below zero would be a NaN in its square root)."""
    x = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 1e-30, -1e-30] * 500, np.float32)
    for dither in (None, 7, 99):
        for step in (1 << 23, 1 << 26, MAX_DITHERED_KEY_STEP):
            recon = np.zeros_like(x)
            encode_block_stream(x, None, recon, ordinal=True, step=step, block=64, dither=dither)
            assert not (np.signbit(recon) & (x > 0)).any()
            assert not ((recon > 0) & (x < 0)).any()


@pytest.mark.parametrize("dither", [None, 5])
def test_ordinal_power_of_two_steps_multiply(dither: int | None) -> None:
    """The ordinal encoder multiplies by the reciprocal of a power-of-two step instead of
    dividing: the same float64 quotient, so the same symbols, at every tie (key differences of
    an odd number of half steps, rounded half to even) and at the largest key differences. A
    step that is not a power of two (3 * 2**k) is still divided: checked at its ties too."""
    m = np.arange(-40, 41, dtype=np.int64)
    for k in range(1, 31):
        for step in {1 << k, 3 << (k - 1)} - {3 << 29}:  # steps of at most MAX_KEY
            offsets = np.concatenate([(2 * m + 1) * step // 2, (2 * m + 1) * step // 2 + 1,
                                      m * step])
            pred = np.float32(1.5).view(np.int32) + np.zeros(offsets.size, np.int64)
            keys = np.clip(pred + offsets, 1, MAX_KEY)
            x, p = numpy_from_keys(keys), numpy_from_keys(pred)
            recon = np.empty_like(x)
            stream, _ = encode_block_stream(x, p, recon, ordinal=True, step=step, block=64,
                                            dither=dither if step <= MAX_DITHERED_KEY_STEP
                                            else None)
            q, expected = numpy_quantize(x, p, ordinal=True, step=step, dither=dither
                                         if step <= MAX_DITHERED_KEY_STEP else None)
            assert_stream_equal(stream, numpy_pack(q, 64))
            assert_bits_equal(recon, expected, f"reconstruction, step {step}")
    d = np.concatenate([np.arange(-2**20, 2**20, 997), [-(2**33) + 1, 2**33 - 1]]).astype(np.float64)
    for k in range(31):
        assert np.array_equal(np.rint(d * (1.0 / 2**k)), np.rint(d / 2**k))


@njit
def _hashes_and_key_offsets(seed: int, n: int, step: int) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray]:
    """The dither hashes and dither offsets of elements ``0..n`` for ``seed``, and the key
    offsets of every hash value ``0..2**24`` for ``step``, as the kernels compute them."""
    bits, u = np.empty(n, np.int64), np.empty(n, np.float32)
    for i in range(n):
        bits[i] = _dither_bits(i, seed)
        u[i] = _dither_of_bits(bits[i])
    offsets = np.empty(1 << 24, np.float64)
    for h in range(1 << 24):
        offsets[h] = _key_offset(np.int32(h), np.float64(step))
    return bits, u, offsets


@pytest.mark.parametrize("step", [1, 2, 3, 255, 1 << 23, 3 << 22, (1 << 29) - 1,
                                  MAX_DITHERED_KEY_STEP])
def test_key_offsets_from_hash_bits(step: int) -> None:
    """The kernels take an ordinal step's dithered key offset from the dither hash's 24 bits
    in float64 (``_key_offset``): for every hash value the offset of FORMAT.md 3.2 from the
    dither offset ``bits * 2**-24 - 0.5`` (numpy_key_offsets), which is ``_dither_of_bits``' and
    numpy_dither's."""
    bits, u, offsets = _hashes_and_key_offsets(12345, 1 << 16, step)
    assert np.array_equal(u, numpy_dither(1 << 16, 12345))
    assert np.array_equal(u, bits.astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5))
    for lo in range(0, 1 << 24, 1 << 22):  # a quarter of the hash values at a time
        hashes = np.arange(lo, lo + (1 << 22))
        dither = hashes.astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
        assert np.array_equal(offsets[hashes], numpy_key_offsets(dither, step))
