"""Writing one step: chunk, encode in parallel, write, fsync, commit (docs/FORMAT.md 1.1).

Chunks are encoded on a thread pool (the kernels and zstd release the GIL)
and written in order by the calling thread, with a bounded number in flight
so memory stays at a few chunks whatever the model size.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch
import xxhash

from deltackpt import __version__
from deltackpt.codecs import EncodedChunk, encode_lossless
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

Encoder = Callable[[np.ndarray, DTypeSpec], EncodedChunk]


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


def _encode(job: _Job, encoder: Encoder) -> tuple[EncodedChunk, str]:
    return encoder(job.raw, job.spec), xxhash.xxh3_64_hexdigest(job.raw)


def write_step(storage: Storage, step: int, captured: CapturedState, *,
               kind: str = "full", base_step: int | None = None,
               encoder: Encoder = encode_lossless, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               workers: int | None = None, progress: bool = False) -> StepMetadata:
    """Write ``captured`` as step ``step`` and commit it; returns its metadata.

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
    data_name = data_file_name(save_id, 0, 0)

    handle = storage.create(f"{step_dir}/{data_name}")
    offset = 0
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="deltackpt-encode") as pool, \
                progress_bar(raw_total, f"save step {step}", progress) as bar:
            in_flight: deque[tuple[_Job, Future]] = deque()

            def write_oldest() -> None:
                nonlocal offset
                job, future = in_flight.popleft()
                encoded, raw_hash = future.result()
                digest = xxhash.xxh3_64()
                for part in encoded.parts:
                    digest.update(part)
                    handle.write(part)
                job.record.fragments[0].chunks.append(Chunk(
                    0, offset, encoded.length, job.raw_offset, job.raw.size,
                    encoded.codec, encoded.params, digest.hexdigest(), raw_hash))
                offset += encoded.length
                bar.update(job.raw.size)

            for job in _chunk_jobs(stored, chunk_bytes):
                in_flight.append((job, pool.submit(_encode, job, encoder)))
                if len(in_flight) >= 2 * workers:
                    write_oldest()
            while in_flight:
                write_oldest()
        storage.finish(handle)
    except BaseException:
        handle.close()
        storage.remove(f"{step_dir}/{data_name}")
        raise

    meta = StepMetadata(
        step=step, kind=kind, base_step=base_step, save_id=save_id,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__, world_size=1,
        files=[DataFile(data_name, 0, offset)], tensors=records, state=captured.tree,
        stats=StepStats(raw_total, offset, 0.0))
    meta.stats.seconds = round(time.perf_counter() - started, 6)
    storage.commit_file(f"{step_dir}/{METADATA_FILE}", meta.to_json().encode())
    remove_unreferenced(storage, step_dir, meta)
    return meta


def remove_unreferenced(storage: Storage, step_dir: str, meta: StepMetadata) -> None:
    """Delete files in ``step_dir`` that its committed metadata does not reference."""
    keep = {METADATA_FILE} | {f.name for f in meta.files}
    for name in storage.listdir(step_dir):
        if name not in keep:
            storage.remove(f"{step_dir}/{name}")
