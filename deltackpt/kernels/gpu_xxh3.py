"""xxh3-64 (seed 0) of bytes on the device, the digest the ``xxhash`` library gives, bit for bit.

Why. Every chunk records ``raw_xxh3``, the xxh3-64 of its decoded bytes
(docs/FORMAT.md). When a CUDA delta step is encoded on the device, its
reconstruction stays there; hashing it there keeps the format as it is while
only the compressed streams, statistics and 64 bytes a digest cross PCIe.

The algorithm is xxh3's for inputs over 240 bytes (the xxHash spec,
doc/xxhash_spec.md, "large inputs", with the default 192-byte secret):
8 u64 accumulators; stripes of 64 bytes (8 little-endian u64 lanes), each
accumulated as ``acc[i ^ 1] += lane[i]; acc[i] += lo32(v) * hi32(v)`` with
``v = lane[i] ^ key`` (the secret's u64 at byte ``8 * stripe + 8 * i``);
blocks of 16 stripes (1024 bytes), the accumulators scrambled after each
full block (``acc ^= acc >> 47; acc ^= secret[128 + 8i]; acc *= PRIME32_1``);
the last block's stripes but its last (always at least one byte is left), no
scramble; the input's final 64 bytes as one more stripe (keys from byte 121
of the secret); then the merge and the avalanche.

Design. Within a block, the stripes' contributions are sums modulo 2**64,
so their order does not matter, and only the scramble between blocks is
sequential. Two launches on the data's current stream, no host
synchronisation:

1. ``_block_sums_kernel``: many programs, each ``_BLOCKS`` blocks of one
   byte range: each block's 8 sums of ``lo32(v) * hi32(v)`` and its 8 sums
   of lanes (stored swapped, at ``i ^ 1``), in ``sums[row, 16]``. A thread
   sums one lane of a block over its 16 stripes, so no sum crosses threads.
   Lanes load as u64 where the data and every range start at a multiple of
   8 bytes (a float32 tensor's chunks of an even number of elements), else
   from their 8 bytes.
2. ``_chain_kernel``: one program a range, its 8 lanes the 8 accumulators:
   the scramble chain over the range's full blocks (``_UNROLL`` blocks a
   step, their loads issued together ahead of the dependent arithmetic),
   then the last block's sums and the final stripe; writes the 8
   accumulators.

The accumulators (64 bytes a digest) are copied to pinned host memory
behind the kernels, and that is all that crosses PCIe; the merge (64x64->
128-bit products folded) and the avalanche of the one 64-bit result run on
the host in Python integers.

Device memory traffic: the input read once, 128 bytes a KiB block written
and read back (a temporary an eighth of the input's size). The chain is the
inherent serial part of xxh3 (one multiply chain a block): one digest of a
large input is bound by its latency, while a batch of ranges
(:func:`xxh3_64_ranges_on_device`, one range a chunk) runs the chains side
by side.

Inputs of at most 240 bytes take xxh3's short-input paths, which share
nothing with the above: their bytes are copied to the host behind the work
queued before (so later writes do not change the digest) and hashed there
with ``xxhash`` by :meth:`PendingDigest.hexdigest`.

Kernels run on CUDA tensors, and on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` when triton and this module are imported), as
:mod:`deltackpt.kernels.gpu_quant`'s, whose launch helpers these share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
import xxhash

from deltackpt.kernels.gpu_quant import _device, _done, _launching

# The xxh3 spec's default secret (seed 0).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_PRIME32_1 = 0x9E3779B1
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME_MX1 = 0x165667919E3779F9
_INITIAL_ACC = (0xC2B2AE3D, _PRIME64_1, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, _PRIME32_1)
_U64 = (1 << 64) - 1
_MAX_SHORT = 240  # longer inputs take the long-input algorithm, on the device
_LAST_STRIPE_KEY = len(_SECRET) - 64 - 7  # the final stripe's keys start at this secret byte
_MERGE_KEY = 11  # the merge's keys start at this secret byte
_BLOCKS = 32  # blocks (of 1024 bytes) a program of _block_sums_kernel sums
_UNROLL = 16  # blocks a step of _chain_kernel's loop (ptxas hoists their loads)
_RANGES = 40  # where the ranges start in the kernels' table (:func:`_table`)


def _secret_u64(offset: int) -> int:
    """The secret's little-endian u64 at byte ``offset``."""
    return int.from_bytes(_SECRET[offset:offset + 8], "little")


def _table(ranges: list[tuple[int, int]], first_rows: Sequence[int]) -> np.ndarray:
    """The kernels' int64 table (u64 as their bit patterns): the secret's 24 aligned words
    (``[0, 24)``: stripe keys at ``stripe + lane``, scramble keys at ``16 + lane``), the
    final stripe's keys (``[24, 32)``), the initial accumulators (``[32, 40)``), then each
    range's start, length and first row of block sums (``40 + 3 * r``)."""
    words = [_secret_u64(8 * j) for j in range(24)]
    last = [_secret_u64(_LAST_STRIPE_KEY + 8 * i) for i in range(8)]
    constants = np.array([*words, *last, *_INITIAL_ACC], np.uint64).view(np.int64)
    rows = [(start, stop - start, first) for (start, stop), first in
            zip(ranges, first_rows, strict=True)]
    return np.concatenate([constants, np.array(rows, np.int64).reshape(-1)])


# -- kernels -------------------------------------------------------------------------------

@triton.jit
def _u64_at(data_ptr, at, mask, ALIGNED: tl.constexpr):
    """The little-endian u64s at byte offsets ``at`` (int64) of ``data``, 0 where not
    ``mask``: loaded as u64 where ``ALIGNED`` (``data`` and ``at`` multiples of 8), else
    from their 8 bytes each (no reduction across threads)."""
    if ALIGNED:
        return tl.load(data_ptr.to(tl.pointer_type(tl.uint64)) + at // 8, mask=mask, other=0)
    word = tl.zeros(at.shape, tl.uint64)
    for k in tl.static_range(8):
        word |= tl.load(data_ptr + at + k, mask=mask, other=0).to(tl.uint64) << (8 * k)
    return word


@triton.jit
def _block_sums_kernel(data_ptr, table_ptr, sums_ptr, RANGES: tl.constexpr,
                       BLOCKS: tl.constexpr, ALIGNED: tl.constexpr):
    """Blocks ``pid0 * BLOCKS ...`` of range ``pid1``: ``sums[row, lane]`` is the block's sum
    of ``lo32(v) * hi32(v)`` in lane ``lane``, ``sums[row, 8 + (lane ^ 1)]`` its sum of lane
    ``lane``'s words; a range's rows from its first row (:func:`_table`), one a block that
    holds stripes before the final one. A thread's sums run over the 16 stripes of its
    blocks' lanes: no reduction across threads. ``ALIGNED``: ``data`` and every range start
    at a multiple of 8 bytes."""
    at = table_ptr + RANGES + 3 * tl.program_id(1)
    start = tl.load(at)
    n_stripes = (tl.load(at + 1) - 1) // 64
    first_row = tl.load(at + 2)
    if tl.program_id(0).to(tl.int64) * BLOCKS * 16 < n_stripes:  # else past a short range
        block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        lane = tl.arange(0, 8)
        product_sums = tl.zeros([BLOCKS, 8], tl.uint64)
        word_sums = tl.zeros([BLOCKS, 8], tl.uint64)
        for s in tl.static_range(16):
            stripe = block * 16 + s
            valid = (stripe < n_stripes)[:, None] & (lane < 8)[None, :]
            words = _u64_at(data_ptr, start + stripe[:, None] * 64 + lane[None, :] * 8, valid,
                            ALIGNED)
            v = words ^ tl.load(table_ptr + s + lane).to(tl.uint64, bitcast=True)[None, :]
            product_sums += tl.where(valid, (v & 0xFFFFFFFF) * (v >> 32), 0)
            word_sums += words
        row = sums_ptr + (first_row + block)[:, None] * 16
        used = (block * 16 < n_stripes)[:, None] & (lane < 8)[None, :]
        tl.store(row + lane[None, :], product_sums.to(tl.int64, bitcast=True), mask=used)
        tl.store(row + 8 + (lane ^ 1)[None, :], word_sums.to(tl.int64, bitcast=True),
                 mask=used)


@triton.jit
def _block_sum(sums_ptr, row, live):
    """Block ``row``'s contribution to the 8 accumulators (0 where not ``live``)."""
    lane = tl.arange(0, 8)
    live = lane < tl.where(live, 8, 0)  # the interpreter mistypes a scalar & a tensor
    products = tl.load(sums_ptr + row * 16 + lane, mask=live, other=0)
    words = tl.load(sums_ptr + row * 16 + 8 + lane, mask=live, other=0)
    return products.to(tl.uint64, bitcast=True) + words.to(tl.uint64, bitcast=True)


@triton.jit
def _chain_kernel(data_ptr, table_ptr, sums_ptr, acc_ptr, RANGES: tl.constexpr,
                  UNROLL: tl.constexpr):
    """Range ``pid``'s 8 accumulators after all its stripes: the scramble chain over its
    full blocks' sums, then its last block's sums and its final 64 bytes."""
    r = tl.program_id(0)
    start = tl.load(table_ptr + RANGES + 3 * r)
    length = tl.load(table_ptr + RANGES + 3 * r + 1)
    n_stripes = (length - 1) // 64
    first_row = tl.load(table_ptr + RANGES + 3 * r + 2)
    n_full = n_stripes // 16
    lane = tl.arange(0, 8)
    acc = tl.load(table_ptr + 32 + lane).to(tl.uint64, bitcast=True)
    scramble_key = tl.load(table_ptr + 16 + lane).to(tl.uint64, bitcast=True)
    for b0 in range(0, n_full, UNROLL):
        for t in tl.static_range(UNROLL):
            live = b0 + t < n_full
            a = acc + _block_sum(sums_ptr, first_row + b0 + t, live)
            a = (a ^ (a >> 47) ^ scramble_key) * 0x9E3779B1  # * PRIME32_1
            acc = tl.where(live, a, acc)
    acc += _block_sum(sums_ptr, first_row + n_full, n_stripes % 16 != 0)
    tail = start + length - 64  # the final stripe
    words = _u64_at(data_ptr, tail + lane * 8, lane < 8, False)
    swapped = _u64_at(data_ptr, tail + (lane ^ 1) * 8, lane < 8, False)
    v = words ^ tl.load(table_ptr + 24 + lane).to(tl.uint64, bitcast=True)
    acc += swapped + (v & 0xFFFFFFFF) * (v >> 32)
    tl.store(acc_ptr + r * 8 + lane, acc.to(tl.int64, bitcast=True))


# -- host side -----------------------------------------------------------------------------

def _merge(acc: Sequence[int], length: int) -> int:
    """xxh3-64 of ``length`` bytes from its final 8 accumulators: the merge and the
    avalanche."""
    result = length * _PRIME64_1 & _U64
    for i in range(4):
        product = (acc[2 * i] ^ _secret_u64(_MERGE_KEY + 16 * i)) * \
            (acc[2 * i + 1] ^ _secret_u64(_MERGE_KEY + 16 * i + 8))
        result = (result + ((product & _U64) ^ (product >> 64))) & _U64
    result ^= result >> 37
    result = result * _PRIME_MX1 & _U64
    return result ^ (result >> 32)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` on ``device``: on a GPU, through pinned memory, a copy queued on the current
    stream (from pageable memory, CUDA may wait for the stream's work first)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: on a GPU, a copy into pinned memory queued on the current stream
    (it waits for nothing); a CPU tensor as it is."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Batch:
    """The results of one call in host memory, complete once ``done`` has passed: the long
    ranges' accumulators (``int64[R, 8]``) and the short ranges' bytes, one after another."""

    def __init__(self, acc: torch.Tensor | None, short: torch.Tensor | None,
                 done: torch.cuda.Event | None) -> None:
        self._acc = acc
        self._short = short
        self._done = done

    def host(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The accumulators and short bytes, once the device work is done (waited for here,
        from any thread)."""
        if self._done is not None:
            self._done.synchronize()
        return self._acc, self._short


class PendingDigest:
    """The xxh3-64 of a byte range queued on the device; :meth:`hexdigest` waits for it."""

    def __init__(self, batch: _Batch, length: int, where: int) -> None:
        self._batch = batch
        self._length = length
        self._where = where  # the row of its accumulators, or its offset in the short bytes

    def hexdigest(self) -> str:
        """``xxhash.xxh3_64_hexdigest`` of the bytes (seed 0): 16 lowercase hex digits. Waits
        for the device work, whose last step copied the accumulators (64 bytes a digest) or
        a short input's bytes to host memory, and finishes there. May be called from any
        thread."""
        acc, short = self._batch.host()
        if self._length <= _MAX_SHORT:
            return xxhash.xxh3_64_hexdigest(
                short[self._where:self._where + self._length].numpy().tobytes())
        return f"{_merge([a & _U64 for a in acc[self._where].tolist()], self._length):016x}"


def _check_data(data: torch.Tensor) -> None:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous 1-d torch.uint8 tensor, got {data.dtype} "
                         f"of shape {tuple(data.shape)} and strides {data.stride()}")


def xxh3_64_ranges_on_device(data: torch.Tensor,
                             ranges: Sequence[tuple[int, int]]) -> list[PendingDigest]:
    """The xxh3-64 digests of byte ranges ``data[start:stop]`` of a 1-d contiguous uint8
    tensor, in the same two launches, queued on its device's current stream without waiting
    (the caller orders them after the work that writes ``data``).

    Raises ``TypeError`` for a ``data`` that is not a tensor, ``ValueError``
    for one that is not 1-d, contiguous and uint8 or for a range outside it.
    Ranges of at most 240 bytes are copied to the host (queued likewise) and
    hashed there by ``xxhash`` when asked.
    """
    _check_data(data)
    size = data.shape[0]
    for start, stop in ranges:
        if not 0 <= start <= stop <= size:
            raise ValueError(f"byte range [{start}, {stop}) is not within the {size} bytes "
                             "of data")
    device = _device(data)
    short = [(start, stop) for start, stop in ranges if stop - start <= _MAX_SHORT]
    long = [(start, stop) for start, stop in ranges if stop - start > _MAX_SHORT]
    short_bytes = torch.cat([data[start:stop] for start, stop in short]) if short else None
    acc = None
    if long:
        rows = [(stop - start - 1) // 1024 + 1 for start, stop in long]  # blocks with stripes
        table = _to_device(_table(long, np.cumsum([0, *rows[:-1]])), device)
        sums = torch.empty((sum(rows), 16), dtype=torch.int64, device=device)
        acc = torch.empty((len(long), 8), dtype=torch.int64, device=device)
        with _launching(device):
            _block_sums_kernel[(triton.cdiv(max(rows), _BLOCKS), len(long))](
                data, table, sums, RANGES=_RANGES, BLOCKS=_BLOCKS,
                ALIGNED=data.data_ptr() % 8 == 0 and all(start % 8 == 0 for start, _ in long),
                num_warps=4)
            _chain_kernel[(len(long),)](data, table, sums, acc, RANGES=_RANGES,
                                        UNROLL=_UNROLL, num_warps=1)
    batch = _Batch(None if acc is None else _to_host(acc),
                   None if short_bytes is None else _to_host(short_bytes), _done(device))
    digests, n_long, short_at = [], 0, 0
    for start, stop in ranges:
        if stop - start <= _MAX_SHORT:
            digests.append(PendingDigest(batch, stop - start, short_at))
            short_at += stop - start
        else:
            digests.append(PendingDigest(batch, stop - start, n_long))
            n_long += 1
    return digests


def xxh3_64_on_device(data: torch.Tensor) -> PendingDigest:
    """The xxh3-64 digest of all of ``data`` (a 1-d contiguous uint8 tensor on a CUDA device,
    or on the CPU in Triton's interpreter), queued on its device's current stream without
    waiting: :func:`xxh3_64_ranges_on_device` of one range."""
    _check_data(data)
    return xxh3_64_ranges_on_device(data, [(0, data.shape[0])])[0]
