"""Accelerate's ``save_state``/``load_state`` as deltackpt steps.

:class:`Checkpointer` saves what ``Accelerator.save_state`` saves, as one step of a
:class:`~deltackpt.CheckpointManager`, and ``load_state`` puts it back:

* the prepared models (unwrapped from DDP and ``torch.compile``; one model by its own FQNs,
  several as ``model.<fqn>``, ``model_1.<fqn>``, ... as accelerate names their files) and the
  prepared optimizers' state by parameter FQN: the tensors deltas are coded for;
* exactly, in the step's ``extra`` under ``"accelerate"``: the schedulers' and the gradient
  scaler's state, the state of every object registered with ``register_for_checkpointing``,
  ``Accelerator.step`` and ``save_iteration``, and for every process its RNG states (torch, CUDA,
  numpy, ``random``) and each prepared dataloader's epoch (``iteration``) and the state of the
  generator its ranks draw their shuffle from.

Accelerate's pre-hooks cannot carry this: a save hook receives the models, their state dicts
and the output folder, and may only take model weights over (by emptying ``weights``);
``save_state`` then writes the optimizers, schedulers, samplers, scaler, the RNG states of every
process and the registered objects with ``torch.save`` into the folder whatever the hook did.
So the integration is a pair of methods beside ``Accelerator``'s own, on an object that keeps
the manager (whose last step the next delta is coded against) from save to save.

Under torch.distributed (DDP, ``Accelerator(cpu=True)`` on gloo included) every process calls
``save_state`` and ``load_state``, as it calls accelerate's: the save and the load are
collective, each process writes its share of the replicated tensors and rank 0 commits.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from deltackpt.dist.group import Group
from deltackpt.errors import (
    BackgroundSaveError,
    DeltackptError,
    DistributedError,
    IntegrationError,
    StorageError,
)
from deltackpt.format.checks import check_bool
from deltackpt.format.tree import encode_tree
from deltackpt.integrations.frameworks import require
from deltackpt.integrations.runs import check_same_run
from deltackpt.manager import CheckpointManager
from deltackpt.save.capture import rng_state, set_rng_state
from deltackpt.save.info import SaveInfo
from deltackpt.save.queue import SaveHandle

log = logging.getLogger("deltackpt")

# Where accelerate keeps its own checkpoints; deltackpt holds a model as DDP or one process does.
UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
# What a save that could not be written raises: deltackpt's errors for a failed write, a
# failure on some rank, an object store, or an asynchronous save.
WRITE_FAILURES = (OSError, StorageError, DistributedError, BackgroundSaveError)
KEY = "accelerate"  # the step's extra holds the integration's state under this key
STATE_KEYS = {"step", "iteration", "schedulers", "scaler", "custom", "processes"}


class SaveStateError(DeltackptError, RuntimeError):
    """A save through :class:`Checkpointer` that could not be written: a ``RuntimeError``, as
    accelerate's ``save_state`` raises when a write fails, with deltackpt's error chained
    (``__cause__``). Nothing of the step was left behind; earlier steps are intact."""


class Checkpointer:
    """``save_state`` and ``load_state`` of an ``accelerate.Accelerator`` through deltackpt.

    >>> ckpt = Checkpointer(accelerator, "runs/ckpt", full_every=10)
    >>> ckpt.save_state(step)   # instead of accelerator.save_state(...)
    >>> ckpt.load_state()       # instead of accelerator.load_state(...): the latest step

    Saves everything ``Accelerator.save_state`` saves (the module's docstring lists it) as a
    step: full every ``full_every`` saves, deltas in between. Every process calls both methods.

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved and loaded.
        path: the checkpoint directory (or URL) of a :class:`~deltackpt.CheckpointManager`.
        continue_run: save into a directory holding steps of another run (otherwise the first
            save refuses with :class:`~deltackpt.OtherRunError`, unless this run resumed from
            one of them by :meth:`load_state`).
        manager_options: the :class:`~deltackpt.CheckpointManager`'s other arguments
            (``full_every``, ``compression``, ``keep``, ``blocking``, ...); ``keep`` defaults to
            ``last=<total_limit>`` when the accelerator's ``ProjectConfiguration`` sets
            ``total_limit``.
    """

    def __init__(self, accelerator: Any, path: str | os.PathLike[str], *,
                 continue_run: bool = False, **manager_options: Any) -> None:
        accelerate = require("accelerate")
        if not isinstance(accelerator, accelerate.Accelerator):
            raise IntegrationError(f"Checkpointer needs an accelerate.Accelerator, got "
                                   f"{type(accelerator).__qualname__}")
        self.continue_run = check_bool(continue_run, "continue_run")
        limit = accelerator.project_configuration.total_limit
        if limit is not None and "keep" not in manager_options:
            manager_options["keep"] = f"last={limit}"
        self.accelerator = accelerator
        self.manager = CheckpointManager(path, **manager_options)
        self._run_checked = False  # whether check_same_run passed (before the first save)
        self._resumed = False  # whether load_state loaded a step of this directory

    def __repr__(self) -> str:
        return f"Checkpointer({self.manager.path!r})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def save_state(self, step: int | None = None, *, blocking: bool | None = None,
                   overwrite: bool = False) -> SaveInfo | SaveHandle:
        """Save the accelerator's state as ``step`` (default: ``accelerator.save_iteration``,
        which every save advances, as accelerate's ``save_state`` does). Every process calls it.

        ``blocking=False`` returns once the state is copied and writes it in the background
        (default: the manager's ``blocking``). Raises :class:`SaveStateError` when the step
        could not be written, :class:`~deltackpt.OtherRunError` at the first save into a
        directory of another run, :class:`~deltackpt.IntegrationError` for state deltackpt
        cannot store (naming the object).
        """
        acc = self.accelerator
        _check_supported(acc)
        step = acc.save_iteration if step is None else step
        model, optimizer = self._training_objects()
        state = self._state()
        if not self._run_checked:
            check_same_run(self.manager, continue_run=self.continue_run, resumed=self._resumed)
            self._run_checked = True
        with _save_failures(f"save_state of step {step}"):
            result = self.manager.save(step, model, optimizer, {KEY: state}, rng=False,
                                       overwrite=overwrite, blocking=blocking)
        acc.project_configuration.iteration = state["iteration"]
        return result

    def load_state(self, step: int | None = None, *, strict: bool = True) -> int:
        """Load ``step`` (default: the latest) into the accelerator's prepared objects, as
        accelerate's ``load_state`` does, and return it. Every process calls it, and gets its
        own RNG states back (a process the step has none for, under a larger world size, keeps
        its own, with a warning). The next save is a delta on the loaded step.

        Raises :class:`~deltackpt.IntegrationError` before anything changes when the step was
        not saved by a ``Checkpointer`` or holds another number of schedulers, registered
        objects or dataloaders than the accelerator has; ``strict`` as in
        :meth:`~deltackpt.CheckpointManager.load` for the models and optimizers.
        """
        acc = self.accelerator
        _check_supported(acc)
        step = self.manager.resolve_step(step)
        self._check_fits(step)
        model, optimizer = self._training_objects()
        state = self.manager.load(step, model, optimizer, strict=strict, rng=False)[KEY]
        for scheduler, saved in zip(acc._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        if acc.scaler is not None:
            acc.scaler.load_state_dict(state["scaler"])
        for obj, saved in zip(acc._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(saved)
        rank, processes = acc.process_index, state["processes"]
        if rank < len(processes):
            set_rng_state(processes[rank]["rng"])
            for loader, saved in zip(acc._dataloaders, processes[rank]["dataloaders"], strict=True):
                _load_dataloader(loader, saved)
        else:
            log.warning("step %d was saved by %d processes: process %d keeps its RNG states and "
                        "dataloader positions", step, len(processes), rank)
        acc.step = state["step"]
        acc.project_configuration.iteration = state["iteration"]
        self._resumed = True
        return step

    def wait(self) -> None:
        """Wait for the saves in flight; raises :class:`SaveStateError` for one that failed."""
        with _save_failures("an asynchronous save_state"):
            self.manager.wait()

    def close(self) -> None:
        """Wait for the saves in flight (raising :class:`SaveStateError` for one that failed)
        and release the manager's writer lock and threads."""
        with _save_failures("an asynchronous save_state"):
            self.manager.close()

    # -- what is saved ---------------------------------------------------------------------

    def _training_objects(self) -> tuple[nn.Module | None, Any]:
        """The prepared models as one module and the prepared optimizers as one optimizer."""
        accelerate = require("accelerate")
        acc = self.accelerator
        models = [acc.unwrap_model(m, keep_torch_compile=False) for m in acc._models]
        optimizers = [o.optimizer if isinstance(o, accelerate.optimizer.AcceleratedOptimizer) else o
                      for o in acc._optimizers]
        if len(models) > 1:  # named as accelerate names their files: model, model_1, ...
            model = nn.ModuleDict({("model" if i == 0 else f"model_{i}"): m
                                   for i, m in enumerate(models)})
        else:
            model = models[0] if models else None
        if len(optimizers) > 1:
            optimizer = _joined_class(tuple(_name(o) for o in optimizers))(optimizers)
        else:
            optimizer = optimizers[0] if optimizers else None
        if optimizer is not None:
            known = {id(p) for p in model.parameters()} if model is not None else set()
            for i, group in enumerate(optimizer.param_groups):
                if any(id(p) not in known for p in group["params"]):
                    raise IntegrationError(f"param group {i} of the prepared optimizers holds "
                                           "parameters of no prepared model (their state is "
                                           "saved by the FQNs of the models' parameters)")
        return model, optimizer

    def _state(self) -> dict[str, Any]:
        """What the step's extra holds under ``"accelerate"``: the same on every process (each
        process's own part gathered from all of them)."""
        acc = self.accelerator
        state = {
            "step": acc.step,
            "iteration": acc.save_iteration + 1,
            "schedulers": [_storable(s.state_dict(), f"scheduler {i} ({_name(s)})")
                           for i, s in enumerate(acc._schedulers)],
            "scaler": None if acc.scaler is None else _storable(acc.scaler.state_dict(),
                                                                "the gradient scaler"),
            "custom": [_storable(o.state_dict(), f"registered object {i} ({_name(o)})")
                       for i, o in enumerate(acc._custom_objects)],
        }
        mine = {"rng": rng_state(), "dataloaders": [_dataloader_state(d, i)
                                                    for i, d in enumerate(acc._dataloaders)]}
        state["processes"] = (Group.current() or Group.single()).all_gather(mine)
        return state

    def _check_fits(self, step: int) -> None:
        """Raise :class:`IntegrationError` unless ``step`` was saved by a Checkpointer from as
        many schedulers, registered objects and dataloaders as the accelerator has (read from
        the step's metadata, before anything is loaded)."""
        acc = self.accelerator
        extra = self.manager.metadata(step).state.get("extra")
        saved = extra.get(KEY) if isinstance(extra, dict) else None
        if not isinstance(saved, dict) or not saved.keys() >= STATE_KEYS:
            raise IntegrationError(f"step {step} of {self.manager.path} was not saved by a "
                                   "deltackpt.accelerate Checkpointer (its extra holds no "
                                   f"{KEY!r} entry)")
        found = [f"{held} {what} (the accelerator has {have})" for what, held, have in (
            ("schedulers", len(saved["schedulers"]), len(acc._schedulers)),
            ("registered objects", len(saved["custom"]), len(acc._custom_objects)),
            ("dataloaders", len(saved["processes"][0]["dataloaders"]), len(acc._dataloaders)),
            ("gradient scalers", int(saved["scaler"] is not None), int(acc.scaler is not None)),
        ) if held != have]
        if found:
            raise IntegrationError(f"step {step} of {self.manager.path} holds " + ", ".join(found)
                                   + ": prepare and register the same objects as the run that "
                                   "saved it (nothing was loaded)")


def _check_supported(acc: Any) -> None:
    kind = acc.distributed_type
    if kind.name in UNSUPPORTED:
        raise IntegrationError(f"deltackpt.accelerate saves models that DDP or a single process "
                               f"holds, not {kind.name} ones: use accelerator.save_state")


def _name(obj: Any) -> str:
    return type(obj).__qualname__


def _storable(value: Any, what: str) -> Any:
    """``value`` if a step can hold it (:func:`~deltackpt.format.tree.encode_tree`); otherwise
    :class:`IntegrationError` naming ``what`` and the entry."""
    try:
        encode_tree(value, ("state_dict",), lambda path, tensor: "")
    except TypeError as exc:
        raise IntegrationError(f"the state of {what} cannot be saved: {exc}") from None
    return value


def _dataloader_state(loader: Any, index: int) -> dict[str, Any]:
    """A prepared dataloader's position as this process sees it: its epoch and the state of the
    generator its ranks shuffle with (rank 0's, synchronised at each epoch; None in a single
    process, whose shuffle draws from the torch RNG)."""
    if getattr(loader, "use_stateful_dataloader", False):
        raise IntegrationError(f"dataloader {index} is a StatefulDataLoader "
                               "(use_stateful_dataloader): its state is not saved by deltackpt")
    generator = getattr(loader, "synchronized_generator", None)
    return {"iteration": getattr(loader, "iteration", 0),
            "generator": generator.get_state() if generator is not None else None}


def _load_dataloader(loader: Any, saved: dict[str, Any]) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = saved["iteration"]
    generator = getattr(loader, "synchronized_generator", None)
    if generator is not None and saved["generator"] is not None:
        generator.set_state(saved["generator"])


@contextmanager
def _save_failures(what: str) -> Iterator[None]:
    """Raise a save's failure to write as :class:`SaveStateError`, the error chained."""
    try:
        yield
    except WRITE_FAILURES as exc:
        raise SaveStateError(f"{what} failed: {exc}") from exc


class _Optimizers:
    """Several optimizers as one, for :meth:`CheckpointManager.save` and ``load``: their param
    groups one after another, their state indexed on across them as one optimizer's would be.
    Its class (:func:`_joined_class`) is named after theirs, which is what a step records."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for o in self.optimizers for group in o.param_groups]

    def state_dict(self) -> dict[str, Any]:
        state, groups, offset = {}, [], 0
        for optimizer in self.optimizers:
            sd = optimizer.state_dict()
            state.update({offset + index: value for index, value in sd["state"].items()})
            groups += [{**group, "params": [offset + i for i in group["params"]]}
                       for group in sd["param_groups"]]
            offset += sum(len(group["params"]) for group in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, offset = iter(state_dict["param_groups"]), 0
        for optimizer in self.optimizers:
            count = sum(len(group["params"]) for group in optimizer.param_groups)
            mine = [next(groups) for _ in optimizer.param_groups]
            optimizer.load_state_dict({
                "state": {i - offset: value for i, value in state_dict["state"].items()
                          if offset <= i < offset + count},
                "param_groups": [{**group, "params": [i - offset for i in group["params"]]}
                                 for group in mine]})
            offset += count


@functools.cache
def _joined_class(classes: tuple[str, ...]) -> type[_Optimizers]:
    """The class of optimizers ``classes`` joined: named as they all are (``AdamW``), or
    ``AdamW+SGD``, so that a step records what their state means (a Lion's moments differ)."""
    name = classes[0] if len(set(classes)) == 1 else "+".join(classes)
    return type(name, (_Optimizers,), {"__qualname__": name, "__module__": __name__})
