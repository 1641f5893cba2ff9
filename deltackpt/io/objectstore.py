"""Checkpoints on object storage (S3, GCS, Azure Blob, ``memory://``) through fsspec.

:class:`ObjectStorage` implements :class:`deltackpt.io.storage.Storage` on an
fsspec file system under the object-store protocol of docs/FORMAT.md 1.3:
data objects are written first and ``metadata.json`` last, each in one PUT
(a multipart upload becomes visible only when it completes), so a step
exists if and only if its metadata object does, and nothing is ever
renamed. One writer at a time holds a lease object taken with a conditional
PUT (``If-None-Match: *``) and renewed while it lives; a crashed writer's
lease expires.

Data objects on S3 are uploaded as multipart uploads whose parts go out in
parallel on a thread pool while encoding goes on. Reads fetch only the
chunks a load needs: the reader is told them up front (``prefetch``), joins
adjacent ones into ranged GETs of up to ``RUN_BYTES`` and streams those on
the same transfer threads, handing each chunk to its decoder as soon as its
bytes have arrived. Transfers are I/O-bound, so their number in flight
(``TRANSFER_THREADS``) does not follow the CPU count. Transient failures (dropped connections, timeouts,
HTTP 500/503 SlowDown) are retried with bounded exponential backoff and
jitter; anything else fails the operation. Credentials given in
``storage_options`` never appear in an error message or the URL a
checkpoint reports.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from deltackpt.errors import (
    CorruptionError,
    DeltackptError,
    ReadFailedError,
    StorageError,
    WriteFailedError,
    WriterLockedError,
)

LEASE_OBJECT = ".writer.lease"
PART_BYTES = 8 << 20  # S3 takes parts of 5 MiB to 5 GiB (the last one may be smaller)
PARTS_IN_FLIGHT = 4  # per data object: bounds the memory an upload holds
TRANSFER_THREADS = 32  # parts uploaded and ranged GETs streamed at once, per storage
RUN_BYTES = 64 << 20  # the most one ranged GET of adjacent chunks fetches
# Chunks this close are fetched by one GET, the bytes between them too, where those are at most
# 1/GAP_SHARE of the run's wanted bytes (fetched / needed stays within 1 + 1/GAP_SHARE).
GAP_BYTES = 256 << 10
GAP_SHARE = 16
STREAM_PIECE_BYTES = 4 << 20  # read from a GET's body per call
RETRIES = 6  # attempts of one operation before its error is final
BACKOFF_SECONDS = 0.1  # first backoff; it doubles per attempt, up to BACKOFF_MAX_SECONDS
BACKOFF_MAX_SECONDS = 5.0

# Option names whose values are secrets (matched as substrings, lower case).
_SECRET_OPTION_WORDS = ("secret", "token", "password", "key", "credential", "sas", "signature")

# Errors of a request that may succeed when repeated: the connection, not the request, failed.
_TRANSIENT_NAMES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ClientConnectionError",
    "ClientConnectorError", "ServerTimeoutError", "ResponseStreamingError", "IncompleteRead",
    "ProtocolError", "IncompleteReadError", "ConnectionError", "HTTPClientError",
})
_CHANGES = ("writing", "deleting", "aborting")  # what _call names a request that changes the store
_TRANSIENT_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                              "RequestTimeTooSkewed", "Throttling", "ThrottlingException",
                              "500", "502", "503", "504"})

_WITHOUT_BUCKETS = frozenset({"memory"})  # stores whose first path component is no bucket

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error that caused it) is a failure worth repeating the request for:
    a reset or dropped connection, a timeout, HTTP 500, 502, 503 (SlowDown) or 504."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE,
                                                      errno.ECONNABORTED, errno.ECONNREFUSED):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in _TRANSIENT_CODES or status in (500, 502, 503, 504):
                return True
        text = str(exc)
        if "SlowDown" in text or "Service Unavailable" in text or "reduce your request rate" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def with_retries(call: Callable[[], T], what: str, retries: int = RETRIES) -> T:
    """``call()``, repeated while it fails transiently, ``retries`` attempts at most, sleeping a
    random time up to ``BACKOFF_SECONDS * 2**attempt`` (capped) in between ("full jitter": many
    clients backing off at once do not return at once)."""
    for attempt in range(retries):
        try:
            return call()
        except Exception as exc:
            if attempt == retries - 1 or not is_transient(exc):
                raise
            time.sleep(random.uniform(0, min(BACKOFF_MAX_SECONDS, BACKOFF_SECONDS * 2 ** attempt)))
    raise AssertionError(what)  # unreachable: the last attempt returns or raises


def _secrets_of(options: Mapping[str, Any]) -> list[str]:
    """The secret values among ``options`` (nested dicts included)."""
    found = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += _secrets_of(value)
        elif isinstance(value, str) and len(value) >= 4 and any(
                word in name.lower() for word in _SECRET_OPTION_WORDS):
            found.append(value)
    return found


def redact_url(url: str) -> str:
    """``url`` without a user name or password in it."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class ObjectStorage:
    """A checkpoint "directory" under a prefix of an object store, through fsspec.

    Directories do not exist on object stores: a step directory is the
    prefix of its objects, present while it holds any.
    """

    lease_seconds = 60.0  # a writer renews its lease every third of this

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec

        options = dict(storage_options or {})
        self._secrets = _secrets_of(options)
        self.url = redact_url(url).rstrip("/")
        if self.url != url.rstrip("/"):
            raise StorageError(f"{self.url}: credentials in the URL are not accepted (they would "
                               "reach logs); pass them in storage_options or the environment")
        scheme = urlsplit(url).scheme
        self.scheme = scheme
        s3 = scheme in ("s3", "s3a")
        if s3:  # retries are ours (with_retries): one attempt per client call, on our own client
            # (botocore's total_max_attempts; its max_attempts counts the retries after the first)
            options["config_kwargs"] = {"retries": {"total_max_attempts": 1},
                                        "max_pool_connections": TRANSFER_THREADS,
                                        **options.get("config_kwargs", {})}
            options.setdefault("skip_instance_cache", True)
        try:
            self.fs = fsspec.filesystem(scheme, use_listings_cache=False, **options)
        except Exception as exc:
            raise self._error(f"cannot open {self.url}", exc) from None
        if s3:
            self.fs.retries = 1
        self.root = self.fs._strip_protocol(url).rstrip("/")
        self._s3 = hasattr(self.fs, "call_s3")
        self._staged: dict[str, tuple[str, bytes]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._lease: _Lease | None = None
        # The identities (ETags) of the objects this storage PUT under the lease it holds: no
        # other writer changes them while it is held, so they are answered without a HEAD.
        self._committed: dict[str, tuple[str, str, str]] = {}
        self._probe()

    # -- helpers -----------------------------------------------------------------------

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _error(self, what: str, exc: BaseException) -> StorageError:
        return StorageError(self._redact(f"{what}: {type(exc).__name__}: {exc}"))

    def _call(self, what: str, call: Callable[[], T]) -> T:
        """``call()`` with retries; a failure other than a missing object is raised as a
        :class:`WriteFailedError` when ``what`` writes, deletes or aborts, else as a
        :class:`ReadFailedError` (both ``OSError``), naming ``what``, redacted."""
        try:
            return with_retries(call, what)
        except (FileNotFoundError, DeltackptError):
            raise
        except Exception as exc:
            kind = WriteFailedError if what.startswith(_CHANGES) else ReadFailedError
            error = kind(self._redact(f"{what}: {type(exc).__name__}: {exc}"))
            error.errno = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
            error.reason = self._redact(f"{type(exc).__name__}: {exc}")
            raise error from None

    def _probe(self) -> None:
        """Fail now, naming the URL, when the bucket is missing or the credentials do not work."""
        try:
            with_retries(lambda: self.fs.info(self.root), f"{self.url}")
            return
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(f"cannot reach {self.url} (check the credentials and endpoint)",
                              exc) from None
        if self.scheme in _WITHOUT_BUCKETS:
            return  # the prefix appears with its first object
        bucket = self.root.strip("/").split("/")[0]
        if bucket == self.root.strip("/"):
            raise StorageError(f"{self.url}: bucket {bucket!r} does not exist")
        try:
            with_retries(lambda: self.fs.info(bucket), self.url)
        except FileNotFoundError:
            raise StorageError(f"{self.url}: bucket {bucket!r} does not exist") from None
        except Exception as exc:
            raise self._error(f"cannot reach {self.url} (check the credentials and endpoint)",
                              exc) from None

    def _transfers(self) -> ThreadPoolExecutor:
        """The threads that upload parts and stream ranged GETs (their tasks wait on nothing but
        the store, so uploads and reads share them safely)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(TRANSFER_THREADS,
                                                thread_name_prefix="deltackpt-transfer")
            return self._pool

    # -- Storage -----------------------------------------------------------------------

    def _own(self, rel: str) -> tuple[str, str, str] | None:
        """The identity of object ``rel`` if this storage PUT it under the lease it still holds
        (no other writer can have replaced or deleted it since), else None."""
        lease = self._lease
        if lease is None or not lease.held():
            return None
        return self._committed.get(rel)

    def kind(self, rel: str) -> str | None:
        """``"file"`` for an object, ``"dir"`` for a prefix holding objects, else None."""
        if self._own(rel) is not None:
            return "file"
        path = self._path(rel)
        try:
            info = self._call(f"{self.url}/{rel}", lambda: self.fs.info(path))
        except FileNotFoundError:
            return None
        return "dir" if info.get("type") == "directory" else "file"

    def exists(self, rel: str) -> bool:
        return self.kind(rel) is not None

    def is_dir(self, rel: str) -> bool:
        return self.kind(rel) == "dir"

    def listdir(self, rel: str = "") -> list[str]:
        path = self._path(rel)
        entries = self._call(f"listing {self.url}/{rel}",
                             lambda: self.fs.ls(path, detail=False, refresh=True))
        prefix = path.rstrip("/") + "/"
        names = {e.rstrip("/")[len(prefix):] for e in entries if e.rstrip("/").startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n)

    def size(self, rel: str) -> int:
        path = self._path(rel)
        return int(self._call(f"{self.url}/{rel}", lambda: self.fs.size(path)))

    def list_files(self, rel: str = "") -> list[str]:
        """Every object below prefix ``rel`` (paths relative to it), in one listing (S3: one
        ListObjectsV2 per thousand objects, an empty prefix included), instead of a request
        per prefix."""
        path = self._path(rel)
        prefix = path.rstrip("/") + "/"
        if not self._s3:
            found = self._call(f"listing {self.url}/{rel}",
                               lambda: self.fs.find(path, detail=False))
            return sorted(p[len(prefix):] for p in found if p.startswith(prefix))
        bucket, _, key_prefix = prefix.partition("/")

        def listing() -> list[str]:  # s3fs's find adds a HEAD and a listing when none is found
            keys: list[str] = []
            more: dict[str, str] = {}
            while True:
                reply = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key_prefix,
                                        **more)
                keys += [o["Key"][len(key_prefix):] for o in reply.get("Contents", [])]
                if not reply.get("IsTruncated"):
                    return sorted(k for k in keys if k and not k.endswith("/"))
                more = {"ContinuationToken": reply["NextContinuationToken"]}

        return self._call(f"listing {self.url}/{rel}", listing)

    def identity(self, rel: str) -> tuple[str, ...] | None:
        """The object's ETag (S3, Azure; GCS: its generation too), which changes whenever it is
        written again with other bytes: a manager keeps the metadata it read or wrote while the
        object's ETag stays the one it had (one HEAD instead of a GET and a parse; none for an
        object this storage PUT under the lease it holds, whose ETag the PUT returned). None
        when the object is missing or the store reports no ETag (``memory://``)."""
        own = self._own(rel)
        if own is not None:
            return own
        path = self._path(rel)
        if self._s3:  # a HEAD alone: s3fs's info lists the prefix too when the object is missing
            bucket, _, key = path.partition("/")
            try:
                reply = self._call(f"{self.url}/{rel}", lambda: self.fs.call_s3(
                    "head_object", Bucket=bucket, Key=key))
            except FileNotFoundError:
                return None
            info = {"ETag": reply.get("ETag"), "size": reply.get("ContentLength")}
        else:
            try:
                info = self._call(f"{self.url}/{rel}", lambda: self.fs.info(path))
            except FileNotFoundError:
                return None
        tag = info.get("ETag") or info.get("etag")
        if not tag or info.get("type") == "directory":
            return None
        return _identity(tag, info.get("generation", ""), info.get("size", ""))

    def makedirs(self, rel: str = "", *, durable: bool = True) -> bool:
        """Nothing to create: a prefix exists once it holds an object (the bucket was probed at
        open). Returns False, without a request: no prefix is created, so a failed save has
        nothing to remove beyond the objects it wrote, which it removes itself."""
        return False

    def sync_dir(self, rel: str = "") -> None:
        """Nothing to do: an object is durable once its PUT returns."""

    def remove_empty_dir(self, rel: str = "") -> None:
        """Nothing to remove: a prefix exists only while it holds objects."""

    def _stream(self, rel: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start..end`` of object ``rel``, from one ranged GET, in pieces as they arrive
        (stores other than S3: one piece)."""
        path = self._path(rel)
        if not self._s3:
            yield self.fs.cat_file(path, start=start, end=end)
            return
        from fsspec.asyn import sync

        bucket, _, key = path.partition("/")
        reply = sync(self.fs.loop, self.fs._call_s3, "get_object", Bucket=bucket, Key=key,
                     Range=f"bytes={start}-{end - 1}")
        body = reply["Body"]
        try:
            while piece := sync(self.fs.loop, body.read, STREAM_PIECE_BYTES):
                yield piece
        finally:
            body.close()

    def read_bytes(self, rel: str) -> bytes:
        path = self._path(rel)
        return self._call(f"reading {self.url}/{rel}", lambda: self.fs.cat_file(path))

    def open_reader(self, rel: str) -> _ObjectRangeReader:
        """Ranged reads of object ``rel``; ``prefetch`` on the reader starts GETs of the
        ranges a load will read."""
        try:
            size = self.size(rel)
        except FileNotFoundError:
            raise CorruptionError(f"{self.url}/{rel}: data file is missing") from None
        return _ObjectRangeReader(self, rel, size)

    def create(self, rel: str) -> IO[bytes]:
        """A new data object for writing, invisible until :meth:`finish`; closing it without
        finishing discards it."""
        if self._s3:
            return _MultipartUpload(self, rel)  # type: ignore[return-value]
        return _BufferedUpload(self, rel)  # type: ignore[return-value]

    def finish(self, handle: IO[bytes]) -> None:
        """Complete an object from :meth:`create`: it exists, whole, once this returns."""
        handle.commit()  # type: ignore[attr-defined]

    def stage(self, rel: str, data: bytes) -> str:
        """Hold ``data`` for :meth:`publish` to PUT as ``rel``; returns a name for it. Nothing is
        written: an object store has no rename, and a PUT is atomic."""
        token = f"{rel}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        self._staged[token] = (rel, bytes(data))
        return token

    def publish(self, staged: str, rel: str) -> None:
        """PUT what :meth:`stage` held as ``rel`` (one atomic PUT)."""
        self.commit_file(rel, self._staged[staged][1])
        del self._staged[staged]

    def commit_file(self, rel: str, data: bytes) -> None:
        """Replace object ``rel`` with ``data`` in one PUT, which is atomic. While this storage
        holds the writer lease, it is checked first: a writer that lost it commits nothing;
        the ETag the PUT returns is then the object's :meth:`identity` while the lease is
        held."""
        if self._lease is not None:
            self._lease.check()
        path = self._path(rel)
        self._committed.pop(rel, None)
        if not self._s3:
            self._call(f"writing {self.url}/{rel}", lambda: self.fs.pipe_file(path, data))
            return
        bucket, _, key = path.partition("/")
        reply = self._call(f"writing {self.url}/{rel}", lambda: self.fs.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=data))
        if self._lease is not None and reply.get("ETag"):
            self._committed[rel] = _identity(reply["ETag"], "", len(data))

    def remove(self, rel: str) -> None:
        """Delete object ``rel`` (or forget a staged one); nothing there is fine."""
        if self._staged.pop(rel, None) is not None:
            return
        self._committed.pop(rel, None)
        path = self._path(rel)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {self.url}/{rel}", lambda: self.fs.rm_file(path))

    def remove_tree(self, rel: str) -> None:
        """Delete every object under prefix ``rel``; nothing there is fine."""
        for own in [r for r in list(self._committed) if r.startswith(f"{rel}/")]:
            del self._committed[own]
        path = self._path(rel)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {self.url}/{rel}/", lambda: self.fs.rm(path, recursive=True))
        self.abort_uploads(rel)

    def abort_uploads(self, rel: str = "") -> None:
        """Abort the unfinished multipart uploads under prefix ``rel`` (those of a killed writer:
        invisible, but stored and billed until aborted)."""
        if not self._s3:
            return
        bucket, _, key = self._path(rel).partition("/")
        prefix = key + "/" if key else ""
        listed = self._call(f"listing uploads of {self.url}/{rel}", lambda: self.fs.call_s3(
            "list_multipart_uploads", Bucket=bucket, Prefix=prefix))
        for upload in listed.get("Uploads", []):
            with contextlib.suppress(OSError):
                self._call(f"aborting an upload of {self.url}", lambda u=upload: self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]))

    def try_lock(self) -> contextlib.AbstractContextManager[None]:
        """Take the writer lease (``.writer.lease``), renewed in the background until released.

        Raises :class:`WriterLockedError` naming the holder (host, process, expiry) while
        another writer holds an unexpired one, or took over an expired one first.
        """
        lease = _Lease(self)
        if not lease.acquire():
            holder = self.lease_holder() or {}
            if "host" in holder and "pid" in holder:
                until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_expires(holder)))
                who = (f"its writer lease is held by process {str(holder['pid'])[:20]} on "
                       f"{str(holder['host'])[:100]}, until {until} unless renewed (a writer "
                       "that crashed holds it no longer than that)")
            else:
                who = "another writer took its writer lease at the same moment"
            raise WriterLockedError(f"{self.url}: another CheckpointManager is writing to this "
                                    f"checkpoint: {who}; only one writer at a time is allowed")
        self._lease = lease
        self._committed.clear()  # PUT under an earlier lease: another writer may have come since
        try:
            self.abort_uploads()  # while the lease is held, they can only be a crashed writer's
        except BaseException:
            self._release_lease()
            raise
        return _HeldLease(self)

    def _release_lease(self) -> None:
        lease, self._lease = self._lease, None
        self._committed.clear()
        if lease is not None:
            lease.release()

    def lease_holder(self) -> dict | None:
        """The current lease's record (owner, host, pid, expiry), if any."""
        try:
            return json.loads(self.read_bytes(LEASE_OBJECT))
        except (FileNotFoundError, ValueError):
            return None


class _HeldLease(contextlib.AbstractContextManager):
    """The writer lease of a storage, released on exit."""

    def __init__(self, storage: ObjectStorage) -> None:
        self.storage = storage

    def __exit__(self, *exc: object) -> None:
        self.storage._release_lease()


class _ObjectRangeReader:
    """Ranged GETs of one object; safe to call from several threads.

    :meth:`prefetch` starts the GETs of the ranges a load will read, joined
    where adjacent (``GAP_BYTES`` apart at most) into runs of up to
    ``RUN_BYTES``, each streamed on the storage's transfer threads: a range
    is handed to :meth:`read` as soon as its bytes have arrived, so decoding
    overlaps the download. A range read without a prefetch is one GET.
    """

    def __init__(self, storage: ObjectStorage, rel: str, size: int) -> None:
        self.storage, self.rel, self.size = storage, rel, size
        self.where = f"reading {storage.url}/{rel}"
        self._ahead: dict[tuple[int, int], Future[bytes]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _truncated(self, offset: int, length: int, got: int | None = None) -> CorruptionError:
        found = f"it has {self.size}" if got is None else f"got {got}"
        return CorruptionError(f"{self.storage.url}/{self.rel}: file is truncated (wanted bytes "
                               f"{offset}..{offset + length}, {found})")

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Start fetching ``ranges`` (offset, length), listed in about the order they will be
        read: runs are started in the order of their first range needed."""
        order: dict[tuple[int, int], int] = {}
        for position, (offset, length) in enumerate(ranges):
            if length > 0 and offset + length <= self.size:
                order.setdefault((offset, length), position)
        with self._lock:
            wanted = sorted(order.keys() - self._ahead.keys())
        runs: list[list[tuple[int, int]]] = []
        end = wanted_bytes = 0  # of the last run
        for offset, length in wanted:
            if runs and offset + length - runs[-1][0][0] <= RUN_BYTES and \
                    offset - end <= min(GAP_BYTES, (wanted_bytes + length) // GAP_SHARE):
                runs[-1].append((offset, length))
                wanted_bytes += length
            else:
                runs.append([(offset, length)])
                wanted_bytes = length
            end = max(end, offset + length)
        runs.sort(key=lambda run: min(order[r] for r in run))
        pool = self.storage._transfers()
        for run in runs:
            futures: list[Future[bytes]] = [Future() for _ in run]
            with self._lock:
                self._ahead.update(zip(run, futures, strict=True))
            pool.submit(self._fetch_run, run, futures)

    def _fetch_run(self, run: list[tuple[int, int]], futures: list[Future[bytes]]) -> None:
        """Stream the bytes of ``run`` (ascending ranges) and resolve each range's future as its
        bytes arrive; a transient failure resumes from the first range not yet resolved."""
        resolved = 0
        end = max(o + n for o, n in run)

        def stream() -> None:
            nonlocal resolved
            base = run[resolved][0]  # the offset of buffer[0]
            buffer = bytearray()
            with contextlib.closing(self.storage._stream(self.rel, base, end)) as pieces:
                for piece in pieces:
                    if self._closed:
                        return
                    buffer += piece
                    while resolved < len(run):
                        offset, length = run[resolved]
                        if offset + length > base + len(buffer):
                            break
                        futures[resolved].set_result(bytes(buffer[offset - base:
                                                                  offset - base + length]))
                        resolved += 1
                    if resolved == len(run):
                        return
                    cut = min(run[resolved][0] - base, len(buffer))  # bytes no range needs now
                    del buffer[:cut]
                    base += cut
            offset, length = run[resolved]
            raise self._truncated(offset, length, max(0, base + len(buffer) - offset))

        try:
            self.storage._call(self.where, stream)
        except BaseException as exc:
            for future in futures[resolved:]:
                future.set_exception(exc)

    def read(self, offset: int, length: int) -> bytes:
        """The bytes of the range; an object deleted since the reader opened it is reported
        as missing, as one missing when it was opened is."""
        try:
            return self._read(offset, length)
        except FileNotFoundError:
            raise CorruptionError(f"{self.storage.url}/{self.rel}: data file is missing") from None

    def _read(self, offset: int, length: int) -> bytes:
        if offset + length > self.size:
            raise self._truncated(offset, length)
        if length == 0:
            return b""
        with self._lock:
            ahead = self._ahead.pop((offset, length), None)
        if ahead is not None:
            return ahead.result()
        path = self.storage._path(self.rel)
        data = self.storage._call(self.where, lambda: self.storage.fs.cat_file(
            path, start=offset, end=offset + length))
        if len(data) != length:
            raise self._truncated(offset, length, len(data))
        return data

    def close(self) -> None:
        """Stop the streams still running and drop what was fetched and not read."""
        self._closed = True
        with self._lock:
            self._ahead.clear()


class _BufferedUpload(io.RawIOBase):
    """A data object of a store without multipart uploads in fsspec: held in memory, one PUT."""

    def __init__(self, storage: ObjectStorage, rel: str) -> None:
        super().__init__()
        self.storage, self.rel, self.buffer = storage, rel, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.buffer.write(data)

    def commit(self) -> None:
        path = self.storage._path(self.rel)
        data = self.buffer.getvalue()
        self.storage._call(f"writing {self.storage.url}/{self.rel}",
                           lambda: self.storage.fs.pipe_file(path, data))
        self.buffer = io.BytesIO()
        super().close()

    def close(self) -> None:
        self.buffer = io.BytesIO()
        super().close()


class _MultipartUpload(io.RawIOBase):
    """A data object uploaded to S3 as a multipart upload, its parts in parallel.

    Writes fill a part; a full part is handed to the storage's upload pool
    (at most ``PARTS_IN_FLIGHT`` of this object at once, so the caller waits
    rather than holding the whole object). Nothing is visible before
    :meth:`commit` completes the upload; :meth:`close` without it aborts it.
    A small object is one PUT.
    """

    def __init__(self, storage: ObjectStorage, rel: str) -> None:
        super().__init__()
        self.storage, self.rel = storage, rel
        self.bucket, _, self.key = storage._path(rel).partition("/")
        self.where = f"writing {storage.url}/{rel}"
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: deque[tuple[int, Future[str]]] = deque()
        self.done: list[dict] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.buffer += view
        while len(self.buffer) >= PART_BYTES:
            self._send(bytes(self.buffer[:PART_BYTES]))
            del self.buffer[:PART_BYTES]
        return view.nbytes

    def _s3(self, method: str, **kwargs: Any) -> Any:
        fs = self.storage.fs
        return self.storage._call(self.where, lambda: fs.call_s3(method, Bucket=self.bucket,
                                                                 Key=self.key, **kwargs))

    def _send(self, part: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._s3("create_multipart_upload")["UploadId"]
        while len(self.parts) >= PARTS_IN_FLIGHT:
            self._collect()
        number = len(self.done) + len(self.parts) + 1
        self.parts.append((number, self.storage._transfers().submit(
            lambda: self._s3("upload_part", UploadId=self.upload_id, PartNumber=number,
                             Body=part)["ETag"])))

    def _collect(self) -> None:
        number, future = self.parts.popleft()
        self.done.append({"PartNumber": number, "ETag": future.result()})

    def commit(self) -> None:
        if self.upload_id is None:  # one part at most: a single PUT
            self._s3("put_object", Body=bytes(self.buffer))
        else:
            if self.buffer:
                self._send(bytes(self.buffer))
            while self.parts:
                self._collect()
            self._s3("complete_multipart_upload", UploadId=self.upload_id,
                     MultipartUpload={"Parts": self.done})
            self.upload_id = None
        self.buffer = bytearray()
        super().close()

    def close(self) -> None:
        """Abort an upload not committed (the save failed): its parts are deleted."""
        if self.closed:
            return
        for _, future in self.parts:
            future.cancel()
        for _, future in self.parts:
            with contextlib.suppress(Exception):
                future.result()
        self.parts.clear()
        if self.upload_id is not None:
            with contextlib.suppress(OSError):
                self._s3("abort_multipart_upload", UploadId=self.upload_id)
            self.upload_id = None
        self.buffer = bytearray()
        super().close()


class _Lease:
    """The writer lease of FORMAT.md 1.3: object ``.writer.lease`` holding who writes and until
    when; created only if absent (``If-None-Match: *``), renewed and taken over only if unchanged
    since read (``If-Match`` its ETag)."""

    def __init__(self, storage: ObjectStorage) -> None:
        self.storage = storage
        self.rel = LEASE_OBJECT
        self.owner = secrets.token_hex(16)
        self.seconds = storage.lease_seconds
        self.expires = 0.0
        self.tag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> tuple[bytes, float]:
        expires = time.time() + self.seconds
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": expires, "seconds": self.seconds}).encode(), expires

    def acquire(self) -> bool:
        if not self.storage._s3 and self.storage.scheme not in _WITHOUT_BUCKETS:
            log.warning("%s: the writer lease on %s:// is checked, then written, in two requests "
                        "(deltackpt makes conditional PUTs on S3 only): two writers starting "
                        "within that moment can both take it (docs/FORMAT.md 1.3)",
                        self.storage.url, self.storage.scheme)
        data, expires = self._record()
        tag = self.storage_put(data, None)
        if tag is None:
            current = self.storage_get()
            if current is None:
                return self.acquire()  # released in between
            record, current_tag = current
            if record.get("owner") == self.owner:  # our own PUT, retried after a dropped reply
                tag = current_tag
            elif _expires(record) > time.time():
                return False
            else:  # a crashed writer's: take it over unless another writer does first
                tag = self.storage_put(data, current_tag)
                if tag is None:
                    return False
        self.tag, self.expires = tag, expires
        self._thread = threading.Thread(target=self._renew, name="deltackpt-lease", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            data, expires = self._record()
            try:
                tag = self.storage_put(data, self.tag)
            except Exception:  # a failed renewal: retried at the next period while time is left
                if time.time() >= self.expires:
                    self.lost = "it expired while it could not be renewed"
                    return
                continue
            if tag is None:
                self.lost = "another writer took it over"
                return
            self.tag, self.expires = tag, expires

    def held(self) -> bool:
        """Whether the lease is still held: not lost, and renewed within its duration."""
        return self.lost is None and time.time() < self.expires

    def check(self) -> None:
        """Raise :class:`WriterLockedError` unless the lease is still held and unexpired."""
        if self.lost is None and time.time() >= self.expires:
            self.lost = "it expired"
        if self.lost is not None:
            raise WriterLockedError(f"{self.storage.url}: this writer lost its lease ({self.lost}); "
                                    "nothing more is committed")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None:
            current = self.storage_get()
            if current is not None and current[0].get("owner") == self.owner:
                with contextlib.suppress(OSError):
                    self.storage.remove(self.rel)

    # Conditional PUT and GET of the lease object: S3's If-None-Match / If-Match, or, elsewhere,
    # a check then a write under a lock of this process: atomic on memory:// (whose store is this
    # process's memory), not between processes on other stores.

    def storage_put(self, data: bytes, if_match: str | None) -> str | None:
        """PUT the lease if absent (``if_match`` None) or unchanged since read with tag
        ``if_match``; its new tag, or None when the condition failed."""
        storage = self.storage
        path = storage._path(self.rel)
        if storage._s3:
            bucket, _, key = path.partition("/")
            condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
            try:
                reply = storage._call(f"writing {storage.url}/{self.rel}", lambda: storage.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=data, **condition))
            except OSError as exc:
                if isinstance(exc, FileExistsError) or "pre-condition" in str(exc) \
                        or isinstance(exc, FileNotFoundError):
                    return None
                raise
            return reply["ETag"]
        with _LOCAL_LEASES:
            try:
                current = storage.fs.cat_file(path)
            except FileNotFoundError:
                current = None
            if (current is None) != (if_match is None) or (current is not None and
                                                           _tag(current) != if_match):
                return None
            storage.fs.pipe_file(path, data)
            return _tag(data)

    def storage_get(self) -> tuple[dict, str] | None:
        storage = self.storage
        path = storage._path(self.rel)
        if storage._s3:
            bucket, _, key = path.partition("/")

            def get() -> tuple[bytes, str]:
                reply = storage.fs.call_s3("get_object", Bucket=bucket, Key=key)
                return _read_body(storage.fs, reply), reply["ETag"]
            try:
                data, tag = storage._call(f"reading {storage.url}/{self.rel}", get)
            except FileNotFoundError:
                return None
        else:
            try:
                data = storage.fs.cat_file(path)
            except FileNotFoundError:
                return None
            tag = _tag(data)
        try:
            record = json.loads(data)
        except ValueError:
            record = {}
        return (record if isinstance(record, dict) else {}), tag


_LOCAL_LEASES = threading.Lock()


def _identity(tag: str, generation: Any, size: Any) -> tuple[str, str, str]:
    """An object's :meth:`ObjectStorage.identity`, from a HEAD's or a PUT's reply alike."""
    return str(tag), str(generation), str(size)


def _tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _expires(record: dict) -> float:
    value = record.get("expires")
    return float(value) if isinstance(value, (int, float)) else 0.0


def _read_body(fs: Any, reply: dict) -> bytes:
    """The body of an s3fs ``get_object`` reply (an aiobotocore stream) read to the end."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        try:
            return await reply["Body"].read()
        finally:
            reply["Body"].close()

    return sync(fs.loop, read)
