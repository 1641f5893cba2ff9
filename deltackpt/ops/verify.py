"""Checking committed steps: what is damaged, in which file, and which steps it makes unrestorable.

A step is checked chunk by chunk against its checksums
(:func:`~deltackpt.io.reader.verify_step`). A delta step can be restored only
if every step of its chain can, so damage in one step reaches every step
coded on it; the report states that damage once, by step and file, with the
list of the steps that depend on it, instead of repeating it for each of
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltackpt.errors import DeltackptError, ReadFailedError, StepNotFoundError
from deltackpt.format.metadata import StepMetadata, metadata_file
from deltackpt.io.reader import chain_of, read_metadata, read_save_id, verify_step
from deltackpt.io.storage import Storage


@dataclass
class Damage:
    """The problems found in one file of one step, and the checked steps whose chain holds that step.

    ``file`` is the URL of a data file or of the step's metadata file; None
    for problems of the step as a whole (a missing base step, or a delta
    that does not decode on its chain).
    """

    step: int
    file: str | None
    problems: list[str]
    dependents: list[int] = field(default_factory=list)


class VerifyReport(dict[int, list[str]]):
    """``{step: [problem, ...]}`` for every checked step; an empty list means it can be restored.

    A step's list holds the damage found in the step itself, then one line
    per damaged step its chain depends on (``depends on step N, which is
    damaged (K problems)``), not that step's problems again, then what could
    not be read. ``damage`` lists every damaged file once (:class:`Damage`,
    ordered by step), including those of steps that were checked only as part
    of a chain. ``unchecked`` maps the steps that could not be checked in full
    (a file of theirs or of their chain could not be read: a permission
    denied, an I/O error) to those reasons, which say nothing of their
    integrity; each also ends the step's list.
    """

    def __init__(self, problems: dict[int, list[str]], damage: list[Damage],
                 unchecked: dict[int, list[str]] | None = None) -> None:
        super().__init__(problems)
        self.damage = damage
        self.unchecked = unchecked or {}

    @property
    def damaged(self) -> list[int]:
        """The checked steps that are damaged, or depend on a damaged step."""
        unchecked = {s: set(reasons) for s, reasons in self.unchecked.items()}
        return [s for s, problems in self.items() if set(problems) - unchecked.get(s, set())]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# Checks of the steps at most, each after the writer's retention changed a step the one before
# read and found damaged (docs/FORMAT.md 1.4).
ATTEMPTS = 8


def verify_steps(storage: Storage, steps: list[int], *, deep: bool = False, workers: int | None = None,
                 progress: bool = False) -> VerifyReport:
    """Check ``steps`` and the chains they depend on; every step is read and checked once.

    ``deep`` also decodes every chunk (a delta step by restoring its chain). Damage found in a
    step the writer's retention replaced or deleted meanwhile is no damage: the steps that
    still exist are checked again (up to :data:`ATTEMPTS` times), so the report holds only
    damage in the current versions.
    """
    for _ in range(ATTEMPTS - 1):
        report, read = _verify(storage, steps, deep, workers, progress)
        if not any(report.values()) or all(read_save_id(storage, s) == save_id
                                           for s, save_id in read.items()):
            return report
        steps = [s for s in steps if storage.exists(metadata_file(s))]
    return _verify(storage, steps, deep, workers, progress)[0]


def _verify(storage: Storage, steps: list[int], deep: bool, workers: int | None,
            progress: bool) -> tuple[VerifyReport, dict[int, str]]:
    """One check of ``steps`` (:func:`verify_steps`), and the ``save_id`` of each step read."""
    metas: dict[int, StepMetadata | DeltackptError] = {}
    unreadable: list[int] = []  # steps whose metadata failed to read, in the order they were asked for
    found: dict[int, dict[str | None, list[str]]] = {}  # the damage of each step, by file
    not_read: dict[int, list[str]] = {}  # what could not be read of each step

    def metadata(step: int) -> StepMetadata:
        if step not in metas:
            try:
                metas[step] = read_metadata(storage, step)
            except DeltackptError as exc:
                metas[step] = exc
                if isinstance(exc, ReadFailedError):
                    not_read[step] = [str(exc)]
                elif not isinstance(exc, StepNotFoundError):
                    found[step] = {f"{storage.url}/{metadata_file(step)}": [str(exc)]}
        meta = metas[step]
        if isinstance(meta, DeltackptError):
            unreadable.append(step)
            raise meta
        return meta

    def damage_of(meta: StepMetadata) -> dict[str | None, list[str]]:
        if meta.step not in found:
            check = verify_step(storage, meta, deep=deep, workers=workers, progress=progress)
            found[meta.step] = dict(check.problems)
            not_read[meta.step] = list(check.could_not_read.values())
        return found[meta.step]

    report: dict[int, list[str]] = {}
    unchecked: dict[int, list[str]] = {}
    dependents: dict[int, list[int]] = {}
    for step in steps:
        try:
            meta = metadata(step)
        except StepNotFoundError:  # listed, then deleted by the writer's retention
            continue
        except ReadFailedError as exc:
            report[step] = unchecked[step] = [str(exc)]
            continue
        except DeltackptError as exc:
            report[step] = [str(exc)]
            continue
        own = damage_of(meta)
        unreadable.clear()
        bases: list[int] = []
        try:
            links = chain_of(storage, meta, metadata)[:-1]
            for link in links:
                damage_of(link)
            bases = [link.step for link in links]
        except ReadFailedError:  # the links down to the one that could not be read
            bases = []
            link = meta
            while link.kind == "delta" and isinstance(metas.get(link.base_step), StepMetadata):
                link = metas[link.base_step]
                damage_of(link)
                bases.append(link.step)
        except DeltackptError as exc:
            broken = unreadable[-1] if unreadable else None
            if broken in found:  # a base whose metadata cannot be read: damage of that step
                bases = [broken]
            else:  # a missing base, or a base that is not an earlier step
                own.setdefault(None, []).append(str(exc))
        damaged = [b for b in bases if found.get(b)]
        for base in damaged:
            dependents.setdefault(base, []).append(step)
        blind = [r for s in [step, *bases, *unreadable] for r in not_read.get(s, [])]
        report[step] = [p for problems in own.values() for p in problems] + [
            f"depends on step {b}, which is damaged "
            f"({_count(sum(map(len, found[b].values())), 'problem')})" for b in damaged]
        if deep and not report[step] and not blind and meta.kind == "delta":
            from deltackpt.restore.chain import restore_chain  # decoding a chain needs torch and the kernels

            try:
                restore_chain(storage, meta, workers=workers, progress=progress)
            except ReadFailedError as exc:
                blind.append(str(exc))
            except DeltackptError as exc:
                own.setdefault(None, []).append(str(exc))
                report[step].append(str(exc))
        if blind:
            unchecked[step] = list(dict.fromkeys(blind))
            report[step] += unchecked[step]
    damage = [Damage(step, file, problems, dependents.get(step, []))
              for step in sorted(found) for file, problems in found[step].items() if problems]
    read = {s: m.save_id for s, m in metas.items() if isinstance(m, StepMetadata)}
    return VerifyReport(report, damage, unchecked), read
