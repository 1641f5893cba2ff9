"""rANS coding of plane streams (FORMAT.md 3.2, *Plane coding*, ``rans_bins``): held to a plain
reading of the spec, round trips of real and edge-case streams, and damaged chunks refused."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from deltackpt.codecs.quant import decode_quant, encode_quant, quant_stream, rans_coded
from deltackpt.errors import CorruptionError, FormatError
from deltackpt.kernels.quant import N_GROUPS, encode_block_stream
from deltackpt.kernels.rans import (
    BODY_LONG,
    BODY_OK,
    BODY_SHORT,
    BODY_STATES,
    byte_freqs,
    decode_planes,
    encode_planes,
)


def _spec_freqs(p: int) -> list[int]:
    f = []
    for b in range(256):
        a = 2**32
        for i in range(8):
            a = a * (p if b >> i & 1 else 65536 - p) // 65536
        f.append(max(1, a * 4096 // 2**32))
    f[0 if p <= 32768 else 255] += 4096 - sum(f)
    return f


def _spec_decode(body: bytes, models: list[int], widths: list[int], n: int, block: int,
                 bins: int) -> bytes:
    """The plane bytes of a body, read as FORMAT.md 3.2 says, in plain Python."""
    contexts = []  # of each plane byte, in stream order
    for k in range(max(widths, default=0)):
        for b, w in enumerate(widths):
            if w > k:
                s = (min(block, n - b * block) + 7) // 8
                contexts += [k * bins + t * bins // s for t in range(s)]
    x = [int.from_bytes(body[4 * i: 4 * i + 4], "little") for i in range(4)]
    pos, j, out = 16, 0, bytearray()
    for c in contexts:
        if not models[c]:
            out.append(0)
            continue
        f = _spec_freqs(models[c])
        start = [sum(f[:b]) for b in range(257)]
        r = x[j % 4] % 4096
        b = next(b for b in range(256) if start[b] <= r < start[b + 1])
        x[j % 4] = f[b] * (x[j % 4] // 4096) + r - start[b]
        if x[j % 4] < 2**16:
            assert pos + 2 <= len(body)
            x[j % 4] = x[j % 4] * 65536 + int.from_bytes(body[pos: pos + 2], "little")
            pos += 2
        out.append(b)
        j += 1
    assert pos == len(body) and x == [2**16] * 4
    return bytes(out)


def _stream(n: int, block: int, scale: float, seed: int, grouped: bool) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    stream, _ = encode_block_stream(x, None, np.empty_like(x), ordinal=False, step=1.0,
                                    block=block, dither=seed, dither_signs=True,
                                    dither_groups=grouped, bit_planes=True)
    return stream


def test_byte_frequencies_are_valid_for_every_model() -> None:
    """Every model 1..65535 gives frequencies of at least 1 that sum to 4096 (so the spec's
    correction of byte 0 or 255 never takes it below 1), as the spec computes them."""
    for p in range(1, 65536):
        f = byte_freqs(p)
        assert f.min() >= 1 and f.sum() == 4096, p
    for p in (1, 77, 32767, 32768, 32769, 50000, 65535):
        assert byte_freqs(p).tolist() == _spec_freqs(p)


@pytest.mark.parametrize(("n", "block", "scale", "bins"), [
    (3000, 256, 0.3, 4), (2049, 1024, 0.05, 4), (777, 100, 2.0, 1), (5000, 512, 40.0, 3),
    (10, 7, 0.3, 16), (1, 1, 5.0, 2)])
def test_bodies_follow_the_spec_and_round_trip(n: int, block: int, scale: float,
                                               bins: int) -> None:
    """Streams of sparse, dense and wide (up to 9-bit) planes, blocks not a multiple of 8 and
    short last blocks, any bins: the body decodes to the planes by the spec's reading and by
    the kernel."""
    stream = _stream(n, block, scale, 7, block <= 1 << 16)
    nb = -(-n // block)
    models, body = encode_planes(stream, n, block, bins)
    assert models.size == int(stream[:nb].max()) * bins
    assert _spec_decode(body.tobytes(), models.tolist(), stream[:nb].tolist(), n, block,
                        bins) == stream[nb:].tobytes()
    out = np.zeros_like(stream)
    out[:nb] = stream[:nb]
    assert decode_planes(body, models, out, n, block, bins) == BODY_OK
    assert np.array_equal(out, stream)


def test_empty_and_all_zero_contexts_take_no_body() -> None:
    """A stream of zero-width blocks has no planes and no models; a context whose bytes are all
    zero has model 0 and takes none of the body: only the four states remain."""
    x = np.zeros(1000, np.float32)
    stream, _ = encode_block_stream(x, None, np.empty_like(x), ordinal=False, step=1.0,
                                    block=256, bit_planes=True)
    models, body = encode_planes(stream, 1000, 256, 4)
    assert models.size == 0 and body.size == 16
    planes = np.zeros(4 + 32 + 29, np.uint8)  # blocks of width 1, 0, 0, 1, every bit 0
    planes[:4] = [1, 0, 0, 1]
    models, body = encode_planes(planes, 1000, 256, 2)
    assert models.tolist() == [0, 0] and body.size == 16
    out = np.full_like(planes, 0xFF)
    out[:4] = planes[:4]
    assert decode_planes(body, models, out, 1000, 256, 2) == BODY_OK
    assert np.array_equal(out, planes)


def test_damaged_bodies_are_refused() -> None:
    """A body cut short, with bytes past its end, of an odd length or with a changed state is
    refused with its status, never read past its end."""
    stream = _stream(4000, 512, 0.4, 3, True)
    nb = -(-4000 // 512)
    models, body = encode_planes(stream, 4000, 512, 4)
    out = np.zeros_like(stream)
    out[:nb] = stream[:nb]
    assert decode_planes(body[:-2], models, out, 4000, 512, 4) == BODY_SHORT
    assert decode_planes(body[:16], models, out, 4000, 512, 4) == BODY_SHORT
    assert decode_planes(body[:8], models, out, 4000, 512, 4) == BODY_SHORT
    assert decode_planes(np.concatenate([body, [0, 0]]).astype(np.uint8), models, out, 4000,
                         512, 4) == BODY_LONG
    assert decode_planes(body[:-1], models, out, 4000, 512, 4) == BODY_LONG
    changed = body.copy()
    changed[3] ^= 0x40
    assert decode_planes(changed, models, out, 4000, 512, 4) in (BODY_STATES, BODY_SHORT,
                                                                 BODY_LONG)


def _grouped_chunk(n: int = 20_000) -> tuple[bytes, dict, np.ndarray, np.ndarray]:
    x = (np.random.default_rng(11).standard_normal(n) * 0.3).astype(np.float32)
    recon = np.empty_like(x)
    chunk, _ = encode_quant(x, None, recon, ordinal=False, step=1.0, block=1024, dither=21)
    assert chunk.params["rans_bins"] == N_GROUPS
    return bytes(chunk.parts[0]), chunk.params, x, recon


def test_grouped_chunks_decode_from_their_rans_body() -> None:
    """A first-moment-like chunk (dithered from zero, grouped) is stored by rANS in 4 bins:
    head length, head frame (widths, models), body; it decodes to the encoder's
    reconstruction."""
    stored, params, x, recon = _grouped_chunk()
    out = np.full_like(x, np.nan)
    decode_quant(memoryview(stored), params, None, out, first=0)
    assert np.array_equal(out.view(np.uint32), recon.view(np.uint32))
    stream = quant_stream(memoryview(stored), params, x.size).data
    assert rans_coded(stream, x.size, 1024, N_GROUPS) == stored


def test_damaged_rans_chunks_are_refused() -> None:
    """A head length past the chunk, a head that is not a frame, of the wrong size or with a
    width over 16, and a body that does not decode are CorruptionErrors naming the problem;
    ``rans_bins`` that is not 1..16 or without ``bit_planes`` is a FormatError."""
    stored, params, x, _ = _grouped_chunk()
    n = x.size
    size = int.from_bytes(stored[:4], "little")
    head = zstandard.ZstdDecompressor().decompress(stored[4: 4 + size])
    body = stored[4 + size:]

    def with_head(raw: bytes) -> memoryview:
        frame = zstandard.ZstdCompressor().compress(raw)
        return memoryview(len(frame).to_bytes(4, "little") + frame + body)

    with pytest.raises(CorruptionError, match=r"too short for its \d+-byte head"):
        quant_stream(memoryview((len(stored)).to_bytes(4, "little") + stored[4:]), params, n)
    with pytest.raises(CorruptionError, match=r"too short"):
        quant_stream(memoryview(stored[:3]), params, n)
    with pytest.raises(CorruptionError, match=r"not a zstd frame"):
        quant_stream(memoryview(stored[:4] + bytes(size) + body), params, n)
    with pytest.raises(CorruptionError, match=r"bytes of models, its \d+ planes in 4 bins"):
        quant_stream(with_head(head[:-2]), params, n)
    wide = bytearray(head)
    wide[0] = 17
    with pytest.raises(CorruptionError, match=r"at most 17 bits wide \(at most 16\)"):
        quant_stream(with_head(bytes(wide)), params, n)
    with pytest.raises(CorruptionError, match=r"rANS body ends before its planes do"):
        quant_stream(memoryview(stored[:-2]), params, n)
    with pytest.raises(CorruptionError, match=r"rANS body holds bytes past its planes"):
        quant_stream(memoryview(stored + bytes(2)), params, n)
    for bad in (0, 17, True, 2.0):
        with pytest.raises(FormatError, match=r"quant params .* are invalid"):
            quant_stream(memoryview(stored), {**params, "rans_bins": bad}, n)
    with pytest.raises(FormatError, match=r"quant params .* are invalid"):
        quant_stream(memoryview(stored), {k: v for k, v in params.items() if k != "bit_planes"},
                     n)


def test_writers_keep_the_smaller_coding() -> None:
    """A grouped chunk whose rANS coding would not be smaller than its zstd frame (a few dozen
    elements: the head's frame and the four states cost more than they save) is stored as
    the frame, without ``rans_bins``, and decodes all the same."""
    x = (np.random.default_rng(5).standard_normal(40) * 0.3).astype(np.float32)
    recon = np.empty_like(x)
    chunk, _ = encode_quant(x, None, recon, ordinal=False, step=1.0, block=1024, dither=8)
    assert chunk.params["dither_groups"] is True and "rans_bins" not in chunk.params
    stream = quant_stream(memoryview(bytes(chunk.parts[0])), chunk.params, x.size).data
    assert len(rans_coded(stream, x.size, 1024, N_GROUPS)) >= len(chunk.parts[0])
    out = np.full_like(x, np.nan)
    decode_quant(memoryview(bytes(chunk.parts[0])), chunk.params, None, out, first=0)
    assert np.array_equal(out.view(np.uint32), recon.view(np.uint32))
