"""The threads that encode and decode chunks.

A save or restore runs its chunks on a thread pool (the kernels, zstd and
xxh3 release the GIL). Starting one per call costs a save of a small state
a noticeable part of its time, so a :class:`~deltackpt.CheckpointManager`
keeps a :class:`WorkerPool` from its first save or restore until
:meth:`~deltackpt.CheckpointManager.close`; one-off callers (the command
line, conversions) pass a thread count and get a pool for the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltackpt.dist.group import Group

THREAD_NAME_PREFIX = "deltackpt"
# A chunk of fewer raw bytes is coded or decoded on the thread that asks for it: handed to a
# worker, such a chunk costs more in the hand-off and its GIL switches than in its work.
INLINE_BYTES = 1 << 18


def default_workers() -> int:
    """Threads for encoding and decoding: one per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_threads(group: Group) -> int:
    """The threads of one rank of ``group``: the CPUs this process may use, shared out between
    the group's ranks on this machine (one rank per core would otherwise run as many threads as
    the machine has cores). A collective, unless the group is a single process."""
    return max(1, default_workers() // group.ranks_on_this_host())


class WorkerPool:
    """A thread pool kept across calls: started at its first use, stopped by :meth:`close`
    (used again after that, it starts anew).

    A child process forked while the pool runs has none of its threads: the
    child's first use starts a pool of its own.
    """

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        _pools.add(self)

    def executor(self) -> ThreadPoolExecutor:
        """The running pool (started now if it is not)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers,
                                                    thread_name_prefix=THREAD_NAME_PREFIX)
            return self._executor

    def close(self) -> None:
        """Stop the threads (waiting for the tasks they run)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent may have held it while forking
        self._executor = None  # its threads exist only in the parent


Workers = int | WorkerPool | None
"""Threads to run on: a :class:`WorkerPool` (kept across calls), a count (a pool of that many
threads for the call), or None (for the call, one thread per usable CPU)."""

_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def worker_count(workers: Workers) -> int:
    """How many threads ``workers`` runs on."""
    if isinstance(workers, WorkerPool):
        return workers.workers
    return workers or default_workers()


@contextlib.contextmanager
def running(workers: Workers) -> Iterator[Executor]:
    """An executor on ``workers``: the pool's own, or one started for the ``with`` block and
    stopped at its end."""
    if isinstance(workers, WorkerPool):
        yield workers.executor()
        return
    with ThreadPoolExecutor(worker_count(workers), thread_name_prefix=THREAD_NAME_PREFIX) as pool:
        yield pool


def done(fn: Callable[..., Any], *args: Any) -> Future:
    """A future already holding ``fn(*args)``, run on this thread (its exception propagates)."""
    future: Future = Future()
    future.set_result(fn(*args))
    return future


def drain(futures: Iterable[Future]) -> None:
    """Cancel those of ``futures`` not started and wait for the others: a call that fails
    leaves nothing of its own running on a kept pool (e.g. a task writing to a file the
    call's clean-up deletes)."""
    futures = list(futures)
    for future in futures:
        future.cancel()
    wait(futures)
