"""Writing one step: chunk, encode and write in parallel, fsync, commit (docs/FORMAT.md 1.1).

Chunks are encoded on a thread pool (the kernels and zstd release the GIL;
:mod:`deltackpt.io.pool`); each thread appends what it encodes to its own data
file. The calling thread only hands out chunks, a bounded number at a time
so memory stays small whatever the model size, and collects their metadata
in order.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Set
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Protocol

import numpy as np
import xxhash

from deltackpt._version import __version__
from deltackpt.codecs import EncodedChunk, encode_lossless
from deltackpt.codecs.lossless import zstd_compress
from deltackpt.dist.shards import Part, parts_to_write
from deltackpt.errors import DeltackptError, FormatError, WriteFailedError, os_failure
from deltackpt.format.dtypes import DTypeSpec, raw_bytes, spec_for
from deltackpt.format.metadata import (
    MAX_METADATA_BYTES,
    MAX_METADATA_INFLATION,
    METADATA_FILE,
    Chunk,
    DataFile,
    Fragment,
    StepMetadata,
    StepStats,
    TensorRecord,
    check_tiling,
    data_file_name,
    step_dir_name,
)
from deltackpt.format.state import CapturedState
from deltackpt.io.pool import INLINE_BYTES, Workers, done, drain, running, worker_count
from deltackpt.io.progress import progress_bar
from deltackpt.io.reader import read_save_id
from deltackpt.io.retired import RetiredFiles
from deltackpt.io.storage import Storage

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_BYTES = 8 << 20

class PendingDigest(Protocol):
    """The xxh3-64 digest of bytes still on a device (:mod:`deltackpt.kernels.gpu_xxh3`)."""

    def hexdigest(self) -> str: ...


ChunkEncoder = Callable[[TensorRecord, DTypeSpec, int, np.ndarray],
                        tuple[EncodedChunk, np.ndarray | PendingDigest]]
"""Codes one chunk: ``(record, spec, raw_offset, raw) -> (stored form, bytes a reader will
decode)``; a chunk coded on a device hands over the digest of those bytes instead."""


def encode_exact(record: TensorRecord, spec: DTypeSpec, raw_offset: int,
                 raw: np.ndarray) -> tuple[EncodedChunk, np.ndarray]:
    """The chunk encoder of full steps: lossless."""
    return encode_lossless(raw, spec), raw


@dataclass
class _Job:
    record: TensorRecord
    fragment: Fragment
    spec: DTypeSpec
    raw_offset: int  # where the chunk starts in the tensor's raw bytes
    raw: np.ndarray  # the chunk's raw bytes


def chunk_spans(nbytes: int, itemsize: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` raw byte offsets of the chunks of a fragment of ``nbytes`` bytes of
    elements of ``itemsize`` bytes: whole elements, at most ``chunk_bytes`` (at least one)."""
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    for start in range(0, nbytes, step):
        yield start, min(start + step, nbytes)


def _chunk_jobs(stored: list[tuple[TensorRecord, Fragment, DTypeSpec, np.ndarray]],
                chunk_bytes: int) -> Iterator[_Job]:
    for record, fragment, spec, raw in stored:
        for start, stop in chunk_spans(raw.size, spec.itemsize, chunk_bytes):
            yield _Job(record, fragment, spec, start, raw[start:stop])


def _fragment_bytes(values: torch.Tensor) -> np.ndarray:
    """The raw bytes of a fragment's values; for a tensor on the ``meta`` device (its chunks
    were coded before the write, on the device that holds it: :mod:`deltackpt.encode.device`)
    an array of its size that reads zeros and holds no memory, which the encoder ignores."""
    if values.is_meta:
        return np.broadcast_to(np.zeros(1, np.uint8), (values.numel() * values.element_size(),))
    return raw_bytes(values)


class _DataFiles:
    """One append-only data file per encoding thread.

    File systems serialize buffered writes to one file, so each thread
    appends the chunks it encodes to a file of its own and the writes of a
    save run in parallel.
    """

    def __init__(self, storage: Storage, step: int, save_id: str, rank: int) -> None:
        self.storage, self.step, self.save_id, self.rank = storage, step, save_id, rank
        self.step_dir = step_dir_name(step)
        self.names: list[str] = []
        self.handles: list[IO[bytes]] = []
        self.sizes: list[int] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def append(self, parts: list) -> tuple[int, int]:
        """Write ``parts`` to this thread's file; returns the file's index and the offset."""
        index = getattr(self._local, "index", None)
        if index is None:
            with self._lock:
                index = len(self.names)
                name = data_file_name(self.save_id, self.rank, index)
                with writing(self.storage, self.step, f"{self.step_dir}/{name}"):
                    self.handles.append(self.storage.create(f"{self.step_dir}/{name}"))
                self.names.append(name)
                self.sizes.append(0)
            self._local.index = index
        offset = self.sizes[index]
        with writing(self.storage, self.step, f"{self.step_dir}/{self.names[index]}"):
            for part in parts:
                self.handles[index].write(part)
                self.sizes[index] += memoryview(part).nbytes
        return index, offset

    def finish(self, pool: Executor) -> list[Future[None]]:
        """Flush, fsync and close every file, in parallel: the tasks doing it."""
        def finish_one(index: int) -> None:
            with writing(self.storage, self.step, f"{self.step_dir}/{self.names[index]}"):
                self.storage.finish(self.handles[index])

        return [pool.submit(finish_one, index) for index in range(len(self.handles))]

    def records(self) -> list[DataFile]:
        """The files written, as metadata."""
        return [DataFile(name, self.rank, size)
                for name, size in zip(self.names, self.sizes, strict=True)]

    def abort(self) -> None:
        """Close and delete every file (the save failed); a close that fails as the writes did (a
        full disk) stops neither its file's removal nor the others'."""
        for handle, name in zip(self.handles, self.names, strict=True):
            with contextlib.suppress(OSError):
                handle.close()
            with contextlib.suppress(OSError):
                self.storage.remove(f"{self.step_dir}/{name}")


def _encode_and_write(job: _Job, encoder: ChunkEncoder, files: _DataFiles) -> Chunk:
    encoded, decoded = encoder(job.record, job.spec, job.raw_offset, job.raw)
    digest = xxhash.xxh3_64()
    for part in encoded.parts:
        digest.update(part)
    file, offset = files.append(encoded.parts)
    raw_digest = xxhash.xxh3_64_hexdigest(decoded) if isinstance(decoded, np.ndarray) \
        else decoded.hexdigest()
    return Chunk(file, offset, encoded.length, job.raw_offset, job.raw.size, encoded.codec,
                 encoded.params, digest.hexdigest(), raw_digest)


@dataclass
class WrittenData:
    """What one process wrote for a step: its tensor records (with the fragments it wrote and
    their chunks), its data files and the raw bytes it coded."""

    records: list[TensorRecord]
    files: list[DataFile]
    raw_bytes: int


def write_data(storage: Storage, step: int, save_id: str, captured: CapturedState, *,
               parts: dict[str, list[Part]] | None = None, rank: int = 0,
               encoder: ChunkEncoder = encode_exact,
               coded_last: Mapping[str, int] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               workers: Workers = None, progress: bool = False,
               sync_dirs: tuple[str, ...] = ()) -> WrittenData:
    """Encode and durably write this process's part of ``captured`` into step ``step``'s
    directory (which must exist), in data files named by ``save_id`` and the rank.

    ``parts`` (a multi-rank save, :func:`distributed.shard_parts`) gives
    the boxes of each tensor that ``rank`` writes (default: every tensor
    whole); records keep the global shape. ``encoder`` codes each chunk
    (default: losslessly). ``coded_last`` maps tensors to a phase (other
    tensors: 0); the chunks of a phase are coded only once those of every
    earlier phase are (their coding reads what those left, e.g. a cast of a
    master copy). ``workers``: the threads that encode and write
    (:data:`pool.Workers`). ``sync_dirs``: directories fsynced while the
    data files are (e.g. the root, after the step's directory was created in
    it). Nothing is visible until a commit lists the files; on an error this
    process's files are deleted, and an ``OSError`` (a full disk) is raised
    as :class:`WriteFailedError` naming the step and the file.
    """
    records, stored = [], []
    for item in captured.tensors:
        spec = spec_for(item.tensor.dtype, item.name)
        record = TensorRecord(item.name, item.role, spec.name, list(item.global_shape),
                              item.fqn, item.state_key, item.alias_of)
        records.append(record)
        if item.alias_of is None:
            mine = parts[item.name] if parts is not None else \
                parts_to_write(item.name, item.role, item.tensor, None, item.placement)
            for part in mine:
                fragment = Fragment(part.offsets, part.sizes)
                record.fragments.append(fragment)
                stored.append((record, fragment, spec, _fragment_bytes(part.values)))
    raw_total = sum(raw.size for *_, raw in stored)

    files = _DataFiles(storage, step, save_id, rank)
    in_flight: deque[tuple[_Job, Future[Chunk]]] = deque()
    syncs: list[Future[None]] = []
    try:
        with running(workers) as pool, \
                progress_bar(raw_total, f"save step {step}", progress) as bar:

            def collect_oldest() -> None:
                job, future = in_flight.popleft()
                job.fragment.chunks.append(future.result())
                bar.update(job.raw.size)

            phases = coded_last or {}
            for phase in sorted({0, *phases.values()}):
                for job in _chunk_jobs([s for s in stored if phases.get(s[0].name, 0) == phase],
                                       chunk_bytes):
                    in_flight.append((job, done(_encode_and_write, job, encoder, files)
                                      if job.raw.size < INLINE_BYTES else
                                      pool.submit(_encode_and_write, job, encoder, files)))
                    if len(in_flight) >= 4 * worker_count(workers):
                        collect_oldest()
                while in_flight:
                    collect_oldest()
            syncs = files.finish(pool)
            for directory in sync_dirs:  # meanwhile, here
                with writing(storage, step, directory):
                    storage.sync_dir(directory)
            for sync in syncs:  # the files fsynced in parallel
                sync.result()
    except BaseException:
        drain([future for _, future in in_flight] + syncs)
        files.abort()
        raise
    return WrittenData(records, files.records(), raw_total)


def merge_written(per_rank: list[WrittenData]) -> WrittenData:
    """One step's data from what every rank wrote (in rank order): each tensor's record with
    every rank's fragments, and every rank's files, chunks pointed at their merged index.

    Raises :class:`FormatError` naming the tensor whose fragments do not
    tile it exactly once.
    """
    records = [TensorRecord(r.name, r.role, r.dtype, r.shape, r.fqn, r.state_key, r.alias_of)
               for r in per_rank[0].records]
    files: list[DataFile] = []
    for written in per_rank:
        for record, theirs in zip(records, written.records, strict=True):
            if theirs.name != record.name:
                raise FormatError(f"ranks list tensor {record.name!r} and {theirs.name!r} "
                                  "at the same position")
            for fragment in theirs.fragments:
                for chunk in fragment.chunks:
                    chunk.file += len(files)
                record.fragments.append(fragment)
        files += written.files
    for record in records:
        if record.alias_of is not None:  # stored under the tensor it aliases
            continue
        record.fragments.sort(key=lambda f: f.offsets)
        try:
            check_tiling(record)
        except FormatError as exc:
            raise FormatError(f"tensor {record.name!r}: {exc}") from None
    return WrittenData(records, files, sum(w.raw_bytes for w in per_rank))


def step_metadata(step: int, save_id: str, written: WrittenData, tree: dict, *, kind: str,
                  base_step: int | None, world_size: int, seconds: float,
                  summary: dict | None = None) -> StepMetadata:
    """The metadata of a step whose data ``written`` holds (every rank's, merged)."""
    return StepMetadata(
        step=step, kind=kind, base_step=base_step, save_id=save_id,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__, world_size=world_size, files=written.files,
        tensors=written.records, state=tree,
        stats=StepStats(written.raw_bytes, sum(f.size for f in written.files), round(seconds, 6),
                        **(summary or {})))


def metadata_bytes(meta: StepMetadata) -> bytes:
    """The content of ``meta``'s ``metadata.json`` as a commit writes it: its text, compressed
    for a delta step unless the text is more than ``MAX_METADATA_INFLATION`` times the frame
    (readers refuse such frames). Raises :class:`FormatError` when the text is larger than
    readers accept."""
    text = meta.to_json().encode()
    if len(text) > MAX_METADATA_BYTES:
        raise FormatError(f"step {meta.step}: its metadata would take {len(text)} bytes, more "
                          f"than readers accept ({MAX_METADATA_BYTES}); save fewer, larger "
                          "chunks (chunk_bytes)")
    if meta.kind == "delta":  # a delta's data is small enough that its metadata's size matters
        frame = zstd_compress(text, "metadata")
        if len(text) <= MAX_METADATA_INFLATION * len(frame):
            return frame
    return text


def stage_metadata(storage: Storage, meta: StepMetadata) -> str:
    """Write ``meta``'s ``metadata.json`` durably to a temporary file beside it, uncommitted;
    returns that file, which ``commit_step(storage, meta, staged)`` renames. A commit from a
    staged file writes nothing, so it cannot fail for want of space."""
    rel = f"{step_dir_name(meta.step)}/{METADATA_FILE}"
    with writing(storage, meta.step, rel):
        return storage.stage(rel, metadata_bytes(meta))


def commit_step(storage: Storage, meta: StepMetadata, staged: str | None = None, *,
                present: list[str] | None = None, retired: RetiredFiles | None = None) -> None:
    """Make ``meta``'s step visible (the rename of its ``metadata.json``, from ``staged`` if
    :func:`stage_metadata` wrote it), then delete the files of its directory it does not
    reference (those of a step it replaces, which ``retired`` keeps a while): of ``present``
    (:func:`remove_unreferenced`)."""
    step_dir = step_dir_name(meta.step)
    rel = f"{step_dir}/{METADATA_FILE}"
    with writing(storage, meta.step, rel):
        if staged is None:
            storage.commit_file(rel, metadata_bytes(meta))
        else:
            storage.publish(staged, rel)
    remove_unreferenced(storage, step_dir, meta, present, retired)


def discard(storage: Storage, meta: StepMetadata, staged: str | None = None) -> None:
    """Delete the data files of ``meta``'s version of its step and its ``staged`` metadata,
    unless that version was committed after all (the failure came after the rename): what a
    failed save or gc leaves. Every file is tried, whatever removing the others does."""
    if committed(storage, meta.step, meta.save_id):
        return
    step_dir = step_dir_name(meta.step)
    rels = [f"{step_dir}/{f.name}" for f in meta.files]
    if staged is not None:
        rels.append(staged)
    for rel in rels:
        with contextlib.suppress(OSError, DeltackptError):
            storage.remove(rel)


def committed(storage: Storage, step: int, save_id: str) -> bool:
    """Whether the committed version of ``step`` is the one save ``save_id`` wrote (a save, or
    a rewrite by gc): a failure that came after the rename of its metadata leaves it committed
    after all."""
    with contextlib.suppress(OSError):
        return read_save_id(storage, step) == save_id
    return False


@contextlib.contextmanager
def writing(storage: Storage, step: int, rel: str) -> Iterator[None]:
    """Raise an ``OSError`` of writing file ``rel`` of step ``step`` (a full disk, an I/O error)
    as :class:`WriteFailedError` naming both, with its ``errno``."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, WriteFailedError) and getattr(exc, "step", None) is not None:
            raise  # named already, by an outer call
        error = os_failure(WriteFailedError, getattr(exc, "path", None) or f"{storage.url}/{rel}",
                           exc, f"writing step {step} failed: ", "; committed steps are intact")
        error.step = step
        raise error from exc


def new_save_id() -> str:
    """A fresh identifier of one save (it names the save's data files)."""
    return secrets.token_hex(8)


def remove_unreferenced(storage: Storage, step_dir: str, meta: StepMetadata,
                        present: list[str] | None = None, retired: RetiredFiles | None = None,
                        keep: Set[str] = frozenset()) -> None:
    """Delete files in ``step_dir`` that its committed metadata does not reference; ``retired``
    keeps their data files for the readers that may still read them (:mod:`deltackpt.io.retired`)
    instead; ``keep`` (paths from the root) are retired already.

    ``present``: the objects the directory held before the save that committed ``meta``, from
    :meth:`Storage.list_files` under the writer lock (an object store's one listing, taken
    when the save was prepared); no other writer adds any since, and this one only added
    ``meta``'s, so they are all there is to delete, without listing again. Default: the
    directory is listed now.
    """
    referenced = {METADATA_FILE} | {f.name for f in meta.files}
    if present is not None:  # no save writes below a step's prefix
        names = [n for n in present if n not in referenced and "/" not in n]
    else:  # no save makes a directory there
        names = [n for n in storage.listdir(step_dir)
                 if n not in referenced and storage.kind(f"{step_dir}/{n}") != "dir"]
    paths = [f"{step_dir}/{name}" for name in names if f"{step_dir}/{name}" not in keep]
    if retired is not None:
        retired.release(paths)
        return
    for rel in paths:
        storage.remove(rel)
