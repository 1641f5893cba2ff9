"""Writing one step: chunk, encode and write in parallel, fsync, commit (docs/FORMAT.md 1.1).

Chunks are encoded on a thread pool (the kernels and zstd release the GIL);
each thread appends what it encodes to its own data file. The calling thread
only hands out chunks, a bounded number at a time so memory stays small
whatever the model size, and collects their metadata in order.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO

import numpy as np
import torch
import xxhash

from deltackpt import __version__
from deltackpt.codecs import EncodedChunk, encode_lossless
from deltackpt.codecs.lossless import zstd_compress
from deltackpt.dtypes import DTypeSpec, spec_for
from deltackpt.format import (
    METADATA_FILE,
    Chunk,
    DataFile,
    Fragment,
    StepMetadata,
    StepStats,
    TensorRecord,
    data_file_name,
    step_dir_name,
)
from deltackpt.progress import progress_bar
from deltackpt.state import CapturedState
from deltackpt.storage import Storage

DEFAULT_CHUNK_BYTES = 8 << 20

ChunkEncoder = Callable[[TensorRecord, DTypeSpec, int, np.ndarray], tuple[EncodedChunk, np.ndarray]]
"""Codes one chunk: ``(record, spec, raw_offset, raw) -> (stored form, bytes a reader will decode)``."""


def encode_exact(record: TensorRecord, spec: DTypeSpec, raw_offset: int,
                 raw: np.ndarray) -> tuple[EncodedChunk, np.ndarray]:
    """The chunk encoder of full steps: lossless."""
    return encode_lossless(raw, spec), raw


def default_workers() -> int:
    """Threads for encoding and decoding: one per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements in row-major order as a 1-d uint8 array (a view when possible)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class _Job:
    record: TensorRecord
    spec: DTypeSpec
    raw_offset: int  # where the chunk starts in the tensor's raw bytes
    raw: np.ndarray  # the chunk's raw bytes


def _chunk_jobs(stored: list[tuple[TensorRecord, DTypeSpec, np.ndarray]],
                chunk_bytes: int) -> Iterator[_Job]:
    for record, spec, raw in stored:
        step = max(spec.itemsize, chunk_bytes - chunk_bytes % spec.itemsize)
        for start in range(0, raw.size, step):
            yield _Job(record, spec, start, raw[start : start + step])


class _DataFiles:
    """One append-only data file per encoding thread.

    File systems serialize buffered writes to one file, so each thread
    appends the chunks it encodes to a file of its own and the writes of a
    save run in parallel.
    """

    def __init__(self, storage: Storage, step_dir: str, save_id: str) -> None:
        self.storage, self.step_dir, self.save_id = storage, step_dir, save_id
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
                name = data_file_name(self.save_id, 0, index)
                self.handles.append(self.storage.create(f"{self.step_dir}/{name}"))
                self.names.append(name)
                self.sizes.append(0)
            self._local.index = index
        offset = self.sizes[index]
        for part in parts:
            self.handles[index].write(part)
            self.sizes[index] += memoryview(part).nbytes
        return index, offset

    def records(self) -> list[DataFile]:
        """The files written, as metadata."""
        return [DataFile(name, 0, size) for name, size in zip(self.names, self.sizes, strict=True)]

    def abort(self) -> None:
        """Close and delete every file (the save failed)."""
        for handle, name in zip(self.handles, self.names, strict=True):
            handle.close()
            self.storage.remove(f"{self.step_dir}/{name}")


def _encode_and_write(job: _Job, encoder: ChunkEncoder, files: _DataFiles) -> Chunk:
    encoded, decoded = encoder(job.record, job.spec, job.raw_offset, job.raw)
    digest = xxhash.xxh3_64()
    for part in encoded.parts:
        digest.update(part)
    file, offset = files.append(encoded.parts)
    return Chunk(file, offset, encoded.length, job.raw_offset, job.raw.size, encoded.codec,
                 encoded.params, digest.hexdigest(), xxhash.xxh3_64_hexdigest(decoded))


def write_step(storage: Storage, step: int, captured: CapturedState, *,
               kind: str = "full", base_step: int | None = None,
               encoder: ChunkEncoder = encode_exact, summary: Callable[[], dict] | None = None,
               coded_last: Collection[str] = (), chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               workers: int | None = None, progress: bool = False) -> StepMetadata:
    """Write ``captured`` as step ``step`` and commit it; returns its metadata.

    ``encoder`` codes each chunk (default: losslessly); ``summary``, called
    once every chunk is coded, gives what the step's ``stats`` record about
    the coding (a delta's error statistics). The chunks of the tensors named
    in ``coded_last`` are coded only once every other chunk is (their coding
    reads what the others' left, e.g. a cast of a master copy).

    The step only becomes visible at the final rename of ``metadata.json``.
    An existing version of the step stays intact until that moment, and its
    data files are removed only after it.
    """
    started = time.perf_counter()
    workers = workers or default_workers()
    records, stored = [], []
    for item in captured.tensors:
        spec = spec_for(item.tensor.dtype, item.name)
        record = TensorRecord(item.name, item.role, spec.name, list(item.tensor.shape),
                              item.fqn, item.state_key, item.alias_of)
        records.append(record)
        if item.alias_of is None:
            record.fragments = [Fragment([0] * item.tensor.dim(), list(item.tensor.shape))]
            stored.append((record, spec, raw_bytes(item.tensor)))
    raw_total = sum(raw.size for _, _, raw in stored)

    step_dir = step_dir_name(step)
    storage.makedirs(step_dir)
    save_id = secrets.token_hex(8)
    files = _DataFiles(storage, step_dir, save_id)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="deltackpt-encode") as pool, \
                progress_bar(raw_total, f"save step {step}", progress) as bar:
            in_flight: deque[tuple[_Job, Future[Chunk]]] = deque()

            def collect_oldest() -> None:
                job, future = in_flight.popleft()
                job.record.fragments[0].chunks.append(future.result())
                bar.update(job.raw.size)

            for last in (False, True):
                for job in _chunk_jobs([s for s in stored if (s[0].name in coded_last) == last],
                                       chunk_bytes):
                    in_flight.append((job, pool.submit(_encode_and_write, job, encoder, files)))
                    if len(in_flight) >= 4 * workers:
                        collect_oldest()
                while in_flight:
                    collect_oldest()
            list(pool.map(storage.finish, files.handles))  # fsync the files in parallel
    except BaseException:
        files.abort()
        raise

    data_files = files.records()
    meta = StepMetadata(
        step=step, kind=kind, base_step=base_step, save_id=save_id,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__, world_size=1, files=data_files, tensors=records,
        state=captured.tree, stats=StepStats(raw_total, sum(f.size for f in data_files), 0.0,
                                             **(summary() if summary else {})))
    meta.stats.seconds = round(time.perf_counter() - started, 6)
    text = meta.to_json().encode()
    if kind == "delta":  # a delta's data is small enough that its metadata's size matters
        text = zstd_compress(text)
    storage.commit_file(f"{step_dir}/{METADATA_FILE}", text)
    remove_unreferenced(storage, step_dir, meta)
    return meta


def remove_unreferenced(storage: Storage, step_dir: str, meta: StepMetadata) -> None:
    """Delete files in ``step_dir`` that its committed metadata does not reference."""
    keep = {METADATA_FILE} | {f.name for f in meta.files}
    for name in storage.listdir(step_dir):
        if name not in keep:
            storage.remove(f"{step_dir}/{name}")
