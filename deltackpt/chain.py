"""The restore chain: rebuild a delta step from its full step and the deltas in between.

A delta step's lossy chunks are coded against the reconstruction of its
base step (docs/FORMAT.md 4). Restoring step ``s`` therefore walks the
``base_step`` links down to a full step, decodes it, and applies each delta
in order to a running float32 reconstruction, checking every chunk of every
step against its checksums on the way. A tensor whose chunks in some step
do not depend on the base (stored exactly, or coded directly) is decoded
from that step on only.

:class:`Reconstruction` is that running state. The writer keeps one too,
updated by every save, so the residuals it codes are against exactly what
a reader will have: the error of a restored step is that of one delta,
however long the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt.codecs.quant import NAME as QUANT
from deltackpt.codecs.quant import decode_quant, uses_base
from deltackpt.compression import LOSSY_DTYPES
from deltackpt.dtypes import dtype_bytes, float32_values, spec_named
from deltackpt.errors import CorruptionError, DeltackptError, StepNotFoundError
from deltackpt.format import Chunk, StepMetadata, TensorRecord
from deltackpt.reader import ChunkSource, read_metadata, read_tensors, run_chunk_tasks
from deltackpt.storage import Storage

Layout = dict[str, tuple[str, str, tuple[int, ...]]]


def layout_of(meta: StepMetadata) -> Layout:
    """Role, dtype and shape of every stored (non-alias) tensor of a step."""
    return {r.name: (r.role, r.dtype, tuple(r.shape)) for r in meta.tensors if r.alias_of is None}


@dataclass
class Reconstruction:
    """What a reader holds after restoring ``step``: the float32 running value of each tensor.

    ``values`` maps tensor names to flat float32 arrays (tensors of dtypes
    a delta may code lossily); ``layout`` is the step's tensor layout, and
    ``deltas`` the number of delta steps since its full step; ``save_id``
    identifies the save that wrote the step (a step overwritten since is
    another save). ``chain`` lists the steps from the full step up to
    ``step``. A writer also knows ``errors``, the mean squared error its
    save left per tensor (a reader cannot know it: it lacks the truth).
    """

    step: int
    deltas: int
    layout: Layout
    values: dict[str, np.ndarray] = field(default_factory=dict)
    save_id: str = ""
    errors: dict[str, float] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)


def chain_of(storage: Storage, meta: StepMetadata,
             read: Callable[[int], StepMetadata] | None = None) -> list[StepMetadata]:
    """Metadata of the full step under ``meta`` and every delta up to it, in order.

    ``read`` reads a step's metadata (default: from ``storage``; a caller
    walking many chains passes a cached reader). Raises
    :class:`CorruptionError` naming the step whose base is missing or
    unreadable, so the caller can tell which link is broken.
    """
    read = read or (lambda step: read_metadata(storage, step))
    chain = [meta]
    while chain[-1].kind == "delta":
        top = chain[-1]
        if top.base_step >= top.step:
            raise CorruptionError(f"step {top.step} names base step {top.base_step}, which is "
                                  "not an earlier step")
        try:
            chain.append(read(top.base_step))
        except StepNotFoundError:
            raise CorruptionError(
                f"step {meta.step} cannot be restored: step {top.step} is a delta on step "
                f"{top.base_step}, which is missing from {storage.url}") from None
        except DeltackptError as exc:
            raise CorruptionError(f"step {meta.step} cannot be restored: the metadata of its "
                                  f"base step {top.base_step} cannot be read ({exc})") from None
    return chain[::-1]


def _self_contained(record: TensorRecord) -> bool:
    return not any(c.codec == QUANT and uses_base(c.params)
                   for f in record.fragments for c in f.chunks)


def _first_needed(chain: list[StepMetadata], name: str) -> int:
    """Index of the first step of the chain ``name`` must be decoded from."""
    for i in range(len(chain) - 1, -1, -1):
        try:
            record = chain[i].tensor(name)
        except KeyError:
            raise CorruptionError(
                f"step {chain[i + 1].step}: tensor {name!r} is coded against base step "
                f"{chain[i].step}, which does not hold it") from None
        if i + 1 < len(chain):
            later = chain[i + 1].tensor(name)
            if (record.dtype, record.shape) != (later.dtype, later.shape):
                raise CorruptionError(
                    f"step {chain[i + 1].step}: tensor {name!r} ({later.dtype} {later.shape}) is "
                    f"coded against step {chain[i].step}, where it is {record.dtype} {record.shape}")
        if _self_contained(record):
            return i
    raise CorruptionError(f"tensor {name!r} of step {chain[-1].step} depends on a base in "
                          f"every step down to the full step {chain[0].step}")


@dataclass
class _DeltaTask:
    record: TensorRecord
    chunk: Chunk
    state: np.ndarray | None  # float32 slice of the running value, or None
    out: np.ndarray  # raw bytes of the chunk in the tensor's dtype


def _single_box(meta: StepMetadata, record: TensorRecord) -> None:
    if len(record.fragments) != 1 or record.fragments[0].sizes != record.shape:
        raise CorruptionError(f"step {meta.step}, tensor {record.name!r}: a delta step must "
                              "store each tensor as one whole fragment")


def _apply_delta(source: ChunkSource, task: _DeltaTask) -> None:
    record, chunk = task.record, task.chunk
    where = f"step {source.meta.step}, tensor {record.name!r}, file {source.path(chunk)}"
    if chunk.codec == QUANT:
        if task.state is None:
            raise CorruptionError(f"{where}: quant chunk on a {record.dtype} tensor")
        stored = source.stored(record, chunk)
        try:
            decode_quant(stored, chunk.params, task.state, task.state)
        except DeltackptError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if record.dtype != "float32":  # float32 tensors are their running values
            task.out[:] = dtype_bytes(task.state, record.dtype)
        source.check_raw(record, chunk, task.out)
    else:
        source.decode(record, chunk, task.out)
        if task.state is not None:
            task.state[:] = float32_values(task.out, record.dtype)


def restore_chain(storage: Storage, meta: StepMetadata, *, workers: int | None = None,
                  progress: bool = False) -> tuple[dict[str, torch.Tensor], Reconstruction]:
    """Every tensor of step ``meta`` rebuilt through its chain, and the reconstruction.

    Tensors are returned by name as :func:`reader.read_tensors` returns
    them (aliases share their target). The reconstruction's arrays share
    memory with the returned float32 tensors.
    """
    chain = chain_of(storage, meta)
    final = {r.name: r for r in meta.tensors if r.alias_of is None}
    start = {name: _first_needed(chain, name) for name in final}
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, np.ndarray] = {}

    full_names = [n for n, i in start.items() if i == 0]
    for name, tensor in read_tensors(storage, chain[0], full_names, workers=workers,
                                     progress=progress).items():
        tensors[name] = tensor.reshape(-1).contiguous()
    for depth, step_meta in enumerate(chain[1:], start=1):
        tasks = []
        for record in step_meta.tensors:
            if record.alias_of is not None or record.name not in final or start[record.name] > depth:
                continue
            _single_box(step_meta, record)
            if record.name not in tensors:
                dtype = spec_named(record.dtype, record.name).torch_dtype
                tensors[record.name] = torch.empty(record.numel, dtype=dtype)
            flat = tensors[record.name]
            raw = flat.view(torch.uint8).numpy()
            state = _state(values, record, flat)
            itemsize = flat.element_size()
            for chunk in record.fragments[0].chunks:
                lo, hi = chunk.raw_offset // itemsize, (chunk.raw_offset + chunk.raw_length) // itemsize
                tasks.append(_DeltaTask(record, chunk, None if state is None else state[lo:hi],
                                        raw[chunk.raw_offset : chunk.raw_offset + chunk.raw_length]))
        source = ChunkSource(storage, step_meta)
        try:
            run_chunk_tasks(tasks, lambda t, s=source: _apply_delta(s, t), workers,
                            f"apply step {step_meta.step}", progress)
        finally:
            source.close()

    for name, record in final.items():
        _state(values, record, tensors[name])  # running values of tensors no delta touched
        tensors[name] = tensors[name].reshape(record.shape)
    out = {}
    for record in meta.tensors:
        out[record.name] = tensors[record.alias_of or record.name]
    deltas = len(chain) - 1
    return out, Reconstruction(meta.step, deltas, layout_of(meta), values, meta.save_id,
                               chain=[m.step for m in chain])


def _state(values: dict[str, np.ndarray], record: TensorRecord,
           flat: torch.Tensor) -> np.ndarray | None:
    """The float32 running value of a tensor of a lossy-capable dtype (created on first use)."""
    if record.dtype not in LOSSY_DTYPES:
        return None
    if record.name not in values:
        values[record.name] = flat.numpy().view(np.float32) if record.dtype == "float32" \
            else flat.float().numpy()
    return values[record.name]
