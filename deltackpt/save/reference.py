"""What a writer's saves advance: the step its next delta is coded against."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltackpt.dist.shards import Part
from deltackpt.encode.encoder import captured_layout
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.format.metadata import Box, StepMetadata, box_index, layout_of, metadata_file
from deltackpt.format.state import CapturedState
from deltackpt.io.reader import read_metadata
from deltackpt.io.storage import Storage

# A step's metadata with the identity its file had when written or read (Storage.identity).
KnownMetadata = dict[int, tuple[tuple[int, ...], StepMetadata]]


@dataclass
class Reference:
    """The last step a writer committed or loaded, which its next delta is coded against.

    ``recon`` is that step's running reconstruction (None: the next save is full). A delta
    changes its base's values in place from the start of its encoding, so they are ``stale``
    until its step commits: after a failed delta the next one reads them again from the
    committed step (what a reader decodes) before coding against them. ``known`` keeps the
    metadata of the chain last saved or restored, parsed once while its files stay the same.
    """

    recon: Reconstruction | None = None
    stale: bool = False
    known: KnownMetadata = field(default_factory=dict)

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

    def restart(self, recon: Reconstruction | None) -> None:
        """Code the next delta against ``recon``, whose values are what a reader decodes (a step
        just loaded, re-coded by a gc, or read again after a failed delta)."""
        self.recon, self.stale = recon, False

    def advance(self, recon: Reconstruction | None, base: Reconstruction | None,
                storage: Storage, meta: StepMetadata | None) -> None:
        """After a save's commit: code the next delta against its ``recon``; keep the metadata
        it committed (``meta``, on the rank that committed it) and that of its ``base``'s chain."""
        self.restart(recon)
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
    return Reconstruction(meta.step, recon.deltas, captured_layout(captured, local), values,
                          meta.save_id, chain=recon.chain, resumed=True, scaled=recon.scaled)
