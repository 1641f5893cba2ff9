"""The restore chain: rebuild a delta step from its full step and the deltas in between.

A delta step's lossy chunks are coded against the reconstruction of its
base step (docs/FORMAT.md 5). Restoring step ``s`` therefore walks the
``base_step`` links down to a full step, decodes it, and applies each delta
in order to a running float32 reconstruction. A chunk that does not depend
on its base in some step (stored exactly, or coded against zero) is
decoded from that step on only.

bitsandbytes' 8-bit moments coded as ``bnb8`` chunks (FORMAT.md 3.4) are
rebuilt after the other tensors: their float32 running values through the
chain, then requantized by bitsandbytes (:func:`_restore_bnb8`).

When a tensor's chunks cover the same elements in every delta (the same
``chunk_bytes``), each chunk range is one task: its chunk of every step is
read and checked against its stored checksum, and all its quant streams
are applied in one pass (:func:`codecs.quant.apply_quant_streams`); the
result is checked against the last step's ``raw_xxh3``. Otherwise the
tensor's deltas are applied one step after another, each checked.

:class:`Reconstruction` is that running state. The writer keeps one too,
updated by every save, so the residuals it codes are against exactly what
a reader will have: the error of a restored step is that of one delta,
however long the chain.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from deltackpt.codecs import bnb8
from deltackpt.codecs.base import decode_into
from deltackpt.codecs.cast import CAST_DTYPES, cast_source
from deltackpt.codecs.cast import NAME as CAST
from deltackpt.codecs.patch import NAME as PATCH
from deltackpt.codecs.patch import apply_patch, kept_for_patches
from deltackpt.codecs.quant import NAME as QUANT
from deltackpt.codecs.quant import (
    QuantStream,
    apply_quant_streams,
    decode_quant,
    quant_stream,
    scale_source,
    uses_base,
)
from deltackpt.codecs.unchanged import NAME as UNCHANGED
from deltackpt.encode.optimizers import bnb_states
from deltackpt.encode.policy import LOSSY_DTYPES
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import CorruptionError, DeltackptError
from deltackpt.format.dtypes import dtype_bytes, float32_values, raw_bytes, spec_named
from deltackpt.format.metadata import (
    SCALED_16_BIT,
    Box,
    Chunk,
    StepMetadata,
    TensorRecord,
    box_index,
    box_intersection,
    check_format_version,
    layout_of,
)
from deltackpt.io.pool import Workers
from deltackpt.io.reader import (
    ChunkSource,
    chain_of,
    check_chunks_readable,
    read_tensors,
    run_chunk_tasks,
)
from deltackpt.io.storage import Storage

ON_BASE_BYTES = (UNCHANGED, PATCH)  # codecs of chunks decoded from their base's bytes


def _self_contained(chunk: Chunk) -> bool:
    """Whether a chunk decodes without its base step (FORMAT.md 5)."""
    if chunk.codec == bnb8.NAME:
        return bnb8.self_contained(chunk.params)
    if chunk.codec in ON_BASE_BYTES:
        return False
    return chunk.codec != QUANT or not uses_base(chunk.params)


def _cast_of(record: TensorRecord) -> str | None:
    """The tensor a record's chunks are cast from, or None if they are not cast chunks."""
    codecs = record.codecs
    if CAST not in codecs:
        return None
    if codecs != [CAST] or len({cast_source(c.params) for f in record.fragments
                               for c in f.chunks}) != 1:
        raise CorruptionError(f"tensor {record.name!r} mixes cast chunks with others, or "
                              "casts from more than one tensor")
    return cast_source(record.fragments[0].chunks[0].params)


def _scale_of(record: TensorRecord) -> str | None:
    """The tensor whose values scale a record's quant chunks (FORMAT.md 3.2), or None."""
    sources = {scale_source(c.params) for f in record.fragments for c in f.chunks
               if c.codec == QUANT}
    sources |= {scale_source(c.params["params"]) for f in record.fragments for c in f.chunks
                if c.codec == bnb8.NAME and isinstance(c.params.get("params"), dict)}
    sources.discard(None)
    if len(sources) > 1:
        raise CorruptionError(f"tensor {record.name!r} is scaled by more than one tensor")
    return sources.pop() if sources else None


def _first_needed(chain: list[StepMetadata], records: list[dict[str, TensorRecord]],
                  name: str) -> int:
    """Index of the first step of the chain ``name`` must be decoded from.

    ``records`` maps tensor names to records, one dict per step of the chain.
    """
    for i in range(len(chain) - 1, -1, -1):
        record = records[i].get(name)
        if record is None:
            raise CorruptionError(
                f"step {chain[i + 1].step}: tensor {name!r} is coded against base step "
                f"{chain[i].step}, which does not hold it")
        if i + 1 < len(chain):
            later = records[i + 1][name]
            if (record.dtype, record.shape) != (later.dtype, later.shape):
                raise CorruptionError(
                    f"step {chain[i + 1].step}: tensor {name!r} ({later.dtype} {later.shape}) is "
                    f"coded against step {chain[i].step}, where it is {record.dtype} {record.shape}")
        if all(_self_contained(c) for f in record.fragments for c in f.chunks):
            if i + 1 < len(chain) and (_cast_of(record) or _scale_of(record)) is not None:
                raise CorruptionError(
                    f"step {chain[i + 1].step}: tensor {name!r} is coded against step "
                    f"{chain[i].step}, where it is cast from or scaled by another tensor "
                    "(FORMAT.md 3.2, 3.3)")
            return i
    raise CorruptionError(f"tensor {name!r} of step {chain[-1].step} depends on a base in "
                          f"every step down to the full step {chain[0].step}")


@dataclass
class _Link:
    """The chunk of one chain step (``depth``) that covers a task's elements."""

    depth: int
    record: TensorRecord
    chunk: Chunk


@dataclass
class _RangeTask:
    """One chunk range of a tensor, taken through consecutive steps of the chain.

    ``links`` are its chunks, oldest first: the first may be self-contained;
    the others are coded against their base. ``state`` is the float32 slice
    of the running values (None for dtypes never coded lossily), ``out``
    the range's raw bytes in the tensor. ``chunk`` is the last link's
    (``run_chunk_tasks`` reports progress by it).
    """

    links: list[_Link]
    state: np.ndarray | None
    out: np.ndarray
    first: int  # index of the range's first element in the tensor

    @property
    def chunk(self) -> Chunk:
        return self.links[-1].chunk


def _whole(record: TensorRecord) -> bool:
    """Whether a record stores its tensor as one fragment covering all of it."""
    return len(record.fragments) == 1 and record.fragments[0].sizes == record.shape


def _boxes(record: TensorRecord) -> list[tuple[list[int], list[int]]]:
    return [(f.offsets, f.sizes) for f in record.fragments]


def _same_boxes(meta: StepMetadata, record: TensorRecord, like: TensorRecord,
                what: str) -> None:
    """Raise unless ``record`` (of step ``meta``) has the fragments of ``like`` (FORMAT.md 5)."""
    if _boxes(record) != _boxes(like):
        raise CorruptionError(f"step {meta.step}, tensor {record.name!r}: its fragments "
                              f"{_boxes(record)} differ from those of {what} {_boxes(like)}")


def _restore_range(sources: list[ChunkSource], task: _RangeTask) -> None:
    """Decode a range through its links; every stored chunk and the result are checked."""
    links = task.links
    first, last = links[0], links[-1]
    if first.chunk.codec not in (QUANT, *ON_BASE_BYTES):  # stored exactly: starts over
        sources[first.depth].decode(first.record, first.chunk, task.out)
        if task.state is not None and first.record.dtype != "float32":  # else a view of out
            task.state[:] = float32_values(task.out, first.record.dtype)
        links = links[1:]
    streams: list[QuantStream] = []
    for link in links:
        source = sources[link.depth]
        if link.chunk.codec in ON_BASE_BYTES:  # the step before's bytes, maybe patched
            _apply_streams(streams, task, link.record.dtype)
            if link.chunk.codec == PATCH:
                _patch(source, link, task.out)
            source.check_raw(link.record, link.chunk, task.out)
            if task.state is not None and link.record.dtype != "float32":
                task.state[:] = float32_values(task.out, link.record.dtype)
            continue
        if task.state is None:
            raise CorruptionError(f"{source.where(link.record, link.chunk)}: quant chunk on a "
                                  f"{link.record.dtype} tensor")
        stored = source.stored(link.record, link.chunk)
        try:
            streams.append(quant_stream(stored, link.chunk.params, task.state.shape[0]))
        except DeltackptError as exc:
            raise type(exc)(f"{source.where(link.record, link.chunk)}: {exc}") from None
    _apply_streams(streams, task, last.record.dtype)
    if last.chunk.codec == QUANT:  # an exact, unchanged or patch last link is checked above
        sources[last.depth].check_raw(last.record, last.chunk, task.out)


def _patch(source: ChunkSource, link: _Link, out: np.ndarray) -> None:
    """Patch ``out``, the bytes of the link's chunk in the step before, into the chunk's."""
    stored = source.stored(link.record, link.chunk)
    try:
        apply_patch(stored, link.chunk.params, out, "patch")
    except DeltackptError as exc:
        raise type(exc)(f"{source.where(link.record, link.chunk)}: {exc}") from None


def _apply_streams(streams: list[QuantStream], task: _RangeTask, dtype: str) -> None:
    """Apply the quant streams gathered to the range's running values and its bytes."""
    if not streams:
        return
    apply_quant_streams(streams, task.state, task.first)
    if dtype != "float32":  # float32 tensors are their running values
        task.out[:] = dtype_bytes(task.state, dtype)
    streams.clear()


def _range_tasks(chain: list[StepMetadata], records: list[dict[str, TensorRecord]], name: str,
                 first: int, k: int, piece: _Piece) -> list[list[_RangeTask]]:
    """The tasks that take fragment ``k`` of tensor ``name`` from step ``first`` of the chain
    to the last (every step from ``first`` on has the same fragments).

    One list of tasks when its chunks line up in every step from ``first``
    on: a task per chunk range, from the last step where that chunk is
    self-contained (or step ``first``, whose values the caller has). Else a
    list per step, each task one chunk of that step, to run in order.
    """
    steps = [(d, records[d][name]) for d in range(first, len(chain))]
    last = steps[-1][1]
    boxes = _boxes(last)
    for d, record in steps:
        if _boxes(record) != boxes:
            _same_boxes(chain[d], record, last, f"step {chain[-1].step}")
    itemsize = spec_named(steps[0][1].dtype, name).itemsize
    state, raw = piece.state, piece.raw

    def task(links: list[_Link]) -> _RangeTask:
        lo, hi = links[-1].chunk.raw_offset, links[-1].chunk.raw_offset + links[-1].chunk.raw_length
        first = lo // itemsize  # in the fragment: quant streams (dither) count from it
        lo, hi = lo - piece.skip * itemsize, hi - piece.skip * itemsize  # in the buffer
        return _RangeTask(links, None if state is None else state[lo // itemsize : hi // itemsize],
                          raw[lo:hi], first)

    bounds = {tuple([(c.raw_offset, c.raw_length) for c in r.fragments[k].chunks]) for _, r in steps}
    if len(bounds) > 1:
        return [[task([_Link(d, r, c)]) for c in r.fragments[k].chunks] for d, r in steps]
    tasks = []
    for i in range(len(last.fragments[k].chunks)):
        chunks = [r.fragments[k].chunks[i] for _, r in steps]
        start = next((j for j in range(len(chunks) - 1, 0, -1) if _self_contained(chunks[j])), 0)
        tasks.append(task([_Link(d, r, c) for (d, r), c in zip(steps[start:], chunks[start:],
                                                                 strict=True)]))
    return [tasks]


@dataclass
class _Piece:
    """One fragment of a tensor being restored: its raw bytes and float32 running values
    (None for dtypes never coded lossily), row-major in the fragment's box. For a tensor of
    one whole fragment they are the tensor's own memory; otherwise buffers that
    :func:`_assemble` copies into the tensor once decoded."""

    box: Box
    buffer: torch.Tensor
    state: np.ndarray | None
    skip: int = 0  # elements of the fragment before the buffer's first (a span, see _spans)

    @property
    def raw(self) -> np.ndarray:
        return self.buffer.reshape(-1).view(torch.uint8).numpy()

    @property
    def index(self) -> tuple[slice, ...]:
        return box_index(*self.box)


def _pieces(values: dict[str, np.ndarray], record: TensorRecord, tensor: torch.Tensor,
            decoded: bool, skip: int = 0) -> list[_Piece]:
    """The pieces of ``tensor`` (flat, holding its values if ``decoded``), one per fragment of
    ``record``; ``skip``: the elements of a span (one fragment) before the tensor's first."""
    if _whole(record):
        return [_Piece((record.fragments[0].offsets, record.shape), tensor,
                       _state(values, record, tensor, decoded), skip)]
    shaped = tensor.view(record.shape)
    pieces = []
    for frag in record.fragments:
        box = (frag.offsets, frag.sizes)
        buffer = shaped[box_index(*box)].contiguous() if decoded else torch.empty(
            frag.sizes, dtype=tensor.dtype)
        state = None
        if record.dtype in LOSSY_DTYPES:
            state = buffer.reshape(-1).numpy().view(np.float32) if record.dtype == "float32" \
                else buffer.reshape(-1).float().numpy()
        pieces.append(_Piece(box, buffer, state))
    return pieces


def _assemble(values: dict[str, np.ndarray], record: TensorRecord, tensor: torch.Tensor,
              pieces: list[_Piece]) -> None:
    """Copy decoded pieces into their tensor (flat) and its running values."""
    if _whole(record):
        return
    shaped = tensor.view(record.shape)
    for piece in pieces:
        shaped[piece.index] = piece.buffer.view(piece.box[1])
    if record.dtype in LOSSY_DTYPES:
        whole = np.empty(record.numel, np.float32).reshape(record.shape)
        for piece in pieces:
            whole[piece.index] = piece.state.reshape(piece.box[1])
        values[record.name] = whole.reshape(-1)


def _regions(final: dict[str, TensorRecord], boxes: dict[str, Box]) -> dict[str, Box]:
    """The box of each tensor of ``boxes`` to rebuild: the smallest one its fragments that
    overlap the wanted box tile (that box itself when fragments line up with it). Tensors
    stored whole (see :func:`_spans`) or whose fragments straddle that region are left out."""
    regions = {}
    for name, box in boxes.items():
        record = final.get(name)  # None: a tied weight, restricted as its target
        if record is None or _whole(record):
            continue
        inside = [f for f in record.fragments if f.sizes and box_intersection((f.offsets, f.sizes), box)]
        if not inside:
            continue
        lo = [min(f.offsets[d] for f in inside) for d in range(len(record.shape))]
        hi = [max(f.offsets[d] + f.sizes[d] for f in inside) for d in range(len(record.shape))]
        region = (lo, [h - low for low, h in zip(lo, hi, strict=True)])
        straddling = [f for f in record.fragments if f.sizes and f not in inside
                      and box_intersection((f.offsets, f.sizes), region)]
        if not straddling:
            regions[name] = region
    return regions


def _spans(chain: list[StepMetadata], boxes: dict[str, Box]) -> dict[str, tuple[int, int]]:
    """For each tensor of ``boxes`` stored whole (one fragment) in every step of the chain:
    the elements ``[lo, hi)`` (row-major) of the chunks that hold its box, widened until no
    chunk of any step straddles them. Tensors whose span would be all of them are left out."""
    if not boxes:
        return {}
    records = [{r.name: r for r in m.tensors} for m in chain]
    spans = {}
    for name, (offsets, sizes) in boxes.items():
        steps = [r.get(name) for r in records]
        if any(r is None or r.alias_of is not None or not _whole(r) for r in steps) \
                or not all(sizes):
            continue
        shape, itemsize = steps[-1].shape, spec_named(steps[-1].dtype, name).itemsize
        lo = _flat_index(offsets, shape) * itemsize
        hi = (_flat_index([o + n - 1 for o, n in zip(offsets, sizes, strict=True)], shape)
              + 1) * itemsize
        while True:
            chunks = [c for r in steps for c in r.fragments[0].chunks
                      if c.raw_offset < hi and c.raw_offset + c.raw_length > lo]
            wider = (min([lo, *(c.raw_offset for c in chunks)]),
                     max([hi, *(c.raw_offset + c.raw_length for c in chunks)]))
            if wider == (lo, hi):
                break
            lo, hi = wider
        if hi - lo < steps[-1].nbytes:
            spans[name] = (lo // itemsize, hi // itemsize)
    return spans


def _paired(final: dict[str, TensorRecord], cuts: dict[str, Any]) -> dict[str, Any]:
    """``cuts`` without the tensors cast from or scaled by a tensor cut otherwise (or not at
    all), and without those sources: such pairs are decoded element for element together."""
    cuts = dict(cuts)
    for name, record in final.items():
        source = _cast_of(record) or _scale_of(record)
        if source is not None and cuts.get(name) != cuts.get(source):
            cuts.pop(name, None)
            cuts.pop(source, None)
    return cuts


def _restricted(meta: StepMetadata, regions: dict[str, Box],
                spans: dict[str, tuple[int, int]]) -> StepMetadata:
    """``meta`` with each tensor of ``regions`` cut down to that box (its shape the box's, its
    fragments those inside the box, offsets relative to it) and each of ``spans`` to those
    elements (a flat tensor of one fragment holding the chunks inside them). Chunks are
    unchanged: their ``raw_offset`` stays relative to their fragment."""
    def cut(record: TensorRecord) -> TensorRecord:
        if record.name in spans:
            lo, hi = spans[record.name]
            itemsize = spec_named(record.dtype, record.name).itemsize
            frag = record.fragments[0]
            chunks = [c for c in frag.chunks if lo * itemsize <= c.raw_offset < hi * itemsize]
            return replace(record, shape=[hi - lo],
                           fragments=[replace(frag, offsets=[0], sizes=[hi - lo], chunks=chunks)])
        lo, sizes = regions[record.name]
        inside = [replace(f, offsets=[o - b for o, b in zip(f.offsets, lo, strict=True)])
                  for f in record.fragments if f.sizes and box_intersection((f.offsets, f.sizes),
                                                                        (lo, sizes))]
        return replace(record, shape=list(sizes), fragments=inside)

    if not regions and not spans:
        return meta
    return replace(meta, tensors=[cut(r) if (r.name in regions or r.name in spans)
                                  and r.alias_of is None else r for r in meta.tensors])


def _strides(shape: list[int]) -> list[int]:
    """Row-major strides (in elements) of a tensor of ``shape``."""
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def _flat_index(index: list[int], shape: list[int]) -> int:
    """Row-major position of element ``index`` of a tensor of ``shape``."""
    return sum(i * s for i, s in zip(index, _strides(shape), strict=True))


def _cut_span(flat: torch.Tensor, lo: int, shape: list[int], box: Box) -> torch.Tensor:
    """Box ``box`` of a tensor of ``shape`` whose row-major elements ``lo..`` ``flat`` holds."""
    offsets, sizes = box
    start = _flat_index(offsets, shape) - lo
    return flat.as_strided(sizes, _strides(shape), flat.storage_offset() + start).contiguous()


def restore_chain(storage: Storage, meta: StepMetadata, *, boxes: dict[str, Box] | None = None,
                  workers: Workers = None, progress: bool = False,
                  read: Callable[[int], StepMetadata] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], Reconstruction]:
    """Every tensor of step ``meta`` rebuilt through its chain, and the reconstruction.

    Tensors are returned by name as :func:`reader.read_tensors` returns
    them (aliases share their target). The reconstruction's arrays share
    memory with the returned float32 tensors.

    ``boxes`` restricts tensors to one box each (global coordinates), as
    for ``read_tensors``: the tensor returned, and its running values in
    the reconstruction, have the box's sizes. A tensor stored in several
    fragments (saved by several ranks) is rebuilt only over the fragments
    that overlap its box; one stored whole (saved by one process) only over
    the chunks that hold the box's first to last element. ``read`` reads the
    metadata of the steps below (as for :func:`chain_of`).
    """
    chain = chain_of(storage, meta, read)
    for step in chain[1:]:  # the full step's chunks: by read_tensors, before it allocates
        check_chunks_readable(storage, step)
    boxes = boxes or {}
    if len(chain) == 1:
        return _restore_full_step(storage, meta, boxes, workers, progress)
    plan = _plan_chain(chain, boxes)
    values: dict[str, np.ndarray] = {}
    tensors = _read_from_full_step(storage, plan, workers, progress)
    pieces, rounds = _range_rounds(plan, tensors, values)
    sources = [ChunkSource(storage, m) for m in plan.chain]
    try:
        _prefetch(sources, plan, rounds)
        for tasks in rounds:
            run_chunk_tasks(tasks, lambda t: _restore_range(sources, t), workers,
                            f"apply deltas up to step {meta.step}", progress)
        _decode_derived(sources[-1], plan, tensors, values, pieces, workers, progress)
        # Scale sources first: a scaled moment is decoded from their running values.
        for name in sorted(plan.moments, key=lambda n: _scale_of(plan.final[n]) is not None):
            _restore_bnb8(storage, plan.chain, plan.records, sources, name, plan.moments[name],
                          plan.start[name], tensors, values, workers)
    finally:
        for source in sources:
            source.close()
    for name, tensor_pieces in pieces.items():
        _assemble(values, plan.final[name], tensors[name], tensor_pieces)
    _dequantized_moments(meta, tensors, values, boxes)
    _cut_to_boxes(plan, tensors, values, boxes)
    scaled = frozenset(plan.scaled).union(n for n in plan.moments
                                          if _scale_of(plan.final[n]) is not None)
    return {r.name: tensors[r.alias_of or r.name] for r in meta.tensors}, Reconstruction(
        meta.step, len(plan.chain) - 1, layout_of(meta), values, meta.save_id,
        chain=[m.step for m in plan.chain], scaled=scaled, digests=_digests(meta),
        kept=_kept(meta, tensors))


def _restore_full_step(storage: Storage, meta: StepMetadata, boxes: dict[str, Box],
                       workers: Workers, progress: bool
                       ) -> tuple[dict[str, torch.Tensor], Reconstruction]:
    """A full step's tensors (``read_tensors`` cuts boxes chunk by chunk) and reconstruction."""
    tensors = read_tensors(storage, meta, boxes=boxes, workers=workers, progress=progress)
    values: dict[str, np.ndarray] = {}
    for record in meta.tensors:
        if record.alias_of is None:
            _state(values, record, tensors[record.name].reshape(-1))
    _dequantized_moments(meta, tensors, values, boxes)
    return tensors, Reconstruction(meta.step, 0, layout_of(meta), values, meta.save_id,
                                   chain=[meta.step], digests=_digests(meta),
                                   kept=_kept(meta, tensors))


def _digests(meta: StepMetadata) -> dict[tuple[str, int], tuple[int, str]]:
    """The raw length and ``raw_xxh3`` of the chunks of the step's tensors stored whole, by
    tensor and raw offset (``Reconstruction.digests``)."""
    return {(r.name, c.raw_offset): (c.raw_length, c.raw_xxh3) for r in meta.tensors
            if len(r.fragments) == 1 for c in r.fragments[0].chunks}


def _kept(meta: StepMetadata, tensors: dict[str, torch.Tensor]
          ) -> dict[tuple[str, int], np.ndarray]:
    """The bytes of the step's chunks of tensors restored whole that a writer continuing from
    the step patches (:func:`kept_for_patches`), by tensor and raw offset
    (``Reconstruction.kept``, FORMAT.md 3.6)."""
    kept = {}
    for r in meta.tensors:
        if r.alias_of is None and len(r.fragments) == 1 and kept_for_patches(r) \
                and tensors[r.name].numel() == r.numel:
            raw = raw_bytes(tensors[r.name])
            kept.update({(r.name, c.raw_offset): raw[c.raw_offset:c.raw_offset + c.raw_length].copy()
                         for c in r.fragments[0].chunks})
    return kept


@dataclass
class _ChainPlan:
    """What restoring a delta step's chain decodes, decided from its metadata alone."""

    chain: list[StepMetadata]  # each step restricted to the regions and spans decoded
    records: list[dict[str, TensorRecord]]  # of each step of ``chain``, by name
    final: dict[str, TensorRecord]  # the restored step's stored tensors
    stored: dict[str, TensorRecord]  # the same, unrestricted
    regions: dict[str, Box]  # tensors stored in fragments: the region of those decoded
    spans: dict[str, tuple[int, int]]  # tensors stored whole: the span of elements decoded
    moments: dict[str, _Bnb8]  # bitsandbytes' 8-bit moments in bnb8 chunks
    derived_absmax: set[str]  # their absmax, derived from the moments
    casts: dict[str, str]  # 16-bit parameters cast from their master copies: the master
    scaled: dict[str, str]  # moments coded with scaled steps: the tensor scaling them
    start: dict[str, int]  # the first step of the chain each tensor is decoded from
    read_first: set[str]  # tensors read from the full step before the deltas are applied


def _plan_chain(chain: list[StepMetadata], boxes: dict[str, Box]) -> _ChainPlan:
    """Which parts of each tensor the chain decodes, and from which step on."""
    meta = chain[-1]
    stored = {r.name: r for r in meta.tensors if r.alias_of is None}
    moments = _bnb8_moments(meta, stored)  # restored whole, and cut to their boxes at the end
    derived_absmax = {moments[name].absmax for name in moments}
    regions, spans = _regions(stored, boxes), _spans(chain, boxes)
    kept = _paired(stored, {**regions, **spans}).keys() - moments.keys() - derived_absmax
    regions = {n: c for n, c in regions.items() if n in kept}
    spans = {n: c for n, c in spans.items() if n in kept}
    chain = [_restricted(m, regions, spans) for m in chain]
    records = [{r.name: r for r in m.tensors} for m in chain]
    final = {r.name: r for r in chain[-1].tensors if r.alias_of is None}
    casts = {name: _checked_cast(meta, record, final) for name, record in final.items()
             if _cast_of(record) is not None}
    scaled = {name: _checked_scale(meta, record, final) for name, record in final.items()
              if _scale_of(record) is not None and name not in moments}
    start = {name: _first_needed(chain, records, name) for name in final}
    # A tensor stored in the full step with the fragments it has in the deltas is decoded from
    # it inside its chunk ranges' tasks, together with the deltas; others are read from it first.
    read_first = {n for n, i in start.items()
                  if i == 0 and _boxes(records[0][n]) != _boxes(final[n])}
    return _ChainPlan(chain, records, final, stored, regions, spans, moments, derived_absmax,
                      casts, scaled, start, read_first)


def _read_from_full_step(storage: Storage, plan: _ChainPlan, workers: Workers,
                         progress: bool) -> dict[str, torch.Tensor]:
    """The flat tensors the plan reads from the full step before applying the deltas."""
    read = read_tensors(storage, plan.chain[0], plan.read_first, workers=workers,
                        boxes={n: plan.regions[n] for n in plan.read_first if n in plan.regions},
                        progress=progress)
    return {name: tensor.reshape(-1).contiguous() for name, tensor in read.items()}


def _range_rounds(plan: _ChainPlan, tensors: dict[str, torch.Tensor],
                  values: dict[str, np.ndarray]
                  ) -> tuple[dict[str, list[_Piece]], list[list[_RangeTask]]]:
    """The pieces of each tensor decoded through chunk ranges (allocated in ``tensors``) and the
    tasks that decode them, in rounds that run one after another."""
    pieces: dict[str, list[_Piece]] = {}
    rounds: list[list[_RangeTask]] = []  # tasks that run at once; each round after the one before
    for name, record in plan.final.items():
        if name in plan.casts or name in plan.scaled or name in plan.moments \
                or name in plan.derived_absmax:
            continue  # decoded from other tensors' values, after these
        if name not in tensors:
            spec = spec_named(record.dtype, name)
            tensors[name] = torch.empty(record.numel, dtype=spec.torch_dtype)
        was_read = name in plan.read_first
        pieces[name] = _pieces(values, record, tensors[name], decoded=was_read,
                               skip=plan.spans.get(name, (0, 0))[0])
        for k, piece in enumerate(pieces[name]):
            planned = _range_tasks(plan.chain, plan.records, name,
                                   1 if was_read else plan.start[name], k, piece)
            rounds += [[] for _ in range(len(planned) - len(rounds))]
            for round_tasks, tasks in zip(rounds, planned, strict=False):
                round_tasks += tasks
    for tasks in rounds:  # the longest first: no thread is left alone with one at the end
        tasks.sort(key=lambda t: t.chunk.raw_length * len(t.links), reverse=True)
    return pieces, rounds


def _prefetch(sources: list[ChunkSource], plan: _ChainPlan,
              rounds: list[list[_RangeTask]]) -> None:
    """Ask each step's source for the chunks the tasks read, in the order they read them, and
    the last step's chunks of casts and scaled moments."""
    needed: list[list[Chunk]] = [[] for _ in plan.chain]
    for task in (task for tasks in rounds for task in tasks):
        for link in task.links:
            needed[link.depth].append(link.chunk)
    needed[-1] += [c for name in {**plan.casts, **plan.scaled}
                   for frag in plan.final[name].fragments for c in frag.chunks]
    for step_source, chunks in zip(sources, needed, strict=True):
        step_source.prefetch(chunks)


def _decode_derived(source: ChunkSource, plan: _ChainPlan, tensors: dict[str, torch.Tensor],
                    values: dict[str, np.ndarray], pieces: dict[str, list[_Piece]],
                    workers: Workers, progress: bool) -> None:
    """Decode the last step's casts and scaled moments from the running values of the tensors
    they come from."""
    derived = []
    for name, origin in {**plan.casts, **plan.scaled}.items():
        record = plan.final[name]
        spec = spec_named(record.dtype, name)
        tensors[name] = torch.empty(record.numel, dtype=spec.torch_dtype)
        pieces[name] = _pieces(values, record, tensors[name], decoded=False,
                               skip=plan.spans.get(name, (0, 0))[0])
        for frag, piece, origin_piece in zip(record.fragments, pieces[name], pieces[origin],
                                             strict=True):
            for c in frag.chunks:
                first = c.raw_offset // spec.itemsize
                lo, hi = first - piece.skip, first - piece.skip + c.raw_length // spec.itemsize
                derived.append(_DerivedTask(
                    record, c, piece.raw[lo * spec.itemsize : hi * spec.itemsize],
                    None if piece.state is None else piece.state[lo:hi],
                    origin_piece.state[lo:hi], first))
    run_chunk_tasks(derived, lambda t: _restore_derived(source, t), workers,
                    f"decode casts and scaled moments of step {plan.chain[-1].step}", progress)


def _cut_to_boxes(plan: _ChainPlan, tensors: dict[str, torch.Tensor],
                  values: dict[str, np.ndarray], boxes: dict[str, Box]) -> None:
    """Shape every restored tensor, cut to its box where one was asked for, with its running
    values (those of tensors no delta touched too)."""
    for name, record in plan.final.items():
        _state(values, record, tensors[name])
        tensors[name] = tensors[name].reshape(record.shape)
        if name in plan.spans:
            shape = plan.stored[name].shape
            tensors[name] = _cut_span(tensors[name], plan.spans[name][0], shape, boxes[name])
            if name in values:
                values[name] = _cut_span(torch.from_numpy(values[name]), plan.spans[name][0],
                                         shape, boxes[name]).reshape(-1).numpy()
        elif name in boxes:
            index = box_index(*boxes[name], plan.regions.get(name, (None, None))[0])
            tensors[name] = tensors[name][index].contiguous()
            if name in values:
                values[name] = values[name].reshape(record.shape)[index].reshape(-1).copy()


def _checked_cast(meta: StepMetadata, record: TensorRecord,
                  final: dict[str, TensorRecord]) -> str:
    """The master a delta step's 16-bit tensor is cast from, checked against FORMAT.md 3.3."""
    source = _cast_of(record)
    master = final.get(source)
    where = f"step {meta.step}, tensor {record.name!r}"
    if meta.kind != "delta" or record.dtype not in CAST_DTYPES:
        raise CorruptionError(f"{where}: cast chunks belong to bfloat16/float16 tensors of delta "
                              f"steps, not to a {record.dtype} tensor of a {meta.kind} step")
    if master is None or master.dtype != "float32" or master.shape != record.shape \
            or _cast_of(master) is not None:
        raise CorruptionError(f"{where}: is cast from {source!r}, which is not a float32 "
                              f"tensor of the step with shape {record.shape}")
    _same_boxes(meta, record, master, f"its master {source!r}")
    if any(c.length for c in record.fragments[0].chunks):
        raise CorruptionError(f"{where}: a cast chunk stores no bytes")
    return source


def _checked_scale(meta: StepMetadata, record: TensorRecord,
                   final: dict[str, TensorRecord]) -> str:
    """The tensor whose values scale a delta step's tensor, checked against FORMAT.md 3.2: a
    float32 tensor scaled by a float32 one, or since format 2.1 a 16-bit one by one of its
    dtype."""
    source = _scale_of(record)
    scale = final.get(source)
    where = f"step {meta.step}, tensor {record.name!r}"
    dtypes = LOSSY_DTYPES if check_format_version(meta.format_version, where) >= SCALED_16_BIT \
        else ("float32",)
    if meta.kind != "delta" or record.dtype not in dtypes:
        raise CorruptionError(f"{where}: scaled quant chunks belong to {' or '.join(dtypes)} "
                              f"tensors of delta steps (format {meta.format_version}), not to a "
                              f"{record.dtype} tensor of a {meta.kind} step")
    if scale is None or scale.dtype != record.dtype or scale.shape != record.shape \
            or (_cast_of(scale) or _scale_of(scale)) is not None:
        raise CorruptionError(f"{where}: is scaled by {source!r}, which is not a {record.dtype} "
                              f"tensor of the step with shape {record.shape} and no cast or "
                              "scaled chunks")
    _same_boxes(meta, record, scale, f"its scale {source!r}")
    return source


@dataclass
class _DerivedTask:
    """A chunk of a delta step decoded from another tensor's running values in the same step:
    a cast chunk (FORMAT.md 3.3), a scaled quant chunk (3.2), or an exact chunk of a tensor of
    scaled ones."""

    record: TensorRecord
    chunk: Chunk
    out: np.ndarray  # the chunk's raw bytes in its tensor
    values: np.ndarray | None  # its running values (float32; a view of out for float32 tensors)
    source: np.ndarray  # the source tensor's running values over the chunk's elements
    first: int  # index of the chunk's first element in the tensor


def _restore_derived(step: ChunkSource, task: _DerivedTask) -> None:
    """Decode a derived chunk into its tensor and check it against its ``raw_xxh3``."""
    record, chunk = task.record, task.chunk
    if chunk.codec == CAST:
        task.out[:] = dtype_bytes(task.source, record.dtype)
    elif chunk.codec == QUANT:
        stored = step.stored(record, chunk)  # its errors name step, tensor and file already
        try:
            decode_quant(stored, chunk.params, None, task.values, task.first, task.source)
        except DeltackptError as exc:
            raise type(exc)(f"{step.where(record, chunk)}: {exc}") from None
        if record.dtype != "float32":  # a 16-bit tensor holds its running values rounded
            task.out[:] = dtype_bytes(task.values, record.dtype)
    elif chunk.codec in ON_BASE_BYTES:
        raise CorruptionError(f"{step.where(record, chunk)}: a chunk of codec {chunk.codec!r} "
                              "in a tensor of scaled chunks (FORMAT.md 3.5, 3.6)")
    else:
        step.decode(record, chunk, task.out)  # checked there
        return
    step.check_raw(record, chunk, task.out)


def _state(values: dict[str, np.ndarray], record: TensorRecord, flat: torch.Tensor,
           decoded: bool = True) -> np.ndarray | None:
    """The float32 running value of a tensor of a lossy-capable dtype (created on first use:
    from ``flat``'s values if ``decoded``, else left to be written)."""
    if record.dtype not in LOSSY_DTYPES:
        return None
    if record.name not in values:
        if record.dtype == "float32":
            values[record.name] = flat.numpy().view(np.float32)
        else:
            values[record.name] = flat.float().numpy() if decoded else \
                np.empty(flat.numel(), np.float32)
    return values[record.name]


def _dequantized_moments(meta: StepMetadata, tensors: dict[str, torch.Tensor],
                         values: dict[str, np.ndarray], boxes: dict[str, Box]) -> None:
    """Set the running values of the bitsandbytes 8-bit moments of a step that holds their
    codes (FORMAT.md 3.4: their dequantized values), which a writer continuing the chain codes
    against. Moments restored from ``bnb8`` chunks have theirs already, and those cut to a box
    have none (a later delta stores them exactly)."""
    optimizer = meta.state.get("optimizer") or {}
    records = [(r.name, r.fqn, r.dtype, tuple(r.shape)) for r in meta.tensors
               if r.role == "optimizer" and r.alias_of is None]
    for name, b in bnb_states(records, optimizer.get("class", "")).items():
        if b.is_8bit and name not in values and not {name, b.absmax, b.qmap} & boxes.keys():
            values[name] = bnb8.dequantize(*(tensors[n].reshape(-1).numpy()
                                             for n in (name, b.absmax, b.qmap)), b.blocksize)


@dataclass(frozen=True)
class _Bnb8:
    """What the ``bnb8`` chunks of an 8-bit moment name: its scales, code map, block size."""

    absmax: str
    qmap: str
    blocksize: int


def _bnb8_moments(meta: StepMetadata, final: dict[str, TensorRecord]) -> dict[str, _Bnb8]:
    """The 8-bit moments of a step stored as ``bnb8`` state chunks, checked against FORMAT.md
    3.4: a ``uint8`` tensor of one fragment whose chunks all name one ``qmap`` (a float32
    tensor of 256 values), ``absmax`` (float32, one value per block, all its
    chunks derived from this moment) and block size."""
    moments = {}
    for name, record in final.items():
        if bnb8.NAME not in record.codecs or all(
                bnb8.is_absmax_chunk(c.params) for f in record.fragments for c in f.chunks):
            continue
        where = f"step {meta.step}, tensor {record.name!r}"
        params = {bnb8.state_params(c.params)[2:] if c.codec == bnb8.NAME else None
                  for f in record.fragments for c in f.chunks}
        if meta.kind != "delta" or record.dtype != "uint8" or not _whole(record) \
                or len(params) != 1 or None in params:
            raise CorruptionError(f"{where}: bnb8 state chunks belong to uint8 tensors of delta "
                                  "steps stored in one fragment, all of whose chunks are bnb8 "
                                  "state chunks naming one qmap, absmax and block size")
        qmap, absmax, blocksize = params.pop()
        q, a = final.get(qmap), final.get(absmax)
        if q is None or (q.dtype, q.shape) != ("float32", [bnb8.QMAP_SIZE]) \
                or set(q.codecs) & {bnb8.NAME, CAST} or _scale_of(q) is not None:
            raise CorruptionError(f"{where}: its qmap {qmap!r} is not a float32 tensor of "
                                  f"{bnb8.QMAP_SIZE} values")
        if a is None or a.dtype != "float32" or a.shape != [-(-record.numel // blocksize)] \
                or not _whole(a) or any(c.codec != bnb8.NAME or bnb8.absmax_source(c.params)
                                        != name for c in a.fragments[0].chunks):
            raise CorruptionError(f"{where}: its absmax {absmax!r} is not a float32 tensor of "
                                  f"one value per block of {blocksize} whose chunks are all "
                                  "bnb8 chunks derived from it")
        moments[name] = _Bnb8(absmax, qmap, blocksize)
    return moments


def _restore_bnb8(storage: Storage, chain: list[StepMetadata],
                  records: list[dict[str, TensorRecord]], sources: list[ChunkSource], name: str,
                  moment: _Bnb8, first: int, tensors: dict[str, torch.Tensor],
                  values: dict[str, np.ndarray], workers: Workers) -> None:
    """Rebuild 8-bit moment ``name`` of the chain's last step: its float32 running values from
    step ``first`` on (dequantized codes where that step stores them, else decoded), each
    step's bnb8 chunks applied and checked, then requantized by bitsandbytes into its codes and
    ``absmax``, which are checked against the running values (FORMAT.md 3.4)."""
    record = records[-1][name]
    running = np.empty(record.numel, np.float32)
    qmap = tensors[moment.qmap].reshape(-1).numpy()  # the same along the chain (3.4)
    if bnb8.NAME not in records[first][name].codecs:  # stored as codes: what they mean
        held = read_tensors(storage, chain[first], [name, moment.absmax], workers=workers)
        running[:] = bnb8.dequantize(held[name].reshape(-1).numpy(),
                                     held[moment.absmax].reshape(-1).numpy(), qmap,
                                     moment.blocksize)
        first += 1
    scale = _scale_of(record)
    for depth in range(first, len(chain)):
        step_record = records[depth][name]
        if any(c.codec != bnb8.NAME for c in step_record.fragments[0].chunks):
            raise CorruptionError(f"step {chain[depth].step}, tensor {name!r}: mixes bnb8 "
                                  "state chunks with others")

        def decode(chunk: Chunk, depth: int = depth, step_record: TensorRecord = step_record
                   ) -> None:
            source = sources[depth]
            codec, inner, *_ = bnb8.state_params(chunk.params)
            out = running[chunk.raw_offset : chunk.raw_offset + chunk.raw_length]
            stored = source.stored(step_record, chunk)  # its errors name step, tensor and file already
            try:
                if codec == QUANT:
                    decode_quant(stored, inner, out, out,
                                 chunk.raw_offset, None if scale is None else
                                 values[scale][chunk.raw_offset : chunk.raw_offset + out.size])
                else:
                    decode_into(codec, inner, stored, out.view(np.uint8))
            except DeltackptError as exc:
                raise type(exc)(f"{source.where(step_record, chunk)}: {exc}") from None
            source.check_raw(step_record, chunk, out.view(np.uint8))

        run_chunk_tasks([_ChunkTask(c, decode) for c in step_record.fragments[0].chunks],
                        lambda t: t.run(), workers, f"apply bnb8 chunks of step {chain[depth].step}",
                        False)
    try:
        codes, absmax = bnb8.quantize_blockwise(running, qmap, moment.blocksize)
        bnb8.check_requantized(running, codes, absmax, qmap, moment.blocksize)
    except DeltackptError as exc:
        raise type(exc)(f"step {chain[-1].step}, tensor {name!r}: {exc}") from None
    absmax_record = records[-1][moment.absmax]
    for chunk in absmax_record.fragments[0].chunks:
        sources[-1].check_raw(absmax_record, chunk, absmax.view(np.uint8)[
            chunk.raw_offset : chunk.raw_offset + chunk.raw_length])
    tensors[name], tensors[moment.absmax] = torch.from_numpy(codes), torch.from_numpy(absmax)
    values[name] = running


@dataclass
class _ChunkTask:
    """One chunk for :func:`reader.run_chunk_tasks`, decoded by ``decode``."""

    chunk: Chunk
    decode: Callable[[Chunk], None]

    def run(self) -> None:
        self.decode(self.chunk)
