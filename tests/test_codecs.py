"""The lossless codec (deltackpt.codecs) against docs/FORMAT.md section 3.

``spec_decode`` below is an independent decoder written from the format
document alone (it uses neither the library's decoders nor its kernels); the
library's stored bytes must decode with it, and with the library's own
``decode_into``, to exactly the raw bytes.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_huffman import reference_decode  # the huffman stream decoded bit by bit, from FORMAT.md 3.1

from deltackpt import CorruptionError, DeltackptError, FormatError
from deltackpt.codecs import CODECS, decode_into, encode_lossless
from deltackpt.codecs.lossless import MIN_CODED_BYTES, PACKED_PARAMS
from deltackpt.codecs.quant import decode_quant, encode_quant, quant_params, rans_coded
from deltackpt.format.dtypes import BY_NAME, DTypeSpec
from deltackpt.kernels.quant import N_GROUPS, encode_block_stream, to_planes

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPE_NAMES = sorted(BY_NAME)
FLOAT_NAMES = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128"}


# -- an independent decoder, from docs/FORMAT.md section 3 ---------------------------------------

def _spec_zstd(frame: bytes, expected_length: int) -> bytes:
    """One zstd frame with its content size (FORMAT.md: "one zstd frame ..., with its content size")."""
    frame_params = zstandard.get_frame_parameters(frame)
    assert frame_params.content_size == expected_length, "zstd frame lacks the right content size"
    data = zstandard.ZstdDecompressor().decompress(frame)
    assert len(data) == expected_length
    return data


def spec_decode(codec: str, params: dict[str, Any], stored: bytes, raw_length: int) -> bytes:
    """Decode one chunk following the format document only."""
    if codec == "raw":
        assert params == {}
        assert len(stored) == raw_length
        return stored
    if codec == "zstd":
        assert params == {}
        return _spec_zstd(stored, raw_length)
    if codec == "huffman":
        assert params == {}
        return reference_decode(stored, raw_length)
    assert codec == "byteplane", codec
    assert set(params) >= {"elem", "rotate", "planes"}
    elem, rotate, planes = params["elem"], params["rotate"], params["planes"]
    assert elem in (2, 4, 8) and isinstance(rotate, bool) and len(planes) == elem
    assert raw_length % elem == 0
    n = raw_length // elem
    plane_bytes, pos = [], 0
    for plane_codec, length in planes:
        piece = stored[pos : pos + length]
        assert len(piece) == length
        pos += length
        assert plane_codec in ("raw", "zstd", "huffman"), plane_codec
        plane_bytes.append(spec_decode(plane_codec, {}, piece, n))
    assert pos == len(stored), "stored bytes are exactly the planes one after another"
    # plane p holds byte E-1-p (little-endian position) of every rotated element
    table = np.zeros((n, elem), dtype=np.uint8)
    for p, data in enumerate(plane_bytes):
        table[:, elem - 1 - p] = np.frombuffer(data, dtype=np.uint8)
    rotated = table.reshape(-1).view(f"<u{elem}")
    if rotate:  # undo "rotate left by one bit" of the E-byte unsigned integer
        bits = 8 * elem
        one = rotated.dtype.type(1)
        rotated = (rotated >> one) | ((rotated & one) << rotated.dtype.type(bits - 1))
    return rotated.astype(f"<u{elem}").tobytes()


SPECIAL_WORDS = {
    1: [0x7F, 0xFF, 0x80, 0x01, 0x78, 0xF8, 0x00],
    2: [0x7E01, 0xFD00, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7F81, 0xFF80],
    4: [0x7FC12345, 0xFFA00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001],
    8: [0x7FF8000000000001, 0xFFF0000000000001, 0x7FF0000000000000, 0x8000000000000000, 1],
}


# -- data -------------------------------------------------------------------------------------------

def _structured(spec: DTypeSpec, n: int, pattern: str, seed: int) -> np.ndarray:
    """``n`` elements of ``spec``'s dtype as raw bytes, following a pattern."""
    gen = torch.Generator().manual_seed(seed)
    dtype = spec.torch_dtype
    if pattern == "zeros":
        t = torch.zeros(n * spec.itemsize, dtype=torch.uint8)
    elif pattern == "constant":
        one = torch.randint(0, 256, (spec.itemsize,), generator=gen, dtype=torch.uint8)
        if dtype == torch.bool:
            one = one % 2
        t = one.repeat(n)
    elif pattern == "random":
        t = torch.randint(0, 256, (n * spec.itemsize,), generator=gen, dtype=torch.uint8)
        if dtype == torch.bool:
            t = t % 2
    elif pattern == "realistic":  # trained-weight-like floats, small ints, or 0/1 bools
        if dtype.is_floating_point or dtype.is_complex:
            values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.02
            t = values.to(dtype).reshape(-1).view(torch.uint8)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8)
        else:
            t = torch.randint(0, 100, (n,), generator=gen, dtype=torch.int64).to(dtype).view(torch.uint8)
    else:  # "special": NaNs with payloads, infinities, -0.0, denormals, as little-endian bit patterns
        words = np.resize(np.array(SPECIAL_WORDS[spec.word], dtype=f"<u{spec.word}"),
                          n * spec.itemsize // spec.word)
        t = torch.from_numpy(words.view(np.uint8).copy())
        if dtype == torch.bool:
            t = t % 2
    return t.contiguous().numpy().copy()


@st.composite
def chunks(draw: st.DrawFn) -> tuple[DTypeSpec, np.ndarray]:
    """A dtype and raw bytes of it: arbitrary or structured, around and well above MIN_CODED_BYTES."""
    spec = BY_NAME[draw(st.sampled_from(DTYPE_NAMES))]
    threshold = MIN_CODED_BYTES // spec.itemsize
    n = draw(st.one_of(st.integers(0, 4), st.integers(threshold - 2, threshold + 2),
                       st.integers(0, 3000)))
    n = max(n, 0)
    if draw(st.booleans()) and n * spec.itemsize <= 2048:
        data = draw(st.binary(min_size=n * spec.itemsize, max_size=n * spec.itemsize))
        raw = np.frombuffer(data, dtype=np.uint8).copy()
        if spec.torch_dtype == torch.bool:
            raw %= 2
    else:
        pattern = draw(st.sampled_from(["zeros", "constant", "random", "realistic", "special"]))
        raw = _structured(spec, n, pattern, draw(st.integers(0, 2**31)))
    assert raw.size == n * spec.itemsize
    return spec, raw


def _stored(encoded) -> bytes:
    return b"".join(bytes(memoryview(part).cast("B")) for part in encoded.parts)


def _decode(codec: str, params: dict[str, Any], stored: bytes, raw_length: int) -> bytes:
    out = np.full(raw_length, 0xA5, dtype=np.uint8)
    decode_into(codec, params, memoryview(stored), out)
    return out.tobytes()


# -- round trip and layout ------------------------------------------------------------------------

@SETTINGS
@given(chunk=chunks())
def test_roundtrip_and_layout_follow_the_spec(chunk: tuple[DTypeSpec, np.ndarray]) -> None:
    """encode_lossless -> concatenated parts decode to the same bytes, by the library and by the spec."""
    spec, raw = chunk
    original = raw.tobytes()
    encoded = encode_lossless(raw, spec)
    stored = _stored(encoded)
    assert raw.tobytes() == original, "encoding must not modify its input"
    assert encoded.length == len(stored)
    assert encoded.codec in ("raw", "zstd", "huffman", "byteplane")
    # params are written to JSON metadata and read back from it
    params = json.loads(json.dumps(encoded.params, allow_nan=False))
    assert _decode(encoded.codec, params, stored, raw.size) == original
    assert _decode(encoded.codec, encoded.params, stored, raw.size) == original
    assert spec_decode(encoded.codec, params, stored, raw.size) == original
    if raw.nbytes < MIN_CODED_BYTES:
        assert encoded.codec == "raw" and stored == original
    if encoded.codec == "byteplane":  # of the dtype's words; single bytes as wider ones
        assert (params["elem"], params["rotate"]) == (spec.word, spec.rotate) if spec.word > 1 \
            else params["elem"] in (2, 4, 8) and not params["rotate"]
        assert sum(length for _, length in params["planes"]) == len(stored)
    elif raw.nbytes >= MIN_CODED_BYTES:
        assert spec.word == 1, f"{spec.name} should go through byteplane"


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dtype_specs(name: str) -> None:
    """Every on-disk dtype has a spec whose word divides its itemsize; floats rotate, others don't."""
    spec = BY_NAME[name]
    assert spec.name == name == str(spec.torch_dtype).removeprefix("torch.")
    assert spec.itemsize == spec.torch_dtype.itemsize
    assert spec.itemsize % spec.word == 0
    assert spec.rotate == (name in FLOAT_NAMES)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_compressible_data_is_compressed(name: str) -> None:
    """Zeros (and realistic float weights) come out much smaller than they went in."""
    spec = BY_NAME[name]
    raw = np.zeros(64 * 1024, dtype=np.uint8)
    encoded = encode_lossless(raw, spec)
    assert encoded.length < raw.nbytes // 20, (name, encoded.codec, encoded.length)
    assert _decode(encoded.codec, encoded.params, _stored(encoded), raw.size) == raw.tobytes()
    if name in ("float32", "bfloat16", "float16"):
        weights = _structured(spec, 32 * 1024 // spec.itemsize, "realistic", 1)
        encoded = encode_lossless(weights, spec)
        assert encoded.codec == "byteplane"
        assert encoded.length < 0.95 * weights.nbytes
        assert any(codec != "raw" for codec, _ in encoded.params["planes"]), "exponent plane"


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_incompressible_data_is_stored_raw(name: str) -> None:
    """Random bytes do not expand: every plane (or the whole chunk) is stored raw (bools: compressed)."""
    spec = BY_NAME[name]
    raw = _structured(spec, 48 * 1024 // spec.itemsize, "random", 7)
    encoded = encode_lossless(raw, spec)
    if spec.torch_dtype == torch.bool:  # random 0/1 bytes hold one bit each: zstd pays off
        assert encoded.codec == "zstd" and encoded.length < raw.nbytes // 4
        assert _decode(encoded.codec, encoded.params, _stored(encoded), raw.size) == raw.tobytes()
        return
    assert encoded.length <= raw.nbytes + 8
    if encoded.codec == "byteplane":
        assert [codec for codec, _ in encoded.params["planes"]] == ["raw"] * spec.word
    else:
        assert encoded.codec == "raw"
    assert spec_decode(encoded.codec, encoded.params, _stored(encoded), raw.size) == raw.tobytes()
    assert _decode(encoded.codec, encoded.params, _stored(encoded), raw.size) == raw.tobytes()


def test_bytes_of_wider_words_are_coded_as_their_planes() -> None:
    """A byte tensor that holds wider integers, as torch's CPU RNG state holds 32-bit words in
    64-bit slots, is coded as the byte planes of those words (FORMAT.md 3's ``byteplane`` of a
    ``uint8`` chunk), smaller than as one stream; bytes of no wider structure stay one stream."""
    spec = BY_NAME["uint8"]
    gen = torch.Generator().manual_seed(0)
    torch.randn(1000, generator=gen)
    state = gen.get_state().numpy()
    words = np.random.default_rng(0).integers(0, 1000, 8192, dtype=np.uint32).view(np.uint8)
    for raw, elem in ((state, 8), (words, 4)):
        encoded = encode_lossless(raw, spec)
        assert (encoded.codec, encoded.params["elem"]) == ("byteplane", elem)
        one_stream = encode_lossless(raw[:-1], spec)  # an odd length splits into no words
        assert one_stream.codec != "byteplane" and encoded.length < 0.85 * one_stream.length
        assert spec_decode(encoded.codec, encoded.params, _stored(encoded), raw.size) \
            == raw.tobytes()
    rng = np.random.default_rng(1)
    for raw in (rng.integers(0, 256, 8192, dtype=np.uint8), rng.integers(0, 4, 8192,
                                                                            dtype=np.uint8)):
        assert encode_lossless(raw, spec).codec in ("raw", "huffman", "zstd")


# -- damaged input ----------------------------------------------------------------------------------

def _encoded_sample(name: str, pattern: str) -> tuple[np.ndarray, str, dict[str, Any], bytes]:
    spec = BY_NAME[name]
    raw = _structured(spec, 4096 // spec.itemsize, pattern, 11)
    encoded = encode_lossless(raw, spec)
    return raw, encoded.codec, json.loads(json.dumps(encoded.params)), _stored(encoded)


SAMPLES = [(name, pattern) for name in ("float32", "bfloat16", "int64", "uint8", "float8_e4m3fn")
           for pattern in ("realistic", "random", "zeros")]


@pytest.mark.parametrize(("name", "pattern"), SAMPLES)
def test_truncated_or_extended_stored_bytes_raise(name: str, pattern: str) -> None:
    """Stored bytes shorter than written always raise; longer ones raise or still decode correctly."""
    raw, codec, params, stored = _encoded_sample(name, pattern)
    for cut in sorted({1, 2, len(stored) // 2, len(stored) - 1, len(stored)}):
        with pytest.raises((CorruptionError, FormatError)):
            _decode(codec, params, stored[: len(stored) - cut], raw.size)
    for tail in (b"\0", b"garbage" * 3):
        try:
            decoded = _decode(codec, params, stored + tail, raw.size)
        except (CorruptionError, FormatError):
            continue
        assert decoded == raw.tobytes(), "extra stored bytes must never change the decoded data"


@pytest.mark.parametrize(("name", "pattern"), SAMPLES)
def test_wrong_raw_length_raises(name: str, pattern: str) -> None:
    """Decoding into a buffer whose length differs from what was encoded raises CorruptionError."""
    raw, codec, params, stored = _encoded_sample(name, pattern)
    itemsize = BY_NAME[name].itemsize
    for length in (raw.size - itemsize, raw.size + itemsize, 2 * raw.size):
        with pytest.raises((CorruptionError, FormatError)):
            _decode(codec, params, stored, length)


@settings(max_examples=100, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_flipped_bytes_raise_only_deltackpt_errors(sample: tuple[str, str], data: st.DataObject) -> None:
    """Flipping stored bytes either decodes (a checksum then catches it) or raises a deltackpt error.

    No foreign exception (zstd, numpy, numba, MemoryError) escapes, and the
    output always has the promised length.
    """
    raw, codec, params, stored = _encoded_sample(*sample)
    assume(len(stored) > 0)
    damaged = bytearray(stored)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(stored) - 1))
        damaged[pos] ^= data.draw(st.integers(1, 255))
    out = np.empty(raw.size, dtype=np.uint8)
    try:
        decode_into(codec, params, memoryview(bytes(damaged)), out)
    except DeltackptError as exc:
        assert isinstance(exc, (CorruptionError, FormatError))
    assert out.size == raw.size


def test_zstd_frame_claiming_huge_content_size_is_corruption() -> None:
    """A zstd frame header claiming far more bytes than the chunk holds raises CorruptionError.

    The decoder must not trust the frame's content size (it must not try to
    allocate it): metadata says how long the chunk is.
    """
    payload = bytes(range(256)) * 16
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    assert frame[4] == 0x60  # single segment, 2-byte frame content size field
    body = frame[4 + 1 + 2 :]
    for claimed in (len(payload) + 1, 10**12, 2**62):
        forged = frame[:4] + bytes([0xE0]) + struct.pack("<Q", claimed) + body  # 8-byte content size
        with pytest.raises(CorruptionError):
            _decode("zstd", {}, forged, len(payload))


@pytest.mark.parametrize("params", [
    {"elem": 3, "rotate": True, "planes": [["raw", 1000]] * 3},
    {"elem": 4, "rotate": "yes", "planes": [["raw", 1024]] * 4},
    {"elem": 4, "rotate": True, "planes": [["raw", 1024]] * 3},
    {"elem": 4, "rotate": True, "planes": [["lz4", 1024]] * 4},
    {"elem": 4, "rotate": True, "planes": [["raw", -1024]] * 4},
    {"elem": 4, "rotate": True},
    {},
])
def test_invalid_byteplane_params_are_format_errors(params: dict[str, Any]) -> None:
    """byteplane params that do not follow the spec raise FormatError (not a crash or wrong data)."""
    stored = bytes(4096)
    with pytest.raises(FormatError):
        _decode("byteplane", params, stored, 4096)


def test_swapped_plane_lengths_raise() -> None:
    """Plane lengths that add up but are assigned to the wrong planes raise CorruptionError."""
    raw, codec, params, stored = _encoded_sample("float32", "realistic")
    assert codec == "byteplane"
    lengths = [length for _, length in params["planes"]]
    assert len(set(lengths)) > 1, "needs planes of different stored lengths"
    swapped = {**params, "planes": [[c, n] for (c, _), n in zip(params["planes"], lengths[::-1],
                                                                 strict=True)]}
    with pytest.raises((CorruptionError, FormatError)):
        _decode(codec, swapped, stored, raw.size)


def test_unknown_codec_is_a_format_error_naming_it() -> None:
    """A codec this version does not know raises FormatError whose message names it."""
    assert {"raw", "zstd", "byteplane"} <= set(CODECS)
    with pytest.raises(FormatError, match="lz77-from-the-future"):
        _decode("lz77-from-the-future", {}, b"\0" * 16, 16)


def test_raw_and_zstd_codecs_by_name() -> None:
    """The raw and zstd codecs decode what the spec says they hold."""
    payload = bytes(range(256)) * 4
    assert _decode("raw", {}, payload, len(payload)) == payload
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    assert _decode("zstd", {}, frame, len(payload)) == payload
    with pytest.raises(CorruptionError):
        _decode("zstd", {}, b"not a zstd frame at all", len(payload))
    with pytest.raises(CorruptionError):
        _decode("raw", {}, payload[:-1], len(payload))


# -- quant params (FORMAT.md 3.2) ------------------------------------------------------------

QUANT_BASE = {"domain": "linear", "pred": "zero", "step": 0.5, "block": 64}
SCALED_QUANT = {**QUANT_BASE, "scale": "optimizer/state/w/exp_avg_sq", "eps": float(np.float32(1e-8))}


@pytest.mark.parametrize("params", [
    QUANT_BASE, {**QUANT_BASE, "pred": "base", "dither": 7},
    {"domain": "ordinal", "pred": "base", "step": 256, "block": 1024}, SCALED_QUANT,
    {**SCALED_QUANT, "dither": 3}, {**QUANT_BASE, "dither": 0},  # since 1.5
    {"domain": "ordinal", "pred": "base", "step": 1 << 29, "block": 64, "dither": 5},
    {**SCALED_QUANT, "dither": 3, "dither_signs": True},  # since 2.2
    {**QUANT_BASE, "pred": "base", "dither": 7, "dither_signs": True},
    {**SCALED_QUANT, "floor_log2": -20}, {**SCALED_QUANT, "floor_log2": -126},  # since 2.3
    {**SCALED_QUANT, "dither": 3, "dither_signs": True, "floor_log2": 127},
    {**SCALED_QUANT, "dither": 3, "dither_signs": True, "dither_groups": True},  # since 2.5
    {**QUANT_BASE, "pred": "base", "dither": 7, "dither_groups": True, "block": 1 << 16},
])
def test_valid_quant_params(params: dict[str, Any]) -> None:
    quant_params(params)


@pytest.mark.parametrize("params", [
    {**QUANT_BASE, "future": 1},  # unknown keys are refused, not ignored
    {**SCALED_QUANT, "pred": "base"}, {**QUANT_BASE, "dither": 2**32}, {**QUANT_BASE, "dither": True},
    {"domain": "ordinal", "pred": "base", "step": (1 << 29) + 1, "block": 64, "dither": 5},
    {**SCALED_QUANT, "domain": "ordinal", "step": 4}, {**SCALED_QUANT, "eps": 0.0},
    {**SCALED_QUANT, "eps": 0.1}, {**SCALED_QUANT, "eps": True}, {**SCALED_QUANT, "scale": 3},
    {**QUANT_BASE, "eps": 1.0}, {k: v for k, v in SCALED_QUANT.items() if k != "eps"},
    {**QUANT_BASE, "dither_signs": True},  # signs folded by a dither it does not have
    {**QUANT_BASE, "dither": 7, "dither_signs": False}, {**QUANT_BASE, "dither": 7, "dither_signs": 1},
    {"domain": "ordinal", "pred": "base", "step": 256, "block": 64, "dither": 5, "dither_signs": True},
    {**QUANT_BASE, "dither_groups": True},  # grouped by a dither it does not have
    {**QUANT_BASE, "dither": 7, "dither_groups": False}, {**QUANT_BASE, "dither": 7, "dither_groups": 1},
    {"domain": "ordinal", "pred": "base", "step": 256, "block": 64, "dither": 5, "dither_groups": True},
    {**QUANT_BASE, "dither": 7, "dither_groups": True, "block": (1 << 16) + 1},  # too large a block
    {**QUANT_BASE, "bit_planes": False}, {**QUANT_BASE, "bit_planes": 1},
    {**QUANT_BASE, "floor_log2": -20},  # a floor shapes a scale it does not have
    {**SCALED_QUANT, "floor_log2": -127}, {**SCALED_QUANT, "floor_log2": 128},
    {**SCALED_QUANT, "floor_log2": -20.0}, {**SCALED_QUANT, "floor_log2": True},
    {**SCALED_QUANT, "floor_log2": 2**70},
])
def test_invalid_quant_params_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(FormatError, match="quant params"):
        quant_params(params)


def test_quant_chunk_is_one_frame_of_its_packed_stream() -> None:
    """A quant chunk stores its packed symbol stream as bit planes (``bit_planes``, since 2.8) in one
    zstd frame with its content size (FORMAT.md 3.2), compressed with the parameters of packed
    streams (PACKED_PARAMS, not level 1): it decodes to exactly the encoder's reconstruction."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(50_000).astype(np.float32)
    pred = (x + rng.standard_normal(x.size).astype(np.float32) * 0.01).astype(np.float32)
    recon = np.empty_like(x)
    chunk, _ = encode_quant(x, pred, recon, ordinal=False, step=0.03125, block=1024, dither=9)
    stream, _ = encode_block_stream(x, pred, np.empty_like(x), ordinal=False, step=0.03125,
                                    block=1024, dither=9, dither_signs=True)
    # every dithered linear chunk folds its signs by the dither; one coded against its base
    # does not group its symbols by it
    assert chunk.params["dither_signs"] is True and "dither_groups" not in chunk.params
    assert chunk.params["bit_planes"] is True
    planes = to_planes(stream, x.size, 1024)
    frame = bytes(chunk.parts[0])
    assert frame == zstandard.ZstdCompressor(compression_params=PACKED_PARAMS).compress(planes)
    assert _spec_zstd(frame, planes.nbytes) == planes.tobytes()
    out = pred.copy()
    decode_quant(memoryview(frame), chunk.params, out, out, first=0)
    assert np.array_equal(out.view(np.uint32), recon.view(np.uint32))


def test_quant_chunks_from_zero_group_their_symbols_by_dither() -> None:
    """A dithered chunk coded from zero (a first moment, mostly within a step) stores its
    symbols grouped by the dither's size (``dither_groups``, FORMAT.md 3.2) in blocks of up to
    65536 elements, its planes coded by rANS in 4 bins (``rans_bins``, smaller than zstd's
    frame here), and decodes to the encoder's reconstruction; a larger block is not grouped,
    and its stream is one zstd frame."""
    x = (np.random.default_rng(4).standard_normal(70_000) * 0.2).astype(np.float32)
    for block, grouped in ((1024, True), (1 << 16, True), ((1 << 16) + 1, False)):
        recon = np.empty_like(x)
        chunk, _ = encode_quant(x, None, recon, ordinal=False, step=1.0, block=block, dither=3,
                                first=5)
        assert chunk.params["dither_signs"] is True
        assert chunk.params.get("dither_groups", False) is grouped, block
        stream, _ = encode_block_stream(x, None, np.empty_like(x), ordinal=False, step=1.0,
                                        block=block, dither=3, dither_signs=True,
                                        dither_groups=grouped, first=5)
        planes = to_planes(stream, x.size, block)
        frame = zstandard.ZstdCompressor(compression_params=PACKED_PARAMS).compress(planes)
        if grouped:
            coded = rans_coded(planes, x.size, block, N_GROUPS)
            assert chunk.params["rans_bins"] == N_GROUPS and len(coded) < len(frame)
            assert bytes(chunk.parts[0]) == coded
        else:
            assert "rans_bins" not in chunk.params and bytes(chunk.parts[0]) == frame
        out = np.full_like(x, np.nan)
        decode_quant(memoryview(bytes(chunk.parts[0])), chunk.params, None, out, first=5)
        assert np.array_equal(out.view(np.uint32), recon.view(np.uint32))
