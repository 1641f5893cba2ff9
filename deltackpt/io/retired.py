"""Data files a writer no longer references, kept a while for the readers that may still read
them (docs/FORMAT.md 1.4).

When a commit replaces a step (an overwrite, or a gc re-coding a kept step) or a gc deletes
one, the old version's data files are not deleted at once: a reader that read the old
metadata before the commit may be reading them. The writer *retires* them instead: it records
their names and the time in a ``retired-*.json`` file in the root, and deletes them once
``grace`` seconds have passed (at a later save or gc of any writer). A reader that read a
step's chain of metadata can therefore read its data for ``grace`` seconds, whatever the
writer does meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from deltackpt.errors import DeltackptError, FormatError, StepNotFoundError
from deltackpt.format.metadata import (
    DATA_FILE_PATTERN,
    MAX_FILE_NAME,
    METADATA_FILE,
    STEP_DIR_PATTERN,
    load_json,
)
from deltackpt.io.reader import read_metadata
from deltackpt.io.storage import Storage

log = logging.getLogger("deltackpt")

RECORD_PATTERN = re.compile(r"retired-([0-9]{1,20})-([0-9a-f]{8})\.json")
RECORD_FORMAT = "deltackpt-retired"
MAX_RECORD_BYTES = 1 << 24
DEFAULT_GRACE = 300.0  # seconds: a few minutes, what restoring a large step may take


@dataclass(frozen=True)
class Record:
    """One ``retired-*.json``: the data files a commit or deletion left unreferenced, and when."""

    name: str
    retired: float  # seconds since the epoch
    files: tuple[str, ...]  # "step-N/d-....bin", relative to the root


def _data_file(path: object) -> bool:
    """Whether ``path`` names a data file of a step directory, and nothing else."""
    if not isinstance(path, str):
        return False
    step_dir, _, name = path.partition("/")
    return bool(STEP_DIR_PATTERN.fullmatch(step_dir) and DATA_FILE_PATTERN.fullmatch(name)
                and len(name) <= MAX_FILE_NAME)


def read_record(storage: Storage, name: str) -> Record:
    """The record ``name`` of the root, validated: it can name nothing but data files of step
    directories. Raises :class:`FormatError` naming it otherwise."""
    where = f"{storage.url}/{name}"
    if storage.size(name) > MAX_RECORD_BYTES:
        raise FormatError(f"{where}: more than {MAX_RECORD_BYTES} bytes")
    obj = load_json(storage.read_bytes(name), where)
    if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
        raise FormatError(f"{where}: not a record of retired files")
    retired, files = obj.get("retired"), obj.get("files")
    if not isinstance(retired, (int, float)) or isinstance(retired, bool) \
            or not isinstance(files, list) or not all(_data_file(f) for f in files):
        raise FormatError(f"{where}: its 'retired' is not a time or its 'files' are not data "
                          "files of step directories")
    return Record(name, float(retired), tuple(files))


class RetiredFiles:
    """The retired files of a checkpoint directory, as its one writer keeps them.

    :meth:`load` reads the records found in the root (when the writer takes the lock);
    :meth:`retire` records files; :meth:`purge` deletes those retired ``grace`` seconds ago
    or more (all of them with ``everything``, when space is short). ``grace`` 0 deletes at once.
    """

    def __init__(self, storage: Storage, grace: float = DEFAULT_GRACE) -> None:
        self.storage, self.grace = storage, grace
        self.records: list[Record] = []
        self._lock = threading.Lock()  # an upload thread retires too (io.tiering)

    def load(self) -> None:
        """Read the records in the root; one that cannot be read is left alone, and logged."""
        records = []
        for name in self.storage.listdir():
            if RECORD_PATTERN.fullmatch(name):
                try:
                    records.append(read_record(self.storage, name))
                except DeltackptError as exc:
                    log.warning("%s: left as it is: %s", self.storage.url, exc)
        with self._lock:
            self.records = records

    def protected(self) -> set[str]:
        """The files retired and not deleted yet: no cleanup of leftovers deletes them."""
        with self._lock:
            return {f for record in self.records for f in record.files}

    def retire(self, files: Iterable[str]) -> None:
        """Keep ``files`` (data files of step directories, no longer referenced) for ``grace``
        seconds: record them durably, or delete them now when ``grace`` is 0. A file retired
        already (a version replaced twice) keeps its record, whose purge deletes it."""
        files = tuple(sorted(set(files) - self.protected()))
        if not files:
            return
        if self.grace <= 0:
            self._delete(files)
            return
        now = time.time()
        record = Record(f"retired-{time.time_ns()}-{secrets.token_hex(4)}.json", now, files)
        self.storage.commit_file(record.name, json.dumps(
            {"format": RECORD_FORMAT, "retired": now, "files": list(files)}).encode())
        with self._lock:
            self.records.append(record)

    def release(self, paths: Iterable[str]) -> None:
        """Files a commit or deletion no longer references: the data files among them are
        retired (:meth:`retire`), anything else (a failed save's ``*.tmp``) deleted now."""
        paths = set(paths)
        data = {p for p in paths if DATA_FILE_PATTERN.fullmatch(p.rpartition("/")[2])}
        self.retire(data)
        for rel in sorted(paths - data):
            self.storage.remove(rel)

    def purge(self, *, everything: bool = False) -> None:
        """Delete the files retired at least ``grace`` seconds ago (with ``everything``: all),
        then their records; a step directory left empty and without metadata goes too."""
        now = time.time()
        with self._lock:
            due = [r for r in self.records if everything or r.retired + self.grace <= now]
        for record in due:
            self._delete(set(record.files) - self._committed(record.files))
            self.storage.remove(record.name)
            with self._lock:
                self.records.remove(record)

    def _committed(self, files: Iterable[str]) -> set[str]:
        """The ``files`` that a committed step references, or that may be: a record read from
        the directory deletes no committed data, whatever it names."""
        kept = set()
        for step_dir in {f.partition("/")[0] for f in files}:
            try:
                meta = read_metadata(self.storage, int(step_dir[5:]))
            except StepNotFoundError:
                continue
            except DeltackptError:  # unreadable: verify reports it; its files stay
                kept |= {f for f in files if f.startswith(f"{step_dir}/")}
                continue
            kept |= {f"{step_dir}/{f.name}" for f in meta.files}
        return kept

    def _delete(self, files: Iterable[str]) -> None:
        step_dirs = set()
        for rel in files:
            self.storage.remove(rel)
            step_dirs.add(rel.partition("/")[0])
        for step_dir in step_dirs:  # a deleted step's directory, unless it was saved again
            if not self.storage.exists(f"{step_dir}/{METADATA_FILE}"):
                self.storage.remove_empty_dir(step_dir)
