"""What a delta step's errors are expected to cost a run resumed from it, in steps of progress.

The fidelity matrix (``bench/fidelity.py``, docs/fidelity.md) resumes real training runs from
delta steps and measures how many steps of progress each resumed run is off the exact run,
behind or ahead. Its by-class runs price each class of error: with one class's bounds ``K``
times ``balanced``'s, the median cost grows by about that class's coefficient times ``K**2 -
1`` (independent, unbiased errors add to the loss by their variance). So a step is expected to
cost ``floor + sum(per_class[c] * s_c**2)`` steps, ``s_c`` being how many times ``balanced``'s
bounds class ``c``'s are in that step (0 for a class stored exactly). It is a median over
runs, not a bound for one: single runs scatter by several steps either way (the fidelity page
has the spread), most of all early in training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from deltackpt.encode.policy import CLASSES, ERROR_BOUNDS, PRESETS, CompressionConfig, Quantizer

REFERENCE = PRESETS["balanced"]  # the preset the matrix prices other errors against


@dataclass(frozen=True)
class CostModel:
    """Expected steps of progress lost: ``floor`` plus each lossy class's coefficient times the
    square of its error bounds as a multiple of ``balanced``'s."""

    floor: float
    per_class: dict[str, float]

    def steps(self, config: CompressionConfig, scale: float = 1.0,
              classes: Iterable[str] | None = None) -> float | None:
        """The expected cost of a delta coded with ``config`` at ``target_ratio``'s ``scale``,
        ``classes`` being those coded lossily in it (default: every class the config codes
        lossily); None where the matrix did not price these errors (a quantizer of another
        kind than ``balanced``'s, a lossy override)."""
        if any(not q.exact for q in config.overrides.values()):
            return None
        classes = [c for c in CLASSES if not getattr(config, c).exact] if classes is None \
            else list(classes)
        total = self.floor
        for cls in classes:
            relative = _relative_bounds(getattr(config, cls), getattr(REFERENCE, cls))
            if relative is None or cls not in self.per_class:
                return None
            total += self.per_class[cls] * (relative * scale) ** 2
        return total


def _relative_bounds(quantizer: Quantizer, reference: Quantizer) -> float | None:
    """How many times ``reference``'s error bounds ``quantizer``'s are (the largest ratio over
    their bounds, ``rms_step`` where unset ``update_step``'s); 0 when exact; None when the two
    are not of one kind."""
    if quantizer.exact:
        return 0.0
    if reference.exact or (quantizer.domain, quantizer.pred, quantizer.dithers) != (
            reference.domain, reference.pred, reference.dithers):
        return None
    mine, theirs = _bounds(quantizer), _bounds(reference)
    if mine.keys() != theirs.keys():
        return None  # density= instead of a step, or a unit balanced does not use
    return max(mine[f] / theirs[f] for f in mine)


def _bounds(quantizer: Quantizer) -> dict[str, float]:
    """A quantizer's error bounds by name, ``rms_step`` as it applies (``update_step``'s where
    unset)."""
    rms = quantizer.rms_unit_step(momentum=True)
    return {f: getattr(quantizer, f) for f in ERROR_BOUNDS if getattr(quantizer, f) is not None} \
        | ({"rms_step": rms} if rms is not None else {})


# Fitted by ``python bench/fidelity.py --fit-cost REPORT...`` to the matrix's by-class runs
# (2026-12-05; one class's errors x4 on 11 cells, x2 on 6 SGD cells; every class's x1.41 on 10,
# x2 and x4 on 8; 20 cells in all: GPTs with AdamW early, mid, after warm-up, over five restores
# and on bf16 masters, with SGD early, mid and over five restores; MLPs with AdamW, SGD and
# Adagrad; BatchNorm CNNs with AdamW and SGD; a GRU with RMSprop). Against those runs it
# predicted aggressive's median (when its second moment had balanced's step) within 9% (2.36
# steps against 2.17 over 16 cells) and every class x1.41's and x2's within 7%, every class
# x4's at twice the measure (9.7 against 4.8 steps):
# beyond twice balanced's errors it is an upper estimate. SGD's momentum costs less than Adam's
# first moment, which the single coefficient of first moments overstates (docs/fidelity.md).
# Fitted at format 2.2. At 2.3, Adam's first moment shaped by its second (policy.shaped_steps),
# its errors x4 on the 8 Adam-family cells of those runs with two seeds (2026-12-06) rose the
# median by 0.52 per unit of K**2 - 1 (0.42 with seed 0 alone, 0.72 with seed 1): the same
# coefficient within what the seed moves it, so it stands.
MATRIX = CostModel(floor=0.375, per_class={"weights": 0.118, "first_moment": 0.445,
                                           "second_moment": 0.036})


def expected_steps(config: CompressionConfig, scale: float = 1.0,
                   classes: Iterable[str] | None = None) -> float | None:
    """:data:`MATRIX`'s expected cost of a delta step (see :meth:`CostModel.steps`), rounded
    to a hundredth of a step."""
    steps = MATRIX.steps(config, scale, classes)
    return None if steps is None or not math.isfinite(steps) else round(steps, 2)
