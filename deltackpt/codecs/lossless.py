"""Lossless codecs: ``raw``, ``zstd``, ``huffman`` and ``byteplane`` (docs/FORMAT.md, section 3).

Full checkpoints use :func:`encode_lossless`, which splits floats into byte
planes and codes each plane with the cheapest codec that pays off, judged
from a sampled histogram before any coding is tried:

* mantissa planes of trained fp32 values are close to random: ``raw``;
* exponent planes (2.5-4 bits of entropy a byte) and the like: ``huffman``,
  block-adaptive and several times faster than zstd at a similar size;
* nearly constant planes (under 1 bit a byte, e.g. moments of unused
  embedding rows): ``zstd``, whose matches go below Huffman's 1 bit a symbol.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import numpy as np
import zstandard

from deltackpt.codecs.base import CODECS, EncodedChunk, check_length, register
from deltackpt.errors import CorruptionError, FormatError
from deltackpt.format.dtypes import BY_NAME, DTypeSpec
from deltackpt.kernels.byteplane import merge_planes, sampled_entropy_bits, split_planes
from deltackpt.kernels.huffman import huffman_decode, huffman_encode

# Chunks below this size are stored raw: coding them costs more than it saves.
MIN_CODED_BYTES = 4096
# A stream whose sampled entropy is above this many bits per byte is stored raw,
RAW_ENTROPY_BITS = 7.5
# and one below this many goes to zstd rather than Huffman (which needs >= 1 bit a symbol).
ZSTD_ENTROPY_BITS = 1.0
# Compressed output must be at most this fraction of the input to be kept.
KEEP_FRACTION = 0.97
# About this many elements are sampled to estimate a plane's entropy (enough to choose a codec).
SAMPLE_ELEMENTS = 1 << 12
# Single bytes are coded as the planes of wider words where those take less than this fraction of
# the bits one stream would (each plane has a codec's overhead, and the estimates are sampled).
PLANE_GAIN = 0.9

# zstd only sees nearly constant streams, where level 1 is as small as any and fast.
ZSTD_LEVEL = 1
# Packed symbol streams (the quant chunks of deltas): level 1's parameters for large inputs, with
# matches of at least 7 bytes instead of 5-6. Fewer, longer matches: on the streams of a 40 MB
# TinyGPT delta 10% less time to compress, 8% less to decompress, 2% fewer bytes.
PACKED_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=19, chain_log=12, hash_log=13, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST)

# Delta steps' metadata (JSON text, tens to hundreds of KB): level 9 stored 13.5% and 12.3%
# fewer bytes than level 1 for a 1.4 MB and a 305 MB TinyGPT's delta, in 0.6 and 2.3 ms
# instead of 0.07 and 0.2 (levels 5-9 all within 4% of each other; 15 and up take 10-60x as
# long for 5-15% less again).
METADATA_LEVEL = 9
# What each kind of frame is compressed with.
FrameKind = Literal["plain", "packed", "metadata"]
_SETTINGS = {"plain": {"level": ZSTD_LEVEL}, "packed": {"compression_params": PACKED_PARAMS},
             "metadata": {"level": METADATA_LEVEL}}

_local = threading.local()


def _compressor(kind: FrameKind) -> zstandard.ZstdCompressor:
    compressors = _local.__dict__.setdefault("compressors", {})
    if kind not in compressors:
        compressors[kind] = zstandard.ZstdCompressor(**_SETTINGS[kind])
    return compressors[kind]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx


def zstd_compress(data: Any, kind: FrameKind = "plain") -> bytes:
    """One zstd frame of ``data``, stating its size (thread-safe: one compressor per thread);
    ``kind``: ``"plain"`` bytes (``ZSTD_LEVEL``), a ``"packed"`` symbol stream
    (``PACKED_PARAMS``) or a step's ``"metadata"`` text (``METADATA_LEVEL``)."""
    return _compressor(kind).compress(data)


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


def _code_stream(stream: np.ndarray, bits: float) -> tuple[str, Any]:
    """The codec for a byte stream given its sampled entropy, and the coded bytes."""
    if bits > RAW_ENTROPY_BITS:
        return "raw", stream
    codec, coded = ("zstd", zstd_compress(stream)) if bits < ZSTD_ENTROPY_BITS else \
        ("huffman", huffman_encode(stream))
    if memoryview(coded).nbytes > KEEP_FRACTION * stream.nbytes:
        return "raw", stream
    return codec, coded


def encode_lossless(raw: np.ndarray, spec: DTypeSpec) -> EncodedChunk:
    """Encode the raw bytes of one chunk of ``spec``-typed elements, exactly.

    ``raw`` is a 1-d uint8 array whose length is a multiple of the element
    size. Multi-byte elements go through ``byteplane``; single bytes are one
    stream coded like a plane, or the planes of wider words (:func:`_byte_word`).
    """
    if raw.nbytes < MIN_CODED_BYTES:
        return EncodedChunk("raw", {}, [raw])
    word, rotate = spec.word, spec.rotate
    if word == 1:
        stream_bits = sampled_entropy_bits(raw[None, :], max(1, raw.size // SAMPLE_ELEMENTS))[0]
        word = _byte_word(raw, stream_bits)
        if word == 1:
            codec, data = _code_stream(raw, stream_bits)
            return EncodedChunk(codec, {}, [data])
    words = raw.view(f"<u{word}")
    planes = np.empty((word, words.size), dtype=np.uint8)
    split_planes(words, rotate, planes)
    bits = sampled_entropy_bits(planes, max(1, words.size // SAMPLE_ELEMENTS))
    plane_meta, parts = [], []
    for p in range(word):
        codec, data = _code_stream(planes[p], bits[p])
        plane_meta.append([codec, memoryview(data).nbytes])
        parts.append(data)
    return EncodedChunk("byteplane", {"elem": word, "rotate": rotate, "planes": plane_meta},
                        parts)


def _byte_word(raw: np.ndarray, bits: float) -> int:
    """The width of the words a stream of single bytes (of sampled entropy ``bits`` a byte) is
    coded as (FORMAT.md 3's ``byteplane``): 1, one stream, unless its sampled bytes take less than
    ``PLANE_GAIN`` of the bits as the planes of 2-, 4- or 8-byte words. Bytes that hold wider
    integers are such a stream: torch's CPU RNG state, 32-bit words in 64-bit slots, is 20%
    smaller as 8 planes."""
    best, fewest = 1, bits * raw.size
    for word in (2, 4, 8):
        if raw.size % word:
            continue
        columns = raw.reshape(-1, word).T  # byte k of every word (planes, in some order)
        total = sampled_entropy_bits(columns, max(1, columns.shape[1] // SAMPLE_ELEMENTS)).sum() \
            * columns.shape[1]
        if total < PLANE_GAIN * fewest:
            best, fewest = word, total
    return best


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


class HuffmanCodec:
    """Block-adaptive canonical Huffman of the raw bytes (FORMAT.md 3.1)."""

    name = "huffman"

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        try:
            huffman_decode(stored, out.nbytes, out=out)
        except ValueError as exc:
            raise CorruptionError(f"huffman stream does not decode ({exc})") from None


PLANE_CODECS = ("raw", "zstd", "huffman")


class BytePlaneCodec:
    """Elements rotated and split into byte planes, each coded with one of PLANE_CODECS."""

    name = "byteplane"

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        elem, rotate, plane_meta = _byteplane_params(params)
        if out.nbytes % elem:
            raise FormatError(f"byteplane chunk of {out.nbytes} bytes is not a multiple of "
                              f"its element size {elem}")
        planes = np.empty((elem, out.nbytes // elem), dtype=np.uint8)
        pos = 0
        for p, (codec, length) in enumerate(plane_meta):
            try:
                CODECS[codec].decode(stored[pos : pos + length], {}, planes[p])
            except CorruptionError as exc:
                raise CorruptionError(f"byteplane plane {p}: {exc}") from None
            pos += length
        check_length(stored.nbytes, pos, "byteplane chunk (stored bytes)")
        merge_planes(planes, rotate, out.view(np.dtype(f"<u{elem}")))


def _byteplane_params(params: dict[str, Any]) -> tuple[int, bool, list[tuple[str, int]]]:
    """Validated ``(elem, rotate, planes)`` of a byteplane chunk."""
    elem, rotate, planes = params.get("elem"), params.get("rotate"), params.get("planes")
    words = {spec.word for spec in BY_NAME.values()} - {1}
    if elem.__class__ is not int or elem not in words or not isinstance(rotate, bool) \
            or not isinstance(planes, list):
        raise FormatError(f"byteplane params {params} are invalid")
    if len(planes) != elem or any(
            not (isinstance(pl, list) and len(pl) == 2 and pl[0] in PLANE_CODECS
                 and isinstance(pl[1], int) and pl[1] >= 0) for pl in planes):
        raise FormatError(f"byteplane planes {planes} are invalid for element size {elem}")
    return elem, rotate, [(c, n) for c, n in planes]


for _codec in (RawCodec(), ZstdCodec(), HuffmanCodec(), BytePlaneCodec()):
    register(_codec)
