"""The root of a checkpoint directory: its marker file, checked when the directory is opened and
written when an empty one is created (docs/FORMAT.md 1)."""

from __future__ import annotations

import contextlib
import json

from deltackpt.errors import NotACheckpointError, WriteFailedError, os_failure
from deltackpt.format.metadata import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_ROOT_MARKER_BYTES,
    ROOT_MARKER,
    check_root_marker,
)
from deltackpt.io.objectstore import LEASE_OBJECT
from deltackpt.io.storage import LOCK_FILE, Storage


def open_root(storage: Storage, *, create: bool) -> None:
    """Check that ``storage`` is a checkpoint directory of a format this version reads; with
    ``create``, make a missing or empty one into an empty checkpoint directory. Raises
    :class:`NotACheckpointError` for anything else, refusing to write into a directory that
    holds other files."""
    url = storage.url
    if storage.exists(ROOT_MARKER):
        where = f"{url}/{ROOT_MARKER}"
        if storage.size(ROOT_MARKER) > MAX_ROOT_MARKER_BYTES:
            raise NotACheckpointError(f"{where}: too large for a deltackpt marker")
        check_root_marker(storage.read_bytes(ROOT_MARKER), where)
    elif not create:
        state = "does not exist" if not storage.exists("") else "has no " + ROOT_MARKER
        raise NotACheckpointError(f"{url} is not a deltackpt checkpoint directory (it {state})")
    elif storage.exists("") and any(n not in (LOCK_FILE, LEASE_OBJECT, ROOT_MARKER)
                                    and not n.endswith(".tmp") for n in storage.listdir()):
        raise NotACheckpointError(
            f"{url} exists, is not empty and is not a deltackpt checkpoint directory "
            f"(no {ROOT_MARKER}); refusing to write into it")
    else:
        created, writing = False, url
        try:
            created = storage.makedirs()
            writing = f"{url}/{ROOT_MARKER}"
            write_root_marker(storage)
        except FileNotFoundError:  # another process (a rank) created it at the same time,
            if not storage.exists(ROOT_MARKER):  # and its clean-up took our temporary file
                raise
        except OSError as exc:  # a full or read-only disk: leave nothing behind
            if created:
                with contextlib.suppress(OSError):
                    storage.remove_empty_dir()
            raise os_failure(WriteFailedError, writing, exc,
                             f"creating the checkpoint directory {url} failed: ") from exc


def write_root_marker(storage: Storage) -> None:
    """Commit the marker that makes ``storage`` a checkpoint directory of this format."""
    storage.commit_file(ROOT_MARKER, json.dumps(
        {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}).encode())
