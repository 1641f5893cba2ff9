"""Retention: which steps of a checkpoint directory to keep, and deleting the others safely.

A :class:`RetentionPolicy` names the steps to keep (the last few, every
M-th, the recent full steps); :func:`collect_garbage` deletes the rest
without ever breaking a kept step. A delta step is restored through its
chain (docs/FORMAT.md 5), so deleting a step that a kept delta depends on
would make that delta unrestorable. Such a delta is first rewritten as a
full (lossless) step holding exactly the values it restored to: it then
restores to the very same tensors, and float32 deltas coded against it stay
valid, since a full step's running values are its stored values. The
running values of ``bfloat16`` and ``float16`` tensors are float32 and
are lost by the rewrite, so a kept delta that codes such a tensor against a
rewritten step is rewritten too.

Order of the work, so that a crash at any point leaves every kept step
restorable to the same values: the plan is made from the metadata alone;
rewrites run from the highest step down (a step's chain holds only lower
steps, so every rewrite restores through the untouched chain); deletions
only start once every rewrite is committed, and run from the highest step
down as well, so every step still visible keeps its chain.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from deltackpt.codecs.quant import NAME as QUANT
from deltackpt.errors import DeltackptError
from deltackpt.format import METADATA_FILE, StepMetadata, step_dir_name
from deltackpt.progress import human_bytes
from deltackpt.storage import Storage
from deltackpt.writer import write_step

if TYPE_CHECKING:
    from deltackpt.manager import CheckpointManager

# Bytes a full step takes per raw byte, for the estimate of a dry run.
FULL_STEP_RATIO = 1.2


@dataclass(frozen=True)
class RetentionPolicy:
    """Which steps to keep; every other step is deleted by :func:`collect_garbage`.

    A step is kept if any rule keeps it, and the latest step always is.

    Args:
        last: keep the ``last`` highest steps.
        every: keep every step whose number is a multiple of ``every``.
        full_within: keep every full step younger than ``full_within``
            training steps, i.e. whose number is above ``latest - full_within``.

    The string form, accepted by :meth:`parse`, the ``keep=`` argument of
    :class:`~deltackpt.CheckpointManager` and ``deltackpt gc --keep``, is
    ``"last=5,every=1000,full_within=2000"`` (any non-empty subset).
    """

    last: int | None = None
    every: int | None = None
    full_within: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"retention policy: {f.name} must be a positive integer, "
                                 f"got {value!r}")
        if self.last is None and self.every is None and self.full_within is None:
            raise ValueError("retention policy: set at least one of last, every and full_within "
                             "(e.g. 'last=5,every=1000')")

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) is not None)

    @classmethod
    def parse(cls, spec: RetentionPolicy | str) -> RetentionPolicy:
        """A policy from its string form (``"last=5,every=100"``); a policy is returned as is.

        Raises ``ValueError`` naming the entry that is not ``KEY=POSITIVE_INT``
        with a known key, or a key given twice.
        """
        if isinstance(spec, RetentionPolicy):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"a retention policy is a RetentionPolicy or a string such as "
                            f"'last=5,every=100', got {type(spec).__name__}")
        known = [f.name for f in fields(cls)]
        values: dict[str, int] = {}
        if not spec.strip():
            raise ValueError(f"retention policy {spec!r} is empty; expected KEY=N entries separated "
                             f"by commas, KEY one of {', '.join(known)} (e.g. 'last=5,every=100')")
        for entry in spec.split(","):
            key, sep, value = (part.strip() for part in entry.partition("="))
            key = key.replace("-", "_")
            where = f"retention policy {spec!r}: entry {entry.strip()!r}"
            if not sep:
                raise ValueError(f"{where} is not KEY=N (KEY one of {', '.join(known)})")
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r}; expected one of {', '.join(known)}")
            if key in values:
                raise ValueError(f"{where}: {key} is given twice")
            if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
                raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
            values[key] = int(value)
        return cls(**values)

    def select(self, steps: list[int], kinds: dict[int, str]) -> set[int]:
        """The steps of ``steps`` this policy keeps; ``kinds`` maps steps to ``"full"``/``"delta"``.

        A step missing from ``kinds`` counts as neither (``full_within`` does
        not keep it); the latest step is always kept.
        """
        ordered = sorted(set(steps))
        if not ordered:
            return set()
        latest = ordered[-1]
        kept = {latest}
        if self.last is not None:
            kept.update(ordered[-self.last:])
        if self.every is not None:
            kept.update(s for s in ordered if s % self.every == 0)
        if self.full_within is not None:
            kept.update(s for s in ordered
                        if kinds.get(s) == "full" and s > latest - self.full_within)
        return kept


@dataclass
class GCReport:
    """What :func:`collect_garbage` did (or, for a dry run, would do).

    ``kept``: the steps left (including ``skipped``); ``removed``: the steps
    deleted; ``rewritten``: the kept delta steps rewritten as full steps;
    ``freed_bytes``: bytes of the removed steps' files, metadata included;
    ``added_bytes``: bytes written by the rewrites (for a dry run an
    estimate, ``raw_bytes / 1.2`` per rewritten step); ``skipped``: kept
    steps left alone because their metadata cannot be read or their chain
    misses a step or has an unreadable one (they could not be restored
    before either). All lists are ascending.
    """

    kept: list[int]
    removed: list[int]
    rewritten: list[int]
    freed_bytes: int
    added_bytes: int
    dry_run: bool
    skipped: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able values."""
        return asdict(self)

    def describe(self) -> str:
        """A one-line summary for people."""
        def n(count: int, what: str = "step") -> str:
            return f"{count} {what}{'' if count == 1 else 's'}"

        removed = f"{n(len(self.removed))}{_listing(self.removed)}"
        rewritten = f"{n(len(self.rewritten), 'delta step')} as full{_listing(self.rewritten)}"
        if self.dry_run:
            text = (f"dry run: would remove {removed}, rewrite {rewritten} and keep "
                    f"{n(len(self.kept))}; would free {human_bytes(self.freed_bytes)} and write "
                    f"about {human_bytes(self.added_bytes)}")
        else:
            text = (f"removed {removed}, rewrote {rewritten}, kept {n(len(self.kept))}; freed "
                    f"{human_bytes(self.freed_bytes)}, wrote {human_bytes(self.added_bytes)}")
        if self.skipped:
            text += (f"; left alone {n(len(self.skipped), 'step')} that cannot be read or "
                     f"restored{_listing(self.skipped)}")
        return text


def _listing(steps: list[int], limit: int = 8) -> str:
    if not steps:
        return ""
    if len(steps) <= limit:
        return f" ({', '.join(map(str, steps))})"
    head = ", ".join(map(str, steps[: limit - 1]))
    return f" ({head}, ..., {steps[-1]})"


def _tree_bytes(storage: Storage, rel: str) -> int:
    """Bytes of every file under ``rel`` (0 for what vanished meanwhile)."""
    total = 0
    try:
        names = storage.listdir(rel)
    except FileNotFoundError:
        return 0
    for name in names:
        child = f"{rel}/{name}"
        with contextlib.suppress(FileNotFoundError):
            total += _tree_bytes(storage, child) if storage.is_dir(child) else storage.size(child)
    return total


def _codes_16bit_against_base(meta: StepMetadata) -> bool:
    """Whether a delta codes a tensor that is not float32 against its base's running values.

    Those running values are float32 while the tensor is stored rounded to
    its dtype, so they do not survive rewriting the base as a full step.
    """
    return any(chunk.codec == QUANT and chunk.params.get("pred") == "base"
               for record in meta.tensors if record.dtype != "float32"
               for fragment in record.fragments for chunk in fragment.chunks)


@dataclass
class _Plan:
    kept: list[int]
    removed: list[int]
    rewritten: list[int]
    skipped: list[int]
    metas: dict[int, StepMetadata]


def _plan(manager: CheckpointManager, policy: RetentionPolicy) -> _Plan:
    """Decide from the metadata alone what to keep, remove and rewrite."""
    steps = manager.steps()
    metas: dict[int, StepMetadata] = {}
    for s in steps:
        with contextlib.suppress(DeltackptError):  # unreadable: kept and left alone
            metas[s] = manager.metadata(s)
    unreadable = set(steps) - set(metas)
    kept = policy.select(steps, {s: m.kind for s, m in metas.items()}) | unreadable
    broken: dict[int, bool] = {}  # whether a step's chain misses a link or has an unreadable one

    def is_broken(step: int) -> bool:
        walked = []
        while step not in broken:
            meta = metas.get(step)
            if meta is None or meta.kind == "full" or meta.base_step >= step:
                broken[step] = meta is None or meta.kind != "full"
                break
            walked.append(step)
            step = meta.base_step
        for link in walked:
            broken[link] = broken[step]
        return broken[step]

    skipped, rewritten = set(unreadable), set()
    for s in sorted(kept - unreadable):
        meta = metas[s]
        if is_broken(s):
            # restoring it fails anyway: it cannot be rewritten, and deleting other steps
            # cannot make it worse
            skipped.add(s)
        elif meta.kind == "delta" and (meta.base_step not in kept or (
                meta.base_step in rewritten and _codes_16bit_against_base(meta))):
            rewritten.add(s)
    return _Plan(sorted(kept), sorted(set(steps) - kept), sorted(rewritten), sorted(skipped), metas)


def collect_garbage(manager: CheckpointManager, policy: RetentionPolicy, *,
                    dry_run: bool = False) -> GCReport:
    """Delete every step of ``manager``'s directory that ``policy`` does not keep.

    A kept delta step whose base is deleted is first rewritten as a full
    step holding exactly the values it restores to (and so is a kept delta
    coding a bfloat16/float16 tensor against a rewritten base); no kept step
    becomes unrestorable or restores to other values. Nothing is deleted
    unless every rewrite succeeded. A step whose metadata cannot be read is
    kept and left alone. ``dry_run`` writes and deletes nothing and reports
    what a real run would do. The caller holds the writer lock (for a real run).

    Raises the error of a kept step that must be rewritten but cannot be
    restored (e.g. a damaged chunk in its chain); nothing is deleted then.
    """
    storage = manager.storage
    plan = _plan(manager, policy)
    freed = sum(_tree_bytes(storage, step_dir_name(s)) for s in plan.removed)
    if dry_run:
        added = sum(int(plan.metas[s].stats.raw_bytes / FULL_STEP_RATIO) for s in plan.rewritten)
        return GCReport(plan.kept, plan.removed, plan.rewritten, freed, added, True, plan.skipped)

    added = 0
    for s in reversed(plan.rewritten):  # each restore walks a chain of lower, untouched steps
        meta = plan.metas[s]
        try:
            ckpt = manager.restore(s)
        except DeltackptError as exc:
            raise type(exc)(f"gc stopped before deleting anything: kept step {s} must be rewritten "
                            f"as a full step, but it cannot be restored: {exc}") from exc
        classes, compression = meta.stats.classes, meta.stats.compression
        new = write_step(storage, s, ckpt.captured(), kind="full", base_step=None,
                         summary=lambda c=classes, k=compression: {"classes": c, "compression": k},
                         chunk_bytes=manager.chunk_bytes, workers=manager.workers)
        added += new.stats.stored_bytes + storage.size(f"{step_dir_name(s)}/{METADATA_FILE}")
        del ckpt

    for s in reversed(plan.removed):  # dependents first: every visible step keeps its chain
        step_dir = step_dir_name(s)
        storage.remove(f"{step_dir}/{METADATA_FILE}")  # the step disappears atomically here
        storage.remove_tree(step_dir)
    return GCReport(plan.kept, plan.removed, plan.rewritten, freed, added, False, plan.skipped)
