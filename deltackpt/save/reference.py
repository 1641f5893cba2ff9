"""What a writer's saves advance: the steps its next deltas are coded against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from deltackpt.dist.shards import Part
from deltackpt.encode.encoder import captured_layout
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import DeltackptError
from deltackpt.format.metadata import Box, StepMetadata, box_index, layout_of, metadata_file
from deltackpt.format.state import CapturedState
from deltackpt.io.reader import read_metadata
from deltackpt.io.storage import Storage
from deltackpt.save.schedule import Schedule

# A step's metadata with the identity its file had when written or read (Storage.identity).
KnownMetadata = dict[int, tuple[tuple[int, ...], StepMetadata]]


@dataclass
class Reference:
    """The committed steps a writer's next deltas may be coded against.

    ``levels`` holds, by depth, the running reconstruction of the latest step at that depth
    that a later save of its group is coded against (:mod:`deltackpt.save.schedule` says
    which): at most one a level. ``position`` counts the saves since the group's full step,
    ``last`` is the step last committed or loaded: the next save must come after it. A delta
    coded on its base's last use changes the base's values in place from the start of its
    encoding (an earlier use writes values of its own), so they are stale (``stale``: that step) until
    it commits: after such a delta failed the next one reads them again from the committed
    step (what a reader decodes) before coding against them. ``known`` keeps the metadata of
    the chain last saved or restored, parsed once while its files stay the same.
    """

    levels: dict[int, Reconstruction] = field(default_factory=dict)
    position: int = 0
    last: int | None = None
    stale: int | None = None
    known: KnownMetadata = field(default_factory=dict)

    @property
    def recon(self) -> Reconstruction | None:
        """The latest step held (None: the next save is full)."""
        return max(self.levels.values(), key=lambda r: r.step, default=None)

    def kept_metadata(self, storage: Storage, step: int) -> StepMetadata | None:
        """The metadata of ``step`` kept from the last chain, while its file is the one written
        or read (else None)."""
        known = self.known.get(step)
        if known is not None and storage.identity(metadata_file(step)) == known[0]:
            return known[1]
        return None

    def metadata(self, storage: Storage, step: int) -> StepMetadata:
        """The metadata of ``step``: kept, or read."""
        known = self.kept_metadata(storage, step)
        return known if known is not None else read_metadata(storage, step)

    def base(self, schedule: Schedule) -> Reconstruction | None:
        """The held step the next save is coded against (None: it is full): the one its
        schedule names (the level above the save's), else the latest held one above it, else
        the latest one a delta on which stays within the schedule's depth (after a load, or a
        gc that replaced the named one)."""
        position = self.position + 1
        if position >= schedule.full_every:
            return None
        want = schedule.depths[position] - 1
        usable = [r for d, r in self.levels.items() if d < schedule.depth]
        above = [r for r in usable if r.deltas <= want]
        return self.levels.get(want) or max(above or usable, key=lambda r: r.step, default=None)

    def needed_after(self, base: Reconstruction, schedule: Schedule) -> bool:
        """Whether a save after the next one is coded against ``base`` too (its schedule's
        next save one level below it comes before the next at its level or above)."""
        for depth in schedule.depths[self.position + 2:]:
            if depth - 1 == base.deltas:
                return True
            if depth <= base.deltas:
                return False
        return False

    def restart(self, recon: Reconstruction | None, position: int = 0) -> None:
        """Code the next deltas against ``recon`` alone, the save at ``position`` of its group,
        whose values are what a reader decodes (a step just loaded, or re-coded by a gc)."""
        self.levels = {} if recon is None else {recon.deltas: recon}
        self.position, self.stale = position, None
        self.last = None if recon is None else recon.step

    def refresh(self, recon: Reconstruction) -> None:
        """Hold ``recon``, read again from its committed step, in place of its stale values."""
        self.levels[recon.deltas], self.stale = recon, None

    def retain(self, changed: set[int], replaced: Reconstruction | None,
               chain: Callable[[int], list[int]]) -> None:
        """After a gc that followed the latest step held and removed or replaced the steps
        ``changed``: hold that step's new version (``replaced``; None where the gc left it as
        it was), and the steps held below it that the gc left as they were and are still in
        its chain (``chain(step)`` reads a step's chain, which a full rewrite may have cut).
        The error against the training state of a re-coded step is the old one plus the
        re-coding's."""
        latest = self.recon
        if replaced is not None and latest is not None:
            errors = {name: latest.errors.get(name, 0.0) + replaced.errors.get(name, 0.0)
                      for name in {*latest.errors, *replaced.errors}}
            latest = replace(replaced, errors=errors)
        elif latest is not None and latest.step in changed:
            latest = None
        held, self.levels, self.stale = self.levels, {}, None
        if latest is None:
            return
        try:
            steps = chain(latest.step)
        except DeltackptError:  # unreadable now: the next save is full
            return
        for recon in [*(r for r in held.values() if r.step not in changed), latest]:
            if recon.step in steps:
                depth = steps.index(recon.step)
                self.levels[depth] = replace(recon, deltas=depth, chain=steps[:depth + 1])

    def advance(self, recon: Reconstruction | None, base: Reconstruction | None,
                schedule: Schedule, storage: Storage, meta: StepMetadata | None) -> None:
        """After a save's commit: hold its ``recon`` where a later save of its group is coded
        against it (``schedule``), and no deeper step; drop its ``base`` where the delta was
        coded on its values in place; keep the metadata it committed (``meta``, on the rank
        that committed it) and that of its ``base``'s chain."""
        if recon is None or base is None:
            self.restart(recon)
        else:
            self.levels = {d: r for d, r in self.levels.items()
                           if d < recon.deltas and r.step != self.stale}  # not coded in place
            self.position += 1
            if schedule.is_base[self.position] and recon.deltas < schedule.depth:
                self.levels[recon.deltas] = recon
            self.last, self.stale = recon.step, None
        if meta is None:
            return
        chain = {s: self.known[s] for s in base.chain if s in self.known} if base else {}
        identity = storage.identity(metadata_file(meta.step))
        self.known = chain if identity is None else {**chain, meta.step: (identity, meta)}


def resumed(recon: Reconstruction, meta: StepMetadata, boxes: dict[str, Box],
            captured: CapturedState, parts: dict[str, list[Part]]) -> Reconstruction | None:
    """The reconstruction a save of ``captured`` (this rank writing ``parts``) codes against
    after step ``meta`` was restored into it: the restored running values (``recon``, of
    ``boxes``; whole tensors elsewhere) of the boxes this rank writes. None when the next save
    must be full: the state is not laid out as the step was, or this rank would write other
    boxes than the step's fragments (a delta keeps its base's fragments, docs/FORMAT.md 5), as
    after a change of world size."""
    if captured_layout(captured) != layout_of(meta):
        return None
    mine = {name: p[0] for name, p in parts.items() if p}
    records = {r.name: r for r in meta.tensors}
    if any((part.offsets, part.sizes) not in [(f.offsets, f.sizes) for f in records[name].fragments]
           for name, part in mine.items()):
        return None
    values = {}
    for name, part in mine.items():
        if name in recon.values:
            origin, shape = boxes.get(name, ([0] * len(part.sizes), records[name].shape))
            index = box_index(part.offsets, part.sizes, origin)
            values[name] = recon.values[name].reshape(shape)[index].reshape(-1).copy()
    local = {name: part.values for name, part in mine.items()}
    whole = {name for name in mine if len(records[name].fragments) == 1}
    return Reconstruction(meta.step, recon.deltas, captured_layout(captured, local), values,
                          meta.save_id, chain=recon.chain, resumed=True, scaled=recon.scaled,
                          digests={k: d for k, d in recon.digests.items() if k[0] in whole},
                          kept={k: b for k, b in recon.kept.items() if k[0] in whole})
