"""Block-adaptive canonical Huffman coding of byte streams.

The exponent plane of trained fp32 weights and optimizer moments has only
2.5-3.5 bits of order-0 entropy per byte, and its distribution drifts along
the tensor. An order-0 coder with a fresh code every block captures nearly
all of that at several times zstd's speed: no match search, one table lookup
per symbol. Each block's symbols are split into four sub-streams so the
decoder can run four independent bit readers at once (instruction-level
parallelism), which is what makes decoding fast.

The stream format is specified in docs/FORMAT.md, section 3.1; the
encoder's choices and what a decoder must reject are listed there too.

Implementation notes. The encoder takes exact per-sub-stream histograms
first, so it knows every size before writing and never backtracks; for
small alphabets (most exponent planes) it codes two symbols per table
lookup. The decoder keeps four bit readers in lock step; each round loads 8
bytes at each reader's bit position and resolves four codes with one
lookup each in a ``2**MAX_CODE_BITS``-entry table of (symbol, length).
Rounds run without per-load checks only while all loads stay inside the
input; the last symbols of a block go through a bounds-checked path, and
the end-of-sub-stream checks catch readers that strayed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from deltackpt.kernels.spans import copy_span

#: Default number of symbols per block: small enough to follow a drifting distribution, large enough
#: that the code table (usually 20-30 bytes for an exponent plane) costs well under 1%.
BLOCK_SYMBOLS = 32768
#: Largest block size the format allows (keeps sub-stream lengths within u16).
MAX_BLOCK_SYMBOLS = 65536
#: Longest code length. 11 keeps the decode table at 4 KiB, lets one 8-byte load serve four codes
#: whatever the bit offset (7 + 4*11 <= 64) and two codes fit the encoder's 32-bit pair entries.
MAX_CODE_BITS = 11
FORMAT_VERSION = 1
HEADER_BYTES = 13

MODE_RAW = 0
MODE_CONSTANT = 1
MODE_HUFFMAN_LIST = 2
MODE_HUFFMAN_RANGE = 3

_N_STREAMS = 4
_TABLE_SIZE = 1 << MAX_CODE_BITS
_MASK = np.uint64(_TABLE_SIZE - 1)
_PAIR_MAX_SYMBOLS = 64  # larger alphabets make the encoder's pair table too costly to build
_U1 = np.uint64(1)
_U2 = np.uint64(2)
_U3 = np.uint64(3)
_U4 = np.uint64(4)
_U5 = np.uint64(5)
_U6 = np.uint64(6)
_U7 = np.uint64(7)
_U8 = np.uint64(8)
_U16 = np.uint64(16)
_U24 = np.uint64(24)
_U32 = np.uint64(32)
_U40 = np.uint64(40)
_U48 = np.uint64(48)
_U56 = np.uint64(56)
_BYTE = np.uint64(0xFF)

# Decoder status codes (kernel return values); messages in _ERRORS.
_OK = 0
_ERR_TRUNCATED = 1
_ERR_MODE = 2
_ERR_TABLE = 3
_ERR_KRAFT = 4
_ERR_PAYLOAD = 5
_ERR_TRAILING = 6
_ERRORS = {
    _ERR_TRUNCATED: "stream ends inside the block",
    _ERR_MODE: "unknown block mode",
    _ERR_TABLE: "invalid code length table",
    _ERR_KRAFT: "code lengths do not form a complete prefix code (Kraft sum != 1)",
    _ERR_PAYLOAD: "sub-stream does not decode to exactly its byte length with zero padding",
    _ERR_TRAILING: "bytes follow the last block",
}


# ---------------------------------------------------------------------------------------------------
# Small helpers (inlined). Indices are unsigned so Numba emits no negative-index wraparound code, which
# lets LLVM merge the byte-wise loads and stores below into single 2- and 8-byte moves.


@njit(inline="always")
def _load16(b: np.ndarray, p: np.uint64) -> np.uint64:
    return np.uint64(b[p]) | (np.uint64(b[p + _U1]) << _U8)


@njit(inline="always")
def _load64(b: np.ndarray, p: np.uint64) -> np.uint64:
    return (np.uint64(b[p]) | (np.uint64(b[p + _U1]) << _U8) | (np.uint64(b[p + _U2]) << _U16)
            | (np.uint64(b[p + _U3]) << _U24) | (np.uint64(b[p + _U4]) << _U32)
            | (np.uint64(b[p + _U5]) << _U40) | (np.uint64(b[p + _U6]) << _U48)
            | (np.uint64(b[p + _U7]) << _U56))


@njit(inline="always")
def _store64(b: np.ndarray, p: np.uint64, x: np.uint64) -> None:
    b[p] = np.uint8(x & _BYTE)
    b[p + _U1] = np.uint8((x >> _U8) & _BYTE)
    b[p + _U2] = np.uint8((x >> _U16) & _BYTE)
    b[p + _U3] = np.uint8((x >> _U24) & _BYTE)
    b[p + _U4] = np.uint8((x >> _U32) & _BYTE)
    b[p + _U5] = np.uint8((x >> _U40) & _BYTE)
    b[p + _U6] = np.uint8((x >> _U48) & _BYTE)
    b[p + _U7] = np.uint8(x >> _U56)


@njit(inline="always")
def _reverse_bits(code: int, length: int) -> int:
    """The low ``length`` (<= 16) bits of ``code`` in reverse order."""
    x = code
    x = ((x & 0x5555) << 1) | ((x >> 1) & 0x5555)
    x = ((x & 0x3333) << 2) | ((x >> 2) & 0x3333)
    x = ((x & 0x0F0F) << 4) | ((x >> 4) & 0x0F0F)
    x = ((x & 0x00FF) << 8) | ((x >> 8) & 0x00FF)
    return x >> (16 - length)


@njit(inline="always")
def _stream_count(m: int, k: int) -> int:
    """Number of symbols of sub-stream ``k`` in a block of ``m`` symbols."""
    return 2 * (m // 8) + min(2, max(0, m % 8 - 2 * k))


# ---------------------------------------------------------------------------------------------------
# Code construction


@njit(cache=True, nogil=True)
def _huffman_sorted(w: np.ndarray, n: int) -> None:
    """Unlimited Huffman code lengths, in place, for ascending weights ``w[:n]`` (``n >= 2``).

    Moffat and Katajainen's in-place algorithm ("In-place calculation of
    minimum-redundancy codes", 1995): O(n), no allocation. On return ``w[i]``
    is the length of the i-th lightest symbol (non-increasing in ``i``).
    """
    w[0] += w[1]
    root = 0
    leaf = 2
    for nxt in range(1, n - 1):
        if leaf >= n or w[root] < w[leaf]:  # first child: an internal node or a leaf
            w[nxt] = w[root]
            w[root] = nxt
            root += 1
        else:
            w[nxt] = w[leaf]
            leaf += 1
        if leaf >= n or (root < nxt and w[root] < w[leaf]):  # second child
            w[nxt] += w[root]
            w[root] = nxt
            root += 1
        else:
            w[nxt] += w[leaf]
            leaf += 1
    w[n - 2] = 0  # parent pointers to internal node depths
    for nxt in range(n - 3, -1, -1):
        w[nxt] = w[w[nxt]] + 1
    avail = 1  # internal node depths to leaf depths
    used = 0
    depth = 0
    root = n - 2
    nxt = n - 1
    while avail > 0:
        while root >= 0 and w[root] == depth:
            used += 1
            root -= 1
        while avail > used:
            w[nxt] = depth
            nxt -= 1
            avail -= 1
        avail = 2 * used
        depth += 1
        used = 0


@njit(cache=True, nogil=True)
def _limit_lengths(w: np.ndarray, n: int, max_bits: int, bl_count: np.ndarray) -> None:
    """Rebalance complete-code lengths ``w[:n]`` (non-increasing) so none exceeds ``max_bits``.

    The length-limiting step of JPEG (ITU-T T.81, Annex K.3, "Adjust_BITS")
    on the count of codes per length: while codes longer than the limit
    exist, two sibling leaves at the deepest level I become one leaf at I-1,
    and a leaf at the deepest level J < I-1 that has one is split into two at
    J+1. Each step keeps the Kraft sum at exactly 1 and the symbol count, so
    the result is a complete code; the lengths are then dealt back shortest
    to the heaviest symbols. Needs ``n <= 2**max_bits`` and ``bl_count`` of
    at least ``max(w[0], max_bits) + 1`` entries. On exponent planes this
    costs 0.002-0.06% more bits than the optimal limited code (package-merge)
    for a fraction of its time.
    """
    deepest = w[0]
    for i in range(max(deepest, max_bits) + 1):
        bl_count[i] = 0
    for i in range(n):
        bl_count[w[i]] += 1
    level = deepest
    while level > max_bits:
        if bl_count[level] > 0:
            j = level - 2
            while bl_count[j] == 0:
                j -= 1
            bl_count[level] -= 2
            bl_count[level - 1] += 1
            bl_count[j + 1] += 2
            bl_count[j] -= 1
        else:
            level -= 1
    i = 0
    for ln in range(max_bits, 0, -1):
        for _ in range(bl_count[ln]):
            w[i] = ln
            i += 1


@njit(cache=True, nogil=True)
def _code_lengths(counts: np.ndarray, max_bits: int, lengths: np.ndarray, keys: np.ndarray,
                  work: np.ndarray) -> int:
    """Code lengths of at most ``max_bits`` for the symbols with ``counts > 0``.

    Writes ``lengths`` (0 for unused symbols) and returns the number of used
    symbols; ``keys`` and ``work`` are scratch of ``len(counts)`` and
    ``2 * len(counts)`` int64. One used symbol gets length 1 (callers code
    that case as CONSTANT); more need ``2**max_bits >= used``. The code is a
    Huffman code, so optimal, whenever its longest length fits; otherwise it
    is rebalanced by :func:`_limit_lengths`. Either way it is complete.
    """
    n_sym = counts.shape[0]
    used = 0
    for s in range(n_sym):
        lengths[s] = 0
        if counts[s] > 0:
            keys[used] = np.int64(counts[s]) * n_sym + s  # unique keys make the order deterministic
            used += 1
    if used == 0:
        return 0
    if used == 1:
        lengths[keys[0] % n_sym] = 1
        return 1
    # Shell sort (Ciura's gaps): as fast as insertion sort on the ~20-40 symbols of exponent planes,
    # fine up to 256, and much cheaper to compile than Numba's np.sort.
    for gap in (132, 57, 23, 10, 4, 1):
        for i in range(gap, used):
            x = keys[i]
            j = i
            while j >= gap and keys[j - gap] > x:
                keys[j] = keys[j - gap]
                j -= gap
            keys[j] = x
    for r in range(used):
        work[r] = keys[r] // n_sym
    # np.int64() keeps Numba from typing (and compiling) callees for literal argument values.
    _huffman_sorted(work, np.int64(used))
    if work[0] > max_bits:
        _limit_lengths(work, np.int64(used), np.int64(max_bits), work[n_sym:])
    for r in range(used):
        lengths[keys[r] % n_sym] = work[r]
    return used


@njit(cache=True, nogil=True)
def _canonical_codes(lengths: np.ndarray, lo: int, hi: int, codes: np.ndarray, next_code: np.ndarray) -> None:
    """Canonical codes (DEFLATE order), bit-reversed for LSB-first output, into ``codes[lo:hi+1]``.

    Symbols outside ``lo..hi`` must be unused; ``next_code`` is scratch of at
    least ``MAX_CODE_BITS + 2`` int64.
    """
    for i in range(MAX_CODE_BITS + 2):
        next_code[i] = 0
    for s in range(lo, hi + 1):
        next_code[lengths[s] + 1] += 1  # count of each length, shifted by one
    next_code[1] = 0  # unused symbols (length 0) take no code space
    code = 0
    for bits in range(1, MAX_CODE_BITS + 1):
        code = (code + next_code[bits]) << 1
        next_code[bits] = code
    for s in range(lo, hi + 1):
        ln = lengths[s]
        codes[s] = _reverse_bits(next_code[ln], ln)
        next_code[ln] += 1


# ---------------------------------------------------------------------------------------------------
# Encoder


@njit(cache=True, nogil=True)
def _histograms(src: np.ndarray, a: int, m: int, sub: np.ndarray, hist: np.ndarray) -> None:
    """``hist[k]`` = byte histogram of sub-stream ``k`` of the block ``src[a:a+m]``.

    Counts go to eight sub-histograms by position mod 8 (``sub``, scratch),
    read eight bytes at a time; runs of one byte then update different
    counters instead of serializing on one. Sub-stream ``k`` holds positions
    ``2k`` and ``2k+1`` mod 8.
    """
    for r in range(8):
        for s in range(256):
            sub[r, s] = 0
    p = np.uint64(a)
    for _ in range(m // 8):
        w = _load64(src, p)
        sub[0, w & _BYTE] += 1
        sub[1, (w >> _U8) & _BYTE] += 1
        sub[2, (w >> _U16) & _BYTE] += 1
        sub[3, (w >> _U24) & _BYTE] += 1
        sub[4, (w >> _U32) & _BYTE] += 1
        sub[5, (w >> _U40) & _BYTE] += 1
        sub[6, (w >> _U48) & _BYTE] += 1
        sub[7, w >> _U56] += 1
        p += _U8
    for r in range(m % 8):
        sub[r, src[a + m // 8 * 8 + r]] += 1
    for k in range(_N_STREAMS):
        for s in range(256):
            hist[k, s] = sub[2 * k, s] + sub[2 * k + 1, s]


@njit(cache=True, nogil=True)
def _is_constant(src: np.ndarray, a: int, m: int) -> bool:
    """Whether ``src[a:a+m]`` repeats one byte; compares 8 bytes at a time and stops at a difference."""
    first = src[a]
    word = np.uint64(first) * np.uint64(0x0101010101010101)
    p = np.uint64(a)
    for _ in range(m // 8):
        if _load64(src, p) != word:
            return False
        p += _U8
    for i in range(a + m // 8 * 8, a + m):  # noqa: SIM110 - an explicit loop for Numba
        if src[i] != first:
            return False
    return True


@njit(inline="always")
def _flush(out: np.ndarray, pos: int, acc: np.uint64, nb: int) -> tuple[int, np.uint64, int]:
    """Store the accumulator (8 bytes wide) and drop its whole bytes."""
    _store64(out, np.uint64(pos), acc)
    return pos + (nb >> 3), acc >> np.uint64(nb & 56), nb & 7


@njit(cache=True, nogil=True)
def _encode_rest(src: np.ndarray, p: np.uint64, rest: int, codes: np.ndarray, lengths: np.ndarray,
                 out: np.ndarray, pos: int, acc: np.uint64, nb: int) -> int:
    """Code the last ``rest`` (< 4) symbols of a sub-stream one by one and flush; return the end."""
    for j in range(rest):
        s = src[p + np.uint64(8 * (j >> 1) + (j & 1))]
        acc |= codes[s] << np.uint64(nb)
        nb += np.int64(lengths[s])
        pos, acc, nb = _flush(out, pos, acc, nb)
    if nb:
        _store64(out, np.uint64(pos), acc)
        pos += 1
    return pos


@njit(cache=True, nogil=True)
def _encode_single(src: np.ndarray, i: int, count: int, codes: np.ndarray, lengths: np.ndarray,
                   out: np.ndarray, pos: int) -> int:
    """Write the codewords of one sub-stream at ``out[pos:]``; return the end position.

    The sub-stream's ``count`` symbols are the byte pairs at ``src[i:i+2],
    src[i+8:i+10], ...`` (the last pair may be cut short by ``count``).
    ``codes`` holds the bit-reversed codes. Stores are 8 bytes wide and may
    run up to 7 bytes past the returned position (the caller overwrites or
    trims them).
    """
    acc = np.uint64(0)
    nb = 0
    p = np.uint64(i)
    for _ in range(count // 4):  # two pairs, at most 44 bits, per flush
        for d in (0, 1, 8, 9):
            s = src[p + np.uint64(d)]
            acc |= codes[s] << np.uint64(nb)
            nb += np.int64(lengths[s])
        pos, acc, nb = _flush(out, pos, acc, nb)
        p += _U16
    return _encode_rest(src, p, count % 4, codes, lengths, out, pos, acc, nb)


@njit(cache=True, nogil=True)
def _encode_pairs(src: np.ndarray, i: int, count: int, pair_codes: np.ndarray, pair_lengths: np.ndarray,
                  codes: np.ndarray, lengths: np.ndarray, out: np.ndarray, pos: int) -> int:
    """Same output as :func:`_encode_single`, one lookup per pair of symbols.

    ``pair_codes[x]``/``pair_lengths[x]`` hold the concatenated codewords of
    the byte pair read little-endian as ``x`` (valid for used symbols only).
    """
    acc = np.uint64(0)
    nb = 0
    p = np.uint64(i)
    for _ in range(count // 4):  # two pairs, at most 44 bits, per flush
        x = _load16(src, p)
        acc |= np.uint64(pair_codes[x]) << np.uint64(nb)
        nb += np.int64(pair_lengths[x])
        x = _load16(src, p + _U8)
        acc |= np.uint64(pair_codes[x]) << np.uint64(nb)
        nb += np.int64(pair_lengths[x])
        pos, acc, nb = _flush(out, pos, acc, nb)
        p += _U16
    return _encode_rest(src, p, count % 4, codes, lengths, out, pos, acc, nb)


@njit(cache=True, nogil=True)
def _encode_kernel(src: np.ndarray, block: int, out: np.ndarray) -> int:
    """Encode ``src`` into ``out`` (worst-case size plus 8 bytes slack); return the stored size."""
    n = src.shape[0]
    out[0] = FORMAT_VERSION
    _store64(out, _U1, np.uint64(n))
    for k in range(4):
        out[9 + k] = np.uint8((block >> (8 * k)) & 0xFF)
    pos = HEADER_BYTES
    sub = np.zeros((8, 256), dtype=np.uint32)
    hist = np.zeros((_N_STREAMS, 256), dtype=np.int64)
    total = np.zeros(256, dtype=np.int64)
    lengths = np.zeros(256, dtype=np.int64)
    keys = np.zeros(256, dtype=np.int64)
    work = np.zeros(512, dtype=np.int64)
    codes = np.zeros(256, dtype=np.int64)
    scratch = np.zeros(32, dtype=np.int64)
    used_syms = np.zeros(256, dtype=np.int64)
    enc_codes = np.zeros(256, dtype=np.uint64)
    enc_lengths = np.zeros(256, dtype=np.uint8)
    pair_codes = np.empty(0, dtype=np.uint32)
    pair_lengths = np.empty(0, dtype=np.uint8)
    stream_bytes = np.zeros(_N_STREAMS, dtype=np.int64)
    for a in range(0, n, block):
        m = min(block, n - a)
        if _is_constant(src, a, m):  # all-zero tensors, masks...: skip the histogram
            out[pos] = MODE_CONSTANT
            out[pos + 1] = src[a]
            pos += 2
            continue
        _histograms(src, a, m, sub, hist)
        first = -1
        last = -1
        for s in range(256):
            total[s] = hist[0, s] + hist[1, s] + hist[2, s] + hist[3, s]
            if total[s]:
                if first < 0:
                    first = s
                last = s
        if first == last:
            out[pos] = MODE_CONSTANT
            out[pos + 1] = first
            pos += 2
            continue
        used = _code_lengths(total, np.int64(MAX_CODE_BITS), lengths, keys, work)
        list_cost = 1 + 2 * used
        range_cost = 2 + (last - first + 2) // 2
        size = 1 + min(list_cost, range_cost) + 2 * _N_STREAMS
        for k in range(_N_STREAMS):
            bits = 0
            for s in range(first, last + 1):
                bits += hist[k, s] * lengths[s]
            stream_bytes[k] = (bits + 7) >> 3
            size += stream_bytes[k]
        if size >= 1 + m:
            out[pos] = MODE_RAW
            copy_span(src, a, out, pos + 1, m)
            pos += 1 + m
            continue
        if range_cost <= list_cost:
            out[pos] = MODE_HUFFMAN_RANGE
            out[pos + 1] = first
            out[pos + 2] = last
            pos += 3
            for s in range(first, last + 1, 2):
                hi = lengths[s + 1] if s + 1 <= last else 0
                out[pos] = np.uint8(lengths[s] | (hi << 4))
                pos += 1
        else:
            out[pos] = MODE_HUFFMAN_LIST
            out[pos + 1] = used - 1
            pos += 2
            for s in range(first, last + 1):
                if lengths[s]:
                    out[pos] = s
                    out[pos + 1] = lengths[s]
                    pos += 2
        for k in range(_N_STREAMS):
            out[pos + 2 * k] = np.uint8(stream_bytes[k] & 0xFF)
            out[pos + 2 * k + 1] = np.uint8(stream_bytes[k] >> 8)
        pos += 2 * _N_STREAMS
        _canonical_codes(lengths, np.int64(first), np.int64(last), codes, scratch)
        nu = 0
        for s in range(first, last + 1):
            enc_codes[s] = codes[s]
            enc_lengths[s] = lengths[s]
            if lengths[s]:
                used_syms[nu] = s
                nu += 1
        # Pair table rows span first..last; building it pays off for the small alphabets of exponent
        # planes, while large ones would also spill it out of the L1 cache.
        pairs = nu <= _PAIR_MAX_SYMBOLS and 4 * nu * (last - first + 1) <= m
        if pairs:
            if pair_codes.shape[0] == 0:
                pair_codes = np.empty(1 << 16, dtype=np.uint32)
                pair_lengths = np.empty(1 << 16, dtype=np.uint8)
            for u in range(nu):  # row: second symbol; the inner loop runs along contiguous entries
                s2 = used_syms[u]
                row = s2 << 8
                c2 = enc_codes[s2]
                l2 = enc_lengths[s2]
                for s1 in range(first, last + 1):
                    pair_codes[row + s1] = np.uint32(enc_codes[s1] | (c2 << np.uint64(enc_lengths[s1])))
                    pair_lengths[row + s1] = enc_lengths[s1] + l2
        for k in range(_N_STREAMS):
            count = _stream_count(m, k)
            if pairs:
                end = _encode_pairs(src, a + 2 * k, count, pair_codes, pair_lengths, enc_codes, enc_lengths,
                                    out, pos)
            else:
                end = _encode_single(src, a + 2 * k, count, enc_codes, enc_lengths, out, pos)
            if end != pos + stream_bytes[k]:
                return -1  # internal inconsistency; cannot happen
            pos = end
    return pos


# ---------------------------------------------------------------------------------------------------
# Decoder


@njit(cache=True, nogil=True)
def _read_table(src: np.ndarray, pos: int, end: int, mode: int, lengths: np.ndarray) -> tuple[int, int]:
    """Parse a code length table at ``src[pos:end]`` into ``lengths``; return ``(status, new pos)``."""
    for s in range(256):
        lengths[s] = 0
    if mode == MODE_HUFFMAN_LIST:
        if pos >= end:
            return _ERR_TRUNCATED, pos
        count = np.int64(src[pos]) + 1
        pos += 1
        if count < 2:
            return _ERR_TABLE, pos
        if end - pos < 2 * count:
            return _ERR_TRUNCATED, pos
        prev = -1
        for _ in range(count):
            s = np.int64(src[pos])
            ln = np.int64(src[pos + 1])
            pos += 2
            if s <= prev or ln < 1 or ln > MAX_CODE_BITS:
                return _ERR_TABLE, pos
            lengths[s] = ln
            prev = s
        return _OK, pos
    if end - pos < 2:
        return _ERR_TRUNCATED, pos
    first = np.int64(src[pos])
    last = np.int64(src[pos + 1])
    pos += 2
    if first >= last:
        return _ERR_TABLE, pos
    span = last - first + 1
    n_bytes = (span + 1) // 2
    if end - pos < n_bytes:
        return _ERR_TRUNCATED, pos
    used = 0
    for r in range(span):
        ln = (np.int64(src[pos + r // 2]) >> (4 * (r & 1))) & 15
        if ln > MAX_CODE_BITS:
            return _ERR_TABLE, pos
        lengths[first + r] = ln
        if ln:
            used += 1
    if span & 1 and src[pos + n_bytes - 1] >> 4:
        return _ERR_TABLE, pos
    if used < 2:
        return _ERR_TABLE, pos
    return _OK, pos + n_bytes


@njit(cache=True, nogil=True)
def _build_decode_table(lengths: np.ndarray, codes: np.ndarray, scratch: np.ndarray,
                        table: np.ndarray) -> int:
    """Fill ``table[peek] = symbol | length << 8`` for a complete code; return a status.

    Kraft's equality guarantees every entry is written exactly once.
    """
    kraft = 0
    lo = 256
    hi = -1
    for s in range(256):
        if lengths[s]:
            kraft += 1 << (MAX_CODE_BITS - lengths[s])
            lo = min(lo, s)
            hi = s
    if kraft != _TABLE_SIZE:
        return _ERR_KRAFT
    _canonical_codes(lengths, np.int64(lo), np.int64(hi), codes, scratch)
    for s in range(lo, hi + 1):
        ln = lengths[s]
        if ln:
            entry = np.uint16(s | (ln << 8))
            for idx in range(codes[s], _TABLE_SIZE, 1 << ln):
                table[idx] = entry
    return _OK


@njit(cache=True, nogil=True)
def _decode_tail(src: np.ndarray, end: int, bitpos: int, table: np.ndarray, out: np.ndarray,
                 base: int, j: int, count: int) -> int:
    """Decode symbols ``j..count-1`` of a sub-stream with bounds-checked loads.

    Symbol ``t`` of the sub-stream goes to ``out[base + 8*(t//2) + t%2]``.
    ``bitpos`` is the absolute bit position of the next code in ``src``;
    bytes at or past ``end`` read as zeros. The final check rejects a stream
    that needed them, that has more than padding left, or whose padding is
    not zero.
    """
    for t in range(j, count):
        byte = bitpos >> 3
        acc = 0
        for k in range(min(3, max(0, end - byte))):  # a code plus the bit offset spans <= 3 bytes
            acc |= np.int64(src[byte + k]) << (8 * k)
        e = table[(acc >> (bitpos & 7)) & (_TABLE_SIZE - 1)]
        out[base + 8 * (t >> 1) + (t & 1)] = np.uint8(e & 0xFF)
        bitpos += np.int64(e >> 8)
    pad = end * 8 - bitpos
    if pad < 0 or pad > 7:
        return _ERR_PAYLOAD
    if pad and src[end - 1] >> (8 - pad):
        return _ERR_PAYLOAD
    return _OK


@njit(cache=True, nogil=True)
def _decode_streams(src: np.ndarray, p: int, stream_len: np.ndarray, table: np.ndarray,
                    out: np.ndarray, a: int, m: int) -> int:
    """Decode the four sub-streams of one Huffman block (payload at ``src[p:]``) into ``out[a:a+m]``."""
    e0 = p + stream_len[0]
    e1 = e0 + stream_len[1]
    e2 = e1 + stream_len[2]
    e3 = e2 + stream_len[3]
    b0, b1, b2, b3 = 8 * p, 8 * e0, 8 * e1, 8 * e2  # absolute bit positions of the readers
    groups = m // 8
    g = 0
    # Fast path: four readers in lock step, each decoding two pairs (16 output bytes in all) per round.
    # A refill loads 8 bytes at the reader's byte position, leaving >= 57 valid bits for 4 codes of at
    # most 11 bits. Loads may run past a reader's own sub-stream into whatever follows in ``src`` (the
    # end checks catch a reader that consumed too much); a round advances a reader by <= 44 bits, so
    # `room // 44 + 1` rounds keep every load inside ``src`` without checking each one.
    limit = 8 * src.shape[0] - 64
    while True:
        room = limit - max(b0, b1, b2, b3)
        rounds = min(room // 44 + 1, (groups - g) // 2)
        if room < 0 or rounds <= 0:
            break
        o = np.uint64(a + 8 * g)
        for _ in range(rounds):
            a0 = _load64(src, np.uint64(b0 >> 3)) >> np.uint64(b0 & 7)
            a1 = _load64(src, np.uint64(b1 >> 3)) >> np.uint64(b1 & 7)
            a2 = _load64(src, np.uint64(b2 >> 3)) >> np.uint64(b2 & 7)
            a3 = _load64(src, np.uint64(b3 >> 3)) >> np.uint64(b3 & 7)
            for d in (0, 1, 8, 9):
                x0 = table[a0 & _MASK]
                x1 = table[a1 & _MASK]
                x2 = table[a2 & _MASK]
                x3 = table[a3 & _MASK]
                out[o + np.uint64(d)] = np.uint8(x0 & 0xFF)
                out[o + np.uint64(d + 2)] = np.uint8(x1 & 0xFF)
                out[o + np.uint64(d + 4)] = np.uint8(x2 & 0xFF)
                out[o + np.uint64(d + 6)] = np.uint8(x3 & 0xFF)
                l0 = np.int64(x0 >> 8)
                l1 = np.int64(x1 >> 8)
                l2 = np.int64(x2 >> 8)
                l3 = np.int64(x3 >> 8)
                a0 >>= np.uint64(l0)
                a1 >>= np.uint64(l1)
                a2 >>= np.uint64(l2)
                a3 >>= np.uint64(l3)
                b0 += l0
                b1 += l1
                b2 += l2
                b3 += l3
            o += _U16
        g += 2 * rounds
    j = 2 * g
    err = _decode_tail(src, e0, b0, table, out, a, j, _stream_count(m, 0))
    err = max(err, _decode_tail(src, e1, b1, table, out, a + 2, j, _stream_count(m, 1)))
    err = max(err, _decode_tail(src, e2, b2, table, out, a + 4, j, _stream_count(m, 2)))
    return max(err, _decode_tail(src, e3, b3, table, out, a + 6, j, _stream_count(m, 3)))


@njit(cache=True, nogil=True)
def _decode_kernel(src: np.ndarray, n: int, block: int, out: np.ndarray) -> tuple[int, int]:
    """Decode the blocks after the header into ``out``; return ``(status, block index)``."""
    end = src.shape[0]
    pos = HEADER_BYTES
    lengths = np.zeros(256, dtype=np.int64)
    codes = np.zeros(256, dtype=np.int64)
    scratch = np.zeros(32, dtype=np.int64)
    table = np.zeros(_TABLE_SIZE, dtype=np.uint16)
    stream_len = np.zeros(_N_STREAMS, dtype=np.int64)
    bi = 0
    for a in range(0, n, block):
        m = min(block, n - a)
        if pos >= end:
            return _ERR_TRUNCATED, bi
        mode = src[pos]
        pos += 1
        if mode == MODE_RAW:
            if end - pos < m:
                return _ERR_TRUNCATED, bi
            copy_span(src, pos, out, a, m)
            pos += m
        elif mode == MODE_CONSTANT:
            if pos >= end:
                return _ERR_TRUNCATED, bi
            sym = src[pos]
            o = np.uint64(a)
            for i in range(m):  # unsigned indices: LLVM turns this into memset
                out[o + np.uint64(i)] = sym
            pos += 1
        elif MODE_HUFFMAN_LIST <= mode <= MODE_HUFFMAN_RANGE:
            err, pos = _read_table(src, pos, end, mode, lengths)
            if err:
                return err, bi
            err = _build_decode_table(lengths, codes, scratch, table)
            if err:
                return err, bi
            if end - pos < 2 * _N_STREAMS:
                return _ERR_TRUNCATED, bi
            payload = 0
            for k in range(_N_STREAMS):
                stream_len[k] = np.int64(src[pos + 2 * k]) | (np.int64(src[pos + 2 * k + 1]) << 8)
                payload += stream_len[k]
            pos += 2 * _N_STREAMS
            if end - pos < payload:
                return _ERR_TRUNCATED, bi
            err = _decode_streams(src, pos, stream_len, table, out, a, m)
            if err:
                return err, bi
            pos += payload
        else:
            return _ERR_MODE, bi
        bi += 1
    if pos != end:
        return _ERR_TRAILING, bi
    return _OK, bi


# ---------------------------------------------------------------------------------------------------
# Public API


def huffman_encode(symbols: np.ndarray, block_symbols: int = BLOCK_SYMBOLS) -> np.ndarray:
    """Encode a 1-d uint8 array into the stream format above; return the stored bytes (uint8).

    ``block_symbols`` (1..65536) trades adaptivity against table overhead;
    decoders read it from the header.
    """
    src = np.asarray(symbols)
    if src.dtype != np.uint8 or src.ndim != 1:
        raise TypeError(f"huffman_encode needs a 1-d uint8 array, got {src.dtype} with shape {src.shape}")
    if not 1 <= block_symbols <= MAX_BLOCK_SYMBOLS:
        raise ValueError(f"block_symbols must be in 1..{MAX_BLOCK_SYMBOLS}, got {block_symbols}")
    src = _readonly(np.ascontiguousarray(src))
    n = src.shape[0]
    n_blocks = -(-n // block_symbols)
    # RAW bounds every block at 1 + m bytes; 8 bytes of slack absorb the encoder's wide stores.
    out = np.empty(HEADER_BYTES + n_blocks + n + 8, dtype=np.uint8)
    size = _encode_kernel(src, block_symbols, out)
    if size < 0:
        raise RuntimeError("huffman_encode: internal size mismatch")
    # Trim in place: realloc gives the unused tail back without copying.
    out.resize(size, refcheck=False)
    return out


def read_header(stored: np.ndarray | memoryview | bytes) -> tuple[int, int]:
    """``(n_symbols, block_symbols)`` from a stream's header; ValueError if it is malformed."""
    buf = _as_bytes(stored)
    return _parse_header(buf)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: the kernels then see one array type whatever the caller passes (read-only
    buffers such as ``bytes`` would otherwise make Numba compile every kernel a second time)."""
    view = a.view()
    view.flags.writeable = False
    return view


def _as_bytes(stored: np.ndarray | memoryview | bytes) -> np.ndarray:
    """``stored`` as a read-only, contiguous 1-d uint8 array (copied only if not contiguous)."""
    if isinstance(stored, np.ndarray):
        if stored.dtype != np.uint8:
            raise TypeError(f"huffman stream must be uint8, got {stored.dtype}")
        return _readonly(np.ascontiguousarray(stored).reshape(-1))
    view = memoryview(stored)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return _readonly(np.frombuffer(view, dtype=np.uint8))


def _parse_header(buf: np.ndarray) -> tuple[int, int]:
    if buf.shape[0] < HEADER_BYTES:
        raise ValueError(f"huffman stream of {buf.shape[0]} bytes is shorter than its "
                         f"{HEADER_BYTES}-byte header")
    head = buf[:HEADER_BYTES].tobytes()
    if head[0] != FORMAT_VERSION:
        raise ValueError(f"huffman stream has version {head[0]}, expected {FORMAT_VERSION}")
    n = int.from_bytes(head[1:9], "little")
    block = int.from_bytes(head[9:13], "little")
    if not 1 <= block <= MAX_BLOCK_SYMBOLS:
        raise ValueError(f"huffman stream has block size {block}, expected 1..{MAX_BLOCK_SYMBOLS}")
    return n, block


def huffman_decode(stored: np.ndarray | memoryview | bytes, n_symbols: int,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Decode a stream that must hold exactly ``n_symbols`` symbols, into ``out`` if given.

    Raises ValueError if the stream is malformed, truncated, has trailing
    bytes or holds a different number of symbols. Reads and writes stay in
    bounds whatever the input.
    """
    buf = _as_bytes(stored)
    n, block = _parse_header(buf)
    if n != n_symbols:
        raise ValueError(f"huffman stream holds {n} symbols, expected {n_symbols}")
    n_blocks = -(-n // block)
    if buf.shape[0] < HEADER_BYTES + 2 * n_blocks:
        raise ValueError(f"huffman stream of {buf.shape[0]} bytes is too short for {n_blocks} blocks")
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (n,)
              and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"out must be a writable contiguous uint8 array of shape ({n},)")
    err, bi = _decode_kernel(buf, n, block, out)
    if err:
        where = "after the last block" if err == _ERR_TRAILING else f"in block {bi}"
        raise ValueError(f"corrupt huffman stream {where}: {_ERRORS[err]}")
    return out


def code_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Code lengths of at most ``max_bits`` for a histogram, as the encoder builds them.

    A Huffman code when its longest code fits, else a length-limited
    rebalancing of it; always complete (Kraft sum 1) for two or more used
    symbols.
    """
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("counts must be a 1-d array of non-negative integers")
    if max_bits < 1 or np.count_nonzero(counts) > (1 << max_bits):
        raise ValueError(f"{np.count_nonzero(counts)} symbols do not fit codes of {max_bits} bits")
    n_sym = counts.shape[0]
    lengths = np.zeros(n_sym, dtype=np.int64)
    _code_lengths(counts, max_bits, lengths, np.zeros(n_sym, np.int64), np.zeros(2 * n_sym, np.int64))
    return lengths
