"""Putting a checkpoint back into a live model and optimizer.

Everything is checked before anything is changed: in strict mode a mismatch
raises :class:`StateMismatchError` listing every problem and leaves the
model and optimizer untouched; otherwise the matching part is loaded and the
rest reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltackpt.errors import StateMismatchError
from deltackpt.save.capture import optimizer_fqns, set_rng_state


@dataclass
class LoadReport:
    """What a load did not match. Empty lists mean everything was loaded."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    optimizer: list[str] = field(default_factory=list)
    extra: Any = None

    @property
    def ok(self) -> bool:
        """True if the checkpoint matched the model and optimizer exactly."""
        return not (self.missing or self.unexpected or self.mismatched or self.optimizer)

    def describe(self) -> str:
        """Multi-line summary of every problem."""
        lines = []
        for title, items in (("missing from the checkpoint", self.missing),
                             ("in the checkpoint but not in the model", self.unexpected),
                             ("shape or dtype differs", self.mismatched),
                             ("optimizer", self.optimizer)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines.extend(f"  {item}" for item in items)
        return "\n".join(lines)


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _plan_model(model: nn.Module, saved: dict[str, torch.Tensor],
                report: LoadReport) -> dict[str, torch.Tensor]:
    target = model.state_dict()
    loadable = {}
    for fqn, current in target.items():
        if fqn not in saved:
            report.missing.append(fqn)
        elif saved[fqn].shape != current.shape or saved[fqn].dtype != current.dtype:
            report.mismatched.append(f"{fqn}: checkpoint {_describe(saved[fqn])}, "
                                     f"model {_describe(current)}")
        else:
            loadable[fqn] = saved[fqn]
    report.unexpected.extend(sorted(saved.keys() - target.keys()))
    return loadable


def _merged_hyperparameters(g: int, sources: list[dict[str, Any]], current: dict[str, Any],
                            report: LoadReport) -> dict[str, Any]:
    """Hyperparameters for target group ``g`` from the saved groups its parameters were in."""
    merged = {}
    for key in dict.fromkeys(k for s in sources for k in s):
        values = [s[key] for s in sources if key in s]
        if len(values) == len(sources) and all(v == values[0] for v in values[1:]):
            merged[key] = values[0]
        else:
            report.optimizer.append(
                f"param group {g}: {key!r} differs among the saved groups its parameters came "
                f"from ({values}); kept the current value {current.get(key)!r}")
    return merged


def _plan_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                    saved: dict[str, Any] | None, saved_model: dict[str, torch.Tensor],
                    report: LoadReport, copy: bool) -> dict[str, Any] | None:
    if saved is None:
        report.optimizer.append("the checkpoint has no optimizer state")
        return None
    if saved["class"] != type(optimizer).__qualname__:
        report.optimizer.append(f"checkpoint optimizer is {saved['class']}, "
                                f"loading into {type(optimizer).__qualname__}")
    group_of = {fqn: g for g, group in enumerate(saved["param_groups"]) for fqn in group["params"]}
    params = {name: p for name, p in model.named_parameters()}
    state, groups, index = {}, [], 0
    target = optimizer_fqns(optimizer, model)
    for g, (group, fqns) in enumerate(zip(optimizer.param_groups, target, strict=True)):
        for fqn in fqns:
            if fqn not in group_of:
                report.optimizer.append(f"{fqn}: parameter not in the saved optimizer")
            elif fqn in saved_model and saved_model[fqn].shape != params[fqn].shape:
                report.optimizer.append(f"{fqn}: saved for shape {list(saved_model[fqn].shape)}, "
                                        f"parameter is {list(params[fqn].shape)}")
            elif fqn in saved["state"]:
                value = saved["state"][fqn]
                state[index] = ({k: v.clone() if isinstance(v, torch.Tensor) else v
                                 for k, v in value.items()} if copy else value)
            index += 1
        sources = [saved["param_groups"][i] for i in dict.fromkeys(
            group_of[f] for f in fqns if f in group_of)]
        hyper = _merged_hyperparameters(
            g, [{k: v for k, v in s.items() if k not in ("params", "param_names")}
                for s in sources], group, report)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper,
                       "params": list(range(index - len(fqns), index))})
    in_target = {f for fqns in target for f in fqns}
    report.optimizer.extend(f"{fqn}: in the saved optimizer, not in this one"
                            for fqn in group_of if fqn not in in_target)
    return {"state": state, "param_groups": groups}


def load_into(model: nn.Module | None, optimizer: torch.optim.Optimizer | None, *,
              saved_model: dict[str, torch.Tensor], saved_optimizer: dict[str, Any] | None,
              saved_rng: dict[str, Any] | None, strict: bool, rng: bool,
              copy: bool) -> LoadReport:
    """Load saved state into ``model`` and ``optimizer``; see the module docstring.

    With ``copy=False`` optimizer state tensors are handed to the optimizer
    as they are (for callers that drop the checkpoint afterwards).
    """
    if optimizer is not None and model is None:
        raise ValueError("loading an optimizer needs its model, to name its parameters")
    report = LoadReport()
    loadable = _plan_model(model, saved_model, report) if model is not None else {}
    opt_sd = (_plan_optimizer(optimizer, model, saved_optimizer, saved_model, report, copy)
              if optimizer is not None else None)
    if strict and not report.ok:
        raise StateMismatchError("checkpoint does not match (nothing was loaded; pass "
                                 "strict=False to load what matches):\n" + report.describe())
    # The optimizer first: its own load_state_dict may still refuse values the checkpoint holds
    # (what it raises then is its own choice: KeyError, TypeError, OverflowError...).
    if opt_sd is not None:
        try:
            optimizer.load_state_dict(opt_sd)
        except Exception as exc:
            raise StateMismatchError(f"the checkpoint's optimizer state does not load into "
                                     f"{type(optimizer).__qualname__}: {type(exc).__name__}: "
                                     f"{exc}") from None
    if model is not None:
        model.load_state_dict(loadable, strict=False)
    if rng and saved_rng is not None:
        try:
            set_rng_state(saved_rng)
        except Exception as exc:  # whatever torch, numpy or random raise for a state they refuse
            raise StateMismatchError(f"the checkpoint's RNG states cannot be restored: "
                                     f"{type(exc).__name__}: {exc}") from None
    return report
