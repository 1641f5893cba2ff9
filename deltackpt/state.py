"""State capture: what a training step consists of, in universal (name-keyed) form.

:func:`capture` turns a model, an optimizer, RNG states and the user's
``extra`` into a flat list of named tensors plus a JSON tree of everything
else. Optimizer state is keyed by parameter name (FQN), never by the
optimizer's integer index, so it can be loaded into an optimizer built in a
different order or with different param groups (DeepSpeed UCP's idea). The
reverse direction, putting a checkpoint back into live objects, is in
:mod:`deltackpt.loading`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.distributed import local_values
from deltackpt.format import tensor_name
from deltackpt.tree import encode_tree


@dataclass
class CapturedTensor:
    """A tensor of the state with its universal name and role."""

    name: str
    role: str
    tensor: torch.Tensor
    fqn: str | None = None
    state_key: str | None = None
    alias_of: str | None = None


@dataclass
class CapturedState:
    """Every tensor of a step, and the tagged-JSON tree of the rest."""

    tensors: list[CapturedTensor]
    tree: dict[str, Any]


class _TensorTable:
    """Collects tensors under unique names; a tensor seen twice becomes an alias."""

    def __init__(self) -> None:
        self.tensors: list[CapturedTensor] = []
        self._names: set[str] = set()
        self._by_view: dict[tuple, str] = {}

    def add(self, path: tuple[str, ...], tensor: torch.Tensor, role: str,
            fqn: str | None = None, state_key: str | None = None) -> str:
        name = tensor_name(*path)
        if name in self._names:
            raise ValueError(f"two tensors of the state would both be stored as {name!r}")
        self._names.add(name)
        tensor = tensor.detach()
        alias_of = None
        if role in ("param", "buffer") and tensor.numel() > 0:
            local = local_values(tensor)  # a DTensor's shard: one per tensor, as the tensor
            view = (local.untyped_storage().data_ptr(), local.storage_offset(),
                    tuple(tensor.shape), tuple(local.stride()), tensor.dtype, local.device)
            alias_of = self._by_view.setdefault(view, name)
            alias_of = None if alias_of == name else alias_of
        self.tensors.append(CapturedTensor(name, role, tensor, fqn, state_key, alias_of))
        return name


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> fqn``; a tied parameter maps to its first name."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_fqns(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """The FQN of every parameter of every param group of ``optimizer``."""
    names = parameter_names(model)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(f"optimizer param group {g}, parameter {i} (shape "
                                 f"{tuple(param.shape)}) is not a parameter of the model")
            fqns.append(names[id(param)])
        groups.append(fqns)
    return groups


def capture(model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
            extra: Any, rng: bool) -> CapturedState:
    """Capture the state to save, without copying tensor data."""
    if optimizer is not None and model is None:
        raise ValueError("saving an optimizer needs its model, to name its parameters")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}")
    table = _TensorTable()
    tree: dict[str, Any] = {"optimizer": None, "rng": None, "extra": None}
    if model is not None:
        for fqn, value in model.state_dict(keep_vars=True).items():
            role = "param" if isinstance(value, nn.Parameter) else "buffer"
            table.add(("model", fqn), value, role, fqn=fqn)
    if optimizer is not None:
        tree["optimizer"] = _capture_optimizer(optimizer, model, table)
    if rng:
        tree["rng"] = encode_tree(rng_state(), ("rng",),
                                  lambda path, t: table.add(path, t, "rng"))
    if extra is not None:
        tree["extra"] = encode_tree(extra, ("extra",),
                                    lambda path, t: table.add(path, t, "extra"))
    return CapturedState(table.tensors, tree)


def _capture_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                       table: _TensorTable) -> dict[str, Any]:
    fqns = optimizer_fqns(optimizer, model)
    sd = optimizer.state_dict()
    by_index = [fqn for group in fqns for fqn in group]
    state: dict[str, Any] = {}
    for index, param_state in sd["state"].items():
        fqn = by_index[index]
        state[fqn] = {
            key: encode_tree(value, ("optimizer", "state", fqn, key),
                             lambda path, t, fqn=fqn, key=key: table.add(
                                 path, t, "optimizer", fqn=fqn, state_key=key))
            for key, value in param_state.items()}
    groups = []
    for g, (group, names) in enumerate(zip(sd["param_groups"], fqns, strict=True)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        encoded = encode_tree(hyper, ("optimizer", "param_groups", str(g)),
                              lambda path, t: table.add(path, t, "optimizer"))
        groups.append({**encoded, "params": names})
    return {"class": type(optimizer).__qualname__, "param_groups": groups, "state": state}


def adam_hyperparameters(captured: CapturedState, key: str) -> dict[str, float]:
    """``fqn -> value`` of a parameter group hyperparameter (``"lr"``, ``"eps"``) for the
    parameters an Adam-family optimizer moves.

    Such an optimizer (its state holds ``exp_avg_sq``) normalizes every
    coordinate's update, so one training step moves a weight by about its
    group's learning rate, the natural unit of a weight's error; and its
    first moment drives an update of ``exp_avg / (sqrt(exp_avg_sq) + eps)``.
    Parameters of groups whose value is not a positive number (or a
    one-element tensor) are left out: a learning rate of 0 freezes them.
    """
    optimizer = captured.tree.get("optimizer")
    if not optimizer:
        return {}
    normalized = {t.fqn for t in captured.tensors if t.state_key == "exp_avg_sq"}
    by_name = {t.name: t.tensor for t in captured.tensors}
    values: dict[str, float] = {}
    for group in optimizer["param_groups"]:
        value = group.get(key)
        if isinstance(value, dict) and "$tensor" in value and by_name[value["$tensor"]].numel() == 1:
            value = float(by_name[value["$tensor"]].item())
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0:
            values.update((fqn, float(value)) for fqn in group["params"] if fqn in normalized)
    return values


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


def rng_state() -> dict[str, Any]:
    """The RNG states a training loop draws from: torch (CPU and CUDA), numpy, ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
