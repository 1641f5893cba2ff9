"""Reading a step while its writer's retention changes the directory (FORMAT.md 1.4).

A gc replaces the metadata of kept steps (re-coding them on a new base) and deletes
the steps it does not keep, each commit and deletion on its own, while readers take no
lock. A reader that read a chain's metadata just before a gc may then find a data file
gone, a base step gone, or a base re-coded after the delta it read (whose decoded values
then fail their checksum). Each of these is reported as damage by the read itself;
:func:`read_consistently` tells them from real damage by reading the chain's metadata
again: when a step of it changed since it was read, the read is done again on the
current chain, and damage is reported only when the step's current chain names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from deltackpt.dist.group import Group
from deltackpt.errors import ChainChangedError, CorruptionError, StepNotFoundError
from deltackpt.format.metadata import StepMetadata, metadata_file
from deltackpt.io.reader import list_steps, read_metadata, read_save_id
from deltackpt.io.storage import Storage

T = TypeVar("T")

# Reads of one step at most; each one after the first follows a change of its chain.
ATTEMPTS = 8


class ChainReads:
    """Reads step metadata (default: from ``storage``), remembering the version of each step
    it read, to tell later whether the writer replaced or deleted it since."""

    def __init__(self, storage: Storage, read: Callable[[int], StepMetadata] | None = None) -> None:
        self.storage = storage
        self._read = read or (lambda step: read_metadata(storage, step))
        self.save_ids: dict[int, str] = {}

    def __call__(self, step: int) -> StepMetadata:
        meta = self._read(step)
        self.save_ids[step] = meta.save_id
        return meta

    def changed(self) -> list[int]:
        """The steps read whose committed version is another now, or that are gone."""
        return [step for step, save_id in self.save_ids.items()
                if read_save_id(self.storage, step) != save_id]


def read_consistently(storage: Storage, step: int, attempt: Callable[[ChainReads], T],
                      new_reads: Callable[[], ChainReads] | None = None,
                      group: Group | None = None) -> T:
    """``attempt(reads)``, which reads ``step`` and its chain through ``reads``; done again on
    the current chain while it fails because the writer changed the chain meanwhile.

    A :class:`CorruptionError` or :class:`StepNotFoundError` of an attempt is raised only when
    no step the attempt read has changed since: the damage is in the current chain. A step
    the writer deleted while it was read raises :class:`StepNotFoundError` saying so; a chain
    changed on every one of :data:`ATTEMPTS` reads raises :class:`ChainChangedError`. Under
    ``group`` every rank calls this and the ranks read again together (any rank's other
    failure is raised on every rank, as :meth:`Group.check` does).
    """
    new_reads = new_reads or (lambda: ChainReads(storage))
    for _ in range(ATTEMPTS):
        reads = new_reads()
        result, error, again = None, None, False
        try:
            result = attempt(reads)
        except Exception as exc:  # under a group: raised on every rank by the check below
            error = exc
            again = isinstance(exc, (CorruptionError, StepNotFoundError)) and bool(reads.changed())
        if group is not None and group.world_size > 1:  # every rank takes the same way
            failed = [a for f, a in group.all_gather((error is not None, again)) if f]
            again = bool(failed) and all(failed)
            if not again:
                group.check(error, f"load of step {step}")
        if not again:
            if error is not None:
                raise error
            return result
        if not storage.exists(metadata_file(step)):
            steps = ", ".join(map(str, list_steps(storage))) or "none"
            raise StepNotFoundError(f"step {step} was deleted from {storage.url} while it was "
                                    f"being read (by its writer's retention); available steps: "
                                    f"{steps}") from None
    raise ChainChangedError(
        f"step {step} of {storage.url}: its writer's retention replaced steps of its chain "
        f"during each of {ATTEMPTS} reads; give the writer a reader_grace longer than this "
        "read takes, or read the step between two of its saves")
