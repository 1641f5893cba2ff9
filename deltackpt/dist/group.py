"""The ranks of a run and collectives that carry one rank's failure to every rank instead of
leaving the others waiting; a single process is a group of one rank."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from deltackpt.errors import DistributedError

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """The ranks of a run, and the process group their collectives run on (``pg``; None: the
    default group). A single process is a group of one rank (:meth:`single`): its collectives
    return what it gives them, without torch.distributed, and :meth:`check` raises its failure
    as it is, so that a save runs the same steps on one rank as on many."""

    rank: int
    world_size: int
    pg: Any = field(default=None, compare=False)

    @staticmethod
    def current() -> Group | None:
        """The running group, or None outside torch.distributed or with a single rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return Group(dist.get_rank(), dist.get_world_size())

    @staticmethod
    def single() -> Group:
        """This process alone, as a group of one rank."""
        return Group(0, 1)

    def background(self) -> Group:
        """The same ranks on a new gloo process group, for the collectives of saves that run in
        the background: never interleaved with the training's collectives on the default group
        (NCCL's, say). Creating it is a collective of the default group."""
        return Group(self.rank, self.world_size, dist.new_group(backend="gloo"))

    def ranks_on_this_host(self) -> int:
        """How many ranks of the group run on this machine (they share its CPUs): torchrun's
        ``LOCAL_WORLD_SIZE``, else counted by host name (a collective)."""
        if self.world_size == 1:
            return 1
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) > 0:
            return int(local)
        host = socket.gethostname()
        return sum(h == host for h in self.all_gather(host))

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        with _collective("gather"):
            dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with _collective("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with _collective("all_gather"):
            dist.all_gather_object(out, obj, group=self.pg)
        return out

    def check(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if ``error`` is set on any rank: :class:`DistributedError`
        naming each failed rank and its error (a single process's ``error`` itself).

        Every rank calls this at the same point, so a failure on one rank
        reaches all of them instead of leaving the others waiting in the
        next collective.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        errors = [(r, e) for r, e in enumerate(self.all_gather(_describe(error))) if e is not None]
        if errors:
            raise DistributedError(f"{what} failed on " + "; ".join(
                f"rank {r}: {e}" for r, e in errors)) from error

    def together(self, what: str, work: Callable[[], T]) -> T:
        """``work()`` on every rank (each calls this at the same point), its result returned;
        any rank's failure raised on every rank by :meth:`check`."""
        result, error = None, None
        try:
            result = work()
        except Exception as exc:  # raised on every rank by the check below
            error = exc
        self.check(error, what)
        return result

    def share(self, result: Any, error: BaseException | None) -> Any:
        """Rank 0's ``result`` on every rank, or rank 0's ``error`` raised on every rank (with
        several ranks as :class:`DistributedError` of its message; a single process's itself).
        The other ranks' arguments are ignored."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return result
        result, message = self.broadcast((result, None if error is None else str(error)))
        if message is not None:
            raise DistributedError(message) from error
        return result


def _describe(error: BaseException | None) -> str | None:
    """An error as every rank reports another's: its type and message."""
    return None if error is None else f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def _collective(name: str) -> Iterator[None]:
    """Raise :class:`DistributedError` when a collective fails: a rank died or the process
    group timed out (the backend's error says which)."""
    try:
        yield
    except RuntimeError as exc:  # what gloo and NCCL raise for a lost peer or a timeout
        raise DistributedError(f"{name} across ranks failed (a rank stopped or timed out): "
                               f"{exc}") from exc
