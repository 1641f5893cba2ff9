"""What optimizer state means: the knowledge the delta codec needs to bound its errors.

A lossy delta is only as good as the unit its error is measured in. This
module reads a captured optimizer (its state keys and param-group
hyperparameters) and says:

* which state tensors are first moments (``exp_avg``, ``momentum_buffer``)
  and which are second moments (``exp_avg_sq``, ``max_exp_avg_sq``,
  ``square_avg``, ``sum``); any other float state is of unknown meaning and
  stored exactly (:func:`unknown_state_keys`);
* how far the optimizer moves each parameter in one training step
  (:func:`movement_units`), the unit of a weight's error.

State is recognized by its keys, as torch's optimizers name it (Adam,
AdamW, NAdam, RAdam, AMSGrad, RMSprop, Adagrad, SGD); another optimizer that
uses the same keys means the same by them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.distributed import local_values

if TYPE_CHECKING:
    import torch

    from deltackpt.state import CapturedState

FIRST_MOMENTS = frozenset({"exp_avg", "momentum_buffer"})
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
KNOWN_KEYS = FIRST_MOMENTS | SECOND_MOMENTS | set(MASTER_KEYS) | {"step"}
SAMPLE_ELEMENTS = 8192  # elements sampled for a root mean square


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


def state_by_parameter(captured: CapturedState) -> dict[str, dict[str, torch.Tensor]]:
    """``fqn -> {state key: tensor}`` of the optimizer's per-parameter state (under
    torch.distributed, the elements this rank holds)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for t in captured.tensors:
        if t.role == "optimizer" and t.state_key is not None and t.fqn is not None:
            out.setdefault(t.fqn, {})[t.state_key] = local_values(t.tensor)
    return out


def unknown_state_keys(captured: CapturedState) -> list[str]:
    """The optimizer state keys holding float tensors whose meaning the codec does not know
    (stored exactly in every step)."""
    return sorted({key for state in state_by_parameter(captured).values()
                   for key, tensor in state.items()
                   if key not in KNOWN_KEYS and tensor.is_floating_point() and tensor.numel() > 1})


def sampled_rms(tensor: torch.Tensor) -> float:
    """Root mean square of about SAMPLE_ELEMENTS evenly strided elements (finite ones)."""
    flat = tensor.detach().reshape(-1)
    xs = flat[:: max(1, flat.numel() // SAMPLE_ELEMENTS)].double().cpu().numpy()
    xs = xs[np.isfinite(xs)]
    return float(np.sqrt(np.mean(xs * xs))) if xs.size else 0.0


def _betas(captured: CapturedState) -> dict[str, tuple[float, float]]:
    """``fqn -> (beta1, beta2)`` of Adam-family param groups whose ``betas`` are two numbers
    in [0, 1)."""
    optimizer = captured.tree.get("optimizer")
    out: dict[str, tuple[float, float]] = {}
    for group in (optimizer or {}).get("param_groups", []):
        betas = group.get("betas")
        betas = betas.get("$tuple") if isinstance(betas, dict) else betas
        if isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            out.update((fqn, (float(betas[0]), float(betas[1]))) for fqn in group["params"])
    return out


def _count(state: dict[str, torch.Tensor]) -> float | None:
    """The number of steps the optimizer took (its ``step`` state), if it holds one."""
    step = state.get("step")
    if step is None or step.numel() != 1:
        return None
    t = float(step.item())
    return t if math.isfinite(t) and t >= 1 else None


def adam_bias_corrections(captured: CapturedState) -> dict[str, tuple[float, float]]:
    """``fqn -> (1 - beta1**t, sqrt(1 - beta2**t))`` for the parameters of an Adam-family
    optimizer after ``t`` steps: its update is ``lr * (exp_avg / c1) / (sqrt(exp_avg_sq) / c2 +
    eps)``. Parameters without ``betas`` or a step count get ``(1, 1)``."""
    betas = _betas(captured)
    out = {}
    for fqn, state in state_by_parameter(captured).items():
        if "exp_avg" not in state or "exp_avg_sq" not in state:
            continue
        t, b = _count(state), betas.get(fqn)
        out[fqn] = (1.0, 1.0) if t is None or b is None else (
            1 - b[0] ** t, math.sqrt(1 - b[1] ** t))
    return out


def _adam_update_rms(state: dict[str, torch.Tensor], corrections: tuple[float, float],
                     eps: float) -> float:
    """Root mean square of Adam's normalized update ``m_hat / (sqrt(v_hat) + eps)`` at about
    SAMPLE_ELEMENTS evenly strided elements."""
    m, v = state["exp_avg"].detach().reshape(-1), state["exp_avg_sq"].detach().reshape(-1)
    if m.shape != v.shape:
        return math.nan
    stride = max(1, m.numel() // SAMPLE_ELEMENTS)
    c1, c2 = corrections
    ms, vs = m[::stride].double().cpu().numpy(), v[::stride].double().cpu().numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        u = (ms / c1) / (np.sqrt(np.maximum(vs, 0)) / c2 + eps)
    u = u[np.isfinite(u)]
    return float(np.sqrt(np.mean(u * u))) if u.size else math.nan


def movement_units(captured: CapturedState) -> dict[str, float]:
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
      buffer's root mean square, since the update is ``lr * momentum_buffer``.

    Parameters whose optimizer says none of this (no optimizer, plain SGD, a
    learning rate of 0, no state yet) are left out.
    """
    rates = group_hyperparameter(captured, "lr")
    decays = group_hyperparameter(captured, "lr_decay")
    epsilons = group_hyperparameter(captured, "eps")
    corrections = adam_bias_corrections(captured)
    units = {}
    for fqn, state in state_by_parameter(captured).items():
        lr = rates.get(fqn)
        if lr is None:
            continue
        if fqn in corrections:
            rms = _adam_update_rms(state, corrections[fqn], epsilons.get(fqn, 0.0))
        elif "square_avg" in state and "acc_delta" not in state:
            rms = sampled_rms(state["momentum_buffer"]) if "momentum_buffer" in state else 1.0
        elif "sum" in state and _count(state) is not None:
            t = _count(state)
            rms = 1 / (1 + (t - 1) * decays.get(fqn, 0.0)) / math.sqrt(t)
        elif "momentum_buffer" in state:
            rms = sampled_rms(state["momentum_buffer"])
        else:
            continue
        if rms > 0 and math.isfinite(rms):
            units[fqn] = lr * rms
    return units
