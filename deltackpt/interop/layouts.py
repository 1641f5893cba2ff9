"""How plain PyTorch checkpoints lay out a training state, in both directions.

A ``torch.save`` file or a DCP directory holds a dict: the model's state
dict, an optimizer state dict (keyed by parameter index as
``Optimizer.state_dict()`` writes it, or by FQN as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does)
and whatever else the training loop kept. This module turns such a dict into
the pieces of a :class:`~deltackpt.state.CapturedState` and back.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltackpt.errors import ConversionError

MODEL_KEYS = ("model", "state_dict", "model_state_dict")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_state_dict")
OPTIMIZER_CLASS_KEY = "optimizer_class"  # written by deltackpt's torch and DCP exports
TORCH_FILE = "checkpoint.pt"  # the file of deltackpt's torch export


@dataclass
class Parts:
    """A training state as values: what :func:`deltackpt.state.capture_values` takes."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    extra: Any
    step: int | None


def weights_only_loadable(value: Any) -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as Python scalars.

    ``torch.load(weights_only=True)`` refuses numpy objects; everything else
    a checkpoint's state can hold (docs/FORMAT.md 2.5) it loads as is.
    """
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {weights_only_loadable(k): weights_only_loadable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(weights_only_loadable(v) for v in value)
    return value


def native_optimizer(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A torch ``Optimizer.state_dict()`` from an FQN-keyed optimizer tree.

    Parameters are numbered in the saved group order, as ``state_dict()``
    does; each group also lists its parameters' FQNs as ``param_names``, so
    :func:`fqn_optimizer` can name them again.
    """
    index: dict[str, int] = {}
    groups = []
    for group in saved["param_groups"]:
        start = len(index)
        index.update((fqn, start + i) for i, fqn in enumerate(group["params"]))
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": list(range(start, start + len(group["params"]))),
                       "param_names": list(group["params"])})
    state = {index[fqn]: value for fqn, value in saved["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def fqn_optimizer(sd: Any, class_name: str | None, origin: str) -> dict[str, Any]:
    """The optimizer tree ``{"class", "param_groups", "state"}`` (state by FQN) of an optimizer
    state dict in either layout; ``class_name`` None: recognized from the hyperparameters.

    An index-keyed state dict needs ``param_names`` in every group to name
    its parameters (torch writes them for optimizers built from
    ``named_parameters()``; deltackpt's torch export writes them too).
    ``origin`` names the file in errors.
    """
    if not isinstance(sd, Mapping) or not isinstance(sd.get("param_groups"), list):
        raise ConversionError(f"{origin}: the optimizer entry is not an optimizer state dict "
                              "(no 'param_groups' list)")
    state = sd.get("state", {})  # DCP drops an empty dict
    groups, names = [], {}
    for g, group in enumerate(sd["param_groups"]):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, list):
            raise ConversionError(f"{origin}: optimizer param group {g} has no 'params' list")
        if all(isinstance(p, str) for p in params):
            fqns = params
            hyper = {k: v for k, v in group.items() if k != "params"}
        elif "param_names" in group and len(group["param_names"]) == len(params):
            fqns = list(group["param_names"])
            names.update(zip(params, fqns, strict=True))
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        else:
            raise ConversionError(
                f"{origin}: optimizer param group {g} lists its parameters by index "
                f"({params[:4]}{'...' if len(params) > 4 else ''}) without 'param_names', so they "
                "cannot be named; save the optimizer with get_optimizer_state_dict (state by FQN) "
                "or build it from model.named_parameters()")
        groups.append({**hyper, "params": list(fqns)})
    by_fqn = {}
    for key, value in state.items():
        # DCP turns the integer keys of an index-keyed state into strings
        index = int(key) if isinstance(key, str) and key.isdigit() and names else key
        fqn = names.get(index, key) if names else key
        if not isinstance(value, Mapping):
            raise ConversionError(f"{origin}: optimizer state of {fqn!r} is a "
                                  f"{type(value).__qualname__}, not a dict")
        by_fqn[fqn] = dict(value)
    if class_name is None:
        class_name = optimizer_class(groups)
        if class_name is None:
            keys = sorted(k for g in groups[:1] for k in g if k != "params")
            raise ConversionError(
                f"{origin}: the optimizer's class is not recorded and its hyperparameters {keys} "
                "match no single torch.optim class; name it (optimizer_class=, --optimizer-class)")
    if not isinstance(class_name, str):
        raise ConversionError(f"{origin}: the optimizer's recorded class {class_name!r} is not a name")
    return {"class": class_name, "param_groups": groups, "state": by_fqn}


@functools.cache
def _torch_optimizer_defaults() -> dict[str, dict[str, Any]]:
    """The default param group of every ``torch.optim`` optimizer that builds on one 2-D parameter."""
    defaults = {}
    for name in torch.optim.__all__:
        cls = getattr(torch.optim, name)
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer) \
                or cls is torch.optim.Optimizer:
            continue
        try:
            group = cls([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
        except (TypeError, ValueError, RuntimeError):  # needs arguments or parameters we lack
            continue
        defaults[cls.__qualname__] = {k: v for k, v in group.items() if k != "params"}
    return defaults


def optimizer_class(param_groups: list[Mapping[str, Any]]) -> str | None:
    """The ``torch.optim`` class whose param groups have exactly these hyperparameter names, or None.

    Adam and AdamW share their names and differ in ``decoupled_weight_decay``.
    """
    if not param_groups:
        return None
    group = param_groups[0]
    keys = {k for k in group if k not in ("params", "param_names")}
    matches = [name for name, d in _torch_optimizer_defaults().items() if set(d) == keys]
    if len(matches) > 1 and "decoupled_weight_decay" in keys:
        matches = [name for name in matches if _torch_optimizer_defaults()[name][
            "decoupled_weight_decay"] == group["decoupled_weight_decay"]]
    return matches[0] if len(matches) == 1 else None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def guess_buffers(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any] | None) -> set[str]:
    """The FQNs of ``model`` that are probably buffers, for formats that do not record it.

    With an optimizer, the tensors it does not list (nor share storage with
    one it lists, as a tied weight does); without one, the tensors that are
    not floating point or complex. Only informative: a parameter and a
    buffer are stored, compressed and loaded alike.
    """
    listed = {fqn for group in (optimizer or {}).get("param_groups", []) for fqn in group["params"]}
    if listed:
        trained = {_storage_key(model[f]) for f in listed if f in model and model[f].numel()}
        return {n for n, t in model.items() if n not in listed
                and not (t.numel() and _storage_key(t) in trained)}
    return {n for n, t in model.items() if not (t.is_floating_point() or t.is_complex())}


def split_document(document: Any, origin: str, optimizer_class_name: str | None) -> Parts:
    """Interpret a ``torch.save`` (or DCP) dict as model, optimizer, extra and step.

    * the model is the entry ``model``, ``state_dict`` or ``model_state_dict``;
      without one, the tensors at the top level (a bare state dict);
    * the optimizer is ``optimizer``, ``optim`` or ``optimizer_state_dict``,
      its class ``optimizer_class_name`` if given, else the entry
      ``optimizer_class``, else recognized from its hyperparameters;
    * an integer ``step`` is the step;
    * ``extra`` is the entry ``extra`` when nothing else is left (the layout
      deltackpt's exports write), else a dict of every other entry.
    """
    if not isinstance(document, Mapping):
        raise ConversionError(f"{origin}: holds a {type(document).__qualname__}, not a dict of "
                              "state (a state dict, or one with 'model' and 'optimizer' entries)")
    rest = dict(document)
    model_key = next((k for k in MODEL_KEYS if k in rest), None)
    if model_key is not None:
        model = rest.pop(model_key)
        if not isinstance(model, Mapping):
            raise ConversionError(f"{origin}: entry {model_key!r} is a {type(model).__qualname__}, "
                                  "not a state dict")
    else:
        model = {k: v for k, v in rest.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in rest.items() if k not in model}
    for fqn, value in model.items():
        if not isinstance(fqn, str) or not isinstance(value, torch.Tensor):
            raise ConversionError(f"{origin}: model entry {fqn!r} is a {type(value).__qualname__}, "
                                  "not a tensor named by a string")
    recorded_class = rest.pop(OPTIMIZER_CLASS_KEY, None)
    optimizer_key = next((k for k in OPTIMIZER_KEYS if k in rest), None)
    sd = rest.pop(optimizer_key) if optimizer_key is not None else None
    optimizer = None if sd is None else fqn_optimizer(
        sd, optimizer_class_name or recorded_class, origin)
    step = rest.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        del rest["step"]
    else:
        step = None
    extra = rest["extra"] if list(rest) == ["extra"] else rest or None
    return Parts(dict(model), optimizer, extra, step)
