"""rANS coding of a plane stream's planes (docs/FORMAT.md 3.2, *Plane coding*).

zstd codes a plane stream's bytes with order-0 Huffman codes: a whole number of bits a byte,
at least one, which costs most where a plane's bits are mostly 0 (high planes, Adam's first
moments), and it cannot tell apart bytes whose statistics differ by their place. Here each byte
is modelled as eight independent bits, one with probability ``p16 / 65536``, fixed per
*context*: its plane and, for ``bins`` above 1, which of ``bins`` equal parts of its block's
segment it lies in (a dither-grouped block orders its symbols by their dither offsets' size, so
a byte's place says how often its symbols are nonzero). The bytes are then coded by rANS
(Duda's asymmetric numeral systems) on that model's byte distribution, four interleaved states
so that the decoder's steps overlap; a context whose bytes are all zero costs nothing.

deltackpt's writers code so the chunks whose symbols are grouped by their dither (first
moments): on the fidelity matrix's cells those took 9-20% fewer bits than in zstd frames
(``bench/rate_bound.py``, docs/fidelity.md). Weights and second moments would gain 3-4%, for
a coder at a third to a half of zstd's speed at every link of a restore chain: they stay zstd
frames.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from deltackpt.kernels.planes import MAX_WIDTH, plane_starts

PROB_BITS = 12  # a byte's frequency is in units of 2**-PROB_BITS
STATE_LOW = 1 << 16  # every state lies in [STATE_LOW, 2**32) between steps
N_STATES = 4
STATE_BYTES = 4 * N_STATES  # the states' final values, where the body starts
MAX_BINS = 16
# Why a body is refused (``decode_planes``).
BODY_OK, BODY_SHORT, BODY_LONG, BODY_STATES = range(4)

_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], np.int64)
_SCALE = 1 << PROB_BITS
_MASK = np.uint64(_SCALE - 1)


@njit(cache=True, nogil=True)
def byte_freqs(p16: int) -> np.ndarray:
    """FORMAT.md 3.2's byte frequencies of model ``p16`` (1 to 65535), summing to 4096: each
    byte's probability as eight independent bits, in 32-bit fixed point, rounded down, at
    least 1; byte 0 (for ``p16 <= 32768``, else byte 255) takes what that leaves (always at
    least 1: tested for every ``p16``)."""
    freqs = np.empty(256, np.int64)
    for b in range(256):
        a = np.uint64(1) << np.uint64(32)
        for i in range(8):
            f = p16 if (b >> i) & 1 else 65536 - p16
            a = (a * np.uint64(f)) >> np.uint64(16)
        freqs[b] = max(1, np.int64((a * np.uint64(_SCALE)) >> np.uint64(32)))
    freqs[0 if p16 <= 32768 else 255] += _SCALE - freqs.sum()
    return freqs


@njit(cache=True, nogil=True)
def _runs(widths, n, block, bins, base):
    """The stream's plane bytes as runs ``(start, stop, context)`` in stream order (the planes
    start at ``base``): a plane is one run of context ``k`` for one bin; with more, each
    block's segment splits into ``bins`` runs, byte ``t`` of ``s`` in bin ``t * bins // s``."""
    starts = plane_starts(widths, n, block, base)
    top = 0
    for b in range(widths.shape[0]):
        top = max(top, np.int64(widths[b]))
    if bins == 1:
        runs = np.empty((top, 3), np.int64)
        for k in range(top):
            runs[k, 0], runs[k, 1], runs[k, 2] = starts[k], starts[k + 1], k
        return runs
    count = 0
    for b in range(widths.shape[0]):
        count += np.int64(widths[b]) * bins
    runs = np.empty((count, 3), np.int64)
    at = starts[:MAX_WIDTH].copy()
    r = 0
    for k in range(top):
        for b in range(widths.shape[0]):
            if widths[b] <= k:
                continue
            s = (min(block, n - b * block) + 7) // 8
            for c in range(bins):
                runs[r, 0] = at[k] + (c * s + bins - 1) // bins
                runs[r, 1] = at[k] + ((c + 1) * s + bins - 1) // bins
                runs[r, 2] = k * bins + c
                r += 1
            at[k] += s
    return runs


@njit(cache=True, nogil=True)
def _models(stream, runs, n_contexts):
    """Each context's model: 0 when its bytes are all zero, else the share of one bits in
    units of 2**-16, rounded, within [1, 65535]."""
    ones = np.zeros(n_contexts, np.int64)
    total = np.zeros(n_contexts, np.int64)
    for r in range(runs.shape[0]):
        c = runs[r, 2]
        total[c] += runs[r, 1] - runs[r, 0]
        for i in range(runs[r, 0], runs[r, 1]):
            ones[c] += _POPCOUNT[stream[i]]
    models = np.zeros(n_contexts, np.uint16)
    for c in range(n_contexts):
        if ones[c]:
            models[c] = min(max((ones[c] * 65536 + 4 * total[c]) // (8 * total[c]), 1), 65535)
    return models


@njit(cache=True, nogil=True)
def _cumulative(models):
    """Per model: each byte's frequency and the sum of those of the bytes below it."""
    freq = np.zeros((models.shape[0], 256), np.int64)
    cum = np.zeros((models.shape[0], 257), np.int64)
    for c in range(models.shape[0]):
        if models[c]:
            freq[c] = byte_freqs(np.int64(models[c]))
            for b in range(256):
                cum[c, b + 1] = cum[c, b] + freq[c, b]
    return freq, cum


@njit(cache=True, nogil=True)
def _encode(stream, runs, models):
    """The body coding ``stream``'s bytes in ``runs`` on ``models``: the four states' final
    values, then the 16-bit words the decoder reads, in its order (little-endian)."""
    freq, cum = _cumulative(models)
    inverse = 1.0 / np.maximum(freq, 1).astype(np.float64)
    coded = 0
    for r in range(runs.shape[0]):
        if models[runs[r, 2]]:
            coded += runs[r, 1] - runs[r, 0]
    words = np.empty(coded + 1, np.uint16)  # at most one a byte, and room for one not kept
    w = words.shape[0]
    # x0 is the state of the next byte to code (byte j uses state j % 4, coded last to first)
    x0 = x1 = x2 = x3 = np.int64(STATE_LOW)
    for r in range(runs.shape[0] - 1, -1, -1):
        c = runs[r, 2]
        if not models[c]:
            continue
        freq_c, cum_c, inverse_c = freq[c], cum[c], inverse[c]
        for i in range(runs[r, 1] - 1, runs[r, 0] - 1, -1):
            s = stream[i]
            f = freq_c[s]
            v = x0
            out = np.int64(v >= f << (32 - PROB_BITS))  # then its low word goes out
            words[w - 1] = np.uint16(v & 0xFFFF)
            w -= out
            v >>= 16 * out
            # v // f by a float reciprocal, exact or one short: a division takes most of a step
            q = np.int64(np.float64(v) * inverse_c[s])
            rest = v - q * f
            if rest >= f:
                q += 1
                rest -= f
            # the states turn in registers: through an array, a step took 1.25x as long
            x0, x1, x2, x3 = x1, x2, x3, (q << PROB_BITS) + rest + cum_c[s]
    x = np.array([x3, x2, x1, x0])  # x0 is now the state of byte -1: state 3
    body = np.empty(STATE_BYTES + 2 * (words.shape[0] - w), np.uint8)
    for k in range(N_STATES):
        for b in range(4):
            body[4 * k + b] = np.uint8((x[k] >> (8 * b)) & 0xFF)
    body[STATE_BYTES:] = words[w:].copy().view(np.uint8)
    return body


def encode_planes(stream: np.ndarray, n: int, block: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The models (uint16, one a context) and body coding the planes of plane stream ``stream``
    of ``n`` elements in ``block``-element blocks, its blocks' segments in ``bins`` bins."""
    nb = -(-n // block)
    runs = _runs(stream[:nb], n, block, bins, nb)
    models = _models(stream, runs, int(stream[:nb].max(initial=0)) * bins)
    return models, _encode(stream, runs, models)


@njit(inline="always")
def _step(x, table):
    """One decode step of state ``x`` on a model's table: its byte and the state after it."""
    slot = x & _MASK
    e = np.uint64(table[slot])  # the slot's byte, its frequency and the sum below it
    freq = (e >> np.uint64(8)) & _MASK
    return np.uint8(e & np.uint64(0xFF)), freq * (x >> np.uint64(PROB_BITS)) + slot - (e >> np.uint64(20))


@njit(inline="always")
def _refill(x, body, pos):
    """State ``x`` renormalized from the word at ``pos`` where it is below STATE_LOW, and the
    position after. Without a branch: whether a state needs a word is a coin toss."""
    low = np.uint64(x < np.uint64(STATE_LOW))
    take = np.uint64(0) - low  # all ones where a word is taken
    word = np.uint64(body[pos >> 1])
    return (x << (np.uint64(16) & take)) | (word & take), pos + 2 * np.int64(low)


@njit(cache=True, nogil=True)
def _decode(body, runs, models, out):
    """Decode the body into ``out``'s bytes in ``runs``: a ``BODY_*`` status. ``body``: its
    16-bit words (the states' too), then 4 zero words, which reads never pass."""
    end = 2 * body.shape[0] - 8
    if end < STATE_BYTES:
        return BODY_SHORT
    freq, cum = _cumulative(models)
    tables = np.zeros((models.shape[0], _SCALE), np.uint32)
    for c in range(models.shape[0]):
        for b in range(256):
            e = np.uint32(b | (freq[c, b] << 8) | (cum[c, b] << 20))
            for t in range(cum[c, b], cum[c, b + 1]):
                tables[c, t] = e
    st = np.zeros(N_STATES, np.uint64)
    for b in range(STATE_BYTES):
        st[b // 4] |= np.uint64((body[b // 2] >> (8 * (b % 2))) & 0xFF) << np.uint64(8 * (b % 4))
    x0, x1, x2, x3 = st[0], st[1], st[2], st[3]
    pos = STATE_BYTES
    for r in range(runs.shape[0]):
        c = runs[r, 2]
        i, stop = runs[r, 0], runs[r, 1]
        if not models[c]:
            out[i:stop] = 0
            continue
        table = tables[c]
        while i + 4 <= stop and pos + 8 <= end:  # four steps read at most 8 bytes
            s0, x0 = _step(x0, table)
            s1, x1 = _step(x1, table)
            s2, x2 = _step(x2, table)
            s3, x3 = _step(x3, table)
            out[i], out[i + 1], out[i + 2], out[i + 3] = s0, s1, s2, s3
            x0, pos = _refill(x0, body, pos)
            x1, pos = _refill(x1, body, pos)
            x2, pos = _refill(x2, body, pos)
            x3, pos = _refill(x3, body, pos)
            i += 4
        while i < stop:  # one byte on state 0, then the states turn
            s0, x0 = _step(x0, table)
            out[i] = s0
            x0, pos = _refill(x0, body, pos)
            if pos > end:
                return BODY_SHORT
            x0, x1, x2, x3 = x1, x2, x3, x0
            i += 1
    if pos != end:
        return BODY_LONG
    low = np.uint64(STATE_LOW)
    return BODY_OK if x0 == low and x1 == low and x2 == low and x3 == low else BODY_STATES


def decode_planes(body: np.ndarray, models: np.ndarray, stream: np.ndarray, n: int,
                  block: int, bins: int) -> int:
    """Decode a body into the planes of plane stream ``stream`` (its width bytes set; ``n``
    elements in ``block``-element blocks, ``bins`` bins, ``models`` one a context): a
    ``BODY_*`` status, ``BODY_OK`` when the body held exactly those bytes."""
    nb = -(-n // block)
    runs = _runs(stream[:nb], n, block, bins, nb)
    if body.shape[0] % 2:  # states and words: an even length
        return BODY_LONG
    padded = np.zeros(body.shape[0] + 8, np.uint8)
    padded[: body.shape[0]] = body
    return int(_decode(padded.view(np.uint16), runs, models, stream))
