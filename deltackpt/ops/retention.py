"""Retention: which steps of a checkpoint directory to keep, and deleting the others safely.

A :class:`RetentionPolicy` names the steps to keep (the last few, every
M-th, the recent full steps); :func:`collect_garbage` deletes the rest
without ever breaking a kept step and without making the directory larger.

**Replacing kept steps.** A delta step is restored through its chain
(docs/FORMAT.md 5). A kept step whose chain keeps every step stays as it
is. A kept delta whose chain loses a step is *replaced*: re-coded as a
delta, with the manager's compression config and closed loop as a save
codes it, against the reconstruction of the nearest kept step below it
that is *stable*, i.e. restores to the same running values before, during
and after this gc: a full step; a step rewritten as a full step by this
gc whose tensors are all float32 (or not floating point), since its
running values are then the values it restored to, stored exactly; or a
delta whose base is stable. The base must also have the step's layout,
have been saved by one process (a delta keeps its base's fragments), and
be less than ``depth`` deltas above its full step (so the re-coded step is
at most ``depth`` deltas deep, the bound its writer keeps). The re-coded
step codes the values it restored to before, so it restores to them within
the error the config allows (its stats record that error, and the old base
and error under
``compression["recoded"]``): against the training state it carries the
error of two deltas, the original and the re-coding. It becomes a full
(lossless) step holding exactly the values it restored to instead when
there is no such base, when the config makes no deltas, or when the delta
is not smaller than a full step of its layout.

Kept deltas above a replaced step in its chain were coded against its old
reconstruction, so they are replaced too, each against a stable step as
above: re-coding a step to reproduce its old reconstruction exactly would
take a lossless step, and a replaced step that is not stable is never a
base. A delta on a full rewrite stays as it is when it codes only float32
tensors against it. The running values of ``bfloat16`` and ``float16``
tensors are float32 while a full step stores the tensor rounded, so a
delta coding such a tensor against a full rewrite is replaced, and such a
rewrite is no base; so are bitsandbytes' 8-bit moments restored from
``bnb8`` chunks, whose running values are float32 while a full step stores
them requantized (FORMAT.md 3.4). A re-coded delta codes 16-bit tensors against its
base's float32 running values and holds new ones, so 16-bit models keep
their deltas wherever a stable step is below them.

Bases must be stable because each replacement is committed on its own
(the rename of its ``metadata.json``, FORMAT.md 1.1): a base whose running
values changed at a commit of the gc would leave, after a crash between
two commits, a step coded against other values than its base has.

**Size.** If the replacements would leave the directory larger than
before (written data and metadata against the steps removed and the old
versions replaced), nothing is replaced and the steps the kept steps'
chains need are kept as well (*held*); the gc then only deletes.

**Order of the work**, so that a crash at any point leaves every kept step
restorable to the values it had (a re-coded step, once committed, to its
re-coded values): the plan is made from the metadata alone; every
replacement is then encoded and written in ascending order, uncommitted,
its ``metadata.json`` included (beside the committed one), restoring its
old values and its base through the untouched directory; a failure there
deletes what was written and changes nothing. Then, from the highest step
down, each replacement is committed (a rename: it writes nothing, so it
cannot fail for want of space) and each removed step deleted: a committed
replacement's chain is its stable base's, which nothing touches; a step
not yet reached has a chain of lower steps that are still as they were
(or, for a full rewrite, restore to the same values for the deltas that
stay on it).

**A full disk.** When writing the replacements fails for want of space,
the gc deletes first the steps that no kept step's chain needs (which
changes no kept step) and writes the replacements again; when they still
do not fit, it keeps the chains (as for size) and reports the bytes the
replacements need, so that a gc with that much free space completes.

**Steps chosen by the caller.** :class:`KeepSteps` keeps the steps a caller
names (a framework that rotates its checkpoints itself, as Lightning's
``ModelCheckpoint`` does) and replaces none: every step a kept step's chain
needs is held, so a step the caller drops is deleted once no kept step needs
it. The directory may then hold up to ``depth`` more steps for each kept
delta (those of its chain), and a kept step keeps the values it had.

**The writer's references.** The manager that runs the gc (``keep=`` after
every save) codes its next saves against the steps its schedule holds
(:mod:`deltackpt.save.schedule`). When the latest of them is replaced, it
continues from the new reconstruction, with those below it that the gc
left as they were; a save whose scheduled reference is gone is coded
against the latest one held instead, within ``depth``, and the next full
step comes where ``full_every`` puts it, as without the gc.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

import numpy as np

from deltackpt.codecs.bnb8 import NAME as BNB8
from deltackpt.codecs.bnb8 import self_contained
from deltackpt.codecs.quant import NAME as QUANT
from deltackpt.codecs.quant import uses_base
from deltackpt.encode.encoder import StepEncoder
from deltackpt.encode.policy import ScaleController
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import ConfigError, DeltackptError, UnsafePathError
from deltackpt.format.checks import check_int, config_error
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import (
    METADATA_FILE,
    Chunk,
    StepMetadata,
    TensorRecord,
    layout_of,
    step_dir_name,
)
from deltackpt.format.state import CapturedState
from deltackpt.io.pool import Workers
from deltackpt.io.progress import human_bytes
from deltackpt.io.retired import RetiredFiles
from deltackpt.io.storage import Storage
from deltackpt.io.writer import (
    commit_step,
    discard,
    metadata_bytes,
    new_save_id,
    stage_metadata,
    step_metadata,
    write_data,
)
from deltackpt.restore.universal import UniversalCheckpoint
from deltackpt.save.driver import ChainRestore, SaveSettings

SIXTEEN_BIT = ("bfloat16", "float16")  # dtypes whose running values are not their values
# Raw bytes per stored byte of a full step, for estimates where no full step of a layout is at hand.
FULL_STEP_RATIO = 1.2


class Steps(Protocol):
    """What a gc reads of a checkpoint directory: its committed steps and their metadata, and
    the storage it deletes from and writes to (a
    :class:`~deltackpt.directory.CheckpointDirectory` is one)."""

    storage: Storage

    def steps(self) -> list[int]: ...

    def metadata(self, step: int) -> StepMetadata: ...


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
            if value is not None:
                check_int(value, f"retention policy: {f.name}")
        if self.last is None and self.every is None and self.full_within is None:
            raise ConfigError("retention policy: set at least one of last, every and full_within "
                              "(e.g. 'last=5,every=1000')")

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) is not None)

    @classmethod
    def parse(cls, spec: RetentionPolicy | str) -> RetentionPolicy:
        """A policy from its string form (``"last=5,every=100"``); a policy is returned as is.

        Raises :class:`~deltackpt.errors.ConfigError` (a ``ValueError``) naming the entry that
        is not ``KEY=POSITIVE_INT`` with a known key, or a key given twice.
        """
        if isinstance(spec, RetentionPolicy):
            return spec
        if not isinstance(spec, str):
            raise ConfigError(f"a retention policy is a RetentionPolicy or a string such as "
                              f"'last=5,every=100', got {type(spec).__name__}")
        known = [f.name for f in fields(cls)]
        values: dict[str, int] = {}
        if not spec.strip():
            raise ConfigError(f"retention policy {spec!r} is empty; expected KEY=N entries separated "
                              f"by commas, KEY one of {', '.join(known)} (e.g. 'last=5,every=100')")
        for entry in spec.split(","):
            key, sep, value = (part.strip() for part in entry.partition("="))
            key = key.replace("-", "_")
            where = f"retention policy {spec!r}: entry {entry.strip()!r}"
            if not sep:
                raise ConfigError(f"{where} is not KEY=N (KEY one of {', '.join(known)})")
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r}; expected one of {', '.join(known)}")
            if key in values:
                raise ConfigError(f"{where}: {key} is given twice")
            if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
                raise config_error(f"{where}: {key}", "a positive integer", value)
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


@dataclass(frozen=True)
class KeepSteps:
    """Keep exactly ``steps`` (those committed), each with the steps its chain needs, and never
    replace a kept step (see the module doc): for a caller that decides itself which steps
    to keep. Every other step is deleted once no kept step's chain needs it."""

    steps: frozenset[int]

    def select(self, steps: list[int], kinds: dict[int, str]) -> set[int]:
        """The steps of ``steps`` to keep (``kinds`` is ignored)."""
        return set(steps) & self.steps


@dataclass
class GCReport:
    """What :func:`collect_garbage` did (or, for a dry run, would do).

    ``kept``: the steps left (including ``skipped`` and ``held``);
    ``removed``: the steps deleted; ``recoded``: the kept delta steps
    re-coded as deltas on another kept step; ``rewritten``: the kept delta
    steps rewritten as full steps; ``held``: steps the policy drops but
    that were kept because replacing the kept steps that need them would
    have grown the directory; ``skipped``: kept steps left alone because
    their metadata cannot be read or their chain misses a step or has an
    unreadable one (they could not be restored before either).
    ``freed_bytes``: bytes of the removed steps' files, metadata included;
    ``added_bytes``: bytes the replacements wrote, metadata included (the
    versions they replace are deleted); ``bytes_before`` and
    ``bytes_after``: bytes of all step directories before and after. For a
    dry run ``added_bytes`` and ``bytes_after`` are estimates: a re-coded
    delta as its own bytes, each class it codes against its base grown by
    the bits an element the directory's deltas of that class take more at
    the new distance to their base than at the old, at most a full step; a
    full step as the nearest full step of its layout, else ``raw_bytes /
    1.2``. ``needed_bytes``: when the disk had no space for
    the replacements even after deleting the steps no kept step needs, the
    bytes they would take (estimated as for a dry run), for which their
    chains are ``held`` instead; else 0. ``chains_kept``: the policy
    (:class:`KeepSteps`) holds the kept steps' chains instead of replacing
    them. All lists are ascending.
    """

    kept: list[int]
    removed: list[int]
    rewritten: list[int]
    freed_bytes: int
    added_bytes: int
    dry_run: bool
    skipped: list[int] = field(default_factory=list)
    recoded: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    needed_bytes: int = 0
    chains_kept: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able values."""
        return asdict(self)

    def describe(self) -> str:
        """A one-line summary for people."""
        def n(count: int, what: str = "step") -> str:
            return f"{count} {what}{'' if count == 1 else 's'}"

        removed = f"{n(len(self.removed))}{_listing(self.removed)}"
        recoded = f"{n(len(self.recoded), 'delta step')}{_listing(self.recoded)}"
        rewritten = f"{n(len(self.rewritten), 'delta step')} as full{_listing(self.rewritten)}"
        before, after = human_bytes(self.bytes_before), human_bytes(self.bytes_after)
        if self.dry_run:
            text = (f"dry run: would remove {removed}, re-code {recoded}, rewrite {rewritten} and "
                    f"keep {n(len(self.kept))}; would free {human_bytes(self.freed_bytes)} and "
                    f"write about {human_bytes(self.added_bytes)} ({before} -> about {after})")
        else:
            text = (f"removed {removed}, re-coded {recoded}, rewrote {rewritten}, kept "
                    f"{n(len(self.kept))}; freed {human_bytes(self.freed_bytes)}, wrote "
                    f"{human_bytes(self.added_bytes)} ({before} -> {after})")
        if self.held and self.chains_kept:
            text += f"; held {n(len(self.held))} the kept steps' chains need{_listing(self.held)}"
        elif self.held:
            why = (f"the disk has no space to replace the steps that need them (they need about "
                   f"{human_bytes(self.needed_bytes)}: free that much and run gc again)"
                   if self.needed_bytes else
                   "replacing the steps that need them would grow the directory")
            text += f"; held {n(len(self.held))} the policy drops, as {why}{_listing(self.held)}"
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
    """Bytes of every file under ``rel`` (0 for what vanished meanwhile, and for a step directory
    that is a link, which is never followed)."""
    total = 0
    try:
        names = storage.listdir(rel)
    except (FileNotFoundError, UnsafePathError):
        return 0
    for name in names:
        child = f"{rel}/{name}"
        with contextlib.suppress(FileNotFoundError):
            total += _tree_bytes(storage, child) if storage.is_dir(child) else storage.size(child)
    return total


def _codes_unstored_against_base(meta: StepMetadata) -> bool:
    """Whether a delta codes a tensor that is not float32 against its base's running values
    (a 16-bit tensor, or an 8-bit optimizer moment in a ``bnb8`` chunk).

    Those running values are float32 while the tensor is stored rounded to
    its dtype (or requantized), so they do not survive rewriting the base as
    a full step.
    """
    return any((chunk.codec == QUANT and chunk.params.get("pred") == "base")
               or (chunk.codec == BNB8 and not self_contained(chunk.params))
               for record in meta.tensors if record.dtype != "float32"
               for chunk in _chunks(record))


def _holds_unstored(meta: StepMetadata, layout: dict) -> bool:
    """Whether a step's running values are not all its stored values (16-bit tensors, or
    8-bit optimizer moments restored from ``bnb8`` chunks): a full rewrite changes them."""
    return any(dtype in SIXTEEN_BIT for _, dtype, _ in layout.values()) or any(
        BNB8 in record.codecs for record in meta.tensors)


@dataclass
class _Plan:
    """Which steps the policy keeps and removes, from the metadata alone."""

    steps: list[int]
    kept: list[int]
    removed: list[int]
    skipped: list[int]
    metas: dict[int, StepMetadata]
    sizes: dict[int, int]  # bytes of each step's directory
    # per step, the share of each tensor its chain's dithered chunks made dense (_dithered_shares)
    dense: dict[int, dict[str, float]] = field(default_factory=dict)


def _plan(directory: Steps, policy: RetentionPolicy | KeepSteps) -> _Plan:
    """Decide from the metadata alone what to keep and remove, and which kept steps to skip."""
    steps = directory.steps()
    metas: dict[int, StepMetadata] = {}
    for s in steps:
        with contextlib.suppress(DeltackptError):  # unreadable: kept and left alone
            metas[s] = directory.metadata(s)
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

    # a broken step cannot be restored, so it cannot be replaced, and deleting other steps
    # cannot make it worse
    skipped = unreadable | {s for s in kept if is_broken(s)}
    sizes = {s: _tree_bytes(directory.storage, step_dir_name(s)) for s in steps}
    return _Plan(steps, sorted(kept), sorted(set(steps) - kept), sorted(skipped), metas, sizes)


def _held(plan: _Plan) -> _Plan:
    """``plan`` keeping, besides, every step of the chains of its kept steps: nothing to replace."""
    kept = set(plan.kept)
    for s in plan.kept:
        meta = plan.metas.get(s)
        while s not in plan.skipped and meta is not None and meta.kind == "delta":
            kept.add(meta.base_step)
            meta = plan.metas.get(meta.base_step)
    return replace(plan, kept=sorted(kept), removed=sorted(set(plan.steps) - kept))


def _replacements(plan: _Plan, bases_allowed: bool, depth: int,
                  decide: Callable[[int, int | None], int | None]) -> dict[int, int | None]:
    """The kept steps to replace, each with the base it is re-coded against (None: full).

    Walks the kept steps upwards, telling stable steps from those to
    replace (see the module doc); ``decide(step, base)`` is given the
    nearest stable step a delta may be coded against (None when there is
    none, or ``bases_allowed`` is false) and returns the base chosen.
    """
    stable: dict[int, int] = {}  # stable kept step -> deltas above its full step
    full: set[int] = set()  # rewritten as full steps, with 16-bit tensors
    replaced: dict[int, int | None] = {}
    for s in plan.kept:
        meta = plan.metas.get(s)
        if s in plan.skipped or meta is None:
            continue
        if meta.kind == "full":
            stable[s] = 0
        elif meta.base_step in stable:
            stable[s] = stable[meta.base_step] + 1
        elif meta.base_step in full and not _codes_unstored_against_base(meta):
            stable[s] = 1
        else:
            layout = layout_of(meta)
            bases = [k for k, deltas in stable.items()
                     if bases_allowed and deltas < depth
                     and plan.metas[k].world_size == 1 and layout_of(plan.metas[k]) == layout]
            replaced[s] = decide(s, max(bases, default=None))
            if replaced[s] is not None:
                continue
            if _holds_unstored(meta, layout):
                full.add(s)
            else:  # every running value is a stored value, the same before and after the rewrite
                stable[s] = 0
    return replaced


def _full_estimate(plan: _Plan, step: int) -> int:
    """Bytes a full step of ``step``'s restored values would take.

    Those of the nearest full step of its layout (else its raw bytes /
    FULL_STEP_RATIO), raised for the share of each tensor that dithered
    chunks have made dense since: a dithered chunk restores a zero as a
    value near it, which a full step stores with all its mantissa bytes,
    at the rate its dtype's parameters take there (the densest values a
    run has). A full step saved early, its moments mostly zero, would
    otherwise promise space a rewrite does not free.
    """
    meta = plan.metas[step]
    layout = layout_of(meta)
    fulls = [s for s, m in plan.metas.items() if m.kind == "full" and layout_of(m) == layout]
    if not fulls:
        return int(meta.stats.raw_bytes / FULL_STEP_RATIO)
    near = min(fulls, key=lambda s: (abs(s - step), s))
    records = {r.name: r for r in plan.metas[near].tensors if r.alias_of is None}
    rates = _dense_rates(records.values())
    shares = _dithered_shares(plan, step)
    grown = 0.0
    for name, record in records.items():
        share = shares.get(name, 0.0)
        raw = sum(chunk.raw_length for chunk in _chunks(record))
        stored = sum(chunk.length for chunk in _chunks(record))
        grown += share * max(0.0, raw * rates.get(record.dtype, 1 / FULL_STEP_RATIO) - stored)
    return plan.sizes[near] + int(grown)


def _chunks(record: TensorRecord) -> list[Chunk]:
    """Every chunk of a record, fragment by fragment."""
    return [chunk for fragment in record.fragments for chunk in fragment.chunks]


def _dense_rates(records: Iterable[TensorRecord]) -> dict[str, float]:
    """Stored bytes per raw byte of a full step's parameters, by dtype."""
    totals: dict[str, list[int]] = {}
    for record in records:
        if record.role == "param":
            total = totals.setdefault(record.dtype, [0, 0])
            for chunk in _chunks(record):
                total[0] += chunk.length
                total[1] += chunk.raw_length
    return {dtype: stored / raw for dtype, (stored, raw) in totals.items() if raw}


def _dithered_shares(plan: _Plan, step: int) -> dict[str, float]:
    """Per tensor, the share of its elements whose restored value at ``step`` a dithered chunk
    of its chain (since its full step) has made dense: a dithered chunk makes its elements
    dense but the zeros it lists (FORMAT.md 3.2), one coded on its base without dither keeps
    what the base had, and one coded from zero without dither, or stored exactly, restores the
    values a full step would store.
    Kept per step in ``plan.dense``, so that a gc walks each chain once."""
    walked = []
    while step not in plan.dense:
        meta = plan.metas.get(step)
        if meta is None or meta.kind != "delta" or meta.base_step >= step:
            plan.dense[step] = {}
            break
        walked.append(meta)
        step = meta.base_step
    shares = plan.dense[step]
    for meta in reversed(walked):
        shares = dict(shares)
        for record in meta.tensors:
            chunks = _chunks(record)
            total = sum(chunk.raw_length for chunk in chunks)
            coded = [chunk for chunk in chunks if chunk.codec == QUANT]
            itemsize = spec_named(record.dtype, record.name).itemsize
            dithered = sum(c.raw_length - c.params.get("zeros", 0) * itemsize for c in coded
                           if c.params.get("dither") is not None)
            kept = sum(c.raw_length for c in coded if uses_base(c.params) and c.params.get("dither") is None)
            if total:
                shares[record.name] = (dithered + shares.get(record.name, 0.0) * kept) / total
        plan.dense[meta.step] = shares
    return shares


def _delta_estimate(plan: _Plan, step: int, base: int,
                    bits: dict[str, Callable[[float], float]]) -> int:
    """Bytes of ``step`` re-coded against ``base``, for a dry run: its own, each class it codes
    against its base (all but first moments, coded from zero) grown by what the directory's
    deltas of that class take more, in bits an element, at the new distance to the base than
    at its old one (``bits[class]``, of log2 of the distance in training steps)."""
    meta = plan.metas[step]
    old, new = math.log2(step - meta.base_step), math.log2(step - base)
    grown = sum(c["elements"] * (bits[name](new) - bits[name](old)) / 8
                for name, c in (meta.stats.classes or {}).items()
                if name not in ("exact", "first_moment") and c.get("elements") and name in bits)
    return plan.sizes[step] + max(0, int(grown))


def _bits_by_distance(plan: _Plan) -> dict[str, Callable[[float], float]]:
    """Per class, the bits an element the directory's deltas take by log2 of the distance to
    their base (in training steps): their mean at each whole log2, non-decreasing, linear in
    between and growing a bit a doubling beyond the largest (a coded residual's spread grows at
    most in proportion to the distance, its entropy by at most a bit a doubling)."""
    points: dict[str, dict[int, list[float]]] = {}
    for s, meta in plan.metas.items():
        if meta.kind != "delta" or meta.base_step is None or meta.base_step >= s:
            continue
        at = round(math.log2(s - meta.base_step))
        for name, c in (meta.stats.classes or {}).items():
            if c.get("elements"):
                points.setdefault(name, {}).setdefault(at, []).append(
                    8 * c.get("stored_bytes", 0) / c["elements"])
    curves = {}
    for name, by_log in points.items():
        xs = np.array(sorted(by_log), np.float64)
        ys = np.maximum.accumulate([float(np.mean(by_log[x])) for x in sorted(by_log)])
        curves[name] = functools.partial(_bits_at, xs, ys)
    return curves


def _bits_at(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    return float(np.interp(x, xs, ys)) + max(0.0, x - float(xs[-1]))


@dataclass
class _Written:
    """A kept step's new version: written, not committed yet."""

    meta: StepMetadata
    staged: str  # its metadata.json, written beside the committed one (writer.stage_metadata)
    size: int  # its data files and metadata
    recon: Reconstruction | None  # what restoring it gives (of the followed step only)


class _Replacer:
    """Writes the new versions of the steps a gc replaces (uncommitted), or estimates them."""

    def __init__(self, storage: Storage, settings: SaveSettings, restore: ChainRestore,
                 workers: Workers, plan: _Plan, follow: int | None) -> None:
        self.storage, self.settings, self.restore, self.workers = storage, settings, restore, workers
        self.plan, self.follow = plan, follow
        self.written: dict[int, _Written] = {}
        self.estimates: dict[int, int] = {}
        self._base: tuple[int, Reconstruction] | None = None  # the last base restored
        self._bits: dict[str, Callable[[float], float]] | None = None  # of a dry run's estimates

    def estimate(self, step: int, base: int | None) -> int | None:
        """Dry run: the base that ``write`` would probably choose; records the bytes."""
        full = _full_estimate(self.plan, step)
        if self._bits is None:
            self._bits = _bits_by_distance(self.plan)
        delta = _delta_estimate(self.plan, step, base, self._bits) if base is not None else full
        self.estimates[step] = min(delta, full)
        return base if delta < full else None

    def write(self, step: int, base: int | None) -> int | None:
        """Write ``step``'s new version: a delta on ``base`` unless that is not smaller than a
        full step (or ``base`` is None), else a full step. Returns the base chosen."""
        meta = self.plan.metas[step]
        try:
            tensors, _ = self.restore(meta, workers=self.workers)
            captured = UniversalCheckpoint(step, tensors, meta).captured()
            recon = self._reconstruction(base) if base is not None else None
        except DeltackptError as exc:
            raise type(exc)(f"gc stopped before changing anything: kept step {step} must be "
                            f"re-coded (its chain loses a step), but it or its new base cannot "
                            f"be restored: {exc}") from exc
        if recon is not None:
            written = self._write(step, captured, recon, base)
            if written.size < _full_estimate(self.plan, step):
                self.written[step] = written
                return base
            discard(self.storage, written.meta, written.staged)
        classes, compression = meta.stats.classes, meta.stats.compression
        self.written[step] = self._write(step, captured, None, None,
                                         {"classes": classes, "compression": compression})
        return None

    def _write(self, step: int, captured: CapturedState, recon: Reconstruction | None, base: int | None,
               summary: dict | None = None) -> _Written:
        """Encode and write ``captured`` as a delta on ``recon`` (full without), uncommitted."""
        storage, started = self.storage, time.perf_counter()
        config = self.settings.config
        controller = ScaleController(config.target_ratio) if config.target_ratio else None
        encoder = StepEncoder(captured, config, recon, controller if recon else None,
                              in_place=False)
        save_id = new_save_id()
        written = write_data(storage, step, save_id, captured, encoder=encoder,
                             coded_last=encoder.coded_last, chunk_bytes=self.settings.chunk_bytes,
                             workers=self.workers)
        if summary is None:
            summary = encoder.summary()
            old = self.plan.metas[step]
            summary["compression"]["recoded"] = {"base_step": old.base_step,
                                                 "classes": old.stats.classes}
        meta = step_metadata(step, save_id, written, captured.tree,
                             kind="delta" if recon else "full", base_step=base, world_size=1,
                             seconds=time.perf_counter() - started, summary=summary)
        try:
            staged = stage_metadata(storage, meta)
        except BaseException:
            discard(storage, meta)
            raise
        size = meta.stats.stored_bytes + len(metadata_bytes(meta))
        return _Written(meta, staged, size, encoder.reconstruction(step, save_id)
                        if step == self.follow else None)

    def _reconstruction(self, step: int) -> Reconstruction:
        """What restoring ``step`` gives, kept for the next step re-coded on it (an encoder
        writes running values of its own)."""
        if self._base is None or self._base[0] != step:
            self._base = None  # release the previous one first
            _, recon = self.restore(self.plan.metas[step], workers=self.workers)
            self._base = step, recon
        return self._base[1]

    def abort(self) -> None:
        """Delete every version written and not committed."""
        for written in self.written.values():
            discard(self.storage, written.meta, written.staged)
        self.written.clear()


def _no_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that failed for want of space (a full disk or quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _delete_step(storage: Storage, step: int, retired: RetiredFiles | None = None) -> None:
    """Delete ``step``: its metadata first (the step disappears there), then its files, or
    have ``retired`` keep its data files a while for the readers that may still read them."""
    step_dir = step_dir_name(step)
    storage.remove(f"{step_dir}/{METADATA_FILE}")
    if retired is None or retired.grace <= 0:
        storage.remove_tree(step_dir)
        return
    retired.release(f"{step_dir}/{n}" for n in storage.listdir(step_dir)
                    if storage.kind(f"{step_dir}/{n}") == "file")


def collect_garbage(directory: Steps, policy: RetentionPolicy | KeepSteps, *,
                    settings: SaveSettings, restore: ChainRestore, workers: Workers = None,
                    dry_run: bool = False, follow: int | None = None,
                    retired: RetiredFiles | None = None
                    ) -> tuple[GCReport, Reconstruction | None]:
    """Delete every step of ``directory`` that ``policy`` does not keep.

    Kept steps whose chain loses a step are replaced first (re-coded as
    deltas on stable kept steps, or rewritten as full steps; see the module
    doc): no kept step becomes unrestorable, and the directory does not
    grow. Under :class:`KeepSteps` none is replaced: the steps their chains
    need are held. Nothing is committed or deleted unless every replacement was
    written, metadata included, so committing them writes nothing. A step
    whose metadata cannot be read is kept and left alone. ``dry_run`` writes
    and deletes nothing and reports what a real run would do, with
    estimated sizes. The caller holds the writer lock (for a real run).
    Replacements are coded with ``settings`` (the writer's compression config,
    ``full_every`` and chunk size) on ``workers`` threads; ``restore`` reads the
    values of a kept step and of its new base (the writer's way to read a chain).

    On a full disk (writing a replacement fails with ``ENOSPC`` or
    ``EDQUOT``) the gc first deletes the steps that no kept step needs, then
    writes the replacements again; if they still do not fit, it keeps the
    steps they need instead (``held``) and reports the bytes the
    replacements need (``needed_bytes``), so that a later gc with that much
    free space finishes the work.

    ``retired`` keeps the data of the steps deleted and of the old versions replaced for the
    readers that may still read them, and deletes what it kept long enough when the gc ends
    (:mod:`deltackpt.io.retired`); without it they are deleted at once. On a full disk all it
    keeps is deleted first.

    Returns the report and, when step ``follow`` is re-coded or rewritten,
    the reconstruction a reader has of its new version (else None).

    Raises the error of a kept step that must be replaced but cannot be
    restored, or whose new base cannot (e.g. a damaged chunk in its
    chain), and any other failure to write a replacement
    (:class:`WriteFailedError`): the directory is then as it was (but for
    the steps deleted to make room on a full disk).
    """
    storage = directory.storage
    plan = _plan(directory, policy)
    before = sum(plan.sizes.values())

    def new_replacer() -> _Replacer:
        return _Replacer(storage, settings, restore, workers, plan, follow)

    def replace_kept(decide: Callable[[int, int | None], int | None]) -> dict[int, int | None]:
        return _replacements(plan, settings.config.deltas, settings.depth, decide)

    replacer = new_replacer()
    followed, deleted, needed = None, [], 0
    hold = isinstance(policy, KeepSteps)

    try:
        try:
            bases = None if hold else replace_kept(replacer.estimate if dry_run else replacer.write)
        except OSError as exc:
            if not _no_space(exc):
                raise
            replacer.abort()
            if retired is not None:  # space first: what readers were given goes, and this
                retired.purge(everything=True)  # gc deletes at once
                retired = None
            deleted = _held(plan).removed  # no kept step needs them: make room
            for s in reversed(deleted):
                _delete_step(storage, s)
            try:
                bases = replace_kept(replacer.write)
            except OSError as exc:
                if not _no_space(exc):
                    raise
                replacer.abort()
                estimator = new_replacer()
                replace_kept(estimator.estimate)
                needed, bases = sum(estimator.estimates.values()), None
        new = replacer.estimates if dry_run else {s: w.size for s, w in replacer.written.items()}
        added = sum(new.values())
        held: list[int] = []
        if bases is None or before - sum(plan.sizes[s] for s in [*plan.removed, *bases]) + added \
                > before:  # no space, or replacing would grow the directory: keep the chains
            replacer.abort()
            policy_kept, plan, bases, added = plan.kept, _held(plan), {}, 0
            held = sorted(set(plan.kept) - set(policy_kept))
        after = before - sum(plan.sizes[s] for s in [*plan.removed, *bases]) + added
        if not dry_run:
            for s in sorted({*plan.removed, *bases} - set(deleted), reverse=True):  # module doc
                if s in bases:
                    written = replacer.written[s]
                    commit_step(storage, written.meta, written.staged, retired=retired)
                    del replacer.written[s]
                    followed = written.recon or followed
                else:
                    _delete_step(storage, s, retired)
            if retired is not None:
                retired.purge()
            kept_for_readers = sum(storage.size(f) for f in retired.protected()
                                   if int(f[5:f.index("/")]) in plan.kept) if retired else 0
            after = sum(_tree_bytes(storage, step_dir_name(s)) for s in plan.kept) \
                - kept_for_readers
    except BaseException:
        replacer.abort()
        raise
    report = GCReport(plan.kept, plan.removed, sorted(s for s, b in bases.items() if b is None),
                      sum(plan.sizes[s] for s in plan.removed), added, dry_run, plan.skipped,
                      sorted(s for s, b in bases.items() if b is not None), held, before, after,
                      needed, hold)
    return report, followed
