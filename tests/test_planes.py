"""The bit planes of packed symbol streams (kernels/planes.py, FORMAT.md 3.2 ``planes``), held
to a numpy reading of the spec, on streams of every width and on streams the quant kernels
packed."""

from __future__ import annotations

import numpy as np
import pytest

from deltackpt.kernels import quant
from deltackpt.kernels.planes import MAX_WIDTH, _spread, plane_starts
from deltackpt.kernels.quant import from_planes, to_planes


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` low bits of each value, least significant first, as a flat bit array."""
    return ((values[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)


def _spec(symbols: np.ndarray, widths: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed stream and the plane stream of zigzag ``symbols``, as FORMAT.md 3.2 says."""
    blocks = [symbols[b * block:(b + 1) * block] for b in range(widths.size)]
    packed = [widths] + [np.packbits(_bits(z, int(w)), bitorder="little")
                         for z, w in zip(blocks, widths, strict=True) if w]
    planes = [widths]
    for k in range(MAX_WIDTH):
        for z, w in zip(blocks, widths, strict=True):
            if w > k:
                planes.append(np.packbits(((z >> k) & 1).astype(np.uint8), bitorder="little"))
    return np.concatenate(packed).astype(np.uint8), np.concatenate(planes).astype(np.uint8)


def _symbols(rng: np.random.Generator, n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Zigzag symbols of random widths (0 to 16, each block reaching its width) and the widths."""
    nb = -(-n // block)
    widths = rng.integers(0, MAX_WIDTH + 1, nb).astype(np.uint8)
    widths[: min(nb, MAX_WIDTH + 1)] = np.arange(min(nb, MAX_WIDTH + 1))
    symbols = np.zeros(n, np.int64)
    for b, w in enumerate(widths):
        if w:
            z = rng.integers(0, 1 << int(w), min(block, n - b * block))
            z[rng.integers(z.size)] |= 1 << (int(w) - 1)
            symbols[b * block:b * block + z.size] = z
    return symbols, widths


def test_a_planes_byte_spreads_to_one_bit_a_symbol() -> None:
    """The decoders' spread of a plane's byte puts its bit ``i`` at bit ``8 * i`` (the lowest
    bit of symbol ``i``'s byte), for each of the 256 values."""
    expected = [sum(((v >> i) & 1) << (8 * i) for i in range(8)) for v in range(256)]
    assert [int(_spread(np.uint8(v))) for v in range(256)] == expected


@pytest.mark.parametrize(("n", "block"), [(64 * 17, 64), (64 * 17 + 5, 64), (1000, 100),
                                          (77 * 19, 77), (7, 64), (5000, 1024)])
def test_planes_match_the_spec(n: int, block: int) -> None:
    rng = np.random.default_rng(n + block)
    symbols, widths = _symbols(rng, n, block)
    packed, planes = _spec(symbols, widths, block)
    assert plane_starts(widths, n, block, widths.size)[-1] == planes.size
    assert np.array_equal(to_planes(packed, n, block), planes)
    assert np.array_equal(from_planes(planes, n, block), packed)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(("n", "block"), [(10_003, 256), (5_000, 100), (77, 64)])
def test_encoder_writes_the_planes_of_its_packed_stream(grouped: bool, n: int,
                                                        block: int) -> None:
    """The encoder's stream in bit planes is the planes of its packed stream (blocks of every
    width up to 16, grouped or not, a short last block), which packs back bit for bit."""
    rng = np.random.default_rng(n)
    scales = rng.choice([0.0, 0.3, 2.0, 40.0, 9000.0], -(-n // block))
    x = (rng.standard_normal(n) * np.repeat(scales, block)[:n]).astype(np.float32)
    coded = {}
    for planes in (False, True):
        recon = np.empty(n, np.float32)
        coded[planes], _ = quant.encode_block_stream(
            x, None, recon, ordinal=False, step=1.0, block=block, dither=7,
            dither_signs=grouped, dither_groups=grouped, bit_planes=planes)
    assert np.array_equal(coded[True], to_planes(coded[False], n, block))
    assert np.array_equal(from_planes(coded[True], n, block), coded[False])
    nb = -(-n // block)
    assert coded[True].size == plane_starts(coded[False][:nb], n, block, nb)[-1]


def test_damaged_plane_streams_are_refused() -> None:
    n, block = 1000, 100
    symbols, widths = _symbols(np.random.default_rng(3), n, block)
    _, planes = _spec(symbols, widths, block)
    with pytest.raises(ValueError, match="shorter than its 10 block widths"):
        from_planes(planes[:9], n, block)
    with pytest.raises(ValueError, match="its block widths need"):
        from_planes(planes[:-1], n, block)
    with pytest.raises(ValueError, match="its block widths need"):
        from_planes(np.concatenate([planes, planes[:1]]), n, block)
    wide = planes.copy()
    wide[4] = MAX_WIDTH + 1
    with pytest.raises(ValueError, match="block width 17 is over 16"):
        from_planes(wide, n, block)


def _coded(n: int, block: int) -> tuple[list[np.ndarray], dict]:
    """Streams of consecutive steps coded closed loop: both domains, dithered, folded and
    grouped (a first moment coded anew from zero heads the chain)."""
    rng = np.random.default_rng(n)
    recon = (rng.standard_normal(n) * 0.1).astype(np.float32)
    kinds = [(False, 2.0**-7, 3, True, True, False), (True, 4096, 5, False, False, True),
             (False, 2.0**-9, 7, True, False, True), (True, 256, None, False, False, True),
             (False, 2.0**-6, None, False, False, True)]
    streams = []
    for ordinal, step, dither, signs, groups, with_base in kinds:
        x = (recon * (1 + 0.05 * rng.standard_normal(n)) + 0.01 * rng.standard_normal(n))
        x = x.astype(np.float32)
        streams.append(quant.encode_block_stream(
            x, recon if with_base else None, recon, ordinal=ordinal, step=step, block=block,
            dither=dither, dither_signs=signs, dither_groups=groups, first=11)[0])
    return streams, {"ordinal": [k[0] for k in kinds], "steps": [k[1] for k in kinds],
                     "dithers": [k[2] for k in kinds], "dither_signs": [k[3] for k in kinds],
                     "dither_groups": [k[4] for k in kinds], "block": block, "first": 11}


@pytest.mark.parametrize(("n", "block"), [(5000, 256), (999, 100), (70, 64)])
def test_kernels_decode_bit_planes_as_packed(n: int, block: int) -> None:
    """The Numba decoders read streams stored as bit planes to the very values of the packed
    streams: one step at a time and a chain whose steps mix both layouts (a directory of
    format 2.7 continued at 2.8)."""
    streams, kwargs = _coded(n, block)
    planes = [to_planes(s, n, block) for s in streams]
    single = {"ordinal": kwargs["ordinal"][0], "step": kwargs["steps"][0],
              "dither": kwargs["dithers"][0], "dither_signs": kwargs["dither_signs"][0],
              "dither_groups": kwargs["dither_groups"][0]}
    expected, out = np.empty(n, np.float32), np.empty(n, np.float32)
    quant.decode_block_stream(streams[0], None, expected, block=block, first=11, **single)
    quant.decode_block_stream(planes[0], None, out, block=block, first=11, bit_planes=True,
                              **single)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    for layout in ([True] * 5, [False, True, False, True, True], [True, False, True, False, False]):
        expected, out = np.zeros(n, np.float32), np.zeros(n, np.float32)
        quant.decode_step_streams(streams, expected, zero_start=True, **kwargs)
        quant.decode_step_streams([p if b else s for s, p, b in zip(streams, planes, layout,
                                                                      strict=True)],
                                  out, zero_start=True, bit_planes=layout, **kwargs)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), layout


def test_kernels_refuse_damaged_plane_streams() -> None:
    """A plane stream whose length is not what its widths imply, or a width over 16, is refused
    naming the stream before anything is written."""
    n, block = 999, 100
    streams, kwargs = _coded(n, block)
    planes = [to_planes(s, n, block) for s in streams]
    for damaged, problem in ((planes[2][:-1], "stream 2: stream is"),
                             (np.concatenate([[17], planes[2][1:]]).astype(np.uint8),
                              "stream 2: block width 17 is over 16"),
                             (planes[2][:3], "stream 2: stream of 3 bytes is shorter")):
        out = np.ones(n, np.float32)
        with pytest.raises(ValueError, match=problem):
            quant.decode_step_streams([*planes[:2], damaged, *planes[3:]], out, zero_start=True,
                                      bit_planes=[True] * 5, **kwargs)
        assert (out == 1).all()
    with pytest.raises(ValueError, match="its block widths need"):
        quant.check_stream(planes[1][:-1], n, block, planes=True)
    with pytest.raises(ValueError, match="5 streams and 4 bit_planes"):
        quant.decode_step_streams(planes, np.zeros(n, np.float32), zero_start=True,
                                  bit_planes=[True] * 4, **kwargs)
