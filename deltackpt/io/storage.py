"""Where checkpoint bytes live, behind one small interface selected by URL.

The writer and reader only use :class:`Storage`: create a directory, write a
new file durably, commit a small file atomically, read byte ranges, list,
delete, and hold the single-writer lock, following no link and opening
nothing but regular files below the root. :class:`LocalStorage` implements it
on a POSIX file system (local disk or a shared network file system),
:class:`deltackpt.io.objectstore.ObjectStorage` on object stores through fsspec;
:func:`open_storage` picks one by URL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.util
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlparse

from deltackpt.errors import (
    CorruptionError,
    DeltackptError,
    NotACheckpointError,
    ReadFailedError,
    StorageError,
    UnsafePathError,
    WriteFailedError,
    os_failure,
)
from deltackpt.format.metadata import STEP_DIR_PATTERN

LOCK_FILE = ".writer.lock"
F = TypeVar("F", bound=Callable[..., Any])


class RangeReader(Protocol):
    """Reads byte ranges of one stored file; safe to call from several threads.

    ``prefetch`` tells it the ranges (offset, length) a caller is about to
    read, in about the order it will: a remote reader starts fetching them
    (few large requests, in parallel); a local one needs no hint.
    """

    def read(self, offset: int, length: int) -> bytes: ...

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None: ...

    def close(self) -> None: ...


class Storage(Protocol):
    """The operations a checkpoint directory needs; paths are relative to its root.

    Below the root nothing is followed: an entry that is a symbolic link,
    FIFO, device or socket, or a directory where a file belongs, raises
    :class:`UnsafePathError` naming it instead of being opened, read through
    or deleted through (it is only ever removed itself, by :meth:`remove`).
    """

    url: str

    def kind(self, rel: str) -> str | None: ...
    def exists(self, rel: str) -> bool: ...
    def is_dir(self, rel: str) -> bool: ...
    def listdir(self, rel: str = "") -> list[str]: ...
    def list_files(self, rel: str = "") -> list[str] | None: ...
    def size(self, rel: str) -> int: ...
    def identity(self, rel: str) -> tuple[int | str, ...] | None: ...
    def makedirs(self, rel: str = "", *, durable: bool = True) -> bool: ...
    def sync_dir(self, rel: str = "") -> None: ...
    def read_bytes(self, rel: str) -> bytes: ...
    def open_reader(self, rel: str) -> RangeReader: ...
    def create(self, rel: str) -> IO[bytes]: ...
    def finish(self, handle: IO[bytes]) -> None: ...
    def stage(self, rel: str, data: bytes) -> str: ...
    def publish(self, staged: str, rel: str) -> None: ...
    def commit_file(self, rel: str, data: bytes) -> None: ...
    def remove(self, rel: str) -> None: ...
    def remove_tree(self, rel: str) -> None: ...
    def remove_empty_dir(self, rel: str = "") -> None: ...
    def try_lock(self) -> contextlib.AbstractContextManager[None] | None: ...


class _FileRangeReader:
    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path
        try:
            # Reads past it are refused before pread, which allocates ``length`` bytes first: a
            # size taken once a file, not a syscall a chunk (a step's files do not grow).
            self.size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise os_failure(ReadFailedError, str(path), exc) from exc

    def read(self, offset: int, length: int) -> bytes:
        try:
            data = os.pread(self.fd, length, offset) if offset + length <= self.size else b""
            if len(data) == length:
                return data
            size = os.fstat(self.fd).st_size  # short of its size when opened, or shrunk since
        except OSError as exc:  # an I/O error: the disk's, not the file's content
            raise os_failure(ReadFailedError, str(self.path), exc) from exc
        raise CorruptionError(f"{self.path}: file is truncated (wanted bytes {offset}.."
                              f"{offset + length}, it has {size})")

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Nothing to start: a local read is served at once (the kernel reads ahead)."""

    def close(self) -> None:
        os.close(self.fd)


def _kind(mode: int) -> str:
    """What :meth:`Storage.kind` calls an entry of ``mode`` (from ``lstat``)."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "other"


def _what(mode: int) -> str:
    """An entry of ``mode`` in words, for error messages."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return {"file": "a regular file", "dir": "a directory", "link": "a symbolic link"}.get(
        _kind(mode), "a special file")


# Never follow a link below the root; O_NONBLOCK: opening a FIFO must not wait for a writer.
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _failing(kind: type[OSError]) -> Callable[[F], F]:
    """A :class:`LocalStorage` method whose OS errors (a permission denied, a name too long, a
    read-only or full disk, an I/O error) are raised as ``kind``, naming the step and the file
    and keeping the ``errno``; a missing or existing file, or a file where a directory belongs,
    stays the ``FileNotFoundError``, ``FileExistsError`` or ``NotADirectoryError`` its callers
    expect."""
    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: LocalStorage, rel: str = "", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, rel, *args, **kwargs)
            except (FileNotFoundError, FileExistsError, NotADirectoryError, DeltackptError):
                raise
            except OSError as exc:
                path = str(self._path(rel))
                match = STEP_DIR_PATTERN.fullmatch(rel.partition("/")[0])
                step = f"step {int(match.group(1))}: " if match else ""
                raise os_failure(kind, path, exc, step) from exc
        return wrapper  # type: ignore[return-value]
    return decorate


_reading, _writing = _failing(ReadFailedError), _failing(WriteFailedError)


class LocalStorage:
    """A checkpoint directory on a POSIX file system.

    The root may be a symbolic link; every path below it is opened one
    component at a time relative to its parent's descriptor, with
    ``O_NOFOLLOW``, after ``lstat`` says it is what belongs there.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def _unsafe(self, rel: str, mode: int, wanted: str) -> UnsafePathError:
        return UnsafePathError(f"{self._path(rel)} is {_what(mode)}, not {wanted}; deltackpt never "
                               "follows links nor opens other entries inside a checkpoint directory")

    @contextlib.contextmanager
    def _dir(self, rel: str) -> Iterator[int]:
        """A descriptor of directory ``rel``, reached without following a link below the root."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            parts = rel.split("/") if rel else []
            for i, part in enumerate(parts):
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                    raise self._unsafe("/".join(parts[: i + 1]), mode, "a directory") from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """A descriptor of the directory holding ``rel``, and ``rel``'s name in it."""
        head, _, name = rel.rpartition("/")
        with self._dir(head) as fd:
            yield fd, name

    def _open_file(self, dir_fd: int, name: str, rel: str, flags: int) -> int:
        """Open regular file ``name`` (``rel``) of directory ``dir_fd``; anything else found there
        is refused before it is opened (a FIFO would block, a device act, a link lead elsewhere)."""
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
        else:
            if not stat.S_ISREG(mode):
                raise self._unsafe(rel, mode, "a regular file")
        fd = os.open(name, flags | _NOFOLLOW, 0o666, dir_fd=dir_fd)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced since the check
            os.close(fd)
            raise self._unsafe(rel, mode, "a regular file")
        return fd

    @_reading
    def kind(self, rel: str) -> str | None:
        """What ``rel`` is, links not followed: ``"file"``, ``"dir"``, ``"link"``, ``"other"``
        (FIFO, device, socket) or None when nothing is there.

        Raises :class:`UnsafePathError` when an entry on the way to it is not a directory.
        """
        try:
            if not rel:
                return _kind(os.stat(self.root).st_mode)  # the root may be a link
            with self._parent(rel) as (fd, name):
                return _kind(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self.kind(rel) is not None

    def is_dir(self, rel: str) -> bool:
        return self.kind(rel) == "dir"

    @_reading
    def listdir(self, rel: str = "") -> list[str]:
        with self._dir(rel) as fd:
            return sorted(os.listdir(fd))

    def list_files(self, rel: str = "") -> None:
        """None: a directory tree is listed one directory at a time (:meth:`listdir`), which
        costs no more here."""
        return None

    @_reading
    def size(self, rel: str) -> int:
        """Bytes of ``rel`` (of a link: of the link itself)."""
        with self._parent(rel) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False).st_size

    @_reading
    def identity(self, rel: str) -> tuple[int, ...] | None:
        """What changes whenever the file ``rel`` is replaced or rewritten (device, inode, size,
        modification and change times), or None if there is none: tells a writer that a file is
        still the one it wrote, or read, without reading it again."""
        try:
            with self._parent(rel) as (fd, name):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    @_writing
    def makedirs(self, rel: str = "", *, durable: bool = True) -> bool:
        """Create directory ``rel`` (the root: with its parents) unless it is one already;
        whether it was created. A created one is made durable (its parent fsynced) unless
        ``durable`` is False: the caller then calls :meth:`sync_dir` on the parent before
        relying on it.

        Raises :class:`UnsafePathError` when something else is there.
        """
        if not rel:
            created = not self.root.exists()
            self.root.mkdir(parents=True, exist_ok=True)
            if created and durable:
                fd = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    _fsync_dir(fd)
                finally:
                    os.close(fd)
            return created
        with self._parent(rel) as (fd, name):
            try:
                os.mkdir(name, dir_fd=fd)
            except FileExistsError:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                if not stat.S_ISDIR(mode):
                    raise self._unsafe(rel, mode, "a directory") from None
                return False
            if durable:
                _fsync_dir(fd)
            return True

    @_writing
    def sync_dir(self, rel: str = "") -> None:
        """Make the entries of directory ``rel`` durable (fsync it)."""
        with self._dir(rel) as fd:
            _fsync_dir(fd)

    @_reading
    def read_bytes(self, rel: str) -> bytes:
        with self._parent(rel) as (dir_fd, name):
            fd = self._open_file(dir_fd, name, rel, os.O_RDONLY)
        with open(fd, "rb") as handle:
            return handle.read()

    @_reading
    def open_reader(self, rel: str) -> RangeReader:
        try:
            with self._parent(rel) as (dir_fd, name):
                return _FileRangeReader(self._open_file(dir_fd, name, rel, os.O_RDONLY),
                                        self._path(rel))
        except FileNotFoundError:
            raise CorruptionError(f"{self._path(rel)}: data file is missing") from None

    @_writing
    def create(self, rel: str) -> IO[bytes]:
        """A new file for writing; fails if it exists. Pass it to :meth:`finish`."""
        with self._parent(rel) as (dir_fd, name):
            fd = self._open_file(dir_fd, name, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        return open(fd, "wb")

    def finish(self, handle: IO[bytes]) -> None:
        """Flush, fsync and close a file from :meth:`create`."""
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()

    @_writing
    def stage(self, rel: str, data: bytes) -> str:
        """Write ``data`` durably to a new temporary file beside ``rel``; returns its path, which
        :meth:`publish` renames to ``rel``. A failed write removes it.

        The name is unique to the call, so processes that commit the same
        file at once (every rank creating a checkpoint directory) each
        rename a whole file of their own.
        """
        head, _, name = rel.rpartition("/")
        staged = f"{head}/{name}" if head else name
        staged += f".{os.getpid()}-{secrets.token_hex(4)}.tmp"
        handle = self.create(staged)
        try:
            handle.write(data)
            self.finish(handle)
        except BaseException:
            with contextlib.suppress(OSError):  # closing flushes again: it fails as the write did
                handle.close()
            with contextlib.suppress(OSError):
                self.remove(staged)
            raise
        return staged

    @_writing
    def publish(self, staged: str, rel: str) -> None:
        """Rename a file from :meth:`stage` (in the same directory) to ``rel`` atomically, and
        make the rename durable (fsync of the directory)."""
        head, _, name = rel.rpartition("/")
        with self._dir(head) as fd:
            os.replace(staged.rpartition("/")[2], name, src_dir_fd=fd, dst_dir_fd=fd)
            _fsync_dir(fd)

    @_writing
    def commit_file(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically and durably (:meth:`stage`, :meth:`publish`);
        a failure before the rename removes the temporary file."""
        staged = self.stage(rel, data)
        try:
            self.publish(staged, rel)
        except BaseException:
            with contextlib.suppress(OSError):
                self.remove(staged)  # gone already if the rename happened
            raise

    @_writing
    def remove(self, rel: str) -> None:
        """Delete file ``rel`` (a link: the link itself); nothing there is fine.

        Raises :class:`UnsafePathError` for a directory.
        """
        with contextlib.suppress(FileNotFoundError), self._parent(rel) as (fd, name):
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                raise self._unsafe(rel, mode, "a file")
            os.unlink(name, dir_fd=fd)

    @_writing
    def remove_tree(self, rel: str) -> None:
        """Delete directory ``rel`` and everything in it, following no link (links in it are
        removed themselves); nothing there is fine.

        Raises :class:`UnsafePathError` when ``rel`` is not a directory.
        """
        with contextlib.suppress(FileNotFoundError), self._parent(rel) as (fd, name):
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if not stat.S_ISDIR(mode):
                raise self._unsafe(rel, mode, "a directory")
            # rmtree refuses a link at the top and removes links inside themselves
            shutil.rmtree(self._path(rel), ignore_errors=True)
            _fsync_dir(fd)

    @_writing
    def remove_empty_dir(self, rel: str = "") -> None:
        """Delete directory ``rel`` (default: the root) if it is empty; else leave it (a directory
        a failed creation made, which another process may have filled meanwhile)."""
        try:
            os.rmdir(self._path(rel))
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                raise

    def try_lock(self) -> contextlib.AbstractContextManager[None] | None:
        """Take the exclusive writer lock; ``None`` if someone else holds it.

        The lock is an ``flock`` on ``.writer.lock``: the kernel releases it
        when its holder exits, even on SIGKILL, so a crashed writer never
        blocks the next one.
        """
        try:
            with self._dir("") as dir_fd:
                fd = self._open_file(dir_fd, LOCK_FILE, LOCK_FILE, os.O_RDWR | os.O_CREAT)
        except OSError as exc:  # a read-only file system, a permission denied
            if isinstance(exc, DeltackptError):
                raise
            raise os_failure(WriteFailedError, str(self._path(LOCK_FILE)), exc,
                             "taking the writer lock failed: ") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return _held_lock(fd)


@contextlib.contextmanager
def _held_lock(fd: int) -> Iterator[None]:
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _fsync_dir(fd: int) -> None:
    """Make the entries of the directory open as ``fd`` durable."""
    os.fsync(fd)


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is an object store URL (``s3://...``), not a local path or
    ``file://`` URL."""
    scheme = urlparse(os.fspath(location)).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


def open_storage(url: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage for a checkpoint URL: a local path or ``file://`` URL gives
    :class:`LocalStorage`; any other fsspec URL (``s3://``, ``gs://``, ``az://``,
    ``memory://``, ...) an :class:`~deltackpt.io.objectstore.ObjectStorage`, opened with
    ``storage_options`` (endpoint, credentials; else the standard environment variables and
    configuration files of its client library apply).

    Raises :class:`NotACheckpointError` when a local path is an existing file, and
    :class:`StorageError` for a scheme no installed package serves (naming the package to
    install and the schemes available), a missing bucket or credentials that do not work.
    """
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        text = parsed.path
    elif is_url(text):
        _check_scheme(parsed.scheme, text)
        from deltackpt.io.objectstore import ObjectStorage

        return ObjectStorage(text, storage_options)
    if storage_options:
        raise StorageError(f"{text}: storage_options apply to object store URLs, not local paths")
    storage = LocalStorage(text)
    if storage.root.exists() and not storage.root.is_dir():
        raise NotACheckpointError(f"{storage.root} is a file, not a checkpoint directory")
    return storage


def _check_scheme(scheme: str, url: str) -> None:
    """Raise :class:`StorageError` unless an installed fsspec implementation serves ``scheme``."""
    from deltackpt.io.objectstore import redact_url

    where = redact_url(url)
    if importlib.util.find_spec("fsspec") is None:
        raise StorageError(f"{where}: {scheme}:// URLs are read and written through fsspec, which "
                           "is not installed (pip install 'deltackpt[remote]', or fsspec and the "
                           f"package for {scheme}://); available now: local paths and file://")
    from fsspec.registry import known_implementations, registry

    known = {**known_implementations, **{name: {"class": ""} for name in registry}}
    available = sorted(name for name, impl in known.items()
                       if name in registry or _installed(impl.get("class", "")))
    schemes = ", ".join(f"{name}://" for name in available)
    if scheme not in known:
        raise StorageError(f"{where}: unknown storage scheme {scheme!r}; available: local paths, "
                           f"{schemes}")
    if scheme not in available:
        hint = known[scheme].get("err") or f"install the package {known[scheme]['class'].split('.')[0]}"
        raise StorageError(f"{where}: {scheme}:// needs a package that is not installed ({hint}); "
                           f"available: local paths, {schemes}")


def _installed(qualified_class: str) -> bool:
    """Whether the top-level package of ``qualified_class`` can be imported (without importing)."""
    top = qualified_class.split(".")[0]
    return bool(top) and importlib.util.find_spec(top) is not None
