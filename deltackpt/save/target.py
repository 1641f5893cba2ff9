"""Where a save writes: a checkpoint directory as its one writer sees it."""

from __future__ import annotations

import contextlib
import logging

from deltackpt.errors import DeltackptError, StepExistsError, WriterLockedError
from deltackpt.format.metadata import METADATA_FILE, STEP_DIR_PATTERN, metadata_file, step_dir_name
from deltackpt.io.reader import dependents, list_steps, read_metadata
from deltackpt.io.retired import RetiredFiles
from deltackpt.io.storage import Storage
from deltackpt.io.tiering import UploadCache
from deltackpt.io.writer import remove_unreferenced

log = logging.getLogger("deltackpt")


class SaveTarget:
    """A checkpoint directory as its one writer sees it: the writer lock, what interrupted saves
    left there, whether a step may be written, and where steps are written (the checkpoint, or
    a local ``cache`` in front of it that uploads them, :mod:`deltackpt.io.tiering`).

    The lock is taken by :meth:`acquire` and held until :meth:`release`; taking it removes what
    interrupted saves left behind. Readers never take it.
    """

    def __init__(self, storage: Storage, cache: UploadCache | None = None, *,
                 read_only: bool = False, retired: RetiredFiles | None = None) -> None:
        self.storage = storage
        self.cache = cache
        self.read_only = read_only
        # the data of replaced and deleted steps, kept a while for readers
        self.retired = retired if retired is not None else RetiredFiles(storage)
        self._lock: contextlib.AbstractContextManager[None] | None = None

    @property
    def writes_to(self) -> Storage:
        """Where the steps are written: the cache in front of the checkpoint, if any."""
        return self.storage if self.cache is None else self.cache.storage

    def acquire(self) -> None:
        """Become the directory's one writer: take the writer lock, held until :meth:`release`,
        and remove what interrupted saves left behind. Raises :class:`WriterLockedError` while
        another writer (in this or another process) holds it."""
        if self.read_only:
            raise PermissionError(f"{self.storage.url}: this manager was opened read_only")
        if self._lock is None:
            lock = self.storage.try_lock()
            if lock is None:
                raise WriterLockedError(
                    f"{self.storage.url}: another CheckpointManager (in this or another process) "
                    "is writing to this directory; only one writer at a time is allowed")
            lock.__enter__()
            self._lock = lock
            self.retired.load()
            self._remove_leftovers()

    def release(self) -> None:
        """Release the writer lock, if held."""
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def _remove_leftovers(self) -> None:
        """Delete what interrupted saves left behind (the lock is held): only what a save
        creates; links, FIFOs and the like are left alone, never followed (readers report them)."""
        storage, retired = self.storage, self.retired.protected()
        for name in storage.listdir():
            try:
                kind = storage.kind(name)
                if name.endswith(".tmp") and kind == "file":
                    storage.remove(name)
                elif STEP_DIR_PATTERN.fullmatch(name) and kind == "dir":
                    if storage.exists(f"{name}/{METADATA_FILE}"):
                        remove_unreferenced(storage, name, read_metadata(storage, int(name[5:])),
                                            keep=retired)
                    elif not any(f.startswith(f"{name}/") for f in retired):
                        storage.remove_tree(name)
                    else:  # a deleted step whose data readers may still read
                        for leftover in {f"{name}/{n}" for n in storage.listdir(name)} - retired:
                            storage.remove(leftover)
            except DeltackptError as exc:  # an unreadable or damaged step: verify reports it
                log.warning("%s: the writer's cleanup left %s as it is: %s", storage.url, name, exc)

    def prepare(self, step: int, overwrite: bool) -> list[str] | None:
        """Take the writer lock and check that ``step`` may be written: a step that exists is
        replaced only with ``overwrite``, and never while deltas are coded against it. Returns
        the files of the step's directory where the storage lists them in one request (an
        object store: the listing also says whether the step exists), for the commit to delete
        those its metadata does not reference (:func:`~deltackpt.io.writer.remove_unreferenced`);
        else None (also with a cache, which this opens: the listing is the checkpoint's)."""
        self.acquire()
        present = self.storage.list_files(step_dir_name(step))
        exists = METADATA_FILE in present if present is not None else \
            self.storage.exists(metadata_file(step))
        if exists:
            if not overwrite:
                raise StepExistsError(f"step {step} already exists in {self.storage.url}; "
                                      "pass overwrite=True to replace it")
            coded_against = dependents(step, list_steps(self.storage),
                                       lambda s: read_metadata(self.storage, s))
            if coded_against:
                raise StepExistsError(
                    f"step {step} cannot be overwritten: delta step(s) {coded_against} are coded "
                    "against it; remove them first (gc) or overwrite them")
        if self.cache is not None:
            self.cache.open()
            return None
        return present
