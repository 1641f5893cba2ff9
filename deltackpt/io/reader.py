"""Reading one step: metadata, then chunks fetched, checked and decoded in parallel.

Each chunk's stored bytes are checked against their xxh3 before decoding
and the decoded bytes against ``raw_xxh3`` after, so corruption is reported
with the step, tensor and file it hit instead of surfacing as wrong numbers.

Reading metadata and checking checksums needs neither torch nor the Numba
kernels, so this module imports them only where it decodes (``deltackpt ls``,
``info`` and ``verify`` start without them).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash
import zstandard

from deltackpt.errors import (
    CorruptionError,
    DeltackptError,
    FormatError,
    ReadFailedError,
    StepNotFoundError,
)
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import (
    MAX_METADATA_BYTES,
    MAX_METADATA_INFLATION,
    METADATA_FILE,
    STEP_DIR_PATTERN,
    ZSTD_MAGIC,
    Box,
    Chunk,
    Fragment,
    StepMetadata,
    TensorRecord,
    box_index,
    box_intersection,
    check_seal,
    layout_of,
    load_json,
    parse_step_metadata,
    step_dir_name,
)
from deltackpt.io.pool import INLINE_BYTES, Workers, drain, running
from deltackpt.io.progress import progress_bar
from deltackpt.io.storage import RangeReader, Storage

if TYPE_CHECKING:
    import torch


def list_steps(storage: Storage) -> list[int]:
    """Committed steps, ascending.

    A step directory that is not a directory (a link, a FIFO) or that cannot
    be looked into (permission denied) is listed too, so that reading it
    reports what it is instead of the step vanishing from view; one that is
    gone by the time it is looked at (a failed save's, removed meanwhile) is not.
    """
    files = storage.list_files()
    if files is not None:  # an object store: one listing, and no entry is other than an object
        return sorted({int(match.group(1)) for step_dir, _, name in
                       (path.partition("/") for path in files)
                       if name == METADATA_FILE and (match := STEP_DIR_PATTERN.fullmatch(step_dir))})
    if not storage.is_dir(""):
        return []
    steps = []
    for name in storage.listdir():
        match = STEP_DIR_PATTERN.fullmatch(name)
        if match and (kind := storage.kind(name)) is not None \
                and (kind != "dir" or _committed(storage, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _committed(storage: Storage, step_dir: str) -> bool:
    """Whether ``step_dir`` holds a ``metadata.json``, or cannot be looked into."""
    try:
        return storage.exists(f"{step_dir}/{METADATA_FILE}")
    except ReadFailedError:
        return True


def step_not_found(storage: Storage, step: int) -> StepNotFoundError:
    """The error for a step that was never committed, listing the ones that were."""
    available = ", ".join(map(str, list_steps(storage))) or "none"
    return StepNotFoundError(f"step {step} not found in {storage.url}; available steps: {available}")


def _metadata_text(storage: Storage, step: int) -> tuple[bytes, str]:
    """The JSON text of ``step``'s metadata file (decompressed) and the file's URL."""
    rel = f"{step_dir_name(step)}/{METADATA_FILE}"
    where = f"{storage.url}/{rel}"
    try:
        size = storage.size(rel)
        if size > MAX_METADATA_BYTES:
            raise FormatError(f"{where}: {size} bytes, more than metadata may take "
                              f"({MAX_METADATA_BYTES})")
        text = storage.read_bytes(rel)
    except FileNotFoundError:
        raise step_not_found(storage, step) from None
    if text[:4] == ZSTD_MAGIC:
        text = _decompress_metadata(text, where)
    return text, where


def read_metadata(storage: Storage, step: int) -> StepMetadata:
    """Parsed and validated metadata of ``step``."""
    text, where = _metadata_text(storage, step)
    meta = parse_step_metadata(text, where)
    if meta.step != step:
        raise CorruptionError(f"{where}: records step {meta.step}, not {step}")
    return meta


def chain_of(storage: Storage, meta: StepMetadata,
             read: Callable[[int], StepMetadata] | None = None) -> list[StepMetadata]:
    """Metadata of the full step under ``meta`` and every delta up to it, in order.

    ``read`` reads a step's metadata (default: from ``storage``; a caller
    walking many chains passes a cached reader). Raises
    :class:`CorruptionError` naming the step whose base is missing or
    unreadable or holds other tensors, so the caller can tell which link is broken.
    """
    read = read or (lambda step: read_metadata(storage, step))
    chain = [meta]
    layout = layout_of(meta)
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
        except ReadFailedError:  # says nothing of the chain's integrity, and names the file
            raise
        except DeltackptError as exc:
            raise CorruptionError(f"step {meta.step} cannot be restored: the metadata of its "
                                  f"base step {top.base_step} cannot be read ({exc})") from None
        below = layout_of(chain[-1])
        if below != layout:  # no delta's tensor outgrows its full step's
            raise CorruptionError(f"step {top.step} is a delta on step {top.base_step}, which "
                                  "holds other tensors (names, roles, dtypes or shapes; FORMAT.md 5)")
        layout = below
    return chain[::-1]


def dependents(step: int, steps: Iterable[int],
               metadata: Callable[[int], StepMetadata]) -> list[int]:
    """The committed delta steps of ``steps`` coded directly against ``step``, by their
    ``metadata`` (those whose metadata cannot be read are left out)."""
    out = []
    for s in steps:
        if s > step:
            with contextlib.suppress(DeltackptError):
                if metadata(s).base_step == step:
                    out.append(s)
    return out


def read_save_id(storage: Storage, step: int) -> str | None:
    """The ``save_id`` of a committed step, or None if it cannot be read.

    Reads only that field, without validating the rest: a writer checking
    that the step it coded the next delta against is still the one it
    wrote needs no more (a full parse costs tens of ms per save).
    """
    try:
        text, where = _metadata_text(storage, step)
        check_seal(text, where)
        save_id = load_json(text, where).get("save_id")
    except (DeltackptError, AttributeError):
        return None
    return save_id if isinstance(save_id, str) else None


def _decompress_metadata(data: bytes, where: str) -> bytes:
    """The JSON of a zstd-compressed ``metadata.json`` (FORMAT.md 2), whose stated size is
    checked against the bounds before anything is inflated."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: damaged zstd frame ({exc})") from None
    if not 0 <= size <= min(MAX_METADATA_BYTES, MAX_METADATA_INFLATION * len(data)):
        raise FormatError(f"{where}: its zstd frame states no size, or {size} bytes: more than "
                          f"metadata may take (at most {MAX_METADATA_INFLATION} times the "
                          f"frame's {len(data)} and {MAX_METADATA_BYTES})")
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: damaged zstd frame ({exc})") from None


class ChunkSource:
    """Opens each data file of a step once and reads verified chunks from it."""

    def __init__(self, storage: Storage, meta: StepMetadata) -> None:
        self.storage, self.meta = storage, meta
        self._readers: dict[int, RangeReader] = {}
        self._lock = threading.Lock()

    def path(self, chunk: Chunk) -> str:
        return f"{self.storage.url}/{step_dir_name(self.meta.step)}/{self.meta.files[chunk.file].name}"

    def where(self, record: TensorRecord, chunk: Chunk) -> str:
        """The step, tensor and file of a chunk, to start an error message with."""
        return f"step {self.meta.step}, tensor {record.name!r}, file {self.path(chunk)}"

    def _reader(self, index: int) -> RangeReader:
        with self._lock:
            if index not in self._readers:
                name = self.meta.files[index].name
                self._readers[index] = self.storage.open_reader(
                    f"{step_dir_name(self.meta.step)}/{name}")
            return self._readers[index]

    def prefetch(self, chunks: Iterable[Chunk]) -> None:
        """Tell the readers of the step's files which chunks will be read, in about that order
        (a remote reader starts fetching them)."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        for chunk in chunks:
            by_file.setdefault(chunk.file, []).append((chunk.offset, chunk.length))
        for index, ranges in by_file.items():
            try:
                reader = self._reader(index)
            except DeltackptError:  # missing or not a file: each read of its chunks says so
                continue
            reader.prefetch(ranges)

    def stored(self, record: TensorRecord, chunk: Chunk) -> memoryview:
        """The chunk's stored bytes, checked against their checksum."""
        try:
            data = self._reader(chunk.file).read(chunk.offset, chunk.length)
        except CorruptionError as exc:  # it names the file
            raise type(exc)(f"step {self.meta.step}, tensor {record.name!r}: {exc}") from None
        if xxhash.xxh3_64_hexdigest(data) != chunk.xxh3:
            raise CorruptionError(f"{self.where(record, chunk)}: checksum mismatch in bytes "
                                  f"{chunk.offset}.."
                                  f"{chunk.offset + chunk.length} (the file is corrupted)")
        return memoryview(data)

    def decode(self, record: TensorRecord, chunk: Chunk, out: np.ndarray) -> None:
        """Decode the chunk into ``out`` (its raw bytes) and check the result."""
        from deltackpt.codecs import decode_into

        stored = self.stored(record, chunk)
        try:
            decode_into(chunk.codec, chunk.params, stored, out)
        except DeltackptError as exc:
            raise type(exc)(f"{self.where(record, chunk)}: {exc}") from None
        self.check_raw(record, chunk, out)

    def check_raw(self, record: TensorRecord, chunk: Chunk, out: np.ndarray) -> None:
        """Raise unless ``out`` (a decoded chunk) matches the chunk's ``raw_xxh3``."""
        if xxhash.xxh3_64_hexdigest(out) != chunk.raw_xxh3:
            raise CorruptionError(f"{self.where(record, chunk)}: decoded bytes do not match their "
                                  "checksum")

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


@dataclass
class _Task:
    record: TensorRecord
    chunk: Chunk
    out: np.ndarray


@dataclass
class _Placement:
    """Where part of a fragment's decoded bytes go once its chunks are decoded: ``buffer``
    holds its elements from ``first`` on; the box ``inter`` (global coordinates) of them is
    copied into ``out``, whose box starts at ``origin``."""

    frag: Fragment
    buffer: torch.Tensor
    first: int
    inter: Box
    out: torch.Tensor
    origin: list[int]

    def place(self) -> None:
        (offsets, sizes), frag = self.inter, self.frag
        row = math.prod(frag.sizes[1:])
        start = (offsets[0] - frag.offsets[0]) * row - self.first
        rows = self.buffer[start : start + sizes[0] * row].view(sizes[0], *frag.sizes[1:])
        src = rows[(slice(None), *box_index(offsets[1:], sizes[1:], frag.offsets[1:]))]
        self.out[box_index(offsets, sizes, self.origin)] = src


def _flat_bytes(tensor: torch.Tensor) -> np.ndarray:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def read_tensors(storage: Storage, meta: StepMetadata, names: Iterable[str] | None = None, *,
                 boxes: dict[str, Box] | None = None, workers: Workers = None,
                 progress: bool = False) -> dict[str, torch.Tensor]:
    """Decode the tensors ``names`` (default: all) of a step; aliases share their target.

    ``boxes`` restricts a tensor to one box (in global coordinates; the
    result has the box's sizes): only the chunks that hold its rows are read
    and decoded, so a rank loading its shard of a tensor saved under
    another layout reads little more than that shard.
    """
    import torch

    wanted = {r.name for r in meta.tensors} if names is None else set(names)
    records = {r.name: r for r in meta.tensors}
    unknown = sorted(wanted - records.keys())
    if unknown:
        raise KeyError(f"step {meta.step} has no tensor(s) {unknown}")
    check_chunks_readable(storage, meta)
    boxes = boxes or {}
    targets = {records[n].alias_of or n for n in wanted}
    tensors: dict[str, torch.Tensor] = {}
    tasks: list[_Task] = []
    placements: list[_Placement] = []
    for name in sorted(targets):
        record = records[name]
        box = boxes.get(name, ([0] * len(record.shape), list(record.shape)))
        tensor = torch.empty(box[1], dtype=spec_named(record.dtype, name).torch_dtype)
        tensors[name] = tensor
        for frag in record.fragments:
            if (frag.offsets, frag.sizes) == (box[0], box[1]):  # decoded in place
                flat = _flat_bytes(tensor)
                tasks.extend(_Task(record, c, flat[c.raw_offset : c.raw_offset + c.raw_length])
                             for c in frag.chunks)
                continue
            inter = box_intersection((frag.offsets, frag.sizes), box) if frag.sizes else None
            if inter is None:
                continue
            # The chunks that hold the rows (along the first dimension) the box needs.
            row_bytes = math.prod(frag.sizes[1:]) * tensor.element_size()
            lo = (inter[0][0] - frag.offsets[0]) * row_bytes
            hi = lo + inter[1][0] * row_bytes
            chunks = [c for c in frag.chunks if c.raw_offset < hi and c.raw_offset + c.raw_length > lo]
            first, last = chunks[0].raw_offset, chunks[-1].raw_offset + chunks[-1].raw_length
            buffer = torch.empty(last - first, dtype=torch.uint8)
            flat = buffer.numpy()
            tasks.extend(_Task(record, c, flat[c.raw_offset - first : c.raw_offset - first
                                               + c.raw_length]) for c in chunks)
            placements.append(_Placement(frag, buffer.view(tensor.dtype),
                                         first // tensor.element_size(), inter, tensor, box[0]))
    source = ChunkSource(storage, meta)
    try:
        source.prefetch(t.chunk for t in tasks)
        run_chunk_tasks(tasks, lambda t: source.decode(t.record, t.chunk, t.out), workers,
             f"restore step {meta.step}", progress)
    finally:
        source.close()
    for placement in placements:
        placement.place()
    for name in wanted:
        if records[name].alias_of is not None:
            tensors[name] = tensors[records[name].alias_of]
    return {n: tensors[n] for n in (r.name for r in meta.tensors) if n in wanted}


def check_chunks_readable(storage: Storage, meta: StepMetadata) -> None:
    """Raise, as reading it would, for the first chunk of a step that cannot be read: of a codec
    this deltackpt does not know, beyond the end of its data file, or in a missing one. A
    restore checks this before it allocates anything on the word of the metadata (whose chunk
    ranges are checked against the files' recorded sizes, not their sizes on disk)."""
    from deltackpt.codecs.base import codec_named

    chain_only = _chain_only_codecs()
    source = ChunkSource(storage, meta)
    try:
        for record, chunk in _all_chunks(meta):
            if chunk.codec not in chain_only:  # those decode through the chain
                try:
                    codec_named(chunk.codec)
                except FormatError as exc:
                    raise FormatError(f"{source.where(record, chunk)}: {exc}") from None
        for index, file in enumerate(meta.files):
            try:
                size = storage.size(f"{step_dir_name(meta.step)}/{file.name}")
            except FileNotFoundError:
                size = -1
            if size < file.size:
                for record, chunk in _all_chunks(meta):
                    if chunk.file == index and (size < 0 or chunk.offset + chunk.length > size):
                        source.stored(record, chunk)  # raises, naming step, tensor and file
    finally:
        source.close()


def run_chunk_tasks(tasks: list, fn, workers: Workers, description: str,
                    progress: bool) -> None:
    """Run ``fn`` over tasks (each with a ``chunk``) on ``workers``; the first error propagates,
    once no task of the call runs any more.

    Chunks of less than ``INLINE_BYTES`` run on the calling thread while the workers take the
    others: restores of TinyGPT states of 1.4, 22 and 305 MB through 8 deltas took 6-18% less
    time than with every chunk handed to a worker, the full step of the 1.4 MB one 40% less."""
    total = sum(t.chunk.raw_length for t in tasks)
    with progress_bar(total, description, progress) as bar, running(workers) as pool:
        pooled = [task for task in tasks if task.chunk.raw_length >= INLINE_BYTES]
        futures = [pool.submit(fn, task) for task in pooled]
        try:
            for task in tasks:
                if task.chunk.raw_length < INLINE_BYTES:
                    fn(task)
                    bar.update(task.chunk.raw_length)
            for task, future in zip(pooled, futures, strict=True):
                future.result()
                bar.update(task.chunk.raw_length)
        finally:
            drain(futures)


@dataclass
class StepCheck:
    """What :func:`verify_step` found in a step: ``problems`` (damage), by the URL of the data
    file they are in, and the files it ``could_not_read`` (a permission denied, an I/O
    error), with the reason, which say nothing of the step's integrity."""

    problems: dict[str, list[str]]
    could_not_read: dict[str, str]


def verify_step(storage: Storage, meta: StepMetadata, *, deep: bool = False,
                workers: Workers = None, progress: bool = False) -> StepCheck:
    """Check a step's data: missing or truncated files and checksum mismatches are problems.

    Checks stored bytes against their checksums; with ``deep`` also decodes
    every chunk that decodes on its own (not the ``quant``, ``cast`` and ``bnb8`` chunks
    of a delta, which need their chain: see ``CheckpointManager.verify``) and checks the
    result. Gives one message per damaged chunk, in the order of the step's chunks.
    """
    problems: dict[int, str] = {}  # by id of the task, filled from the pool's threads
    unread: dict[str, str] = {}
    source = ChunkSource(storage, meta)
    chain_only = _chain_only_codecs() if deep else ()

    def check(task: _Task) -> None:
        try:
            if deep and task.chunk.codec not in chain_only:
                source.decode(task.record, task.chunk, np.empty(task.chunk.raw_length, np.uint8))
            else:
                source.stored(task.record, task.chunk)
        except ReadFailedError as exc:
            unread.setdefault(source.path(task.chunk), str(exc))
        except DeltackptError as exc:
            problems[id(task)] = str(exc)

    tasks = [_Task(r, c, np.empty(0, np.uint8)) for r, c in _all_chunks(meta)]
    try:
        source.prefetch(t.chunk for t in tasks)
        run_chunk_tasks(tasks, check, workers, f"verify step {meta.step}", progress)
    finally:
        source.close()
    by_file: dict[str, list[str]] = {}
    for task in tasks:
        if id(task) in problems:
            by_file.setdefault(source.path(task.chunk), []).append(problems[id(task)])
    return StepCheck(by_file, dict(sorted(unread.items())))


def _chain_only_codecs() -> tuple[str, ...]:
    """The codecs whose chunks decode only on their chain (their modules import torch and the
    kernels: imported by a deep check only)."""
    from deltackpt.codecs.bnb8 import NAME as BNB8
    from deltackpt.codecs.cast import NAME as CAST
    from deltackpt.codecs.patch import NAME as PATCH
    from deltackpt.codecs.quant import NAME as QUANT
    from deltackpt.codecs.unchanged import NAME as UNCHANGED

    return QUANT, CAST, BNB8, UNCHANGED, PATCH


def _all_chunks(meta: StepMetadata) -> Iterator[tuple[TensorRecord, Chunk]]:
    for record in meta.tensors:
        for frag in record.fragments:
            for chunk in frag.chunks:
                yield record, chunk
