"""How plain PyTorch checkpoints lay out a training state, in both directions.

A ``torch.save`` file or a DCP directory holds a dict: the model's state
dict, an optimizer state dict (keyed by parameter index as
``Optimizer.state_dict()`` writes it, or by FQN as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does)
and whatever else the training loop kept. This module turns such a dict into
the pieces of a :class:`~deltackpt.format.state.CapturedState` and back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltackpt.errors import ConversionError

MODEL_KEYS = ("model", "state_dict", "model_state_dict")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_state_dict")
OPTIMIZER_CLASS_KEY = "optimizer_class"  # written by deltackpt's torch and DCP exports
TORCH_FILE = "checkpoint.pt"  # the file of deltackpt's torch export
# What to do about an optimizer whose parameters cannot be named after the model, as a converter says it.
NAMING_ADVICE = ("save the optimizer with parameter names (build it from model.named_parameters(), "
                 "or save get_optimizer_state_dict), or convert the model alone (--model-only)")


@dataclass
class Parts:
    """A training state as values (what :func:`deltackpt.save.capture.capture_values` takes), and notes
    on how it was read."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    extra: Any
    step: int | None
    notes: list[str] = field(default_factory=list)  # what reading it could not take over, or guessed


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


def fqn_optimizer(sd: Any, class_name: str | None, origin: str,
                  model: Mapping[str, torch.Tensor] | None = None,
                  notes: list[str] | None = None, advice: str = NAMING_ADVICE) -> dict[str, Any]:
    """The optimizer tree ``{"class", "param_groups", "state"}`` (state by FQN) of an optimizer
    state dict in either layout; ``class_name`` None: recognized from the hyperparameters.

    An index-keyed state dict names its parameters by ``param_names`` in its
    groups (torch writes them for optimizers built from
    ``named_parameters()``; deltackpt's torch export writes them too).
    Without them, the parameters are named after ``model``, the state dict
    saved beside it, when its parameters match the indices in order
    (:func:`parameters_by_index`; one sentence saying so is added to
    ``notes``; ``advice`` ends the error where they cannot be). ``origin`` names the file in
    errors.
    """
    if not isinstance(sd, Mapping) or not isinstance(sd.get("param_groups"), list):
        raise ConversionError(f"{origin}: the optimizer entry is not an optimizer state dict "
                              "(no 'param_groups' list)")
    state = sd.get("state", {})  # DCP drops an empty dict
    if not isinstance(state, Mapping):
        raise ConversionError(f"{origin}: the optimizer's 'state' is a {type(state).__qualname__}, "
                              "not a dict")
    for g, group in enumerate(sd["param_groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
            raise ConversionError(f"{origin}: optimizer param group {g} has no 'params' list")
    by_model = None
    unnamed = [(g, group["params"]) for g, group in enumerate(sd["param_groups"])
               if not all(isinstance(p, str) for p in group["params"])
               and not ("param_names" in group and len(group["param_names"]) == len(group["params"]))]
    if unnamed and model is not None:
        by_model = parameters_by_index(sd["param_groups"], state, model, origin, advice)
        if notes is not None:
            notes.append(by_model.note)
    elif unnamed:
        g, params = unnamed[0]
        raise ConversionError(
            f"{origin}: optimizer param group {g} lists its parameters by index "
            f"({params[:4]}{'...' if len(params) > 4 else ''}) without 'param_names', so they "
            "cannot be named; save the optimizer with get_optimizer_state_dict (state by FQN) "
            "or build it from model.named_parameters()")
    groups, names = [], {}
    for group in sd["param_groups"]:
        params = group["params"]
        if all(isinstance(p, str) for p in params):
            fqns = params
        elif by_model is not None:
            fqns = [by_model.names[p] for p in params]
        else:
            fqns = list(group["param_names"])
        if fqns is not params:
            names.update(zip(params, fqns, strict=True))
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": list(fqns)})
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


# torch.nn's batch and instance norms keep these statistics as buffers, after their parameters
NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class IndexNames:
    """The FQN of every parameter index of an optimizer state dict, and the sentence saying how they
    were found."""

    names: dict[int, str]
    note: str


def names_text(names: list[str], limit: int = 6) -> str:
    """The first ``limit`` of ``names`` for a message, and how many more there are."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def parameters_by_index(param_groups: list[Mapping[str, Any]], state: Mapping[Any, Any],
                        model: Mapping[str, torch.Tensor], origin: str,
                        advice: str = NAMING_ADVICE) -> IndexNames:
    """Name the parameters of an optimizer state dict that lists them by index, without
    ``param_names``, after the model state dict saved with it.

    ``Optimizer.state_dict()`` numbers the parameters in the order of its
    groups; an optimizer built from ``model.parameters()`` lists them in the
    order the model's state dict holds them (a tied parameter once). So
    index ``i`` is the model's ``i``-th parameter, once it is known which of
    the state dict's floating-point tensors are parameters rather than
    buffers: the assignment in order that agrees with the shapes of every
    parameter's optimizer state, where each module's parameters come before
    its buffers and torch's batch-norm statistics are buffers. Refused, with
    a ConversionError saying why and what to do (``advice``), when no
    assignment agrees or the state leaves more than one.
    """
    indices = [p for group in param_groups for p in group["params"]]
    n = len(indices)
    if sorted(p for p in indices if type(p) is int) != list(range(n)):
        raise ConversionError(f"{origin}: the optimizer's param groups list "
                              f"{names_text(list(map(repr, indices)))}, not the indices 0..{n - 1} "
                              "once each")
    shapes: list[set[tuple[int, ...]]] = [set() for _ in range(n)]  # what each index's state fixes
    for key, value in state.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(index, int) or not 0 <= index < n:
            raise ConversionError(f"{origin}: the optimizer holds state for parameter {key!r}, which no "
                                  "param group lists")
        if isinstance(value, Mapping):
            shapes[index] = {tuple(t.shape) for t in value.values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0}
    candidates, seen = [], set()  # floating-point tensors, a tied one once, that can be parameters
    for fqn, tensor in model.items():
        key = _storage_key(tensor) if tensor.numel() else fqn  # empty tensors share no storage
        if (tensor.is_floating_point() or tensor.is_complex()) and key not in seen \
                and fqn.rpartition(".")[2] not in NORM_BUFFERS:
            candidates.append(fqn)
            seen.add(key)

    def fits(index: int, fqn: str) -> bool:
        return not shapes[index] or shapes[index] == {tuple(model[fqn].shape)}

    modules: list[list[str]] = []  # candidates by module, in order
    for fqn in candidates:
        if modules and modules[-1][0].rpartition(".")[0] == fqn.rpartition(".")[0]:
            modules[-1].append(fqn)
        else:
            modules.append([fqn])
    # Each module gives its first k candidates: count the ways (up to 2) to name 0..m-1 after
    # each module, keeping the first and last way found to each count.
    reach: dict[int, tuple[int, tuple[int, int], tuple[int, int]]] = {0: (1, (0, 0), (0, 0))}
    history = []
    left = len(candidates)
    for module in modules:
        left -= len(module)
        nxt: dict[int, tuple[int, tuple[int, int], tuple[int, int]]] = {}
        for start, (ways, _, _) in sorted(reach.items()):
            for k in range(len(module) + 1):
                end = start + k
                if end > n or (k and not fits(end - 1, module[k - 1])):
                    break
                if end + left < n:
                    continue
                before, first, _ = nxt.get(end, (0, (start, k), (start, k)))
                nxt[end] = (min(2, before + ways), first, (start, k))
        history.append(nxt)
        reach = nxt

    def assignment(which: int) -> list[str]:
        taken, count = [], n
        for module, nxt in zip(reversed(modules), reversed(history), strict=True):
            count, k = nxt[count][which]
            taken.append(module[:k])
        return [fqn for part in reversed(taken) for fqn in part]

    start = f"{origin}: the optimizer lists its {n} parameters by index, without names, and"
    if n not in reach:
        floating = len(candidates)
        why = (f"the model's state dict has only {floating} floating-point tensors that can be "
               "parameters" if floating < n else _first_misfit(n, candidates, fits, shapes))
        raise ConversionError(f"{start} the model's state dict does not match them in order: {why}; "
                              f"{advice}")
    if reach[n][0] > 1:
        one, other = assignment(1), assignment(2)
        i = next(i for i, (a, b) in enumerate(zip(one, other, strict=True)) if a != b)
        raise ConversionError(f"{start} the model's state dict matches them in more than one way: "
                              f"parameter {i} is {one[i]!r} or {other[i]!r} (the shapes of the "
                              f"optimizer state do not tell); {advice}")
    names = assignment(1)
    trained = {_storage_key(model[f]) if model[f].numel() else f for f in names}
    buffers = [f for f, t in model.items() if (t.is_floating_point() or t.is_complex())
               and (_storage_key(t) if t.numel() else f) not in trained]
    note = (f"the optimizer lists its {n} parameters by index, without names: named after the "
            "model's parameters in state dict order, which agree with the shapes of the optimizer "
            "state")
    if buffers:
        note += f" (floating-point tensors taken to be buffers: {names_text(buffers)})"
    return IndexNames(dict(enumerate(names)), note)


def _first_misfit(n: int, candidates: list[str], fits: Callable[[int, str], bool],
                  shapes: list[set[tuple[int, ...]]]) -> str:
    """Where matching the indices to the model's tensors in order first fails, in words."""
    at, previous = 0, None
    for index in range(n):
        while at < len(candidates) and not fits(index, candidates[at]):
            at += 1
        if at == len(candidates):
            shape = " and ".join(str(list(s)) for s in sorted(shapes[index]))
            after = "" if previous is None else f" after {previous!r} (parameter {index - 1})"
            return f"the state of parameter {index} has shape {shape}, which no model tensor{after} has"
        previous = candidates[at]
        at += 1
    return "no assignment in order keeps each module's parameters before its buffers"


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

    Adam and AdamW share their names and differ in ``decoupled_weight_decay``. The
    ``initial_lr`` that torch's learning-rate schedulers add to every group does not count.
    """
    if not param_groups:
        return None
    group = param_groups[0]
    keys = {k for k in group if k not in ("params", "param_names", "initial_lr")}
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


def count_tensors(value: Any) -> int:
    """How many tensors ``value`` holds, in dicts, lists and tuples at any depth: what a reader
    must carry over. A container met twice (or inside itself, as a crafted pickle can make it) is
    counted once."""
    count, todo, seen = 0, [value], set()
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            count += 1
        elif isinstance(item, (Mapping, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend(item.values() if isinstance(item, Mapping) else item)
    return count


def split_document(document: Any, origin: str, optimizer_class_name: str | None,
                   model_only: bool = False) -> Parts:
    """Interpret a ``torch.save`` (or DCP) dict as model, optimizer, extra and step.

    * the model is the entry ``model``, ``state_dict`` or ``model_state_dict``;
      without one, the tensors at the top level (a bare state dict);
    * the optimizer is ``optimizer``, ``optim`` or ``optimizer_state_dict``,
      its class ``optimizer_class_name`` if given, else the entry
      ``optimizer_class`` beside it, else recognized from its hyperparameters; an
      optimizer that lists its parameters by index without names is named
      after the model (:func:`parameters_by_index`);
    * an integer ``step`` is the step;
    * ``extra`` is the entry ``extra`` when nothing else is left (the layout
      deltackpt's exports write), else a dict of every other entry.

    With ``model_only``, the optimizer and extra are left out unread (the
    notes name the entries).
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
    step = rest.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        del rest["step"]
    else:
        step = None
    notes: list[str] = []
    if model_only:
        if rest:
            notes.append(f"model only: left out {', '.join(map(repr, rest))}")
        return Parts(dict(model), None, None, step, notes)
    optimizer_key = next((k for k in OPTIMIZER_KEYS if k in rest), None)
    sd = rest.pop(optimizer_key) if optimizer_key is not None else None
    # the class deltackpt's exports record beside the optimizer; in a file without an optimizer
    # entry, an entry of that name is the training loop's own, kept in extra
    recorded_class = rest.pop(OPTIMIZER_CLASS_KEY, None) if optimizer_key is not None else None
    optimizer = None if sd is None else fqn_optimizer(
        sd, optimizer_class_name or recorded_class, origin, model, notes)
    extra = rest["extra"] if list(rest) == ["extra"] else rest or None
    return Parts(dict(model), optimizer, extra, step, notes)
