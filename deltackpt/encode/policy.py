"""Compression policy: which tensors a delta step quantizes, how finely, and to what ratio.

A delta step codes each tensor by its class (:func:`tensor_class`), and each
class's error is bounded in a unit that keeps its meaning from run to run:

* ``weights`` (float parameters, and the float32 master copies
  mixed-precision optimizers keep of them): closed-loop residual against
  the reconstruction of the previous step, dithered, with a step in units of
  how far the optimizer moves the weight in one training step
  (:func:`deltackpt.encode.optimizers.movement_units`: for Adam ``lr`` times the
  root mean square of its update, ``lr / sqrt(step)`` for Adagrad, ``lr``
  times the momentum's root mean square for SGD with momentum), and at most
  a fraction of the tensor's root mean square;
* ``first_moment`` (Adam's ``exp_avg``, SGD's and RMSprop's
  ``momentum_buffer``, centered RMSprop's ``grad_avg``): coded from zero,
  dithered (unbiased, never zeroed wholesale), with a step in units of the
  update it drives: per element ``sqrt(exp_avg_sq) + eps`` for Adam, the
  tensor's root mean square otherwise; Adam's shaped within the tensor by
  its second moment (:func:`shaped_steps`): finer where the gradients are
  larger, coarser where they are small, at the same count of nonzero
  symbols; ``grad_avg`` per element in units of
  ``sqrt(square_avg) + eps``, so that the variance it centres keeps the
  second moment's error bound (:func:`centred_steps`);
* ``second_moment`` (``exp_avg_sq``, ``max_exp_avg_sq``, RMSprop's
  ``square_avg``, Adagrad's ``sum``): ordinal domain, i.e. a bounded relative
  error, against the previous reconstruction, dithered so that slow growth
  or decay is never coded as "no change" (the error is unbiased);
* ``buffers`` (BatchNorm running statistics and other float buffers):
  exact unless configured otherwise;
* everything else (integers, scalars such as Adam's ``step``, optimizer
  state whose meaning is not known, RNG states, ``extra``, tensors with
  non-finite values) is stored exactly.

A :class:`Quantizer` gives a class its step. With ``target_ratio`` the
library scales every step by one factor, chosen per save from the sampled
entropy of the symbols it would produce and corrected by what the previous
saves actually achieved, never beyond ``max_error``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.codecs.quant import (
    MAX_DITHERED_KEY_STEP,
    MAX_FLOOR_LOG2,
    MAX_KEY,
    MIN_FLOOR_LOG2,
    numpy_fold,
    numpy_keys,
)
from deltackpt.encode.optimizers import FIRST_MOMENTS, SECOND_MOMENTS
from deltackpt.errors import ConfigError
from deltackpt.format.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    config_error,
)
from deltackpt.format.dtypes import DTypeSpec

CLASSES = ("weights", "first_moment", "second_moment", "buffers")
LOSSY_DTYPES = ("float32", "bfloat16", "float16")
# Tensors smaller than this are stored exactly: coding them saves nothing.
MIN_LOSSY_ELEMENTS = 16
BINADE_KEYS = 1 << 23  # ordinal keys between one power of two and the next
SAMPLE_ELEMENTS = 8192  # elements sampled per tensor to pick steps and estimate sizes
# target_ratio never scales the configured errors beyond this by default: on the fidelity matrix,
# balanced's errors sqrt(2) times larger cost a resumed run about what aggressive costs (and
# four times larger, 6-38 times balanced's cost: docs/fidelity.md)
DEFAULT_MAX_SCALE = math.sqrt(2)
# A Quantizer's error bounds: a step and the units it may be given in (target_ratio scales them all)
ERROR_BOUNDS = ("step", "move_step", "rel_step", "update_step", "rms_step")
# A first moment whose sign is the update (Lion's) is coded at update_step * SIGN_FLIP_STEP *
# (1 - beta2) of its root mean square: where its error displaces a weight, through the signs it
# flips while it lasts, about as far as Adam's first moment at update_step (derived in
# Quantizer.rms_unit_step).
SIGN_FLIP_STEP = 5 * math.sqrt(2 * math.pi)
# Adam's first moment: its steps are divided by sqrt(sqrt(v) + floor), the floor the power of two
# nearest this fraction of the tensor's root mean square of sqrt(v) (bench/error_shaping.py: at
# about the same bits, 1.3-2x fewer steps of progress lost on a GPT, a BatchNorm CNN and an MLP;
# docs/fidelity.md).
SHAPE_FLOOR = 1 / 16


@dataclass(frozen=True)
class Quantizer:
    """How one class of tensors is coded in delta steps.

    Args:
        step: quantization step where no unit below applies. Linear domain: a
            multiple of the root mean square of the coded values (residuals
            for ``pred="base"``); the error is then at most ``step / 2`` of
            it. Ordinal domain: a fraction of a binade, so the relative error
            is at most about ``step / 2`` binades (1.0: within a factor
            ``sqrt(2)``).
        density: instead of ``step``, the fraction of coded values that
            should stay non-zero (linear domain); the step is then set from
            a sampled quantile of the values.
        domain: ``"linear"`` (absolute error <= step / 2) or ``"ordinal"``
            (relative error; for positive or wide-ranging values).
        pred: ``"base"`` codes the residual against the previous step's
            reconstruction (closed loop), ``"zero"`` codes the value itself.
        move_step: weights: the step as a multiple of how far the optimizer moves the
            weight in one training step (:func:`movement_units`), where that is known: a
            restored weight is within ``move_step / 2`` training steps' worth of movement of
            the saved one, however far apart the saves are.
        rel_step: weights: the most the step may be, as a multiple of the tensor's root mean
            square, so that a restored weight also stays within ``rel_step / 2`` of its
            typical magnitude (this binds early in training).
        update_step: first moments (``pred="zero"``): the step as a multiple of the update the
            moment drives. For Adam's ``exp_avg`` each element's step is ``update_step *
            (sqrt(exp_avg_sq) + eps)`` (FORMAT.md 3.2, scaled steps), so its restored update
            is within ``update_step / 2`` learning rates of the saved one.
        rms_step: momentum buffers (SGD's and RMSprop's ``momentum_buffer``, of which the
            update is a multiple): the step as a multiple of the tensor's root mean square, so
            its restored update is within ``rms_step / 2`` of the typical update (default:
            ``update_step``). Lion's ``exp_avg``, whose sign is the update, takes
            ``update_step * SIGN_FLIP_STEP * (1 - beta2)`` times its root mean square, where
            the signs its error flips move a weight about as far as Adam's first moment moves
            it (:meth:`rms_unit_step`); other first moments not scaled by a second, ``update_step``
            times it.
        dither: shift each element's quantization grid by its own pseudo-random fraction of
            a step (FORMAT.md 3.2), which makes the error uniform, unbiased and independent of
            how the values moved (the manual's "What a delta keeps" says why that matters).
        exact: store the class losslessly in every step instead.
    """

    step: float | None = 1.0
    density: float | None = None
    move_step: float | None = None
    rel_step: float | None = None
    update_step: float | None = None
    rms_step: float | None = None
    domain: Literal["linear", "ordinal"] = "linear"
    pred: Literal["base", "zero"] = "base"
    dither: bool = True
    exact: bool = False

    def __post_init__(self) -> None:
        check_choice(self.domain, "Quantizer domain", ("linear", "ordinal"))
        check_choice(self.pred, "Quantizer pred", ("base", "zero"))
        check_bool(self.dither, "Quantizer dither")
        if check_bool(self.exact, "Quantizer exact"):
            return
        if (self.step is None) == (self.density is None):
            raise ConfigError("give a Quantizer exactly one of step= and density=")
        if self.step is not None and self.domain == "ordinal" and self.dither:
            check_number(self.step, "Quantizer step (dithered, ordinal domain)",  # key offsets
                         most=MAX_DITHERED_KEY_STEP / BINADE_KEYS)  # exact in float64
        elif self.step is not None:
            check_number(self.step, "Quantizer step")
        if self.density is not None:
            check_number(self.density, "Quantizer density", most=1)
            if self.domain != "linear":
                raise ConfigError("Quantizer density= needs the linear domain")
        for key, pred in (("move_step", "base"), ("rel_step", "base"), ("update_step", "zero"),
                          ("rms_step", "zero")):
            value = getattr(self, key)
            if value is None:
                continue
            check_number(value, f"Quantizer {key}")
            if (self.domain, self.pred) != ("linear", pred):
                raise ConfigError(f"Quantizer {key}= needs the linear domain and pred={pred!r}")

    def rms_unit_step(self, momentum: bool, sign_memory: float | None = None) -> float | None:
        """The step of a first moment whose steps are not scaled, in its root mean square:
        ``rms_step`` for a momentum buffer where set, else ``update_step``; for a moment whose
        sign is the update (``sign_memory``: ``1 - beta2``), ``update_step * SIGN_FLIP_STEP *
        sign_memory``.

        That moment is Lion's, with ``sign(beta1 m + (1 - beta1) g)`` and ``m <- beta2 m +
        (1 - beta2) g``. An error ``e`` in ``m`` shifts the sign's argument by ``beta1 e``,
        decaying by ``beta2`` a step, and flips the update where the argument lies within it
        of zero: a step ``t`` after the restore, with probability at most ``f(0) |e|
        beta2**t``, ``f`` the density of ``m`` (the gradient's share of the argument only
        spreads it; at zero, ``1 / (sqrt(2 pi) rms)`` for a normal ``m``). Each flip moves the
        weight two learning rates, so over the error's life about ``f(0) E|e| / (1 - beta2)``
        times two, ``f(0) step / (2 (1 - beta2))`` learning rates for a dithered error
        (``E|e|`` a quarter step). Adam's first moment at ``update_step`` moves a weight
        ``update_step / 4`` learning rates a step for ``1 / (1 - 0.9)`` steps (its default
        beta1): equal at the step above."""
        if momentum and self.rms_step is not None:
            return self.rms_step
        if sign_memory is not None and self.update_step is not None:
            return self.update_step * SIGN_FLIP_STEP * sign_memory
        return self.update_step

    @property
    def dithers(self) -> bool:
        """Whether ``dither`` applies (a lossy quantizer)."""
        return self.dither and not self.exact


EXACT = Quantizer(exact=True)


@dataclass(frozen=True)
class CompressionConfig:
    """What delta steps keep: a quantizer per tensor class, overrides, and an optional target.

    Use a preset (``CompressionConfig.preset("balanced")``, or just the
    name where an API takes a config) and adjust it with
    :func:`dataclasses.replace`, or build one from scratch.

    Args:
        weights, first_moment, second_moment, buffers: the quantizer of each
            class (see the module doc; ``buffers`` is exact by default).
        overrides: ``{pattern: quantizer}``; a tensor whose universal name
            (``model/<fqn>``, ``optimizer/state/<fqn>/<key>``) or FQN
            matches the shell-style ``pattern`` uses that quantizer
            (first match wins). E.g. ``{"model/tok.*": EXACT}``. A pattern
            that matches no tensor of a save is an error.
        target_ratio: aim for this ratio of raw to stored bytes on every
            delta step by scaling all steps by one factor; the achieved
            ratio is recorded per step.
        max_error: the ceiling of that factor, as the largest error of a
            weight in training steps' worth of its movement (the unit of
            ``weights.move_step``, whose error is ``move_step / 2``): the
            scaled steps never exceed ``max_error / (weights.move_step /
            2)`` times the configured ones, for every class alike (default:
            ``sqrt(2)`` times the configured ones, which on ``balanced``
            costs a resumed run about what ``aggressive`` costs: a target
            beyond that needs an explicit ``max_error``). Where the target cannot be met
            within it, the save stays at this floor and says so
            (``SaveInfo.at_max_error``, the step's metadata, one warning per
            manager).
        deltas: False makes every save a full lossless checkpoint.
        block: elements per block of the packed symbol stream.
        name: the preset this config came from (recorded in the metadata).
    """

    weights: Quantizer = Quantizer(step=1.0, move_step=32.0, rel_step=0.25)
    first_moment: Quantizer = Quantizer(step=1.4, update_step=1.4, rms_step=2.8, pred="zero")
    second_moment: Quantizer = Quantizer(step=2.0, domain="ordinal")
    buffers: Quantizer = EXACT
    overrides: Mapping[str, Quantizer] = field(default_factory=dict)
    target_ratio: float | None = None
    max_error: float | None = None
    deltas: bool = True
    block: int = 1024
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.target_ratio is not None:
            check_number(self.target_ratio, "target_ratio", above=1)
        if self.max_error is not None:
            check_number(self.max_error, "max_error")
        check_int(self.block, "block", least=64, most=1 << 20)
        check_bool(self.deltas, "deltas")
        if not isinstance(self.name, str):
            raise config_error("name", "a string", self.name)
        for cls in CLASSES:
            if not isinstance(getattr(self, cls), Quantizer):
                raise config_error(cls, "a Quantizer", getattr(self, cls))
        if not isinstance(self.overrides, Mapping):
            raise config_error("overrides", "a mapping of name patterns to Quantizers",
                               self.overrides)
        for pattern, quantizer in self.overrides.items():
            if not isinstance(pattern, str):
                raise config_error("an overrides pattern", "a string", pattern)
            if not isinstance(quantizer, Quantizer):
                raise config_error(f"overrides[{pattern!r}]", "a Quantizer", quantizer)
        self._check_target()

    def _check_target(self) -> None:
        """Raise :class:`ConfigError` for a ``target_ratio`` or ``max_error`` that cannot act: on
        a config without deltas, ``max_error`` without a target to cap, or ``max_error`` when the
        weights have no ``move_step``, its unit."""
        if not self.deltas and (self.target_ratio, self.max_error) != (None, None):
            raise ConfigError(f"{'target_ratio' if self.target_ratio is not None else 'max_error'}"
                              " applies to delta steps, and this config has none (deltas=False, "
                              "as the 'lossless' preset)")
        if self.max_error is None:
            return
        if self.target_ratio is None:
            raise ConfigError(f"max_error ({self.max_error}) caps how far target_ratio scales the "
                              "errors; without a target_ratio it does nothing: set one, or leave "
                              "max_error out")
        if self.weights.exact or not self.weights.move_step:
            raise ConfigError(f"max_error ({self.max_error}) is in steps' worth of a weight's "
                              "movement, the unit of weights.move_step, and these weights have "
                              "none (exact, or no move_step): leave max_error out (target_ratio "
                              f"then scales the errors up to {DEFAULT_MAX_SCALE:.3g} times)")

    @classmethod
    def preset(cls, name: str) -> CompressionConfig:
        """``"lossless"``, ``"balanced"`` (the default) or ``"aggressive"``."""
        return PRESETS[check_choice(name, "compression preset", sorted(PRESETS))]

    @property
    def max_scale(self) -> float:
        """The largest factor ``target_ratio`` may scale the steps by (see ``max_error``)."""
        if self.max_error is None:
            return DEFAULT_MAX_SCALE
        return self.max_error / (self.weights.move_step / 2)  # set with max_error: _check_target

    def quantizer_for(self, name: str, fqn: str | None, cls: str | None) -> Quantizer:
        """The quantizer of one tensor: an override that matches it, else its class's."""
        pattern = self.override_for(name, fqn)
        if pattern is not None:
            return self.overrides[pattern]
        return EXACT if cls is None else getattr(self, cls)

    def override_for(self, name: str, fqn: str | None) -> str | None:
        """The first override pattern matching a tensor's name or FQN, if any."""
        for pattern in self.overrides:
            if fnmatch.fnmatchcase(name, pattern) or (fqn is not None
                                                       and fnmatch.fnmatchcase(fqn, pattern)):
                return pattern
        return None

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
            out.update(target_ratio=self.target_ratio, max_scale=self.max_scale)
            if self.max_error is not None:
                out["max_error"] = self.max_error
        return out


# The presets' steps are in units of what each class drives (module doc), chosen on the matrix
# of bench/fidelity.py (models, optimizers, intervals, early to late restore points), not on one
# run. balanced restores a weight within 16 steps' worth of its movement and within 12% of its
# tensor's root mean square (the second binds early in training, when weights are small
# against a step's movement: without it, restores right after warm-up cost 2.6% of loss), the
# update a first moment drives within 0.7 of a learning rate (noisy but unbiased, never zero;
# within one, an early restore cost 0.5-0.55% of loss over three seeds), and a second moment
# within one binade of its keys (its update within a factor sqrt(2)). A momentum buffer (SGD's,
# RMSprop's) drives the update within 1.4 of its root mean square: against the typical update
# still twice as fine as Adam's first moment, whose 0.7 learning rates are 3-4 times its update
# (0.17-0.23 learning rates an element, the median tensor of four AdamW runs: docs/fidelity.md).
# aggressive allows three times the weights' movement, twice their relative error, a first
# moment within one learning rate (a momentum within 2 of its rms) and a second moment within
# two binades (its update within a factor 2). Coarser moments cost more than they saved: a
# first moment within two learning rates lost 2-3% of loss in early restores, a second moment
# within four binades 0.7-0.9%. Two binades against one, over the whole matrix with three
# training seeds: 9.1% more ratio (3-17% by run) and resumed losses no farther from the exact
# runs' (0.045% closer on average, closer in 55 of 93 runs: docs/fidelity.md).
PRESETS = {
    "lossless": CompressionConfig(deltas=False, name="lossless"),
    "balanced": CompressionConfig(name="balanced"),
    "aggressive": CompressionConfig(weights=Quantizer(step=2.0, move_step=96.0, rel_step=0.5),
                                    first_moment=Quantizer(step=2.0, update_step=2.0, rms_step=4.0,
                                                           pred="zero"),
                                    second_moment=Quantizer(step=4.0, domain="ordinal"),
                                    name="aggressive"),
}


def as_config(compression: str | CompressionConfig) -> CompressionConfig:
    """A config from a preset name or a config."""
    if isinstance(compression, CompressionConfig):
        return compression
    if isinstance(compression, str):
        return CompressionConfig.preset(compression)
    raise config_error("compression", "a preset name or a CompressionConfig", compression)


def tensor_class(role: str, state_key: str | None, spec: DTypeSpec, numel: int) -> str | None:
    """The class a tensor is coded by in delta steps, or None if it is always stored exactly."""
    if spec.name not in LOSSY_DTYPES or numel < MIN_LOSSY_ELEMENTS:
        return None
    if role == "param":
        return "weights"
    if role == "buffer":
        return "buffers"
    if role != "optimizer" or state_key is None:
        return None
    if state_key in MASTER_KEYS:  # a float32 master copy of a parameter is that parameter
        return "weights"
    if state_key in FIRST_MOMENTS:
        return "first_moment"
    if state_key in SECOND_MOMENTS:
        return "second_moment"
    return None


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


@dataclass(frozen=True)
class Sample:
    """What a quantizer codes at a tensor's sampled elements (:func:`sample_values`), with the
    dither offsets of those elements (None undithered), to estimate the symbols' entropy."""

    values: np.ndarray
    dither: np.ndarray | None
    ordinal: bool

    def bits(self, step: float) -> float:
        """Order-0 entropy, bits per element, of the symbols the sample quantizes to at
        ``step``, as the kernels choose them (FORMAT.md 3.2; dithered grids included: a
        dither turns small residuals into symbols of 1 as often as they cover the step, whose
        signs a linear chunk folds by the dither)."""
        u = 0.0 if self.dither is None else self.dither.astype(np.float64)
        if self.ordinal:
            step = float(max(round(step), 1))
            q = np.rint((self.values - (np.floor((u + 0.5) * step) - np.floor(step / 2))) / step)
        else:
            q = np.rint(self.values / step + u)
            if self.dither is not None:  # as codecs.quant.dither_context has it
                q = numpy_fold(q, u)
        q = q[np.isfinite(q)]
        if q.size == 0:
            return 0.0
        q = np.clip(q, -4096, 4096).astype(np.int64) + 4096
        counts = np.bincount(q)
        p = counts[counts > 0] / q.size
        return float(-(p * np.log2(p)).sum())


def shaped_steps(moment: np.ndarray, second: np.ndarray, eps: float) -> tuple[float, float, np.ndarray]:
    """How an Adam first moment's scaled steps are shaped, from samples of it and of the
    second moment that scales them (FORMAT.md 3.2: an element's step ``step * (sqrt(v) + eps)
    / sqrt(sqrt(v) + floor)``). Returns the ``floor`` (the power of two nearest SHAPE_FLOOR of
    the root mean square of ``sqrt(v)``, plus eps: FORMAT.md 3.2 stores its exponent); the
    factor the unshaped step is multiplied by so that the symbols' mean magnitude, the count of
    nonzero symbols at the low rates a first moment is coded at, stays what unshaped steps give
    (for an all-zero sample, so that the steps' geometric mean does); and each sampled element's
    step over the shaped ``step``.

    The error a dithered quantizer leaves in an element's update is then in proportion to
    ``(sqrt(v) + floor) ** -0.5``: an element whose gradients are large moves the loss more
    per unit of update, and its first moment is recomputed from new gradients more slowly
    relative to its size than its error would take to matter (docs/fidelity.md).
    """
    m = np.abs(moment.astype(np.float64))
    root = np.sqrt(np.maximum(second.astype(np.float64), 0.0))
    finite = np.isfinite(m) & np.isfinite(root)
    m, root = m[finite], root[finite]
    rms = math.sqrt(float(np.mean(root * root))) if root.size else 0.0
    floor = 2.0 ** min(max(round(math.log2(SHAPE_FLOOR * rms + eps)), MIN_FLOOR_LOG2),
                       MAX_FLOOR_LOG2)
    unshaped = root + eps
    shaped = unshaped / np.sqrt(root + floor)
    held = float(np.sum(m / unshaped))
    if held > 0:
        factor = float(np.sum(m / shaped)) / held
    elif root.size:
        factor = float(np.exp(np.mean(np.log(unshaped / shaped))))
    else:  # nothing finite sampled: the shape of v = 0
        factor = math.sqrt(floor)
    units = np.full(finite.shape, np.nan)
    units[finite] = shaped
    return floor, factor, units


def needs_sample(quantizer: Quantizer, unit: float | None) -> bool:
    """Whether :func:`base_step` needs a sample of the values to choose ``quantizer``'s step:
    of what it codes (:func:`needs_residuals`), or of the values' root mean square."""
    return needs_residuals(quantizer, unit) or (quantizer.domain == "linear"
                                                and quantizer.rel_step is not None)


def needs_residuals(quantizer: Quantizer, unit: float | None) -> bool:
    """Whether :func:`base_step` needs a sample of what ``quantizer`` codes (else the step
    follows from the movement ``unit`` and the values' root mean square)."""
    return quantizer.domain == "linear" and (quantizer.move_step is None or unit is None)


def base_step(quantizer: Quantizer, sample: np.ndarray | None, carried_error: float = 0.0,
              unit: float | None = None, value_rms: float | None = None,
              momentum: bool = False, sign_memory: float | None = None) -> float:
    """The step ``quantizer`` asks for, before any target-ratio scaling.

    ``sample`` (what the quantizer codes, at sampled elements) may be None
    where :func:`needs_sample` says it is not used. ``unit`` is how far the
    optimizer moves the tensor in one training step, if known
    (:func:`deltackpt.encode.optimizers.movement_units`, for
    ``Quantizer.move_step``). A first moment's step (:meth:`Quantizer.rms_unit_step`;
    ``momentum``: a momentum buffer) is relative to the root mean square of the sample: the
    moment itself; ``sign_memory`` (``1 - beta2``) marks one whose sign is the update (Lion's).
    ``carried_error`` is the mean squared error the previous save left in
    the prediction. A closed-loop residual is the change since that save
    plus this error; the step follows the change alone, so the error a
    delta leaves does not feed back into the next delta's step and stays
    the same however long the chain. ``value_rms`` is the root mean square
    of the tensor's values (for ``Quantizer.rel_step``).
    """
    if quantizer.domain == "ordinal":
        return quantizer.step * BINADE_KEYS
    if quantizer.move_step is not None and unit is not None:
        step = quantizer.move_step * unit
        if quantizer.rel_step is not None and value_rms:
            step = min(step, quantizer.rel_step * value_rms)
        return step
    finite = sample[np.isfinite(sample)]
    if finite.size == 0:
        return 0.0
    if quantizer.density is not None:
        mags = np.abs(finite)
        k = min(mags.size - 1, int(mags.size * (1 - quantizer.density)))
        return 2 * float(np.partition(mags, k)[k])
    mean_sq = float(np.mean(finite * finite))
    rms_unit = quantizer.rms_unit_step(momentum, sign_memory)
    if rms_unit is not None:
        return rms_unit * mean_sq ** 0.5
    change_sq = max(mean_sq - carried_error, mean_sq / 16)
    return quantizer.step * change_sq ** 0.5


def ordinal_floor(step: float) -> float:
    """The least ratio of a restored value to the true one that an ordinal step of ``step``
    keys allows: the error is at most ``step / 2`` keys, and keys a binade apart
    (``BINADE_KEYS``) halve a value, so the ratio is at least ``2 ** -(step / 2 / BINADE_KEYS)``."""
    return 2.0 ** -(step / 2 / BINADE_KEYS)


def centred_steps(second_step: float, x: np.ndarray) -> tuple[float, float]:
    """The steps of centered RMSprop's ``grad_avg``, in units of ``sqrt(square_avg)`` per
    element (``x``: sampled ``grad_avg / sqrt(square_avg)``), and of the ``square_avg`` it
    centres, in binades (at most ``second_step``, its step at this save's scale), so that the
    variance its update divides by, ``square_avg - grad_avg**2``, keeps the second moment's
    error bound; ``(0, second_step)`` where no step can (gradients that hardly vary: both are
    then stored exactly).

    The lower edge of the second moment's error band (:func:`ordinal_floor`) must lie above
    the sample's largest ``x**2``; its step is at most ``-log2`` of that ``x**2``, which puts
    the edge at least halfway, in log, from it to 1: where the variance needs the precision,
    the square_avg pays it, rather than the grad_avg (or both, stored exactly). A dithered
    error ``d`` (uniform in a step ``t``) of ``grad_avg`` lowers the variance by ``(2 x d +
    d**2)`` ``square_avg``: on average by ``t**2 / 12`` of it, which must not exceed the mean
    bias of the second moment's own dithered ordinal error, and at worst by ``|x| t + t**2 /
    4``, which must keep it above that lower edge, for the largest ``|x|`` against the least
    ``square_avg`` the band restores. The writer checks every element of every chunk against
    that edge (``StepEncoder``) and stores a chunk that misses it exactly."""
    x2 = x[np.isfinite(x)].astype(np.float64) ** 2
    largest = float(x2.max(initial=0.0))
    if x2.size == 0 or largest >= 1:
        return 0.0, second_step
    s = min(second_step, -math.log2(largest)) if largest else second_step
    floor = ordinal_floor(s * BINADE_KEYS)
    bias = (2 ** (s / 2) - 2 ** (-s / 2)) / (s * math.log(2)) - 1  # E[2**U] - 1, U in +-s/2
    t_bias = math.sqrt(12 * bias / float(np.mean(1 / (1 - np.minimum(x2, 1 - 2.0 ** -20)))))
    a, room = math.sqrt(largest / floor), 1 - floor
    t_worst = 2 * (math.sqrt(a * a + room * (1 - a * a)) - a)  # t**2/4 + a t = room (1 - a**2)
    return min(t_bias, t_worst), s


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
    order-0 entropy misjudges the coder. The factor never exceeds
    ``max_scale`` (:attr:`CompressionConfig.max_scale`): where the target
    needs more, the save stays at that floor and ``at_floor`` says so.
    """

    target_ratio: float
    max_scale: float = math.inf
    correction: float = 1.15
    exact_bytes: int | None = None
    at_floor: bool = False
    SCALES: tuple[float, ...] = tuple(2.0 ** (k / 16) for k in range(-64, 65))

    def choose(self, samples: list[tuple[Sample, float, int]], raw_bytes: int,
               exact_raw_bytes: int) -> tuple[float, float]:
        """The factor whose estimated size is closest to the target, and its estimated bits.

        ``samples`` holds, per quantized tensor, its sample, its unscaled
        step and its element count; ``exact_raw_bytes`` the raw size of what
        is stored exactly (used until a save has shown what it takes).
        The estimate falls as the factor grows, so the factor is bisected.
        """
        budget = raw_bytes / self.target_ratio
        exact = self.exact_bytes if self.exact_bytes is not None else exact_raw_bytes
        scales = [s for s in self.SCALES if s <= self.max_scale] or [self.max_scale]

        def bits_at(scale: float) -> float:
            return sum(s.bits(step * scale) * n for s, step, n in samples if step > 0)

        def size_at(scale: float) -> float:
            return exact + self.correction * bits_at(scale) / 8

        lo, hi = 0, len(scales) - 1
        while lo < hi:  # first scale whose estimate fits the budget (the last one if none does)
            mid = (lo + hi) // 2
            if size_at(scales[mid]) <= budget:
                hi = mid
            else:
                lo = mid + 1
        self.at_floor = lo == len(scales) - 1 and size_at(scales[lo]) > budget
        if lo > 0 and size_at(scales[lo]) > 0 and math.log(
                size_at(scales[lo - 1]) / budget) < math.log(budget / size_at(scales[lo])):
            lo -= 1  # the finer neighbour overshoots the budget by less than this one undershoots
        return scales[lo], bits_at(scales[lo])

    def update(self, estimated_bits: float, coded_bytes: int, exact_bytes: int) -> None:
        """Learn from the last save: bytes of its quantized chunks against their estimated
        bits, and bytes of its exactly stored chunks."""
        self.exact_bytes = exact_bytes
        if estimated_bits > 0 and coded_bytes > 0:
            observed = 8 * coded_bytes / estimated_bits
            self.correction = min(4.0, max(0.5, 0.5 * self.correction + 0.5 * observed))
