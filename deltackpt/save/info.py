"""What one save wrote, as ``save`` returns it and a step's metadata records it."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltackpt.format.metadata import StepMetadata

# A delta within this factor of target_ratio counts as meeting it.
TARGET_TOLERANCE = 1.15


@dataclass(frozen=True)
class SaveInfo:
    """What one ``save`` wrote."""

    step: int
    kind: str
    base_step: int | None
    raw_bytes: int
    stored_bytes: int
    seconds: float
    target_ratio: float | None = None
    at_max_error: bool = False  # the target needed errors beyond max_error: steps at that floor
    # what a run resumed from the step is expected to lose, in steps of training progress (the
    # fidelity matrix's median: deltackpt/encode/cost.py); 0 for a lossless step, None for a
    # delta whose errors the matrix did not price
    expected_steps: float | None = 0.0
    # What the call that saved it cost the caller (not compared: the step's record is the same):
    # how long ``save`` blocked it, for an asynchronous save waiting for a save in flight at the
    # max_in_flight limit, capturing and copying the state, for a blocking one the whole save;
    blocked_seconds: float = field(default=0.0, compare=False)
    # of which waiting at the limit, or for the saves in flight before a delta encoded on a device
    waited_seconds: float = field(default=0.0, compare=False)
    snapshot_bytes: int = field(default=0, compare=False)  # host memory of the async snapshot

    @property
    def ratio(self) -> float:
        """Raw bytes of the state per stored byte."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @property
    def target_met(self) -> bool | None:
        """Whether a delta reached the configured ``target_ratio`` (within 15%); None without one."""
        if self.target_ratio is None:
            return None
        return self.ratio >= self.target_ratio / TARGET_TOLERANCE

    @classmethod
    def of(cls, meta: StepMetadata) -> SaveInfo:
        """The save summary recorded in a step's metadata."""
        compression = meta.stats.compression or {}
        target, expected = compression.get("target_ratio"), compression.get("expected_steps")
        return cls(meta.step, meta.kind, meta.base_step, meta.stats.raw_bytes,
                   meta.stats.stored_bytes, meta.stats.seconds,
                   float(target) if isinstance(target, (int, float)) else None,
                   compression.get("at_max_error") is True,
                   0.0 if meta.kind == "full" else
                   float(expected) if isinstance(expected, (int, float)) else None)
