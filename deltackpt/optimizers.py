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

if TYPE_CHECKING:  # metadata-only commands import this module without torch
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
    """``fqn -> {state key: tensor}`` of the optimizer's per-parameter state."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for t in captured.tensors:
        if t.role == "optimizer" and t.state_key is not None and t.fqn is not None:
            out.setdefault(t.fqn, {})[t.state_key] = t.tensor
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


def movement_units(captured: CapturedState) -> dict[str, float]:
    """``fqn -> how far one training step moves each element of the parameter``, where the
    optimizer says it:

    * an optimizer normalizing its updates (its state holds ``exp_avg_sq``
      or ``square_avg``: Adam, AdamW, RMSprop...): the learning rate;
    * Adagrad (``sum``): ``lr / (1 + (t - 1) * lr_decay) / sqrt(t)`` after
      ``t`` steps, the update of a gradient as large as the typical one so far;
    * SGD with momentum (``momentum_buffer`` alone): ``lr`` times the
      buffer's root mean square, since the update is ``lr * momentum_buffer``.

    Parameters whose optimizer says none of this (no optimizer, plain SGD, a
    learning rate of 0) are left out.
    """
    rates = group_hyperparameter(captured, "lr")
    decays = group_hyperparameter(captured, "lr_decay")
    units = {}
    for fqn, state in state_by_parameter(captured).items():
        lr = rates.get(fqn)
        if lr is None:
            continue
        if "exp_avg_sq" in state or ("square_avg" in state and "acc_delta" not in state):
            units[fqn] = lr  # Adam's family, RMSprop (Adadelta's square_avg scales otherwise)
        elif "sum" in state and "step" in state and state["step"].numel() == 1:
            t = max(1.0, float(state["step"].item()))
            units[fqn] = lr / (1 + (t - 1) * decays.get(fqn, 0.0)) / math.sqrt(t)
        elif "momentum_buffer" in state:
            rms = sampled_rms(state["momentum_buffer"])
            if rms > 0 and math.isfinite(rms):
                units[fqn] = lr * rms
    return units
