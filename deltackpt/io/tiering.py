"""A local cache in front of remote checkpoints: save to local disk, upload in the background.

``CheckpointManager("s3://bucket/run1", cache="/local/nvme/run1")`` writes
each step into the cache directory (itself a checkpoint directory), commits
it there, and returns; a background thread then uploads it to the remote
under the remote's commit protocol (data objects first, ``metadata.json``
last), while training goes on. Every other operation of the manager (the
next save, a restore, listing, gc, close) first waits for that upload, and
raises its failure, so the remote never shows a step before its base and a
failed upload is never silent. The cache keeps the ``cache_keep`` newest
uploaded steps and the steps their chains need; a step is deleted from it
only once its upload is committed. A restore reads the cached copy of a
chain when every step's cached metadata is the remote's, byte for byte
(chunk checksums then vouch for the data), and the remote otherwise or
when a cached chunk fails its checksum.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from deltackpt.errors import DeltackptError, WriteFailedError, WriterLockedError
from deltackpt.format.metadata import (
    METADATA_FILE,
    ROOT_MARKER,
    StepMetadata,
    step_dir_name,
)
from deltackpt.io.reader import list_steps, read_metadata
from deltackpt.io.retired import RetiredFiles
from deltackpt.io.root import write_root_marker
from deltackpt.io.storage import LocalStorage, Storage
from deltackpt.io.writer import remove_unreferenced

COPY_BYTES = 8 << 20  # read from the cached file and handed to the upload per call


class UploadCache:
    """The local tier of a remote checkpoint (see the module doc).

    Args:
        path: the cache directory (created if missing).
        remote: the storage steps are uploaded to.
        keep: uploaded steps kept in the cache (the newest), besides the steps
            their chains need and steps not on the remote: a step whose upload
            failed, or whose process died before it, is never deleted here.
    """

    def __init__(self, path: str | os.PathLike[str], remote: Storage, keep: int = 1,
                 retired: RetiredFiles | None = None) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"cache_keep must be a non-negative integer, got {keep!r}")
        self.storage = LocalStorage(path)
        self.remote = remote
        self.keep = keep
        self.retired = retired  # keeps an overwritten step's old data on the remote for readers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-upload-steps")
        self._pending: Future[None] | None = None
        self._failed: StepMetadata | None = None  # a committed step whose upload failed
        self._lock: contextlib.AbstractContextManager[None] | None = None
        self._guard = threading.Lock()

    def open(self) -> None:
        """Take the cache directory's writer lock and make it a checkpoint directory."""
        if self._lock is not None:
            return
        self.storage.makedirs()
        lock = self.storage.try_lock()
        if lock is None:
            raise WriterLockedError(f"{self.storage.url}: another CheckpointManager uses this "
                                    "cache directory")
        lock.__enter__()
        self._lock = lock
        if not self.storage.exists(ROOT_MARKER):
            write_root_marker(self.storage)

    def upload(self, meta: StepMetadata) -> None:
        """Upload committed cached step ``meta`` in the background."""
        with self._guard:
            self._pending = self._pool.submit(self._upload, meta)

    def wait(self) -> None:
        """Wait for the upload in flight; retry one that failed before. Raises
        :class:`WriteFailedError` naming the step while its upload fails."""
        with self._guard:
            pending, self._pending = self._pending, None
            failed = self._failed
        if pending is None and failed is not None:
            pending = self._pool.submit(self._upload, failed)
        if pending is not None:
            pending.result()

    def _upload(self, meta: StepMetadata) -> None:
        step_dir = step_dir_name(meta.step)
        try:
            for f in meta.files:
                self._copy(f"{step_dir}/{f.name}")
            self.remote.commit_file(f"{step_dir}/{METADATA_FILE}",
                                    self.storage.read_bytes(f"{step_dir}/{METADATA_FILE}"))
        except (OSError, DeltackptError) as exc:
            self._failed = meta
            raise WriteFailedError(f"uploading step {meta.step} to {self.remote.url} failed: "
                                   f"{exc}; the step is committed in the cache "
                                   f"{self.storage.url} and its upload is retried by the next "
                                   "operation") from exc
        self._failed = None
        with contextlib.suppress(OSError, DeltackptError):
            remove_unreferenced(self.remote, step_dir, meta, retired=self.retired)
        self._trim()

    def _copy(self, rel: str) -> None:
        """Upload cached file ``rel`` as is, without holding it in memory."""
        reader = self.storage.open_reader(rel)
        handle = self.remote.create(rel)
        try:
            size, offset = self.storage.size(rel), 0
            while offset < size:
                length = min(COPY_BYTES, size - offset)
                handle.write(reader.read(offset, length))
                offset += length
            self.remote.finish(handle)
        except BaseException:
            with contextlib.suppress(OSError):
                handle.close()  # an unfinished upload is aborted
            with contextlib.suppress(OSError, DeltackptError):
                self.remote.remove(rel)
            raise
        finally:
            reader.close()

    def _uploaded(self, step: int) -> bool:
        """Whether cached ``step`` is on the remote as the same version (its metadata equal)."""
        rel = f"{step_dir_name(step)}/{METADATA_FILE}"
        try:
            return self.storage.read_bytes(rel) == self.remote.read_bytes(rel)
        except (OSError, DeltackptError):
            return False

    def _trim(self) -> None:
        """Delete uploaded steps beyond the ``keep`` newest and the chains those need. A step that
        is not on the remote (its upload failed, or its process died before it) stays."""
        uploaded = [s for s in list_steps(self.storage) if self._uploaded(s)]
        needed: set[int] = set()
        for step in uploaded[len(uploaded) - self.keep:] if self.keep else []:
            while step is not None and step not in needed:
                needed.add(step)
                try:
                    step = read_metadata(self.storage, step).base_step
                except DeltackptError:
                    break
        for step in uploaded:
            if step not in needed:
                self.drop(step)

    def drop(self, step: int) -> None:
        """Delete ``step`` from the cache (its metadata first: the step disappears there)."""
        step_dir = step_dir_name(step)
        with contextlib.suppress(OSError, DeltackptError):
            self.storage.remove(f"{step_dir}/{METADATA_FILE}")
            self.storage.remove_tree(step_dir)

    def holds(self, chain: list[StepMetadata]) -> bool:
        """Whether every step of ``chain`` (read from the remote) is cached as the same version."""
        return all(self._uploaded(meta.step) for meta in chain)

    def close(self) -> None:
        """Wait for the upload in flight (raising its failure), then release the cache."""
        try:
            self.wait()
        finally:
            if self._lock is not None:
                self._lock.__exit__(None, None, None)
                self._lock = None
