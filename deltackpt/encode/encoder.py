"""The encoder side of a save: full or delta, and the writer's running reconstruction.

:class:`StepEncoder` codes the chunks of one save for :func:`writer.write_data`.
For a full step it stores every tensor losslessly and starts a new
:class:`~deltackpt.encode.reconstruction.Reconstruction`. For a delta step it quantizes each
tensor as its :class:`~deltackpt.encode.policy.Quantizer` says, against the
reconstruction of its base (closed loop), into running values that are exactly
what a reader will decode: the base's own arrays on their last use, else
arrays of its own, written chunk by chunk on the writer's threads (no copy
of the base on the caller's); tensors
marked exact, too small, not of a float dtype, or holding non-finite values
in a chunk, are stored losslessly. bitsandbytes' 8-bit moments are coded by
their dequantized values, their ``absmax`` derived from those
(:mod:`deltackpt.codecs.bnb8`). It also gathers the per-class error
statistics that the step's metadata records.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from deltackpt.codecs import EncodedChunk, encode_lossless
from deltackpt.codecs.bnb8 import block_absmax, dequantize, encode_absmax, encode_state
from deltackpt.codecs.cast import encode_cast
from deltackpt.codecs.patch import encode_patch, kept_for_patches
from deltackpt.codecs.quant import (
    N_STATS,
    STAT_MAX_ABS,
    STAT_MAX_REL,
    STAT_NONZERO,
    STAT_SUM_SQ,
    STAT_SUM_SQ_ERR,
    Scale,
    encode_quant,
    numpy_dither,
)
from deltackpt.codecs.unchanged import encode_unchanged
from deltackpt.encode.cost import expected_steps
from deltackpt.encode.optimizers import (
    MOMENTUM_BUFFERS,
    BnbState,
    adam_bias_corrections,
    captured_bnb_states,
    finite_rms,
    group_hyperparameter,
    master_copies,
    movement_units,
    sign_memories,
    state_by_parameter,
    state_meanings,
    unknown_state_keys,
)
from deltackpt.encode.policy import (
    BINADE_KEYS,
    CLASSES,
    LOSSY_DTYPES,
    CompressionConfig,
    Quantizer,
    Sample,
    ScaleController,
    base_step,
    centred_steps,
    finalize_step,
    needs_residuals,
    needs_sample,
    ordinal_floor,
    sample_stride,
    sample_values,
    shaped_steps,
    tensor_class,
)
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import ConfigError
from deltackpt.format.dtypes import (
    DTypeSpec,
    dtype_bytes,
    float32_values,
    raw_bytes,
    spec_for,
    spec_named,
)
from deltackpt.format.metadata import Layout, TensorRecord
from deltackpt.format.state import CapturedState, CapturedTensor

if TYPE_CHECKING:
    from deltackpt.io.writer import PendingDigest

RUNNING_DTYPES = tuple(getattr(torch, name) for name in LOSSY_DTYPES)  # float32 running values
TINY = float(np.finfo(np.float32).tiny)  # the least normal float32


def _centred(captured: CapturedState, meanings: dict[str, str],
             local: dict[str, torch.Tensor]) -> dict[str, str]:
    """``grad_avg -> square_avg`` names of centered RMSprop's state that this process codes:
    both of one parameter, shape and dtype."""
    squares = {t.fqn: t.name for t in captured.tensors
               if meanings.get(t.name) == "square_avg" and t.name in local}
    out = {}
    for t in captured.tensors:
        v = squares.get(t.fqn) if meanings.get(t.name) == "grad_avg" else None
        if v is not None and t.name in local and local[t.name].shape == local[v].shape \
                and local[t.name].dtype == local[v].dtype:
            out[t.name] = v
    return out


def captured_layout(captured: CapturedState,
                    local: dict[str, torch.Tensor] | None = None) -> Layout:
    """Role, dtype and shape of every stored tensor of a capture (as ``format.layout_of``), or of
    the ``local`` parts of its tensors that one rank codes."""
    if local is None:
        return {t.name: (t.role, spec_for(t.tensor.dtype, t.name).name, t.global_shape)
                for t in captured.tensors if t.alias_of is None}
    return {t.name: (t.role, spec_for(t.tensor.dtype, t.name).name, tuple(local[t.name].shape))
            for t in captured.tensors if t.name in local}


@dataclass
class _Plan:
    """How one tensor is coded in this save."""

    cls: str | None
    quantizer: Quantizer  # this save's: exact where a delta must store the tensor exactly
    lossy: bool = False  # whether the config codes it lossily (its running values are kept)
    step: float | int = 0
    pred: bool = False
    cast_of: str | None = None  # the float32 master copy the tensor is rounded from
    dither: int | None = None  # seed of the dither that shifts its quantization grid
    # (exp_avg_sq, eps, factor) scaling its steps per element: update_step * factor is its step
    scale: tuple[str, float, float] | None = None
    floor: float = 0.0  # Adam's first moment: the floor that shapes its scaled steps (0: none)
    centres: str | None = None  # centered RMSprop's grad_avg: the square_avg it is subtracted from
    variance_floor: float = 0.0  # grad_avg: the least its restored variance may shrink to
    centred_sample: np.ndarray | None = None  # grad_avg: its sample, in sqrt(square_avg) units
    bnb: BnbState | None = None  # a bitsandbytes 8-bit moment coded as bnb8 chunks in this save
    absmax_of: str | None = None  # the bnb8-coded moment whose running values this absmax is
    unchanged: bool = False  # a code map equal to its base's: a quant chunk of zero symbols


@dataclass(frozen=True)
class _Meanings:
    """What the optimizer state of a save means, for coding each tensor (read once)."""

    roles: dict[str, str]  # optimizer state tensors: what each holds (a first moment, ...)
    units: dict[str, float]  # parameters by FQN: how far one training step moves them
    masters: dict[str, str]  # 16-bit parameters: their float32 master copy
    bnb: dict[str, tuple[BnbState, np.ndarray]]  # bnb8-coded moments and their dequantized values
    qmaps: dict[str, bool]  # bitsandbytes code maps: whether each equals its base's
    scales: dict[str, tuple[str, float, float]]  # first moments scaled by their second
    centred: dict[str, str]  # centered RMSprop: grad_avg -> the square_avg it centres
    sign_memories: dict[str, float]  # Lion's parameters by FQN: 1 - beta2 (Quantizer.rms_unit_step)


@dataclass(frozen=True)
class QuantCoding:
    """How the chunks of a tensor are quantized in a delta (the arguments of
    :func:`codecs.quant.encode_quant` but the arrays): coded against the base's values
    (``with_base``) or from zero, and with steps scaled by the running values of tensor
    ``scale[0]`` with ``eps = scale[1]``, shaped by the floor ``scale[2]`` (0: not shaped)."""

    ordinal: bool
    with_base: bool
    step: float | int
    block: int
    dither: int | None
    scale: tuple[str, float, float] | None


@dataclass
class _ClassStats:
    tensors: int = 0
    elements: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    exact_elements: int = 0
    nonzero: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float | None = None  # tracked in the ordinal (relative) domain only
    sum_sq_err: float = 0.0
    sum_sq: float = 0.0

    def merge(self, other: _ClassStats) -> None:
        """Add another rank's statistics of the same class."""
        for key in ("tensors", "elements", "raw_bytes", "stored_bytes", "exact_elements",
                    "nonzero", "sum_sq_err", "sum_sq"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.max_abs_error = max(self.max_abs_error, other.max_abs_error)
        if other.max_rel_error is not None:
            self.max_rel_error = max(self.max_rel_error or 0.0, other.max_rel_error)

    def as_json(self) -> dict:
        rms = (self.sum_sq_err / self.sum_sq) ** 0.5 if self.sum_sq > 0 else 0.0
        return {"tensors": self.tensors, "elements": self.elements, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "exact_elements": self.exact_elements,
                "nonzero": self.nonzero, "max_abs_error": self.max_abs_error,
                "max_rel_error": self.max_rel_error, "rms_rel_error": rms}


def host_array(values: np.ndarray | torch.Tensor) -> np.ndarray:
    """Running values as a numpy array: a copy of those on a device, else a view."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


def strided_sample(values: np.ndarray | torch.Tensor, stride: int) -> np.ndarray:
    """Every ``stride``-th element of ``values``, flattened, as a contiguous float32 host array:
    gathered once, as each pass over a strided view of a large tensor misses the cache at
    every element (on a 305 MB state, finite_rms took three times as long on such views)."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values.reshape(-1)[::stride], np.float32)
    return values.detach().reshape(-1)[::stride].float().contiguous().cpu().numpy()


def shrunk_variances(centre: np.ndarray | torch.Tensor, true_centre: np.ndarray | torch.Tensor,
                     second: np.ndarray | torch.Tensor, floor: float) -> int | torch.Tensor:
    """How many elements of centered RMSprop's variance ``second - centre**2`` (its restored
    ``square_avg`` and ``grad_avg``) fall below ``floor`` times the variance with the true
    ``grad_avg``, in float32 as torch's RMSprop computes it: the count of a torch tensor's on
    its device (numpy arrays: an int)."""
    if isinstance(centre, torch.Tensor):
        c, t, v = centre.float(), true_centre.float(), second.float()
        return ((v - c * c) < floor * (v - t * t)).sum()
    c, t, v = (a.astype(np.float32, copy=False) for a in (centre, true_centre, second))
    return int(np.count_nonzero((v - c * c) < np.float32(floor) * (v - t * t)))


def _empty_like(values: np.ndarray | torch.Tensor | None, numel: int) -> np.ndarray | torch.Tensor:
    """An uninitialized array like running ``values`` (torch tensors on their device, pinned
    where they are), or a numpy array of ``numel`` float32 values where there are none."""
    if values is None or isinstance(values, np.ndarray):
        return np.empty(numel, np.float32)
    pinned = values.device.type == "cpu" and values.is_pinned()
    return torch.empty_like(values, pin_memory=pinned)


def _error_stats(x: np.ndarray, y: np.ndarray, nonzero: int) -> np.ndarray:
    """One row of the kernels' statistics (``STAT_*``) of a chunk restored as ``y``."""
    x64 = x.astype(np.float64)
    err = np.abs(y - x64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(x64 != 0, err / np.abs(x64), 0.0)
    stats = np.zeros((1, N_STATS))
    stats[0, [STAT_MAX_ABS, STAT_MAX_REL, STAT_SUM_SQ_ERR, STAT_SUM_SQ, STAT_NONZERO]] = (
        err.max(initial=0.0), rel.max(initial=0.0), np.dot(err, err), np.dot(x64, x64), nonzero)
    return stats


class StepEncoder:
    """Codes the chunks of one save and keeps the reconstruction a reader will have.

    Args:
        captured: the state being saved.
        config: the compression config.
        base: reconstruction of the previous save for a delta step, or
            ``None`` for a full step.
        in_place: whether a delta writes its running values into ``base``'s
            arrays (its last use) or into arrays of its own, leaving them as
            they are for the later deltas coded against them too.
        controller: meets ``config.target_ratio`` from save to save.
        local: under torch.distributed, the part of each tensor this rank
            writes (its one fragment), by name; the encoder codes and keeps
            the running values of these alone. Default: every tensor whole.
    """

    def __init__(self, captured: CapturedState, config: CompressionConfig,
                 base: Reconstruction | None, controller: ScaleController | None, *,
                 keep: bool = True, in_place: bool = True,
                 local: dict[str, torch.Tensor] | None = None) -> None:
        self.config, self.base, self.controller, self.keep = config, base, controller, keep
        self.local = local if local is not None else {
            t.name: t.tensor for t in captured.tensors if t.alias_of is None}
        self.layout = captured_layout(captured, self.local)
        self.scale = 1.0
        self.estimated_bits: float | None = None
        self._lock = threading.Lock()
        self._stats: dict[str, _ClassStats] = {}
        self._errors: dict[str, float] = {}  # summed squared error per tensor
        self._plans: dict[str, _Plan] = {}
        self._numel: dict[str, int] = {}
        # Running values: numpy arrays, or float32 tensors for tensors coded on a device. The
        # base's are what a delta codes against, its own what it writes (:meth:`running`).
        self._base_values: dict[str, np.ndarray | torch.Tensor] = {} if base is None \
            else base.values
        self._values = self._base_values if in_place else {}
        self._digests: dict[tuple[str, int], tuple[int, str]] = {}  # Reconstruction.digests
        self._kept: dict[tuple[str, int], np.ndarray] = {}  # Reconstruction.kept
        # Chunks coded before the write (on a device, :mod:`deltackpt.encode.device`), by
        # (tensor, raw offset): what finishes each, as this encoder's __call__ returns
        self.coded_before: dict[tuple[str, int], Callable[[], tuple[EncodedChunk,
                                                                    np.ndarray | PendingDigest]]] = {}
        # What bitsandbytes' 8-bit moments mean: their dequantized values, by name
        self._dequantized: dict[str, np.ndarray] = {}
        self._plan(captured)

    @property
    def is_delta(self) -> bool:
        """Whether this save is a delta step."""
        return self.base is not None

    def _plan(self, captured: CapturedState) -> None:
        """How each tensor this process writes is coded, and with which step."""
        self._check_overrides(captured)
        meanings = self._meanings(captured)
        samples, fixed = [], 0  # fixed: bytes stored exactly, whatever the steps
        for item in captured.tensors:
            tensor = self.local.get(item.name)
            if tensor is None:  # an alias, or a tensor another rank writes
                continue
            plan = self._plan_coding(item, tensor, meanings)
            if plan.cast_of is not None:
                continue
            if plan.quantizer.exact or not self.is_delta:
                fixed += self._exact_size(item, tensor, spec_for(tensor.dtype, item.name))
                continue
            samples.append(self._plan_step(item, tensor, plan, meanings))
        for name, plan in list(self._plans.items()):
            if plan.bnb is not None:  # its absmax is derived from its running values
                self._plans[plan.bnb.absmax].absmax_of = name
        self._choose_scale(samples, fixed)

    def _meanings(self, captured: CapturedState) -> _Meanings:
        """What the optimizer state of ``captured`` means, read once for every tensor."""
        bnb_moments = captured_bnb_states(captured)
        states = state_by_parameter(captured, bnb_moments)
        self.unknown_state_keys = unknown_state_keys(captured, states)
        roles = state_meanings(captured, bnb_moments)
        bnb = self._bnb8(captured, bnb_moments)
        qmaps = {b.qmap: self.is_delta and b.qmap in self._base_values and np.array_equal(
            self._base_values[b.qmap], self.local[b.qmap].reshape(-1).cpu().numpy())
            for b, _ in bnb.values()}
        centred = _centred(captured, roles, self.local)
        return _Meanings(
            roles, movement_units(captured, states) if self.is_delta else {},
            master_copies(captured) if self.is_delta else {}, bnb, qmaps,
            self._scales(captured, roles, bnb, states, centred) if self.is_delta else {},
            centred, sign_memories(captured) if self.is_delta else {})

    def _plan_coding(self, item: CapturedTensor, tensor: torch.Tensor,
                     meanings: _Meanings) -> _Plan:
        """The tensor's class and quantizer in this save: lossy as the config says, or exact
        where a delta cannot code it against its base, or a cast of its master copy."""
        spec = spec_for(tensor.dtype, item.name)
        numel = tensor.numel()
        bnb, qmaps = meanings.bnb, meanings.qmaps
        cls = tensor_class(item.role, meanings.roles.get(item.name, item.state_key),
                           spec_named("float32") if item.name in bnb else spec, numel)
        quantizer = self.config.quantizer_for(item.name, item.fqn, cls) if cls else Quantizer(
            exact=True)
        plan = self._plans[item.name] = _Plan(cls, quantizer, not quantizer.exact)
        self._numel[item.name] = numel
        if item.name in qmaps:  # kept, so that an unchanged one costs nothing in a delta
            plan.lossy = True
            plan.unchanged = qmaps[item.name]
        if item.name in bnb and not quantizer.exact:
            self._dequantized[item.name] = bnb[item.name][1]
            if self.is_delta and not (item.name in self._base_values
                                      and qmaps[bnb[item.name][0].qmap]):
                # No running values to code against (a base from before 1.6), or its code
                # map changed (bnb8 chunks keep it along the chain): stored exactly.
                plan.quantizer = Quantizer(exact=True)
        master = meanings.masters.get(item.name)
        if master is not None and not quantizer.exact and self.is_delta:
            if torch.equal(tensor, self.local[master].to(tensor.dtype)):
                plan.cast_of = master
                return plan
            # Changed apart from its master: stored exactly, so that no later delta needs
            # the running value a cast gave it.
            plan.quantizer = Quantizer(exact=True)
        plan.centres = meanings.centred.get(item.name)
        if plan.centres is not None and not (item.name in meanings.scales
                                             and quantizer.update_step is not None):
            # Its error is bounded through the variance it centres (policy.centred_steps),
            # which takes steps scaled by square_avg's running values: else stored exactly.
            plan.quantizer = Quantizer(exact=True)
        if self.is_delta and quantizer.pred == "base" and item.name in self.base.scaled:
            # The base step's value came from a scaled chunk, which no delta may code against
            # (FORMAT.md 3.2): stored exactly once.
            plan.quantizer = Quantizer(exact=True)
        return plan

    def _plan_step(self, item: CapturedTensor, tensor: torch.Tensor, plan: _Plan,
                   meanings: _Meanings) -> tuple[np.ndarray | None, int, _Plan, bool]:
        """The step of a tensor a delta codes lossily (``plan.step``), from a strided sample of
        it where its quantizer's bounds or the target ratio need one; returns the sample (in
        units of each element's step where they vary), its element count, its plan and whether
        its domain is ordinal, for :meth:`_choose_scale`."""
        quantizer, numel = plan.quantizer, tensor.numel()
        plan.bnb = meanings.bnb[item.name][0] if item.name in meanings.bnb else None
        ordinal = quantizer.domain == "ordinal"
        plan.pred = quantizer.pred == "base"
        unit = meanings.units.get(item.fqn) if plan.cls == "weights" else None
        if quantizer.dithers and (not plan.pred or self.base.deltas == 0 or self.base.resumed):
            # Coded against the base, the grid is shifted in the first delta on values
            # training holds exactly (a full step, or a load) and stays shifted; coded from
            # zero, in every delta. One seed per tensor and base step.
            plan.dither = zlib.crc32(f"{self.base.step}/{item.name}".encode())
        plan.scale = meanings.scales.get(item.name) if quantizer.update_step is not None else None
        centred = plan.centres is not None
        shaped = plan.scale is not None and not centred and plan.bnb is None
        shaping = 1.0
        sample, value_rms = None, None
        if self.controller is not None or centred or shaped or (
                plan.scale is None and needs_sample(quantizer, unit)):
            stride = sample_stride(numel)
            xs = strided_sample(self._dequantized[item.name] if plan.bnb is not None else tensor,
                                stride)
            value_rms = finite_rms(xs)
            if self.controller is not None or centred or needs_residuals(quantizer, unit):
                ps = strided_sample(self._base_values[item.name], stride) if plan.pred else None
                sample = sample_values(xs, ps, ordinal)
            if plan.scale is not None:
                # The scale will be this save's reconstruction of exp_avg_sq, which moves
                # only where exp_avg_sq moved by more than its step: the base's is closer
                # to it than exp_avg_sq itself. A grad_avg's bound is on the variance of this
                # save: against this save's square_avg (which its square never exceeds). A
                # shape holds its count of symbols against this save's exp_avg_sq: against the
                # base's, 20 steps old at beta2 0.95, GPT 0.12M's first moments coded 13% more
                # nonzero symbols than unshaped steps (docs/fidelity.md).
                source, eps, _ = plan.scale
                now = strided_sample(self.local[source], stride) if centred or shaped else None
                if shaped:
                    plan.floor, shaping, units = shaped_steps(xs, now, eps)
                else:
                    v = now if centred else strided_sample(self._base_values[source], stride)
                    units = np.sqrt(np.maximum(v, 0)) + eps
                if sample is not None:  # in units of each element's step over plan.step
                    sample /= units
        if centred:
            second = self.config.quantizer_for(plan.centres, item.fqn, "second_moment")
            plan.step, _ = centred_steps(second.step, sample)  # for the scale; set once scaled
            plan.centred_sample = sample
            if plan.step <= 0:
                plan.quantizer = Quantizer(exact=True)
        elif plan.scale is not None:
            plan.step = quantizer.update_step * plan.scale[2] * shaping
        else:
            carried = self.base.errors.get(item.name, 0.0) if plan.pred else 0.0
            plan.step = base_step(
                quantizer, sample, carried, unit, value_rms,
                momentum=meanings.roles.get(item.name) in MOMENTUM_BUFFERS,
                sign_memory=meanings.sign_memories.get(item.fqn)
                if plan.cls == "first_moment" else None)
            if plan.step <= 0:  # nothing moved: a dither would move what stays put
                plan.dither = None
        return sample, numel, plan, ordinal

    def _choose_scale(self, samples: list[tuple[np.ndarray | None, int, _Plan, bool]],
                      fixed: int) -> None:
        """Scale every lossy tensor's step by one factor, the target-ratio controller's choice
        from the samples' entropy (1 without a target), and finalize the steps."""
        if samples and self.controller is not None:
            raw = sum(t.numel() * t.element_size() for t in self.local.values())
            self.scale, self.estimated_bits = self.controller.choose(
                [(Sample(s, None if plan.dither is None else numpy_dither(
                    s.size, plan.dither, stride=sample_stride(n)), ordinal), plan.step, n)
                 for s, n, plan, ordinal in samples], raw, fixed)
        for _, _, plan, ordinal in samples:
            plan.step = finalize_step(plan.step * self.scale, ordinal)
        self._guard_variances()

    def _guard_variances(self) -> None:
        """Keep centered RMSprop's restored variance ``square_avg - grad_avg**2`` positive and
        within the second moment's bound, at this save's scale: set each lossy ``grad_avg``'s
        step and its ``square_avg``'s from that scaled bound (:func:`centred_steps`: scaling
        the two apart breaks it), and give the ``grad_avg`` the least its variance may shrink
        to, the lower edge of ``square_avg``'s error band (its chunks that miss it are stored
        exactly); store a ``square_avg`` exactly in this save where its step could restore it
        below some element's ``grad_avg**2`` (gradients that hardly vary)."""
        for name, plan in self._plans.items():
            second = self._plans.get(plan.centres) if plan.centres is not None else None
            if second is None or second.quantizer.exact or not self.is_delta:
                continue
            if not plan.quantizer.exact:
                step, binades = centred_steps(second.step / BINADE_KEYS, plan.centred_sample)
                plan.step = finalize_step(step, False)
                second.step = finalize_step(binades * BINADE_KEYS, True)
                plan.variance_floor = ordinal_floor(second.step)
            g, v = self.local[name].detach().float(), self.local[plan.centres].detach().float()
            # in float32, as torch's RMSprop (the margin covers rounding to a 16-bit dtype)
            if bool((g * g > v * (ordinal_floor(second.step) * (1 - 2.0 ** -7))).any()):
                second.quantizer = Quantizer(exact=True)

    def _check_overrides(self, captured: CapturedState) -> None:
        """Refuse override patterns that match no tensor of the state: a misspelt pattern would
        otherwise leave the tensors it meant coded as their class says, silently."""
        unmatched = set(self.config.overrides)
        for item in captured.tensors:
            pattern = self.config.override_for(item.name, item.fqn) if unmatched else None
            unmatched.discard(pattern)
        if unmatched:
            raise ConfigError(f"compression override pattern(s) {sorted(unmatched)} match no "
                              f"tensor of the state (names look like 'model/<fqn>' and "
                              f"'optimizer/state/<fqn>/<key>', or the FQN alone)")

    def _bnb8(self, captured: CapturedState, states: dict[str, BnbState],
              ) -> dict[str, tuple[BnbState, np.ndarray]]:
        """``name -> (state, dequantized values)`` of the bitsandbytes 8-bit moments (of the
        capture's ``states``) this process holds whole, with their ``absmax`` and ``qmap``, and
        whose values are finite (others are stored as their bytes: a moment split between
        ranks, or one no 8-bit state can hold)."""
        out = {}
        captured_tensors = captured.by_name()
        for name, b in states.items():
            parts = [self.local.get(n) for n in (name, b.absmax, b.qmap)]
            if b.is_8bit and all(p is not None and p.numel() == captured_tensors[n].numel()
                                 for p, n in zip(parts, (name, b.absmax, b.qmap), strict=True)):
                codes, absmax, qmap = (p.detach().reshape(-1).cpu().numpy() for p in parts)
                values = dequantize(codes, absmax, qmap, b.blocksize)
                if np.isfinite(values).all():
                    out[name] = (b, values)
        return out

    def _scales(self, captured: CapturedState, meanings: dict[str, str],
                bnb: dict[str, tuple[BnbState, np.ndarray]],
                states: dict[str, dict[str, torch.Tensor]],
                centred: dict[str, str]) -> dict[str, tuple[str, float, float]]:
        """``first moment`` name -> (name of its second moment, eps, factor), where a first
        moment can be coded relative to the second: both of one shape and dtype with float32
        running values (float32, bfloat16 or float16, or bitsandbytes 8-bit moments, ``bnb``),
        the second coded lossily (so its reconstruction is kept), ``eps`` positive. Coded to the
        tensor's root mean square instead, the first moment of an element whose second is
        small (a rare token's embedding row) would drive an update thousands of learning rates
        off.

        Adam's update is ``(m / c1) / (sqrt(v) / c2 + eps)`` with its bias
        corrections ``c1``, ``c2`` (:func:`adam_bias_corrections`), so an
        element's step ``update_step * factor * (sqrt(v) + eps')`` with
        ``factor = c1 / c2`` and ``eps' = eps * c2`` (float32) is
        ``update_step`` learning rates of that update, early in training too.
        Centered RMSprop's ``grad_avg`` (``centred``) is scaled by its
        ``square_avg`` with the least positive ``eps`` (factor 1; its step is
        :func:`policy.centred_steps`): the variance it centres must stay
        positive also where ``square_avg`` is zero (a parameter never used).
        """
        epsilons = group_hyperparameter(captured, "eps")
        corrections = adam_bias_corrections(captured, states)
        local = self.local
        second = {t.fqn: t.name for t in captured.tensors
                  if meanings.get(t.name) == "exp_avg_sq" and t.name in local}
        items = {t.name: t for t in captured.tensors}

        def float32_running(name: str) -> bool:
            return local[name].dtype in RUNNING_DTYPES or name in bnb

        scales = {}
        for item in captured.tensors:
            v = centred.get(item.name) or (second.get(item.fqn)
                                           if meanings.get(item.name) == "exp_avg" else None)
            if item.name not in local or v is None \
                    or not (float32_running(item.name) and float32_running(v)) \
                    or (item.name in bnb) != (v in bnb) \
                    or local[item.name].dtype != local[v].dtype \
                    or local[item.name].shape != local[v].shape:
                continue
            if item.name in centred:
                eps, factor = TINY, 1.0
            else:
                c1, c2 = corrections.get(item.fqn, (1.0, 1.0))
                eps = float(np.float32(float(np.float32(epsilons.get(item.fqn, 0.0))) * c2))
                factor = c1 / c2
            v_cls = tensor_class(items[v].role, meanings[v], spec_named("float32"),
                                 local[v].numel())
            if eps > 0 and v_cls is not None \
                    and not self.config.quantizer_for(v, items[v].fqn, v_cls).exact:
                scales[item.name] = (v, eps, factor)
        return scales

    def release_state(self) -> None:
        """Drop the references to the state's tensors, which only planning reads (the writer
        hands each chunk's bytes over): a save planned at its call then keeps no live tensor
        alive until it is written."""
        self.local = {}

    def base_values(self, name: str) -> np.ndarray | torch.Tensor:
        """The running values of tensor ``name`` in the base, which a delta codes against."""
        return self._base_values[name]

    def running(self, name: str) -> np.ndarray | torch.Tensor:
        """This save's running values of tensor ``name``: its base's arrays where it codes in
        place; else arrays of its own, made at first use like its base's (a flat float32
        array; on a device, or pinned, where those are)."""
        values = self._values.get(name)
        if values is None:
            with self._lock:
                values = self._values.get(name)
                if values is None:
                    values = self._values[name] = _empty_like(self._base_values.get(name),
                                                              self._numel[name])
        return values

    def quant_coding(self, name: str) -> QuantCoding | None:
        """How tensor ``name``'s chunks are quantized in this save; None where they are not
        (a full step, stored exactly, cast or derived from another tensor)."""
        plan = self._plans.get(name)
        if plan is None or not self.is_delta or plan.quantizer.exact or plan.cls is None \
                or plan.cast_of is not None or plan.absmax_of is not None:
            return None
        return QuantCoding(plan.quantizer.domain == "ordinal", plan.pred, plan.step,
                           self.config.block, plan.dither,
                           None if plan.scale is None else (*plan.scale[:2], plan.floor))

    def variance_check(self, name: str) -> tuple[str, float] | None:
        """For a lossy centered RMSprop ``grad_avg``: its ``square_avg`` and the least its
        variance may shrink to (:func:`shrunk_variances`), which each of its chunks must keep."""
        plan = self._plans.get(name)
        return None if plan is None or not plan.variance_floor else (plan.centres,
                                                                     plan.variance_floor)

    def quantized_as_is(self, name: str) -> QuantCoding | None:
        """:meth:`quant_coding` of a tensor whose chunks quantize its own values (not a
        bitsandbytes moment's dequantized ones, nor a code map kept when unchanged): what a
        device can code from the tensor alone."""
        plan = self._plans.get(name)
        if plan is None or plan.bnb is not None or plan.unchanged:
            return None
        return self.quant_coding(name)

    def __call__(self, record: TensorRecord, spec: DTypeSpec, raw_offset: int,
                 raw: np.ndarray) -> tuple[EncodedChunk, np.ndarray | PendingDigest]:
        coded = self.coded_before.pop((record.name, raw_offset), None)
        if coded is not None:
            return coded()
        plan = self._plans[record.name]
        lo, hi = raw_offset // spec.itemsize, (raw_offset + raw.size) // spec.itemsize
        if plan.cast_of is not None:
            return self._cast(record, plan, raw_offset, raw, lo, hi)
        if plan.absmax_of is not None:
            return self._absmax(record, plan, raw_offset, raw, lo, hi)
        if plan.unchanged:  # predicted by the base exactly: every symbol is zero
            recon = self.running(record.name)[lo:hi]
            chunk, _ = encode_quant(float32_values(raw, record.dtype),
                                    self._base_values[record.name][lo:hi], recon,
                                    ordinal=False, step=1.0, block=self.config.block)
            if chunk is not None and np.array_equal(recon.view(np.uint8), raw):
                self._count(plan, chunk, raw_offset, raw.size, hi - lo, exact=True)
                return chunk, raw
        coding = self.quant_coding(record.name)
        if coding is None:
            return self._exact(record, plan, spec, raw_offset, raw, lo, hi)
        bnb = plan.bnb
        x = self._dequantized[record.name][lo:hi] if bnb else float32_values(raw, record.dtype)
        recon = self.running(record.name)[lo:hi]
        scale = None if coding.scale is None else Scale(  # coded by now: see coded_last
            coding.scale[0], self.running(coding.scale[0])[lo:hi], *coding.scale[1:])
        pred = self._base_values[record.name][lo:hi] if coding.with_base else None
        chunk, stats = encode_quant(x, pred, recon,
                                    ordinal=coding.ordinal, step=coding.step, block=coding.block,
                                    dither=coding.dither, first=lo, scale=scale)
        check = self.variance_check(record.name)
        if chunk is not None and check is not None and shrunk_variances(
                recon, x, self.running(check[0])[lo:hi], check[1]):
            chunk = None  # a grad_avg that shrank the variance it centres too far
        if chunk is None:  # non-finite values or a change out of range: stored exactly
            recon[:] = x
            if bnb is not None:  # its running values, as a bnb8 chunk's inner chunk
                chunk = encode_state(encode_lossless(recon.view(np.uint8), spec_named("float32")),
                                     bnb.qmap, bnb.absmax, bnb.blocksize)
                self.count_exact(record.name, chunk, raw_offset, raw.size, hi - lo)
                return chunk, recon.view(np.uint8)
            chunk = encode_lossless(raw, spec)
            self.count_exact(record.name, chunk, raw_offset, raw.size, hi - lo)
            return chunk, raw
        if bnb is not None:  # its raw_xxh3 covers the running values (FORMAT.md 3.4)
            self.count_coded(record.name, chunk, raw_offset, raw.size, hi - lo, stats)
            return encode_state(chunk, bnb.qmap, bnb.absmax, bnb.blocksize), recon.view(np.uint8)
        decoded = dtype_bytes(recon, record.dtype)
        rounded = None
        if spec.itemsize < 4:  # the tensor holds its running values rounded: count that error
            rounded = _error_stats(x, float32_values(decoded, record.dtype),
                                   int(stats[:, STAT_NONZERO].sum()))
        self.count_coded(record.name, chunk, raw_offset, raw.size, hi - lo, stats, rounded)
        return chunk, decoded

    def _exact(self, record: TensorRecord, plan: _Plan, spec: DTypeSpec, raw_offset: int,
               raw: np.ndarray, lo: int, hi: int) -> tuple[EncodedChunk, PendingDigest]:
        """A chunk stored exactly (:meth:`_stored_exactly`). Returns the digest of its bytes,
        which the next delta compares with its own."""
        digest = xxhash.xxh3_64(raw)
        key, known = (record.name, raw_offset), (raw.size, digest.hexdigest())
        whole = not plan.lossy and self._numel[record.name] == record.numel
        chunk = self._stored_exactly(key, known, raw, spec, whole)
        self._keep_exact(record, plan, raw, lo, hi)
        if whole and self.keep:
            with self._lock:
                self._digests[key] = known
                if kept_for_patches(record):
                    self._kept[key] = raw.copy()
        self.count_exact(record.name, chunk, raw_offset, raw.size, hi - lo)
        return chunk, digest

    def _stored_exactly(self, key: tuple[str, int], known: tuple[int, str], raw: np.ndarray,
                        spec: DTypeSpec, whole: bool) -> EncodedChunk:
        """The chunk ``key`` (tensor, raw offset) of bytes ``raw`` (``known``: their length
        and digest) stored exactly. Where the tensor has no running values and this process
        writes it ``whole`` (a tensor sharded over ranks may be scaled in another rank's part,
        and no chunk of a scaled tensor is coded against its base): as ``unchanged`` (nothing)
        if the base step restores the very same bytes (FORMAT.md 3.5), else as a ``patch`` on
        the base's bytes (3.6) where the base kept them and that is smaller; else losslessly."""
        if whole and self.is_delta:
            if self.base.digests.get(key) == known:
                return encode_unchanged()
            kept = self.base.kept.get(key)
            if kept is not None and kept.size == raw.size:
                return min(encode_patch(raw, kept, spec.integer), encode_lossless(raw, spec),
                           key=lambda c: c.length)
        return encode_lossless(raw, spec)

    def _exact_size(self, item: CapturedTensor, tensor: torch.Tensor, spec: DTypeSpec) -> int:
        """The bytes a tensor stored exactly is expected to take, for the target ratio: its
        raw size; for the controller's first delta, where the base kept the tensor's bytes,
        those of the chunk it will store (an RNG state's patch takes tens of its kilobytes)."""
        size = tensor.numel() * spec.itemsize
        kept = self.base.kept.get((item.name, 0)) if self.is_delta else None
        if kept is None or kept.size != size or self.controller is None \
                or self.controller.exact_bytes is not None:
            return size
        raw = raw_bytes(tensor)
        return self._stored_exactly((item.name, 0), (size, xxhash.xxh3_64_hexdigest(raw)), raw,
                                    spec, whole=True).length

    def count_coded(self, name: str, chunk: EncodedChunk, raw_offset: int, raw_bytes: int,
                    elements: int, stats: np.ndarray, rounded: np.ndarray | None = None) -> None:
        """Account a quant-coded chunk of tensor ``name`` with the kernels' block statistics
        ``stats``: its squared error in the running values (carried into the next delta's
        steps) and its class's statistics, of the values restored (``rounded``, for a tensor of
        a 16-bit dtype: those of the running values rounded to it, one row)."""
        error = float(stats[:, STAT_SUM_SQ_ERR].sum())
        with self._lock:
            self._errors[name] = self._errors.get(name, 0.0) + error
        self._count(self._plans[name], chunk, raw_offset, raw_bytes, elements,
                    stats=stats if rounded is None else rounded)

    def count_exact(self, name: str, chunk: EncodedChunk, raw_offset: int, raw_bytes: int,
                    elements: int) -> None:
        """Account a chunk of tensor ``name`` stored exactly."""
        self._count(self._plans[name], chunk, raw_offset, raw_bytes, elements, exact=True)

    def _cast(self, record: TensorRecord, plan: _Plan, raw_offset: int, raw: np.ndarray,
              lo: int, hi: int) -> tuple[EncodedChunk, np.ndarray]:
        """A chunk of a 16-bit parameter taken from its master's reconstruction, which
        :func:`writer.write_data` has finished before (``coded_last``)."""
        decoded = dtype_bytes(host_array(self.running(plan.cast_of)[lo:hi]), record.dtype)
        x, y = float32_values(raw, record.dtype), float32_values(decoded, record.dtype)
        stats = _error_stats(x, y, int(np.count_nonzero(y != x)))
        chunk = encode_cast(plan.cast_of)
        self._keep_exact(record, plan, decoded, lo, hi)
        self._count(plan, chunk, raw_offset, raw.size, hi - lo, stats=stats)
        return chunk, decoded

    def _absmax(self, record: TensorRecord, plan: _Plan, raw_offset: int, raw: np.ndarray,
                lo: int, hi: int) -> tuple[EncodedChunk, np.ndarray]:
        """A chunk of the ``absmax`` of a bnb8-coded moment: derived from the moment's running
        values, coded before (``coded_last``)."""
        blocksize = self._plans[plan.absmax_of].bnb.blocksize
        values = self.running(plan.absmax_of)[lo * blocksize : hi * blocksize]
        decoded = block_absmax(values, blocksize).view(np.uint8)
        chunk = encode_absmax(plan.absmax_of)
        self._count(plan, chunk, raw_offset, raw.size, hi - lo, exact=True)
        return chunk, decoded

    @property
    def coded_last(self) -> dict[str, int]:
        """``name -> phase`` of the tensors whose chunks are coded from other tensors'
        reconstruction (casts of master copies, first moments scaled by second ones: 1; the
        ``absmax`` of a bnb8-coded moment: one after the moment's):
        :func:`writer.write_data` codes each phase after the ones before."""
        phases = {name: 1 for name, plan in self._plans.items()
                  if plan.cast_of is not None or plan.scale is not None}
        for name, plan in self._plans.items():
            if plan.absmax_of is not None:
                phases[name] = phases.get(plan.absmax_of, 0) + 1
        return phases

    def _keep_exact(self, record: TensorRecord, plan: _Plan, raw: np.ndarray, lo: int,
                    hi: int) -> None:
        """Record the running values of a tensor's chunk stored exactly (or cast): later deltas
        may code against them."""
        if not plan.lossy or not self.keep:
            return
        values = self.running(record.name)
        dequantized = self._dequantized.get(record.name)  # a bitsandbytes 8-bit moment's
        exact = dequantized[lo:hi] if dequantized is not None else float32_values(raw,
                                                                                   record.dtype)
        if isinstance(values, np.ndarray):
            values[lo:hi] = exact
        else:  # kept on a device
            values[lo:hi].copy_(torch.from_numpy(exact))

    def _count(self, plan: _Plan, chunk: EncodedChunk, raw_offset: int, raw_bytes: int,
               elements: int, *, exact: bool = False, stats: np.ndarray | None = None) -> None:
        key = plan.cls if plan.cls is not None and not plan.quantizer.exact else "exact"
        # the chunk's sums and maxima over its blocks, outside the lock the threads share
        totals, peaks = (stats.sum(axis=0), stats.max(axis=0)) if stats is not None else (None, None)
        with self._lock:
            c = self._stats.setdefault(key, _ClassStats())
            c.tensors += raw_offset == 0
            c.elements += elements
            c.raw_bytes += raw_bytes
            c.stored_bytes += chunk.length
            if exact:
                c.exact_elements += elements
            if totals is not None:
                c.nonzero += int(totals[STAT_NONZERO])
                c.max_abs_error = max(c.max_abs_error, float(peaks[STAT_MAX_ABS]))
                if plan.quantizer.domain == "ordinal":
                    c.max_rel_error = max(c.max_rel_error or 0.0, float(peaks[STAT_MAX_REL]))
                c.sum_sq_err += float(totals[STAT_SUM_SQ_ERR])
                c.sum_sq += float(totals[STAT_SUM_SQ])

    @property
    def class_stats(self) -> dict[str, _ClassStats]:
        """The error statistics of this process's chunks, per tensor class."""
        return self._stats

    def summary(self, ranks: list[dict[str, _ClassStats]] | None = None) -> dict:
        """What the step's ``stats`` record: per-class statistics and, for a delta, the config.

        ``ranks``: every rank's :attr:`class_stats` in a distributed save,
        merged into the step's (default: this process's alone).
        """
        merged: dict[str, _ClassStats] = {}
        for stats in ranks if ranks is not None else [self._stats]:
            for key, c in stats.items():
                merged.setdefault(key, _ClassStats()).merge(c)
        out: dict = {"classes": {k: v.as_json() for k, v in sorted(merged.items())}}
        if self.is_delta:
            compression = self.config.describe()
            compression["scale"] = self.scale
            # classes with no lossy chunk in any rank (stored exactly throughout) cost nothing
            expected = expected_steps(self.config, self.scale, [c for c in merged if c in CLASSES])
            if expected is not None:
                compression["expected_steps"] = expected
            if self.controller is not None:
                compression["at_max_error"] = self.controller.at_floor
            if self.unknown_state_keys:
                compression["exact_state_keys"] = self.unknown_state_keys
            out["compression"] = compression
        return out

    def reconstruction(self, step: int, save_id: str) -> Reconstruction | None:
        """The reconstruction a reader has after this save, once it is committed."""
        if not self.keep:
            return None
        deltas = self.base.deltas + 1 if self.base is not None else 0
        errors = {name: total / self._numel[name] for name, total in self._errors.items()}
        chain = (self.base.chain if self.base is not None else []) + [step]
        scaled = frozenset(name for name, plan in self._plans.items() if plan.scale is not None)
        return Reconstruction(step, deltas, self.layout, self._values, save_id, errors, chain,
                              scaled=scaled, digests=self._digests, kept=self._kept)

    def learn(self) -> None:
        """Tell the target-ratio controller what this save stored."""
        if self.controller is not None and self.estimated_bits is not None:
            exact = self._stats.get("exact")
            coded = sum(c.stored_bytes for k, c in self._stats.items() if k != "exact")
            self.controller.update(self.estimated_bits, coded, exact.stored_bytes if exact else 0)
