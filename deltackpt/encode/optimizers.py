"""What optimizer state means: the knowledge the delta codec needs to bound its errors.

A lossy delta is only as good as the unit its error is measured in. This
module reads a captured optimizer (its state keys and param-group
hyperparameters) and says:

* which state tensors are first moments (``exp_avg``, ``momentum_buffer``,
  centered RMSprop's ``grad_avg``: a running mean of the gradient, whose
  square it subtracts from ``square_avg`` to divide by the variance) and
  which are second moments (``exp_avg_sq``, ``max_exp_avg_sq``,
  ``square_avg``, ``sum``); any other float state is of unknown meaning and
  stored exactly (:func:`unknown_state_keys`);
* how far the optimizer moves each parameter in one training step
  (:func:`movement_units`), the unit of a weight's error.

State is recognized by its keys, as torch's optimizers name it (Adam,
AdamW, NAdam, RAdam, AMSGrad, RMSprop, Adagrad, SGD); another optimizer that
uses the same keys means the same by them. bitsandbytes' optimizers name
their moments ``state1`` and ``state2`` (:func:`bnb_states`): ``state1`` is
Adam's and Lion's ``exp_avg`` (SGD's ``momentum_buffer``, RMSprop's
``square_avg``, Adagrad's ``sum``), ``state2`` Adam's ``exp_avg_sq``; their
8-bit form (``uint8`` codes with ``absmax`` and ``qmap``) means its
dequantized values (:mod:`deltackpt.codecs.bnb8`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltackpt.codecs.bnb8 import BLOCKSIZES, QMAP_SIZE, dequantize
from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.dist.shards import local_values

if TYPE_CHECKING:
    from deltackpt.format.state import CapturedState

FIRST_MOMENTS = frozenset({"exp_avg", "momentum_buffer", "grad_avg"})
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
# First moments the update is a multiple of (SGD's and RMSprop's momentum): policy.Quantizer.rms_step
MOMENTUM_BUFFERS = frozenset({"momentum_buffer"})
# Lion's default beta2 (Chen et al. 2023), for param groups that state none.
LION_BETA2 = 0.99
KNOWN_KEYS = FIRST_MOMENTS | SECOND_MOMENTS | set(MASTER_KEYS) | {"step"}
SAMPLE_ELEMENTS = 8192  # elements sampled for a root mean square
BNB_WRAPPER = "__bnb_optimizer_quant_state__"  # bitsandbytes' state_dict nests its states here


@dataclass(frozen=True)
class BnbState:
    """A bitsandbytes optimizer moment (``state1``/``state2``) of parameter ``fqn`` and what it
    means (``key``: the torch state key of that moment). An 8-bit one (``uint8`` codes) also
    names its scales and code map (tensor names) and its block size; a float32 one none."""

    fqn: str
    key: str
    absmax: str | None = None
    qmap: str | None = None
    blocksize: int = 0

    @property
    def is_8bit(self) -> bool:
        return self.absmax is not None


def _bnb_key(slot: str, optimizer_class: str) -> str:
    """The torch state key a bitsandbytes ``state1``/``state2`` means in ``optimizer_class``."""
    if slot == "state2":
        return "exp_avg_sq"
    for prefix, key in (("RMSprop", "square_avg"), ("Adagrad", "sum"), ("SGD", "momentum_buffer")):
        if optimizer_class.startswith(prefix):
            return key
    return "exp_avg"  # Adam's family, Lion, LAMB


def bnb_states(tensors: list[tuple[str, str | None, str, tuple[int, ...]]],
               optimizer_class: str) -> dict[str, BnbState]:
    """``name -> BnbState`` of the bitsandbytes moments among ``tensors`` (``(name, fqn,
    dtype name, shape)`` of a capture or a step): ``.../state1`` and ``.../state2`` of a
    parameter, directly in its state or under bitsandbytes' ``__bnb_optimizer_quant_state__``;
    float32, or ``uint8`` with a float32 ``absmax1``/``absmax2`` of one value per block (a power
    of two from 64 to 4096 elements) and a 256-entry ``qmap1``/``qmap2`` beside it."""
    by_name = {name: (dtype, tuple(shape)) for name, _, dtype, shape in tensors}
    out = {}
    for name, fqn, dtype, shape in tensors:
        prefix, _, slot = name.rpartition("/")
        if fqn is None or slot not in ("state1", "state2") or not prefix.startswith("optimizer/state/"):
            continue
        key = _bnb_key(slot, optimizer_class)
        if dtype == "float32":
            out[name] = BnbState(fqn, key)
            continue
        absmax, qmap = f"{prefix}/absmax{slot[-1]}", f"{prefix}/qmap{slot[-1]}"
        numel = math.prod(shape)
        if dtype != "uint8" or by_name.get(qmap) != ("float32", (QMAP_SIZE,)) \
                or by_name.get(absmax, ("",))[0] != "float32" or len(by_name[absmax][1]) != 1:
            continue
        blocks = [b for b in BLOCKSIZES if -(-numel // b) == by_name[absmax][1][0]]
        if numel and blocks:
            out[name] = BnbState(fqn, key, absmax, qmap, blocks[0])
    return out


def captured_bnb_states(captured: CapturedState) -> dict[str, BnbState]:
    """:func:`bnb_states` of a capture (the state of its optimizer)."""
    optimizer = captured.tree.get("optimizer")
    if not optimizer:
        return {}
    return bnb_states([(t.name, t.fqn, str(t.tensor.dtype).removeprefix("torch."),
                        tuple(t.tensor.shape)) for t in captured.tensors
                       if t.role == "optimizer" and t.alias_of is None], optimizer["class"])


def state_meanings(captured: CapturedState, bnb: dict[str, BnbState] | None = None,
                   ) -> dict[str, str]:
    """``tensor name -> state key it means`` of the optimizer state tensors: a tensor stored
    under its key means that key; a bitsandbytes moment the torch key of its moment
    (``bnb``: the capture's :func:`captured_bnb_states`, if the caller has them)."""
    meanings = {t.name: t.state_key for t in captured.tensors
                if t.role == "optimizer" and t.state_key is not None
                and t.name.endswith("/" + t.state_key.replace("~", "~0").replace("/", "~1"))}
    bnb = captured_bnb_states(captured) if bnb is None else bnb
    meanings.update((name, b.key) for name, b in bnb.items())
    return meanings


def group_hyperparameter(captured: CapturedState, key: str) -> dict[str, float]:
    """``fqn -> value`` of a param-group hyperparameter (``"lr"``, ``"eps"``...), for the
    parameters of groups where it is a positive finite number (or a one-element tensor)."""
    optimizer = captured.tree.get("optimizer")
    if not optimizer:
        return {}
    by_name = {t.name: t.tensor for t in captured.tensors}
    values: dict[str, float] = {}
    for group in optimizer["param_groups"]:
        value = group.get(key)
        if isinstance(value, dict) and "$tensor" in value and by_name[value["$tensor"]].numel() == 1:
            value = float(by_name[value["$tensor"]].item())
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0:
            values.update((fqn, float(value)) for fqn in group["params"])
    return values


def state_by_parameter(captured: CapturedState, bnb: dict[str, BnbState] | None = None,
                       ) -> dict[str, dict[str, torch.Tensor]]:
    """``fqn -> {state key: tensor}`` of the optimizer's per-parameter state (under
    torch.distributed, the elements this rank holds). bitsandbytes' moments appear under the
    keys they mean; an 8-bit one dequantized at about SAMPLE_ELEMENTS evenly strided elements
    (what every use here samples), its scales and code map not at all. ``bnb``: the
    capture's :func:`captured_bnb_states`, if the caller has them."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    bnb = captured_bnb_states(captured) if bnb is None else bnb
    parts = {b.absmax for b in bnb.values()} | {b.qmap for b in bnb.values()}
    by_name = captured.by_name()
    for t in captured.tensors:
        if t.role != "optimizer" or t.state_key is None or t.fqn is None or t.name in parts:
            continue
        if t.name in bnb:
            b = bnb[t.name]
            values = local_values(t.tensor)
            if b.is_8bit:
                stride = max(1, values.numel() // SAMPLE_ELEMENTS)
                index = np.arange(0, values.numel(), stride)
                codes = values.reshape(-1)[::stride].cpu().numpy()
                absmax = by_name[b.absmax].reshape(-1).cpu().numpy()[index // b.blocksize]
                values = torch.from_numpy(dequantize(codes, absmax, by_name[b.qmap].cpu().numpy(), 1))
            out.setdefault(t.fqn, {})[b.key] = values
        else:
            out.setdefault(t.fqn, {})[t.state_key] = local_values(t.tensor)
    return out


def unknown_state_keys(captured: CapturedState,
                       states: dict[str, dict[str, torch.Tensor]] | None = None) -> list[str]:
    """The optimizer state keys holding float tensors whose meaning the codec does not know
    (stored exactly in every step). ``states``: the capture's :func:`state_by_parameter`,
    if the caller has it."""
    states = state_by_parameter(captured) if states is None else states
    return sorted({key for state in states.values()
                   for key, tensor in state.items()
                   if key not in KNOWN_KEYS and tensor.is_floating_point() and tensor.numel() > 1})


def finite_rms(values: np.ndarray) -> float | None:
    """Root mean square of the finite elements of ``values`` (None if there are none)."""
    finite = np.isfinite(values)
    xs = (values if finite.all() else values[finite]).astype(np.float64, copy=False)
    return float(np.sqrt(np.mean(xs * xs))) if xs.size else None


def _sampled(tensor: torch.Tensor) -> np.ndarray:
    """About SAMPLE_ELEMENTS evenly strided elements of ``tensor`` as float64 (exact): through
    numpy for a float32 tensor in CPU memory, a few microseconds less than torch's cast."""
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // SAMPLE_ELEMENTS)]
    if sample.dtype == torch.float32 and sample.device.type == "cpu":
        return sample.numpy().astype(np.float64)
    return sample.double().cpu().numpy()


def sampled_rms(tensor: torch.Tensor) -> float:
    """Root mean square of about SAMPLE_ELEMENTS evenly strided elements (finite ones)."""
    return finite_rms(_sampled(tensor)) or 0.0


def _betas(captured: CapturedState) -> dict[str, tuple[float, float]]:
    """``fqn -> (beta1, beta2)`` of Adam-family (and Lion) param groups whose ``betas`` are two
    numbers in [0, 1)."""
    optimizer = captured.tree.get("optimizer")
    out: dict[str, tuple[float, float]] = {}
    for group in (optimizer or {}).get("param_groups", []):
        betas = group.get("betas")
        betas = betas.get("$tuple") if isinstance(betas, dict) else betas
        if isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            out.update((fqn, (float(betas[0]), float(betas[1]))) for fqn in group["params"])
    return out


def _counts(captured: CapturedState) -> dict[str, float]:
    """``fqn -> the number of steps the optimizer took`` from its ``step`` state, a one-element
    tensor or (as bitsandbytes keeps it) a number."""
    optimizer = captured.tree.get("optimizer")
    by_name = captured.by_name()
    out = {}
    for fqn, state in (optimizer or {}).get("state", {}).items():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, dict) and "$tensor" in step:
            tensor = by_name[step["$tensor"]]
            step = float(local_values(tensor).item()) if tensor.numel() == 1 else None
        if isinstance(step, (int, float)) and not isinstance(step, bool) \
                and math.isfinite(step) and step >= 1:
            out[fqn] = float(step)
    return out


def adam_bias_corrections(captured: CapturedState,
                          states: dict[str, dict[str, torch.Tensor]] | None = None,
                          counts: dict[str, float] | None = None,
                          ) -> dict[str, tuple[float, float]]:
    """``fqn -> (1 - beta1**t, sqrt(1 - beta2**t))`` for the parameters of an Adam-family
    optimizer after ``t`` steps: its update is ``lr * (exp_avg / c1) / (sqrt(exp_avg_sq) / c2 +
    eps)``. Parameters without ``betas`` or a step count get ``(1, 1)``. ``states`` and
    ``counts``: the capture's :func:`state_by_parameter` and step counts, if the caller has
    them."""
    states = state_by_parameter(captured) if states is None else states
    betas, counts = _betas(captured), _counts(captured) if counts is None else counts
    out = {}
    for fqn, state in states.items():
        if "exp_avg" not in state or "exp_avg_sq" not in state:
            continue
        t, b = counts.get(fqn), betas.get(fqn)
        out[fqn] = (1.0, 1.0) if t is None or b is None else (
            1 - b[0] ** t, math.sqrt(1 - b[1] ** t))
    return out


def _adam_update_rms(state: dict[str, torch.Tensor], corrections: tuple[float, float],
                     eps: float) -> float:
    """Root mean square of Adam's normalized update ``m_hat / (sqrt(v_hat) + eps)`` at about
    SAMPLE_ELEMENTS evenly strided elements."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.numel() != v.numel():
        return math.nan
    c1, c2 = corrections
    ms, vs = _sampled(m), _sampled(v)
    with np.errstate(invalid="ignore", divide="ignore"):
        u = (ms / c1) / (np.sqrt(np.maximum(vs, 0)) / c2 + eps)
    rms = finite_rms(u)
    return math.nan if rms is None else rms


def movement_units(captured: CapturedState,
                   states: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
    """``fqn -> how far one training step moves the parameter`` (the root mean square over its
    elements), where the optimizer's state says it:

    * Adam's family (``exp_avg`` and ``exp_avg_sq``): ``lr`` times the root
      mean square of the bias-corrected update ``m_hat / (sqrt(v_hat) +
      eps)`` (a fraction of ``lr`` once gradients are noisy);
    * RMSprop (``square_avg``): ``lr`` times the root mean square of its
      ``momentum_buffer``, or ``lr`` without momentum (the update is
      normalized); Adadelta's ``square_avg`` means otherwise;
    * Adagrad (``sum``): ``lr / (1 + (t - 1) * lr_decay) / sqrt(t)`` after
      ``t`` steps, the update of a gradient as large as the typical one so far;
    * SGD with momentum (``momentum_buffer`` alone): ``lr`` times the
      buffer's root mean square, since the update is ``lr * momentum_buffer``;
    * Lion (an optimizer class whose name says ``Lion``, as bitsandbytes' ``Lion8bit``):
      ``lr``, since its update is the sign of a momentum.

    Parameters whose optimizer says none of this (no optimizer, plain SGD, a
    learning rate of 0, no state yet) are left out. ``states``: the capture's
    :func:`state_by_parameter`, if the caller has it.
    """
    rates = group_hyperparameter(captured, "lr")
    decays = group_hyperparameter(captured, "lr_decay")
    epsilons = group_hyperparameter(captured, "eps")
    states = state_by_parameter(captured) if states is None else states
    counts = _counts(captured)
    corrections = adam_bias_corrections(captured, states, counts)
    lion = is_lion(captured)
    units = {}
    for fqn, state in states.items():
        lr = rates.get(fqn)
        if lr is None:
            continue
        if lion:
            rms = 1.0
        elif fqn in corrections:
            rms = _adam_update_rms(state, corrections[fqn], epsilons.get(fqn, 0.0))
        elif "square_avg" in state and "acc_delta" not in state:
            rms = sampled_rms(state["momentum_buffer"]) if "momentum_buffer" in state else 1.0
        elif "sum" in state and fqn in counts:
            t = counts[fqn]
            rms = 1 / (1 + (t - 1) * decays.get(fqn, 0.0)) / math.sqrt(t)
        elif "momentum_buffer" in state:
            rms = sampled_rms(state["momentum_buffer"])
        else:
            continue
        if rms > 0 and math.isfinite(rms):
            units[fqn] = lr * rms
    return units


def is_lion(captured: CapturedState) -> bool:
    """Whether the optimizer is Lion, whose update is the sign of its momentum: a class whose
    name says ``Lion`` (lion-pytorch's ``Lion``, bitsandbytes' ``Lion8bit`` and
    ``PagedLion8bit``, Composer's ``DecoupledLionW``)."""
    optimizer = captured.tree.get("optimizer") or {}
    return "Lion" in optimizer.get("class", "")


def sign_memories(captured: CapturedState) -> dict[str, float]:
    """``fqn -> 1 - beta2`` of a Lion optimizer's parameters: how much of its momentum a step
    replaces, so that an error in it lasts about ``1 / (1 - beta2)`` steps (``beta2`` of 0.99,
    Lion's default, where a group states none). Empty for other optimizers."""
    if not is_lion(captured):
        return {}
    betas = _betas(captured)
    rates = group_hyperparameter(captured, "lr")
    return {fqn: 1 - (betas[fqn][1] if fqn in betas else LION_BETA2) for fqn in rates}


def master_copies(captured: CapturedState) -> dict[str, str]:
    """``parameter name -> master name`` of the bfloat16/float16 parameters whose optimizer
    state holds a float32 master copy of the same shape (see :mod:`deltackpt.codecs.cast`)."""
    params = {t.fqn: t for t in captured.tensors if t.role == "param" and t.alias_of is None}
    copies = {}
    for t in captured.tensors:
        param = params.get(t.fqn) if t.role == "optimizer" and t.state_key in MASTER_KEYS else None
        if param is not None and t.tensor.dtype == torch.float32 \
                and param.tensor.dtype in (torch.bfloat16, torch.float16) \
                and param.tensor.shape == t.tensor.shape:
            copies[param.name] = t.name
    return copies
