"""Lossless codecs: ``raw``, ``zstd`` and ``byteplane`` (docs/FORMAT.md, section 3).

Full checkpoints use :func:`encode_lossless`, which splits floats into byte
planes and compresses only the planes worth compressing. Mantissa planes of
trained fp32 values are close to random: trying zstd on them costs time and
gains nothing, so a sampled histogram decides per plane before compressing.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

from deltackpt.codecs.base import EncodedChunk, check_length, register
from deltackpt.dtypes import BY_NAME, DTypeSpec
from deltackpt.errors import CorruptionError, FormatError
from deltackpt.kernels.byteplane import merge_planes, sampled_histograms, split_planes

# Chunks below this size are stored raw: coding them costs more than it saves.
MIN_CODED_BYTES = 256
# A plane whose sampled entropy is above this many bits per byte is stored raw.
RAW_ENTROPY_BITS = 7.5
# Compressed output must be at most this fraction of the input to be kept.
KEEP_FRACTION = 0.97
# About this many elements are sampled to estimate a plane's entropy.
SAMPLE_ELEMENTS = 1 << 16

# Exponent planes are short-range noisy: zstd's fast strategy with the longest
# minimum match and a small hash table is both faster and smaller than level 1
# on them (measured on a trained GPT's weights and Adam moments).
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=12, chain_log=6, search_log=1, min_match=7,
    strategy=zstandard.STRATEGY_FAST, write_content_size=True)

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "cctx"):
        _local.cctx = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)
    return _local.cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx


def zstd_compress(data: Any) -> bytes:
    """One zstd frame of ``data`` (thread-safe: one compressor per thread)."""
    return _compressor().compress(data)


def zstd_decompress(stored: memoryview, raw_length: int, what: str) -> bytes:
    """Decompress one zstd frame that must hold exactly ``raw_length`` bytes."""
    try:
        # A frame states its own size; check it before zstd allocates that much.
        check_length(zstandard.frame_content_size(stored), raw_length, what)
        data = _decompressor().decompress(stored, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"{what}: zstd frame does not decode ({exc})") from None
    check_length(len(data), raw_length, what)
    return data


def entropy_bits(hist: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a byte histogram."""
    total = int(hist.sum())
    if total == 0:
        return 0.0
    p = hist[hist > 0] / total
    return float(-(p * np.log2(p)).sum())


def _code_stream(stream: np.ndarray, hist: np.ndarray) -> tuple[str, Any]:
    """``("zstd", frame)`` if compressing ``stream`` pays off, else ``("raw", stream)``."""
    if entropy_bits(hist) > RAW_ENTROPY_BITS:
        return "raw", stream
    frame = zstd_compress(stream)
    if len(frame) > KEEP_FRACTION * stream.nbytes:
        return "raw", stream
    return "zstd", frame


def encode_lossless(raw: np.ndarray, spec: DTypeSpec) -> EncodedChunk:
    """Encode the raw bytes of one chunk of ``spec``-typed elements, exactly.

    ``raw`` is a 1-d uint8 array whose length is a multiple of the element
    size. Multi-byte elements go through ``byteplane``; single bytes through
    ``zstd`` or ``raw``.
    """
    if raw.nbytes < MIN_CODED_BYTES:
        return EncodedChunk("raw", {}, [raw])
    if spec.word == 1:
        stride = max(1, raw.size // SAMPLE_ELEMENTS)
        codec, data = _code_stream(raw, sampled_histograms(raw[None, :], stride)[0])
        return EncodedChunk(codec, {}, [data])
    words = raw.view(spec.word_numpy)
    planes = np.empty((spec.word, words.size), dtype=np.uint8)
    split_planes(words, spec.rotate, planes)
    hist = sampled_histograms(planes, max(1, words.size // SAMPLE_ELEMENTS))
    plane_meta, parts = [], []
    for p in range(spec.word):
        codec, data = _code_stream(planes[p], hist[p])
        plane_meta.append([codec, memoryview(data).nbytes])
        parts.append(data)
    return EncodedChunk("byteplane", {"elem": spec.word, "rotate": spec.rotate,
                                      "planes": plane_meta}, parts)


class RawCodec:
    """Stored bytes are the raw bytes."""

    name = "raw"

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        check_length(stored.nbytes, out.nbytes, "raw chunk")
        out[:] = np.frombuffer(stored, dtype=np.uint8)


class ZstdCodec:
    """One zstd frame of the raw bytes."""

    name = "zstd"

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        out[:] = np.frombuffer(zstd_decompress(stored, out.nbytes, "zstd chunk"), dtype=np.uint8)


class BytePlaneCodec:
    """Elements rotated and split into byte planes, each stored raw or as zstd."""

    name = "byteplane"

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        elem, rotate, plane_meta = _byteplane_params(params)
        if out.nbytes % elem:
            raise FormatError(f"byteplane chunk of {out.nbytes} bytes is not a multiple of "
                              f"its element size {elem}")
        n = out.nbytes // elem
        planes = np.empty((elem, n), dtype=np.uint8)
        pos = 0
        for p, (codec, length) in enumerate(plane_meta):
            piece = stored[pos : pos + length]
            pos += length
            what = f"byteplane plane {p}"
            if codec == "raw":
                check_length(piece.nbytes, n, what)
                planes[p] = np.frombuffer(piece, dtype=np.uint8)
            else:
                planes[p] = np.frombuffer(zstd_decompress(piece, n, what), dtype=np.uint8)
        check_length(stored.nbytes, pos, "byteplane chunk (stored bytes)")
        merge_planes(planes, rotate, out.view(np.dtype(f"<u{elem}")))


def _byteplane_params(params: dict[str, Any]) -> tuple[int, bool, list[tuple[str, int]]]:
    """Validated ``(elem, rotate, planes)`` of a byteplane chunk."""
    elem, rotate, planes = params.get("elem"), params.get("rotate"), params.get("planes")
    words = {spec.word for spec in BY_NAME.values()} - {1}
    if elem not in words or not isinstance(rotate, bool) or not isinstance(planes, list):
        raise FormatError(f"byteplane params {params} are invalid")
    if len(planes) != elem or any(
            not (isinstance(pl, list) and len(pl) == 2 and pl[0] in ("raw", "zstd")
                 and isinstance(pl[1], int) and pl[1] >= 0) for pl in planes):
        raise FormatError(f"byteplane planes {planes} are invalid for element size {elem}")
    return elem, rotate, [(c, n) for c, n in planes]


for _codec in (RawCodec(), ZstdCodec(), BytePlaneCodec()):
    register(_codec)
