"""Compression policy: which tensors a delta step quantizes, how finely, and to what ratio.

A delta step codes each tensor by its class (:func:`tensor_class`):

* ``weights`` (float parameters and buffers, and the float32 master copies
  mixed-precision optimizers keep of them): closed-loop residual against
  the reconstruction of the previous step, linear domain;
* ``exp_avg`` (Adam's first moment): directly (it forgets its past within
  a few dozen steps), linear domain;
* ``exp_avg_sq`` (Adam's second moment, positive, many orders of
  magnitude): ordinal domain, i.e. bounded relative error, predicted from
  the previous reconstruction;
* ``optimizer_other`` (SGD momentum, Adagrad sums, any state of unknown
  meaning): ordinal domain at a fine step, a safe generic codec;
* everything else (integers, scalars such as Adam's ``step``, RNG states,
  ``extra``, tensors with non-finite values) is stored exactly.

A :class:`Quantizer` gives a class its step. In the linear domain the step
is relative to the root mean square of what is coded (sampled, never a
full pass or sort), so one setting suits every tensor and every interval;
in the ordinal domain it is a fraction of a binade (1.0: one power of two).
With ``target_ratio`` the library scales every step by one factor, chosen
per save from the sampled entropy of the symbols it would produce and
corrected by what the previous save actually achieved.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.dtypes import DTypeSpec
from deltackpt.kernels.quant import MAX_KEY, numpy_keys

CLASSES = ("weights", "exp_avg", "exp_avg_sq", "optimizer_other")
LOSSY_DTYPES = ("float32", "bfloat16", "float16")
# Tensors smaller than this are stored exactly: coding them saves nothing.
MIN_LOSSY_ELEMENTS = 16
BINADE_KEYS = 1 << 23  # ordinal keys between one power of two and the next
SAMPLE_ELEMENTS = 8192  # elements sampled per tensor to pick steps and estimate sizes


@dataclass(frozen=True)
class Quantizer:
    """How one class of tensors is coded in delta steps.

    Args:
        step: quantization step. Linear domain: a multiple of the root mean
            square of the coded values (residuals for ``pred="base"``);
            values within half a step of the prediction become zero, the
            rest are rounded to the step. Ordinal domain: a fraction of a
            binade, so the relative error is at most about ``step / 2``.
        density: instead of ``step``, the fraction of coded values that
            should stay non-zero (linear domain); the step is then set from
            a sampled quantile of the values.
        domain: ``"linear"`` (absolute error <= step / 2) or ``"ordinal"``
            (relative error; for positive or wide-ranging values).
        pred: ``"base"`` codes the residual against the previous step's
            reconstruction (closed loop), ``"zero"`` codes the value itself.
        lr_step: weights moved by an Adam-family optimizer (Adam, AdamW:
            any whose state holds ``exp_avg_sq``): the step as a multiple
            of the parameter group's learning rate, used instead of
            ``step``/``density`` where that rate is known. Such an optimizer
            moves each weight by about ``lr`` a training step, so a
            restored weight is within ``lr_step / 2`` training steps' worth
            of movement of the saved one, however many steps apart the
            saves are. A step relative to the change since the last save
            grows with that interval, and so does the error.
        update_step: Adam's ``exp_avg`` (linear domain, ``pred="zero"``):
            each element's step as a multiple of its Adam denominator
            ``sqrt(exp_avg_sq) + eps`` (the reconstructed ``exp_avg_sq`` of
            the same save, the group's ``eps``; FORMAT.md 3.2, scaled
            steps), used instead of ``step``/``density`` where the
            parameter's ``exp_avg_sq`` is coded lossily too. The first
            moment drives an update of ``exp_avg / (sqrt(exp_avg_sq) +
            eps)``, so each element's restored update is then within
            ``update_step / 2`` of a learning rate of the saved one. A step
            relative to the whole tensor's spread zeroes most elements'
            moments instead: resumed training restarts their momentum.
        dither: weights an Adam-family optimizer moves (linear domain,
            ``pred="base"``): the first delta after a full step or a load
            shifts each element's quantization grid by its own
            pseudo-random fraction of a step (FORMAT.md 3.2, ``dither``).
            Elements that do not move still code as zero, so it costs no
            bits, but the error of every restored step is then uniform and
            independent of how the values moved. Without it a restored
            weight lags behind its recent movement: resumed training loses
            that progress, and five restores in a row cost several percent
            of loss (bench/fidelity.py's ``repeated_restores``).
        exact: store the class losslessly in every step instead.
    """

    step: float | None = 1.0
    density: float | None = None
    lr_step: float | None = None
    update_step: float | None = None
    domain: Literal["linear", "ordinal"] = "linear"
    pred: Literal["base", "zero"] = "base"
    dither: bool = True
    exact: bool = False

    def __post_init__(self) -> None:
        if self.domain not in ("linear", "ordinal"):
            raise ValueError(f"Quantizer domain must be 'linear' or 'ordinal', got {self.domain!r}")
        if self.pred not in ("base", "zero"):
            raise ValueError(f"Quantizer pred must be 'base' or 'zero', got {self.pred!r}")
        if self.exact:
            return
        if (self.step is None) == (self.density is None):
            raise ValueError("give a Quantizer exactly one of step= and density=")
        if self.step is not None and not (math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"Quantizer step must be a positive number, got {self.step!r}")
        if self.density is not None:
            if not 0 < self.density <= 1:
                raise ValueError(f"Quantizer density must be in (0, 1], got {self.density!r}")
            if self.domain != "linear":
                raise ValueError("Quantizer density= needs the linear domain")
        for key, pred in (("lr_step", "base"), ("update_step", "zero")):
            value = getattr(self, key)
            if value is None:
                continue
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Quantizer {key} must be a positive number, got {value!r}")
            if (self.domain, self.pred) != ("linear", pred):
                raise ValueError(f"Quantizer {key}= needs the linear domain and pred={pred!r}")

    @property
    def dithers(self) -> bool:
        """Whether ``dither`` applies: a lossy linear quantizer coding against the base."""
        return self.dither and not self.exact and (self.domain, self.pred) == ("linear", "base")


EXACT = Quantizer(exact=True)


@dataclass(frozen=True)
class CompressionConfig:
    """What delta steps keep: a quantizer per tensor class, overrides, and an optional target.

    Use a preset (``CompressionConfig.preset("balanced")``, or just the
    name where an API takes a config) and adjust it with
    :func:`dataclasses.replace`, or build one from scratch.

    Args:
        weights, exp_avg, exp_avg_sq, optimizer_other: the quantizer of each class.
        overrides: ``{pattern: quantizer}``; a tensor whose universal name
            (``model/<fqn>``, ``optimizer/state/<fqn>/<key>``) or FQN
            matches the shell-style ``pattern`` uses that quantizer
            (first match wins). E.g. ``{"model/tok.*": EXACT}``.
        target_ratio: aim for this ratio of raw to stored bytes on every
            delta step by scaling all steps by one factor (1/16 to 16 times
            the configured ones); the achieved ratio is recorded per step.
        deltas: False makes every save a full lossless checkpoint.
        block: elements per block of the packed symbol stream.
        name: the preset this config came from (recorded in the metadata).
    """

    weights: Quantizer = Quantizer(step=5.0, lr_step=16.0)
    exp_avg: Quantizer = Quantizer(step=16.0, update_step=2.0, pred="zero")
    exp_avg_sq: Quantizer = Quantizer(step=16.0, domain="ordinal")
    optimizer_other: Quantizer = Quantizer(step=2.0**-10, domain="ordinal")
    overrides: Mapping[str, Quantizer] = field(default_factory=dict)
    target_ratio: float | None = None
    deltas: bool = True
    block: int = 1024
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.target_ratio is not None and not (math.isfinite(self.target_ratio)
                                                  and self.target_ratio > 1):
            raise ValueError(f"target_ratio must be a number above 1, got {self.target_ratio!r}")
        if not isinstance(self.block, int) or not 64 <= self.block <= 1 << 20:
            raise ValueError(f"block must be an integer in [64, 2**20], got {self.block!r}")
        for pattern, quantizer in self.overrides.items():
            if not isinstance(pattern, str) or not isinstance(quantizer, Quantizer):
                raise TypeError(f"overrides maps name patterns to Quantizer, got "
                                f"{pattern!r}: {quantizer!r}")

    @classmethod
    def preset(cls, name: str) -> CompressionConfig:
        """``"lossless"``, ``"balanced"`` (the default) or ``"aggressive"``."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown compression preset {name!r}; "
                             f"choose one of {sorted(PRESETS)}") from None

    def quantizer_for(self, name: str, fqn: str | None, cls: str | None) -> Quantizer:
        """The quantizer of one tensor: an override that matches it, else its class's."""
        for pattern, quantizer in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern) or (fqn is not None
                                                       and fnmatch.fnmatchcase(fqn, pattern)):
                return quantizer
        return EXACT if cls is None else getattr(self, cls)

    def describe(self) -> dict:
        """A JSON summary for step metadata."""
        def q(quantizer: Quantizer) -> dict:
            out = {k: v for k, v in vars(quantizer).items()
                   if k != "dither" and v is not None and v is not False}
            return {**out, "dither": True} if quantizer.dithers else out
        out = {"name": self.name, "block": self.block,
               **{c: q(getattr(self, c)) for c in CLASSES}}
        if self.overrides:
            out["overrides"] = {p: q(v) for p, v in self.overrides.items()}
        if self.target_ratio is not None:
            out["target_ratio"] = self.target_ratio
        return out


# Chosen with bench/fidelity.py (TinyGPT small, AdamW betas (0.9, 0.95), resumed 100 steps from a
# delta step; the deviation is of the mean resumed loss). balanced: 79x at 0.05% saving every 20
# steps, 55x at 0.21% every 100 steps; five restores 40 steps apart 0.06-0.9% over four runs,
# where near-lossless restores of the same runs cost 0.3-0.5%. aggressive: 156x at 0.28% every
# 20 steps, 102x at 0.85% every 100. Weights moved by Adam are coded at a step proportional to
# the learning rate (a step proportional to the change since the last save grew with the
# interval: 59x at 2.7% every 100 steps) and dithered: undithered, five restores cost 5-7% of
# loss. balanced codes exp_avg relative to sqrt(exp_avg_sq), within a learning rate of the
# update it drives: at a step relative to its spread (aggressive, for its ratio) it is stored
# nearly all zero, and five restores then cost 0.7-1.1%. exp_avg_sq only scales the update:
# updated where it moved by more than 256x.
PRESETS = {
    "lossless": CompressionConfig(deltas=False, name="lossless"),
    "balanced": CompressionConfig(name="balanced"),
    "aggressive": CompressionConfig(weights=Quantizer(step=9.0, lr_step=48.0),
                                    exp_avg=Quantizer(step=16.0, pred="zero"),
                                    name="aggressive"),
}


def as_config(compression: str | CompressionConfig) -> CompressionConfig:
    """A config from a preset name or a config."""
    if isinstance(compression, CompressionConfig):
        return compression
    if isinstance(compression, str):
        return CompressionConfig.preset(compression)
    raise TypeError(f"compression must be a preset name or a CompressionConfig, "
                    f"got {type(compression).__name__}")


def tensor_class(role: str, state_key: str | None, spec: DTypeSpec, numel: int) -> str | None:
    """The class a tensor is coded by in delta steps, or None if it is always stored exactly."""
    if spec.name not in LOSSY_DTYPES or numel < MIN_LOSSY_ELEMENTS:
        return None
    if role in ("param", "buffer"):
        return "weights"
    if role != "optimizer" or state_key in (None, "step"):
        return None
    if state_key in MASTER_KEYS:  # a float32 master copy of a parameter is that parameter
        return "weights"
    if state_key == "exp_avg":
        return "exp_avg"
    if state_key in ("exp_avg_sq", "max_exp_avg_sq"):
        return "exp_avg_sq"
    return "optimizer_other"


def sample_stride(numel: int) -> int:
    """Stride that samples about SAMPLE_ELEMENTS elements of a tensor."""
    return max(1, numel // SAMPLE_ELEMENTS)


def sample_values(xs: np.ndarray, ps: np.ndarray | None, ordinal: bool) -> np.ndarray:
    """What the quantizer codes for sampled values ``xs`` and predictions ``ps``: residuals,
    as float64 or as ordinal keys."""
    if ordinal:
        ks = numpy_keys(xs)
        return ks - numpy_keys(ps) if ps is not None else ks
    xs = xs.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: non-finite samples are dropped later
        return xs - ps if ps is not None else xs


def _symbol_bits(sample: np.ndarray, step: float) -> float:
    """Order-0 entropy, bits per element, of the symbols ``sample`` quantizes to at ``step``."""
    q = np.rint(sample / step)
    q = q[np.isfinite(q)]
    if q.size == 0:
        return 0.0
    q = np.clip(q, -4096, 4096).astype(np.int64) + 4096
    counts = np.bincount(q)
    p = counts[counts > 0] / q.size
    return float(-(p * np.log2(p)).sum())


def needs_sample(quantizer: Quantizer, lr: float | None) -> bool:
    """Whether :func:`base_step` needs a sample of the values to choose ``quantizer``'s step."""
    return quantizer.domain == "linear" and (quantizer.lr_step is None or lr is None)


def base_step(quantizer: Quantizer, sample: np.ndarray | None, carried_error: float = 0.0,
              lr: float | None = None) -> float:
    """The step ``quantizer`` asks for, before any target-ratio scaling.

    ``sample`` (what the quantizer codes, at sampled elements) may be None
    where :func:`needs_sample` says it is not used. ``lr`` is the learning
    rate of the Adam-family optimizer that moves the tensor, if any (for
    ``Quantizer.lr_step``). ``carried_error`` is the
    mean squared error the previous save left in the prediction. A
    closed-loop residual is the change since that save plus this error; the
    step follows the change alone, so the error a delta leaves does not
    feed back into the next delta's step and stays the same however long
    the chain.
    """
    if quantizer.domain == "ordinal":
        return quantizer.step * BINADE_KEYS
    if quantizer.lr_step is not None and lr is not None:
        return quantizer.lr_step * lr
    finite = sample[np.isfinite(sample)]
    if finite.size == 0:
        return 0.0
    if quantizer.density is not None:
        mags = np.abs(finite)
        k = min(mags.size - 1, int(mags.size * (1 - quantizer.density)))
        return 2 * float(np.partition(mags, k)[k])
    mean_sq = float(np.mean(finite * finite))
    change_sq = max(mean_sq - carried_error, mean_sq / 16)
    return quantizer.step * change_sq ** 0.5


def finalize_step(step: float, ordinal: bool) -> float | int:
    """A step the kernels accept: an integer key count, or a positive float32 value."""
    if ordinal:
        return int(min(max(round(step), 1), MAX_KEY))
    step32 = float(np.float32(step))
    if not (math.isfinite(step32) and step32 > 0):
        step32 = float(np.finfo(np.float32).tiny)
    return step32


@dataclass
class ScaleController:
    """Chooses the factor on every step that meets ``target_ratio``, save after save.

    Estimates come from sampled symbol entropies. Two things are learnt from
    each save: how many bytes the coder actually spent per estimated bit
    (``correction``), and what the exactly stored tensors took
    (``exact_bytes``), so the target is met within a few saves even where
    order-0 entropy misjudges the coder.
    """

    target_ratio: float
    correction: float = 1.15
    exact_bytes: int | None = None
    SCALES: tuple[float, ...] = tuple(2.0 ** (k / 16) for k in range(-64, 65))

    def choose(self, samples: list[tuple[np.ndarray, float, int]], raw_bytes: int,
               exact_raw_bytes: int) -> tuple[float, float]:
        """The factor whose estimated size is closest to the target, and its estimated bits.

        ``samples`` holds, per quantized tensor, its sample, its unscaled
        step and its element count; ``exact_raw_bytes`` the raw size of what
        is stored exactly (used until a save has shown what it takes).
        The estimate falls as the factor grows, so the factor is bisected.
        """
        budget = raw_bytes / self.target_ratio
        exact = self.exact_bytes if self.exact_bytes is not None else exact_raw_bytes

        def bits_at(scale: float) -> float:
            return sum(_symbol_bits(s, step * scale) * n for s, step, n in samples if step > 0)

        def size_at(scale: float) -> float:
            return exact + self.correction * bits_at(scale) / 8

        lo, hi = 0, len(self.SCALES) - 1
        while lo < hi:  # first scale whose estimate fits the budget (the last one if none does)
            mid = (lo + hi) // 2
            if size_at(self.SCALES[mid]) <= budget:
                hi = mid
            else:
                lo = mid + 1
        if lo > 0 and size_at(self.SCALES[lo]) > 0 and math.log(
                size_at(self.SCALES[lo - 1]) / budget) < math.log(budget / size_at(self.SCALES[lo])):
            lo -= 1  # the finer neighbour overshoots the budget by less than this one undershoots
        return self.SCALES[lo], bits_at(self.SCALES[lo])

    def update(self, estimated_bits: float, coded_bytes: int, exact_bytes: int) -> None:
        """Learn from the last save: bytes of its quantized chunks against their estimated
        bits, and bytes of its exactly stored chunks."""
        self.exact_bytes = exact_bytes
        if estimated_bits > 0 and coded_bytes > 0:
            observed = 8 * coded_bytes / estimated_bits
            self.correction = min(4.0, max(0.5, 0.5 * self.correction + 0.5 * observed))
