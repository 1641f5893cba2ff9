"""State capture: what a training step consists of, in universal (name-keyed) form.

:func:`capture` turns a model, an optimizer, RNG states and the user's
``extra`` into a flat list of named tensors plus a JSON tree of everything
else. Optimizer state is keyed by parameter name (FQN), never by the
optimizer's integer index, so it can be loaded into an optimizer built in a
different order or with different param groups (DeepSpeed UCP's idea). The
reverse direction, putting a checkpoint back into live objects, is in
:mod:`deltackpt.restore.loading`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from deltackpt.dist.shards import local_values
from deltackpt.format.metadata import tensor_name
from deltackpt.format.state import CapturedState, CapturedTensor
from deltackpt.format.tree import encode_tree


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
        fqns = optimizer_fqns(optimizer, model)
        sd = optimizer.state_dict()
        by_index = [fqn for group in fqns for fqn in group]
        tree["optimizer"] = _encode_optimizer(
            table, type(optimizer).__qualname__,
            [{**group, "params": names} for group, names in zip(sd["param_groups"], fqns, strict=True)],
            {by_index[index]: param_state for index, param_state in sd["state"].items()})
    return _finish(table, tree, rng_state() if rng else None, extra)


def capture_values(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any] | None = None,
                   extra: Any = None, *, buffers: Collection[str] = (), rng: Any = None) -> CapturedState:
    """Capture state given as values rather than live objects: a checkpoint read from another format.

    ``model`` is a state dict by FQN (tensors sharing storage become
    aliases, as tied parameters do in :func:`capture`); the FQNs in
    ``buffers`` get the role ``buffer``, the others ``param``. ``optimizer``
    is ``{"class", "param_groups": [{..., "params": [fqn, ...]}], "state":
    {fqn: {key: value}}}`` as :attr:`UniversalCheckpoint.optimizer` gives
    it. The result names every tensor as :func:`capture` would have.
    """
    table = _TensorTable()
    tree: dict[str, Any] = {"optimizer": None, "rng": None, "extra": None}
    for fqn, value in model.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model entry {fqn!r} is a {type(value).__qualname__}, not a tensor")
        table.add(("model", fqn), value, "buffer" if fqn in buffers else "param", fqn=fqn)
    if optimizer is not None:
        listed = [fqn for group in optimizer["param_groups"] for fqn in group["params"]]
        unknown = [fqn for fqn in listed if fqn not in model]
        if unknown:
            raise ValueError(f"the optimizer's param groups list {unknown}, which the model "
                             "state does not hold")
        stray = [fqn for fqn in optimizer["state"] if fqn not in set(listed)]
        if stray:
            raise ValueError(f"the optimizer holds state for {stray}, which no param group lists")
        tree["optimizer"] = _encode_optimizer(table, optimizer["class"], optimizer["param_groups"],
                                              optimizer["state"])
    return _finish(table, tree, rng, extra)


def _encode_optimizer(table: _TensorTable, class_name: str, param_groups: list[Mapping[str, Any]],
                      state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The optimizer's tree (FORMAT.md 2.2) from param groups listing FQNs and state by FQN."""
    encoded_state: dict[str, Any] = {}
    for fqn, param_state in state.items():
        encoded_state[fqn] = {
            key: encode_tree(value, ("optimizer", "state", fqn, key),
                             lambda path, t, fqn=fqn, key=key: table.add(
                                 path, t, "optimizer", fqn=fqn, state_key=key))
            for key, value in param_state.items()}
    groups = []
    for g, group in enumerate(param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        encoded = encode_tree(hyper, ("optimizer", "param_groups", str(g)),
                              lambda path, t: table.add(path, t, "optimizer"))
        groups.append({**encoded, "params": list(group["params"])})
    return {"class": class_name, "param_groups": groups, "state": encoded_state}


def _finish(table: _TensorTable, tree: dict[str, Any], rng: Any, extra: Any) -> CapturedState:
    """Add the RNG states and ``extra`` (when not None) to a capture."""
    if rng is not None:
        tree["rng"] = encode_tree(rng, ("rng",), lambda path, t: table.add(path, t, "rng"))
    if extra is not None:
        tree["extra"] = encode_tree(extra, ("extra",), lambda path, t: table.add(path, t, "extra"))
    return CapturedState(table.tensors, tree)


def rng_state() -> dict[str, Any]:
    """The RNG states a training loop draws from: torch (CPU and CUDA), numpy, ``random``.

    ``random``'s 625 words are held in a ``uint32`` array, as numpy's keys are: stored as a
    tensor (FORMAT.md 2.2), a delta stores them as nothing while the run draws no number from
    ``random`` (an ``unchanged`` chunk, 3.5), where inline in the metadata they took 3 KB a
    save. :func:`python_rng_state` gives the tuple ``random.setstate`` takes."""
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "numpy": np.random.get_state(),
                             "python": (version, np.array(words, np.uint32), gauss_next)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def python_rng_state(state: tuple) -> tuple:
    """``random``'s state as ``random.setstate`` takes it, from :func:`rng_state`'s (its words
    an array) or from ``random.getstate``'s (as steps of format 2.5 and earlier hold it)."""
    version, words, gauss_next = state
    return version, tuple(map(int, words)), gauss_next


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(python_rng_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
