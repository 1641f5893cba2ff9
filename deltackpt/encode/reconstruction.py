"""The running reconstruction of a step: what a reader holds after restoring it, and what the
next delta of a writer is coded against."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt.format.metadata import Layout


@dataclass
class Reconstruction:
    """What a reader holds after restoring ``step``: the float32 running value of each tensor.

    ``values`` maps tensor names to flat float32 arrays (tensors of dtypes
    a delta may code lossily); a writer keeps those of tensors coded on a
    device as flat float32 torch tensors (:mod:`deltackpt.encode.device`),
    a reader's are numpy arrays; ``layout`` is the step's tensor layout, and
    ``deltas`` the number of delta steps since its full step; ``save_id``
    identifies the save that wrote the step (a step overwritten since is
    another save). ``chain`` lists the steps from the full step up to
    ``step``. A writer also knows ``errors``, the mean squared error its
    save left per tensor (a reader cannot know it: it lacks the truth).
    ``resumed`` marks the values training was loaded with: like a full
    step's, they are the training state itself. ``scaled`` names the
    tensors coded with scaled steps in this step, which no later delta may
    code against (FORMAT.md 3.2). ``digests`` holds the raw length and ``raw_xxh3`` of
    chunks of the step, by tensor and raw offset in the fragment this process writes: a
    later delta stores a chunk of the same bytes as ``unchanged`` (FORMAT.md 3.5). ``kept``
    holds the bytes of those chunks of integer tensors of at most 64 KiB (RNG states), by the
    same keys: a later delta stores a chunk that changed as a ``patch`` on them (3.6).
    """

    step: int
    deltas: int
    layout: Layout
    values: dict[str, np.ndarray | torch.Tensor] = field(default_factory=dict)
    save_id: str = ""
    errors: dict[str, float] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)
    resumed: bool = False
    scaled: frozenset[str] = frozenset()
    digests: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)
    kept: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
