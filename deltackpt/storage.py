"""Where checkpoint bytes live, behind one small interface selected by URL.

The writer and reader only use :class:`Storage`: create a directory, write a
new file durably, commit a small file atomically, read byte ranges, list,
delete, and hold the single-writer lock. :class:`LocalStorage` implements it
on a POSIX file system (local disk or a shared network file system);
:func:`open_storage` maps a path or ``file://`` URL to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlparse

from deltackpt.errors import CorruptionError, NotACheckpointError

LOCK_FILE = ".writer.lock"


class RangeReader(Protocol):
    """Reads byte ranges of one stored file; safe to call from several threads."""

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class Storage(Protocol):
    """The operations a checkpoint directory needs; paths are relative to its root."""

    url: str

    def exists(self, rel: str) -> bool: ...
    def is_dir(self, rel: str) -> bool: ...
    def listdir(self, rel: str = "") -> list[str]: ...
    def size(self, rel: str) -> int: ...
    def identity(self, rel: str) -> tuple[int, ...] | None: ...
    def makedirs(self, rel: str = "", *, durable: bool = True) -> bool: ...
    def sync_dir(self, rel: str = "") -> None: ...
    def read_bytes(self, rel: str) -> bytes: ...
    def open_reader(self, rel: str) -> RangeReader: ...
    def create(self, rel: str) -> IO[bytes]: ...
    def finish(self, handle: IO[bytes]) -> None: ...
    def commit_file(self, rel: str, data: bytes) -> None: ...
    def remove(self, rel: str) -> None: ...
    def remove_tree(self, rel: str) -> None: ...
    def try_lock(self) -> contextlib.AbstractContextManager[None] | None: ...


class _FileRangeReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise CorruptionError(f"{self.path}: file is truncated (wanted bytes {offset}.."
                                  f"{offset + length}, it has {os.fstat(self.fd).st_size})")
        return data

    def close(self) -> None:
        os.close(self.fd)


class LocalStorage:
    """A checkpoint directory on a POSIX file system."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def is_dir(self, rel: str) -> bool:
        return self._path(rel).is_dir()

    def listdir(self, rel: str = "") -> list[str]:
        return sorted(os.listdir(self._path(rel)))

    def size(self, rel: str) -> int:
        return self._path(rel).stat().st_size

    def identity(self, rel: str) -> tuple[int, ...] | None:
        """What changes whenever the file ``rel`` is replaced or rewritten (device, inode, size,
        modification and change times), or None if there is none: tells a writer that a file is
        still the one it wrote, or read, without reading it again."""
        try:
            st = os.lstat(self._path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def makedirs(self, rel: str = "", *, durable: bool = True) -> bool:
        """Create directory ``rel`` (and its parents) if missing; whether it was created. A
        created one is made durable (its parent fsynced) unless ``durable`` is False: the
        caller then calls :meth:`sync_dir` on the parent before relying on it."""
        path = self._path(rel)
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        if created and durable:
            _fsync_dir(path.parent)
        return created

    def sync_dir(self, rel: str = "") -> None:
        """Make the entries of directory ``rel`` durable (fsync it)."""
        _fsync_dir(self._path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self._path(rel).read_bytes()

    def open_reader(self, rel: str) -> RangeReader:
        path = self._path(rel)
        try:
            return _FileRangeReader(path)
        except FileNotFoundError:
            raise CorruptionError(f"{path}: data file is missing") from None

    def create(self, rel: str) -> IO[bytes]:
        """A new file for writing; fails if it exists. Pass it to :meth:`finish`."""
        return open(self._path(rel), "xb")

    def finish(self, handle: IO[bytes]) -> None:
        """Flush, fsync and close a file from :meth:`create`."""
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()

    def commit_file(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically and durably (write, fsync, rename, fsync dir).

        The temporary file's name is unique to the call, so processes that
        commit the same file at once (every rank creating a checkpoint
        directory) each rename a whole file of their own.
        """
        path = self._path(rel)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(rel).unlink()

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._path(rel), ignore_errors=True)
        _fsync_dir(self._path(rel).parent)

    def try_lock(self) -> contextlib.AbstractContextManager[None] | None:
        """Take the exclusive writer lock; ``None`` if someone else holds it.

        The lock is an ``flock`` on ``.writer.lock``: the kernel releases it
        when its holder exits, even on SIGKILL, so a crashed writer never
        blocks the next one.
        """
        handle = open(self._path(LOCK_FILE), "a+b")  # noqa: SIM115 (owned by the lock)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return _held_lock(handle)


@contextlib.contextmanager
def _held_lock(handle: IO[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """The storage for a local path or ``file://`` URL.

    Raises :class:`NotACheckpointError` when the path is an existing file.
    """
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        text = parsed.path
    elif parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive
        raise ValueError(f"{text}: storage scheme {parsed.scheme!r} is not supported yet "
                         "(use a local or shared file system path)")
    storage = LocalStorage(text)
    if storage.root.exists() and not storage.root.is_dir():
        raise NotACheckpointError(f"{storage.root} is a file, not a checkpoint directory")
    return storage

