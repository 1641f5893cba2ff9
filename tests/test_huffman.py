"""The block-adaptive Huffman coder (deltackpt.kernels.huffman) against its stream format spec.

``reference_decode`` below is a plain, bit-by-bit reading of the spec in the
module docstring, written independently of the kernels: the tests check that
the Numba decoder agrees with it on valid streams and on damaged ones (same
output, or both refuse), and that everything the encoder writes passes it.
"""

from __future__ import annotations

import heapq
import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt.kernels.huffman import (
    BLOCK_SYMBOLS,
    HEADER_BYTES,
    MAX_BLOCK_SYMBOLS,
    MAX_CODE_BITS,
    code_lengths,
    huffman_decode,
    huffman_encode,
    read_header,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RAW, CONSTANT, LIST, RANGE = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------------
# Reference decoder (slow, obviously correct)


class _Reader:
    """Sequential reads from a byte string; running past its end is a ValueError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, k: int) -> bytes:
        if self.pos + k > len(self.data):
            raise ValueError("truncated")
        piece = self.data[self.pos : self.pos + k]
        self.pos += k
        return piece

    def u8(self) -> int:
        return self.take(1)[0]

    def uint(self, k: int) -> int:
        return int.from_bytes(self.take(k), "little")


def _read_lengths(r: _Reader, mode: int) -> dict[int, int]:
    """The code length table of a Huffman block: {symbol: length} of the used symbols."""
    lengths: dict[int, int] = {}
    if mode == LIST:
        count = r.u8() + 1
        if count < 2:
            raise ValueError("list table with fewer than two symbols")
        prev = -1
        for _ in range(count):
            sym, ln = r.u8(), r.u8()
            if sym <= prev or not 1 <= ln <= MAX_CODE_BITS:
                raise ValueError("bad list entry")
            lengths[sym] = ln
            prev = sym
    else:
        first, last = r.u8(), r.u8()
        if first >= last:
            raise ValueError("bad range")
        span = last - first + 1
        nibbles = r.take((span + 1) // 2)
        for i in range(span):
            ln = (nibbles[i // 2] >> (4 * (i % 2))) & 15
            if ln > MAX_CODE_BITS:
                raise ValueError("code too long")
            if ln:
                lengths[first + i] = ln
        if span % 2 and nibbles[-1] >> 4:
            raise ValueError("spare nibble not zero")
        if len(lengths) < 2:
            raise ValueError("range table with fewer than two symbols")
    if sum(Fraction(1, 2**ln) for ln in lengths.values()) != 1:
        raise ValueError("Kraft sum is not 1")
    return lengths


def _canonical(lengths: dict[int, int]) -> dict[tuple[int, int], int]:
    """{(length, code): symbol} of the canonical code, codes numbered MSB-first."""
    codes = {}
    code = prev_len = 0
    for i, (sym, ln) in enumerate(sorted(lengths.items(), key=lambda item: (item[1], item[0]))):
        if i:
            code = (code + 1) << (ln - prev_len)
        codes[(ln, code)] = sym
        prev_len = ln
    return codes


def _decode_substream(bits: bytes, count: int, codes: dict[tuple[int, int], int]) -> list[int]:
    """``count`` symbols from an LSB-first bit string, which they must use up to its padding."""
    symbols = []
    pos = 0
    for _ in range(count):
        code = length = 0
        while (length, code) not in codes:
            if pos >= 8 * len(bits) or length == MAX_CODE_BITS:
                raise ValueError("sub-stream overrun")
            code = 2 * code + ((bits[pos // 8] >> (pos % 8)) & 1)
            length += 1
            pos += 1
        symbols.append(codes[(length, code)])
    pad = 8 * len(bits) - pos
    if not 0 <= pad <= 7:
        raise ValueError("sub-stream has bytes left over")
    if pad and bits[-1] >> (8 - pad):
        raise ValueError("padding bits not zero")
    return symbols


def reference_decode(stored: bytes, n_symbols: int, modes: list[int] | None = None) -> bytes:
    """Decode a stream per the module docstring, bit by bit; append each block's mode to ``modes``."""
    r = _Reader(bytes(stored))
    version, n, block = r.u8(), r.uint(8), r.uint(4)
    if version != 1 or not 1 <= block <= MAX_BLOCK_SYMBOLS or n != n_symbols:
        raise ValueError("bad header")
    out = bytearray()
    for start in range(0, n, block):
        m = min(block, n - start)
        mode = r.u8()
        if modes is not None:
            modes.append(mode)
        if mode == RAW:
            out += r.take(m)
        elif mode == CONSTANT:
            out += bytes([r.u8()]) * m
        elif mode in (LIST, RANGE):
            codes = _canonical(_read_lengths(r, mode))
            stream_lengths = [r.uint(2) for _ in range(4)]
            streams = [r.take(length) for length in stream_lengths]
            decoded = bytearray(m)
            for k in range(4):
                positions = [i for i in range(m) if (i // 2) % 4 == k]
                symbols = _decode_substream(streams[k], len(positions), codes)
                for i, sym in zip(positions, symbols, strict=True):
                    decoded[i] = sym
            out += decoded
        else:
            raise ValueError("bad mode")
    if r.pos != len(r.data):
        raise ValueError("trailing bytes")
    return bytes(out)


def _outcome(decoder, stored: bytes, n: int) -> bytes | str:
    """What a decoder makes of ``stored``: the decoded bytes, or "error" for a ValueError."""
    try:
        return bytes(decoder(stored, n))
    except ValueError:
        return "error"


# ---------------------------------------------------------------------------------------------------
# Test data


def _exponent_bytes(values: np.ndarray) -> np.ndarray:
    """The exponent byte of float32 values rotated left by one bit (sign to bit 0)."""
    u = values.astype(np.float32).view(np.uint32)
    return (((u << 1) | (u >> 31)) >> 24).astype(np.uint8)


def _fibonacci_stream(n: int, n_symbols: int, rng: np.random.Generator) -> np.ndarray:
    """Symbols with Fibonacci-like frequencies, whose Huffman code is deeper than MAX_CODE_BITS."""
    fib = [1, 1]
    while len(fib) < n_symbols:
        fib.append(fib[-1] + fib[-2])
    p = np.array(fib[:n_symbols], dtype=np.float64)
    syms = rng.choice(256, n_symbols, replace=False)
    x = syms[rng.choice(n_symbols, n, p=p / p.sum())].astype(np.uint8)
    if n >= n_symbols:  # every symbol at least once, so the rare ones force length limiting
        x[rng.choice(n, n_symbols, replace=False)] = syms
    return x


def _symbols(kind: str, n: int, seed: int) -> np.ndarray:
    """``n`` symbols of a named kind: the byte streams the coder meets, and ones that stress it."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "constant":
        return np.full(n, rng.integers(0, 256), dtype=np.uint8)
    if kind == "two":
        a, b = rng.choice(256, 2, replace=False)
        return np.where(rng.random(n) < 0.01, a, b).astype(np.uint8)
    if kind == "few":
        alphabet = rng.choice(256, rng.integers(2, 9), replace=False)
        return alphabet[rng.geometric(0.4, n) % len(alphabet)].astype(np.uint8)
    if kind == "fibonacci":
        return _fibonacci_stream(n, int(rng.integers(14, 40)), rng)
    if kind == "weights":
        return _exponent_bytes(rng.standard_normal(n) * 0.02)
    if kind == "drifting":  # exponents whose scale drifts along the stream, with constant stretches
        scale = 10.0 ** np.repeat(rng.uniform(-6, 0, n // 5000 + 1), 5000)[:n]
        x = _exponent_bytes(rng.standard_normal(n) ** 2 * scale)
        if n > 10:
            x[n // 3 : n // 3 + rng.integers(0, n // 3)] = 0
        return x
    if kind == "low_byte":  # 7 random bits and a constant zero sign bit
        u = np.abs(rng.standard_normal(n)).astype(np.float32).view(np.uint32)
        return ((u << 1) & 0xFF).astype(np.uint8)
    raise AssertionError(kind)


KINDS = ["random", "constant", "two", "few", "fibonacci", "weights", "drifting", "low_byte"]
block_sizes = st.sampled_from([BLOCK_SYMBOLS, BLOCK_SYMBOLS, 1, 7, 8, 9, 100, 1000, 4097, MAX_BLOCK_SYMBOLS])
EDGE_LENGTHS = [BLOCK_SYMBOLS - 1, BLOCK_SYMBOLS, BLOCK_SYMBOLS + 1, 3 * BLOCK_SYMBOLS + 5]
symbol_arrays = st.builds(
    _symbols, kind=st.sampled_from(KINDS),
    n=st.one_of(st.integers(0, 40), st.integers(0, 3000), st.integers(0, 100_000),
                st.sampled_from(EDGE_LENGTHS)),
    seed=st.integers(0, 2**32 - 1))


def _block_count(n: int, block: int) -> int:
    return -(-n // block)


# ---------------------------------------------------------------------------------------------------
# Round trips and agreement with the reference


@SETTINGS
@given(x=symbol_arrays, block=block_sizes)
def test_round_trip(x: np.ndarray, block: int) -> None:
    """decode(encode(x)) == x for every kind of data, length and block size; into ``out`` too."""
    if block < 100 and x.size > 5000:  # tiny blocks: keep the block count (and run time) modest
        x = x[:5000]
    stored = huffman_encode(x, block)
    assert stored.dtype == np.uint8 and stored.ndim == 1
    assert read_header(stored) == (x.size, block)
    np.testing.assert_array_equal(huffman_decode(stored, x.size), x)
    out = np.full(x.size, 7, dtype=np.uint8)
    assert huffman_decode(stored.tobytes(), x.size, out=out) is out
    np.testing.assert_array_equal(out, x)
    # Never larger than storing every block raw.
    assert stored.size <= HEADER_BYTES + _block_count(x.size, block) + x.size


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), n=st.integers(0, 2500), seed=st.integers(0, 2**32 - 1),
       block=st.sampled_from([1, 5, 8, 64, 333, 1024, BLOCK_SYMBOLS]))
def test_reference_decoder_agrees(kind: str, n: int, seed: int, block: int) -> None:
    """The encoder's output follows the spec: the bit-by-bit reference decodes it to the input."""
    x = _symbols(kind, n, seed)
    stored = huffman_encode(x, block).tobytes()
    modes: list[int] = []
    assert reference_decode(stored, n, modes) == x.tobytes()
    assert bytes(huffman_decode(stored, n)) == x.tobytes()
    # Encoder choices: CONSTANT exactly for one-symbol blocks, never Huffman for those.
    for i, mode in enumerate(modes):
        distinct = len(np.unique(x[i * block : (i + 1) * block]))
        assert (mode == CONSTANT) == (distinct == 1)


def test_hand_built_stream() -> None:
    """A stream built by hand from the spec decodes as specified (pins bit order and code order)."""
    # Block of 10 symbols, code lengths a=1, b=2, c=3, d=3 (canonical: a=0, b=10, c=110, d=111).
    symbols = b"abcdabcdaa"
    codes = {ord("a"): "0", ord("b"): "10", ord("c"): "110", ord("d"): "111"}
    streams = []
    for k in range(4):
        bits = "".join(codes[symbols[i]] for i in range(10) if (i // 2) % 4 == k)
        bits += "0" * (-len(bits) % 8)
        # LSB-first: stream bit j is bit j % 8 of byte j // 8.
        streams.append(bytes(int(bits[j : j + 8][::-1], 2) for j in range(0, len(bits), 8)))
    # Range table: symbols 'a'..'d' (97..100), nibbles low first: (1, 2), (3, 3).
    body = bytes([RANGE, 97, 100, 0x21, 0x33]) + b"".join(len(s).to_bytes(2, "little") for s in streams)
    stored = bytes([1]) + (10).to_bytes(8, "little") + (64).to_bytes(4, "little") + body + b"".join(streams)
    assert reference_decode(stored, 10) == symbols
    assert bytes(huffman_decode(stored, 10)) == symbols
    # The same block with a list table.
    listed = bytes([LIST, 3, 97, 1, 98, 2, 99, 3, 100, 3]) + body[5:]
    stored = stored[:HEADER_BYTES] + listed + b"".join(streams)
    assert bytes(huffman_decode(stored, 10)) == symbols == reference_decode(stored, 10)


# ---------------------------------------------------------------------------------------------------
# Code construction


def _huffman_cost(counts: list[int]) -> int:
    """Total bits of an (unlimited) Huffman code for ``counts`` (positive, at least two)."""
    heap = list(counts)
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        cost += merged
        heapq.heappush(heap, merged)
    return cost


def _check_code(counts: np.ndarray, lengths: np.ndarray, max_bits: int) -> None:
    used = counts > 0
    assert (lengths[~used] == 0).all()
    assert (lengths[used] >= 1).all() and lengths.max() <= max_bits
    assert sum(1 << (max_bits - int(ln)) for ln in lengths[used]) == 1 << max_bits  # Kraft sum exactly 1
    # More frequent symbols never get longer codes.
    order = np.argsort(counts[used], kind="stable")
    assert (np.diff(lengths[used][order]) <= 0).all()


count_arrays = st.one_of(
    st.lists(st.integers(0, 10**6), min_size=2, max_size=256),
    st.lists(st.integers(0, 3), min_size=2, max_size=256),
    st.integers(2, 60).map(lambda k: [round(1.618**i) for i in range(k)]),  # Fibonacci-like
    st.integers(2, 45).map(lambda k: [2**i for i in range(k)]),
)


@SETTINGS
@given(counts=count_arrays, max_bits=st.sampled_from([MAX_CODE_BITS, MAX_CODE_BITS, 8, 6, 4]))
def test_code_lengths_complete_and_limited(counts: list[int], max_bits: int) -> None:
    """Lengths satisfy Kraft with equality, respect the limit, and are Huffman's when that fits."""
    c = np.array(counts, dtype=np.int64)
    used = int(np.count_nonzero(c))
    if used > 1 << max_bits:
        with pytest.raises(ValueError):
            code_lengths(c, max_bits)
        return
    lengths = code_lengths(c, max_bits)
    if used < 2:
        assert lengths.sum() == used
        return
    _check_code(c, lengths, max_bits)
    cost = int((c * lengths).sum())
    huffman = _huffman_cost([int(v) for v in c if v])
    if lengths.max() < max_bits:  # the limit did not bind: this must be a Huffman code
        assert cost == huffman
    else:
        assert cost >= huffman
        if used <= 6:  # when it binds, the rebalanced code stays near the best limited code
            assert cost <= 1.2 * _best_limited_cost(c[c > 0], max_bits)


def _best_limited_cost(counts: np.ndarray, max_bits: int) -> int:
    """Brute force: the cheapest complete code with lengths <= max_bits for a few symbols."""
    c = sorted(counts.tolist(), reverse=True)
    return min(sum(ci * li for ci, li in zip(c, lens, strict=True))
               for lens in itertools.combinations_with_replacement(range(1, max_bits + 1), len(c))
               if sum(1 << (max_bits - ln) for ln in lens) == 1 << max_bits)


def test_fibonacci_block_is_length_limited() -> None:
    """Fibonacci frequencies want codes longer than MAX_CODE_BITS; the stream stays valid."""
    x = _fibonacci_stream(20_000, 30, np.random.default_rng(5))
    counts = np.bincount(x, minlength=256)
    lengths = code_lengths(counts)
    assert lengths.max() == MAX_CODE_BITS
    _check_code(counts, lengths, MAX_CODE_BITS)
    stored = huffman_encode(x)
    assert reference_decode(stored.tobytes(), x.size) == x.tobytes()


# ---------------------------------------------------------------------------------------------------
# Sizes


def test_all_zeros_is_tiny() -> None:
    """A million zero bytes: one CONSTANT block (2 bytes) per 32K symbols."""
    x = np.zeros(1_000_000, dtype=np.uint8)
    stored = huffman_encode(x)
    assert stored.size == HEADER_BYTES + 2 * _block_count(x.size, BLOCK_SYMBOLS) <= 100
    np.testing.assert_array_equal(huffman_decode(stored, x.size), x)


def test_random_bytes_fall_back_to_raw() -> None:
    """Incompressible data costs one mode byte per block over the raw size."""
    x = np.random.default_rng(1).integers(0, 256, 100_001, dtype=np.uint8)
    stored = huffman_encode(x)
    assert stored.size == HEADER_BYTES + _block_count(x.size, BLOCK_SYMBOLS) + x.size
    np.testing.assert_array_equal(huffman_decode(stored, x.size), x)


def test_two_symbols_use_one_bit_each() -> None:
    """A 99/1 two-symbol stream is coded with one bit per symbol (Huffman's floor), not raw."""
    x = _symbols("two", 100_000, 2)
    stored = huffman_encode(x)
    modes: list[int] = []
    reference_decode(stored.tobytes(), x.size, modes)
    assert set(modes) <= {LIST, RANGE}
    assert stored.size <= x.size / 8 + 20 * len(modes) + HEADER_BYTES


def test_close_to_block_entropy() -> None:
    """Exponent bytes of Gaussian weights cost within 2.5% of the per-block order-0 entropy."""
    x = _symbols("weights", 8 * BLOCK_SYMBOLS, 3)
    entropy_bits = 0.0
    for start in range(0, x.size, BLOCK_SYMBOLS):
        h = np.bincount(x[start : start + BLOCK_SYMBOLS])
        p = h[h > 0] / h.sum()
        entropy_bits -= float((h[h > 0] * np.log2(p)).sum())
    assert 8 * huffman_encode(x).size <= 1.025 * entropy_bits


# ---------------------------------------------------------------------------------------------------
# Malformed input: always a ValueError (never a crash), and the same verdict as the reference


def _mixed_stream() -> tuple[np.ndarray, bytes]:
    """Blocks of every mode: RAW, CONSTANT, Huffman with a range table and with a list table."""
    rng = np.random.default_rng(11)
    x = np.concatenate([
        rng.integers(0, 256, 64, dtype=np.uint8),                            # RAW
        np.full(64, 9, dtype=np.uint8),                                      # CONSTANT
        _exponent_bytes(rng.standard_normal(64) * 0.02),                     # range table
        np.where(rng.random(64) < 0.2, 3, 250).astype(np.uint8),             # list table (far apart)
        _exponent_bytes(rng.standard_normal(37) * 0.02),                     # short last block
    ])
    stored = huffman_encode(x, 64).tobytes()
    modes: list[int] = []
    reference_decode(stored, x.size, modes)
    assert modes == [RAW, CONSTANT, RANGE, LIST, RANGE]
    return x, stored


def test_every_truncation_is_rejected() -> None:
    x, stored = _mixed_stream()
    for cut in range(len(stored)):
        with pytest.raises(ValueError):
            huffman_decode(stored[:cut], x.size)
    with pytest.raises(ValueError):
        huffman_decode(stored + b"\0", x.size)


def test_every_byte_flip_matches_reference() -> None:
    """Flipping any single bit gives the kernel and the reference the same verdict and output."""
    x, stored = _mixed_stream()
    for pos in range(len(stored)):
        for bit in (0, 3, 7):
            damaged = bytearray(stored)
            damaged[pos] ^= 1 << bit
            expected = _outcome(reference_decode, bytes(damaged), x.size)
            assert _outcome(huffman_decode, bytes(damaged), x.size) == expected, (pos, bit)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), n=st.integers(1, 600), block=st.sampled_from([16, 64, 200, 4096]),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.sampled_from("xsid")),
                      min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_random_damage_matches_reference(kind: str, n: int, block: int, edits: list, seed: int) -> None:
    """Random overwrites, XORs, insertions and deletions: kernel and reference agree (or both refuse)."""
    x = _symbols(kind, n, seed)
    damaged = bytearray(huffman_encode(x, block).tobytes())
    for where, value, op in edits:
        i = where % (len(damaged) + 1)
        if op == "x" and i < len(damaged):
            damaged[i] ^= value or 1
        elif op == "s" and i < len(damaged):
            damaged[i] = value
        elif op == "i":
            damaged.insert(i, value)
        elif op == "d" and i < len(damaged):
            del damaged[i]
    stored = bytes(damaged)
    assert _outcome(huffman_decode, stored, n) == _outcome(reference_decode, stored, n)


def _header(n: int, block: int, version: int = 1) -> bytes:
    return bytes([version]) + n.to_bytes(8, "little") + block.to_bytes(4, "little")


def _range_block(first: int, nibbles: bytes, stream_lengths: list[int], payload: bytes) -> bytes:
    """A Huffman block with a range table over ``2 * len(nibbles)`` symbols from ``first``."""
    last = first + 2 * len(nibbles) - 1
    return (bytes([RANGE, first, last]) + nibbles
            + b"".join(v.to_bytes(2, "little") for v in stream_lengths) + payload)


@pytest.mark.parametrize(("what", "stored", "n"), [
    ("empty", b"", 0),
    ("short header", _header(0, 64)[:12], 0),
    ("version 0", _header(0, 64, version=0), 0),
    ("version 2", _header(0, 64, version=2), 0),
    ("block size 0", _header(0, 0), 0),
    ("block size too large", _header(0, MAX_BLOCK_SYMBOLS + 1), 0),
    ("count mismatch", _header(5, 64) + bytes([CONSTANT, 1]), 4),
    ("huge count", _header(2**63 - 1, MAX_BLOCK_SYMBOLS) + bytes([CONSTANT, 1]), 2**63 - 1),
    ("no blocks", _header(5, 64), 5),
    ("unknown mode", _header(4, 64) + bytes([4, 0, 0, 0, 0]), 4),
    ("mode 255", _header(4, 64) + bytes([255, 0, 0, 0, 0]), 4),
    ("raw block short", _header(4, 64) + bytes([RAW, 1, 2, 3]), 4),
    ("constant without symbol", _header(4, 64) + bytes([CONSTANT]), 4),
    ("trailing byte", _header(4, 64) + bytes([CONSTANT, 1, 0]), 4),
    ("second block missing", _header(70, 64) + bytes([CONSTANT, 1]), 70),
    # 2 symbols 'a' 'b' with lengths 1, 1; block of 2 symbols: sub-stream 0 holds both (bits 0, 1).
    ("list of one symbol", _header(2, 64) + bytes([LIST, 0, 97, 1]) + bytes(8), 2),
    ("list symbols not increasing",
     _header(2, 64) + bytes([LIST, 1, 98, 1, 97, 1, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("list length 0", _header(2, 64) + bytes([LIST, 1, 97, 0, 98, 1, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("list length 12", _header(2, 64) + bytes([LIST, 1, 97, 12, 98, 1, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("list Kraft < 1", _header(2, 64) + bytes([LIST, 1, 97, 1, 98, 2, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("list Kraft > 1", _header(2, 64) + bytes([LIST, 2, 97, 1, 98, 1, 99, 1, 1, 0, 0, 0, 0, 0, 0, 0, 2]),
     2),
    ("range first == last", _header(2, 64) + bytes([RANGE, 97, 97, 0x11, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("range of one used symbol", _header(2, 64) + _range_block(97, bytes([0x01]), [1, 0, 0, 0],
                                                                bytes([0])), 2),
    ("range nibble 12", _header(2, 64) + _range_block(97, bytes([0xC1]), [1, 0, 0, 0], bytes([2])), 2),
    ("range spare nibble", _header(2, 64) + bytes([RANGE, 97, 99, 0x11, 0x10, 1, 0, 0, 0, 0, 0, 0, 0, 2]), 2),
    ("payload longer than data", _header(2, 64) + _range_block(97, bytes([0x11]), [3, 0, 0, 0], bytes([2])),
     2),
    ("payload byte left over", _header(2, 64) + _range_block(97, bytes([0x11]), [2, 0, 0, 0], bytes([2, 0])),
     2),
    ("padding bits set", _header(2, 64) + _range_block(97, bytes([0x11]), [1, 0, 0, 0], bytes([0x82])), 2),
    ("empty sub-stream with bytes", _header(2, 64) + _range_block(97, bytes([0x11]), [1, 1, 0, 0],
                                                                   bytes([2, 0])), 2),
    ("sub-stream too short", _header(2, 64) + _range_block(97, bytes([0x11]), [0, 0, 0, 0], b""), 2),
])
def test_malformed_streams(what: str, stored: bytes, n: int) -> None:
    """Each hand-made defect is a ValueError for both the kernel and the reference."""
    with pytest.raises(ValueError):
        huffman_decode(stored, n)
    with pytest.raises(ValueError):
        reference_decode(stored, n)


def test_valid_hand_made_block_passes() -> None:
    """The well-formed twin of the malformed cases above decodes ('a' = 0, 'b' = 1 -> bits 0, 1)."""
    stored = _header(2, 64) + _range_block(97, bytes([0x11]), [1, 0, 0, 0], bytes([0b10]))
    assert reference_decode(stored, 2) == b"ab" == bytes(huffman_decode(stored, 2))


def test_input_types_and_arguments() -> None:
    """bytes, bytearray, memoryviews (strided too) and arrays decode alike; bad arguments are refused."""
    x = _symbols("weights", 5000, 4)
    stored = huffman_encode(x)
    padded = np.zeros(2 * stored.size, dtype=np.uint8)
    padded[::2] = stored
    for form in (stored, stored.tobytes(), bytearray(stored.tobytes()), memoryview(stored.tobytes()),
                 memoryview(padded)[::2], padded[::2]):
        np.testing.assert_array_equal(huffman_decode(form, x.size), x)
    with pytest.raises(ValueError):
        huffman_decode(stored, x.size, out=np.empty(x.size + 1, dtype=np.uint8))
    with pytest.raises(ValueError):
        huffman_decode(stored, x.size, out=np.empty(x.size, dtype=np.int16))
    with pytest.raises(TypeError):
        huffman_encode(x.astype(np.int16))
    with pytest.raises(ValueError):
        huffman_encode(x, MAX_BLOCK_SYMBOLS + 1)
    with pytest.raises(ValueError):
        huffman_encode(x, 0)
    np.testing.assert_array_equal(huffman_encode(x), stored)  # deterministic
