"""The queue of asynchronous saves, between a save's snapshot and its driver.

A :class:`SaveQueue` hands each ``save(..., blocking=False)`` to one background
thread. Saves run one after another in the order they were made, each
planned once the one before it is committed or failed, so a delta is always
coded against what a reader of its base decodes. (The whole path of a save:
:mod:`deltackpt.save`.)

A save's failure in the background is kept until the caller hears of it:
by its :class:`SaveHandle` (``wait`` raises it, ``exception`` returns it),
or else by the manager's next ``save``, ``wait`` or ``close``, which raise
:class:`~deltackpt.errors.BackgroundSaveError` with the original chained.

A process that exits with saves in flight finishes them first: the queue
waits for them before Python stops the thread pools at exit (a process
killed meanwhile leaves no partial step: docs/FORMAT.md 1.1). A child
forked meanwhile (a DataLoader worker) has none of them in flight.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from deltackpt.errors import BackgroundSaveError, SaveInFlightError
from deltackpt.save.snapshot import HostBuffers, SnapshotPool

if TYPE_CHECKING:
    from deltackpt.save.info import SaveInfo

log = logging.getLogger("deltackpt")

THREAD_NAME = "deltackpt-save"


class SaveHandle:
    """A save running in the background, as ``save(..., blocking=False)`` returns it."""

    def __init__(self, step: int, future: Future[SaveInfo], queue: SaveQueue) -> None:
        self.step = step
        self._future = future
        self._queue = queue
        self._reported = False  # its failure reached the caller

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, {'done' if self.done() else 'in flight'})"

    def done(self) -> bool:
        """Whether the save has ended: committed, or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the save (at most ``timeout`` seconds, else ``TimeoutError``) and return what
        it wrote; raises its failure, which the manager then does not raise again."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save (at most ``timeout`` seconds, else ``TimeoutError``) and return its
        failure (None if it committed), which the manager then does not raise again."""
        error = self._future.exception(timeout)
        if error is not None:
            self._queue.reported(self)
        return error


class SaveQueue:
    """The asynchronous saves of one manager: at most ``max_in_flight`` at a time, each holding
    a snapshot buffer set from its call until it is written, run in order on one thread."""

    def __init__(self, max_in_flight: int) -> None:
        self.snapshots = SnapshotPool(max_in_flight)
        self._executor: ThreadPoolExecutor | None = None
        self._changed = threading.Condition()
        self._in_flight: list[SaveHandle] = []
        self._unreported: list[SaveHandle] = []  # failed, and not yet raised to the caller
        self._thread_ids: set[int] = set()
        _queues.add(self)

    def on_save_thread(self) -> bool:
        """Whether the calling thread is the one running this queue's saves."""
        return threading.get_ident() in self._thread_ids

    def in_flight(self) -> list[int]:
        """The steps of the saves not ended yet, in the order they were made."""
        with self._changed:
            return [h.step for h in self._in_flight]

    def admit(self, step: int) -> None:
        """Raise :class:`SaveInFlightError` if ``step`` is being saved, or is older than a step
        being saved (its delta would be coded against a later save)."""
        steps = self.in_flight()
        later = [s for s in steps if s >= step]
        if later:
            what = "is being saved" if step in later else \
                f"is older than step {max(later)}, which is being saved"
            raise SaveInFlightError(
                f"cannot save step {step}: it {what} in the background (steps in flight: "
                f"{steps}); wait for it (handle.wait() or manager.wait()) first")

    def submit(self, step: int, run: Callable[[], SaveInfo], buffers: HostBuffers) -> SaveHandle:
        """Run ``run`` (the save of ``step``) on the save thread after the saves before it; its
        snapshot ``buffers`` go back to the pool when it ends."""
        def job() -> SaveInfo:
            self._thread_ids.add(threading.get_ident())
            try:
                return run()
            finally:
                self.snapshots.release(buffers)

        with self._changed:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
            future = self._executor.submit(job)
            handle = SaveHandle(step, future, self)
            self._in_flight.append(handle)
        future.add_done_callback(lambda _: self._ended(handle))
        return handle

    def _ended(self, handle: SaveHandle) -> None:
        with self._changed:
            self._in_flight.remove(handle)
            if handle._future.exception() is not None and not handle._reported:
                self._unreported.append(handle)
            self._changed.notify_all()

    def reported(self, handle: SaveHandle) -> None:
        """The caller got ``handle``'s failure from the handle itself."""
        with self._changed:
            handle._reported = True
            if handle in self._unreported:
                self._unreported.remove(handle)

    def wait_all(self) -> None:
        """Wait for every save in flight (their failures are kept for :meth:`raise_failure`)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._in_flight)

    def raise_failure(self) -> None:
        """Raise :class:`BackgroundSaveError` for the saves that failed and whose failure the
        caller has not heard of (the first one's error chained), forgetting them."""
        with self._changed:
            failed, self._unreported = self._unreported, []
        if failed:
            first = failed[0]._future.exception()
            steps = ", ".join(str(h.step) for h in failed)
            raise BackgroundSaveError(
                f"the background save of step{'s' if len(failed) > 1 else ''} {steps} failed "
                f"(step {failed[0].step}: {type(first).__name__}: {first}); steps committed "
                "before are intact") from first

    def close(self) -> None:
        """Wait for every save in flight, stop the save thread and free the snapshot buffers (a
        later save starts and allocates them again)."""
        self.wait_all()
        with self._changed:
            executor, self._executor = self._executor, None
            self.snapshots = SnapshotPool(self.snapshots.slots)
        if executor is not None:
            executor.shutdown(wait=True)
        self._thread_ids.clear()

    def _forget_after_fork(self) -> None:
        """In a forked child (a DataLoader worker, say): the parent's saves are not in flight
        here, and none of its locks or threads exist."""
        self._changed = threading.Condition()
        self._in_flight, self._unreported = [], []
        self._executor, self._thread_ids = None, set()
        self.snapshots = SnapshotPool(self.snapshots.slots)

    def finish_at_exit(self) -> None:
        """At interpreter exit: wait for the saves in flight, and log the failures no caller
        heard of."""
        self.wait_all()
        with self._changed:
            failed, self._unreported = self._unreported, []
        for handle in failed:
            error = handle._future.exception()
            log.error("the background save of step %d failed: %s: %s", handle.step,
                      type(error).__name__, error)


_queues: weakref.WeakSet[SaveQueue] = weakref.WeakSet()


def _forget_saves_after_fork() -> None:
    for queue in list(_queues):
        queue._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_saves_after_fork)


def _finish_saves_at_exit() -> None:
    for queue in list(_queues):
        queue.finish_at_exit()


# Python stops its thread pools at exit (threading._shutdown) before atexit functions run, and
# the saves in flight need the manager's encoding threads: they are waited for first. The hooks
# of threading run newest first, so this one runs before concurrent.futures' (imported above).
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_finish_saves_at_exit)
