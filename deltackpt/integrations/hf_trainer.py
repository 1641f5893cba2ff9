"""The Hugging Face ``Trainer`` saving deltackpt steps instead of ``checkpoint-N`` folders.

Every save the ``TrainingArguments`` ask for (``save_steps``, ``save_strategy``) is written as
step ``global_step`` of a deltackpt checkpoint (by default ``<output_dir>/deltackpt``): the
model and the optimizer as tensors (full steps every ``full_every`` saves, deltas between),
and as the step's ``extra`` (stored exactly) the ``TrainerState`` as its
``trainer_state.json`` holds it, the scheduler's and the gradient scaler's state dicts and the
RNG states of every rank. ``train(resume_from_checkpoint=...)`` resumes from such a step.

The Trainer's loop decides when to save and when each part of a checkpoint is loaded on
resume (the model before the optimizer exists, the RNG states only once the data skipped
has been drawn); the overrides below keep its loop and replace what it reads and writes, each
at the point where the Trainer reads or writes its own file:

* ``train``: resolves ``resume_from_checkpoint`` to a step and hands the Trainer a temporary
  folder holding only that step's ``trainer_state.json``, which the Trainer reads itself (the
  global step, and from it the epochs and batches it skips); checks the directory's run.
* ``_save_checkpoint``: saves the step (with the Trainer's bookkeeping of the best model and
  of its stateful callbacks), then applies retention (``save_total_limit``).
* ``_load_from_checkpoint``: nothing for a deltackpt step: the model is loaded with the
  optimizer, in one restore of the step, so that the next save is a delta on it.
* ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``: load the step's
  model and optimizer, scheduler, scaler and this rank's RNG states.
* ``_load_best_model``: loads the best step's model (``load_best_model_at_end``).

For a Hugging Face ``checkpoint-N`` folder each falls back to the Trainer's own, so a run
checkpointed by the Trainer resumes from its folder and saves deltackpt steps from there on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import (
    ConfigError,
    DeltackptError,
    IntegrationError,
    StepExistsError,
    StepNotFoundError,
)
from deltackpt.format.checks import check_bool
from deltackpt.format.metadata import STEP_DIR_PATTERN, step_dir_name
from deltackpt.format.tree import decode_tree
from deltackpt.integrations.frameworks import require
from deltackpt.integrations.runs import check_same_run
from deltackpt.manager import CheckpointManager
from deltackpt.ops.retention import RetentionPolicy
from deltackpt.save.capture import rng_state, set_rng_state

transformers = require("transformers")

from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402 (after the version check)
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint  # noqa: E402

log = logging.getLogger("deltackpt")

FOLDER = "deltackpt"  # the checkpoint directory's name under output_dir, by default
SAVE_STRATEGIES_WITH_BEST = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)


@dataclass(frozen=True)
class TrainerRetention(RetentionPolicy):
    """A retention policy that also keeps the Trainer's best step (``best``), as its own
    rotation does: with ``last`` alone (``save_total_limit``) the best step takes the place
    of the oldest of the last steps (the latest always stays), with other rules it is kept
    besides them."""

    best: int | None = None

    def select(self, steps: list[int], kinds: dict[int, str]) -> set[int]:
        kept = super().select(steps, kinds)
        if self.best is not None and self.best in steps and self.best not in kept:
            if self.every is None and self.full_within is None and len(kept) > 1:
                kept.discard(min(kept))
            kept.add(self.best)
        return kept


@dataclass
class _Resume:
    """A step being resumed from: the manager reading it, and the temporary folder the Trainer
    is handed (holding its ``trainer_state.json``), by which the overrides know it."""

    manager: CheckpointManager
    step: int
    trainer_state: dict[str, Any]
    folder: str = ""
    has_optimizer: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class CheckpointMixin:
    """Makes a ``transformers.Trainer`` (or a subclass, listed after this mixin) save deltackpt
    steps instead of ``checkpoint-N`` folders and resume from them.

    Args:
        checkpoint: where the steps go: a path or fsspec URL (default
            ``<output_dir>/deltackpt``), or a :class:`~deltackpt.CheckpointManager`, for its
            settings (``full_every``, ``compression``, ``keep``, ``blocking=False``, a ``cache``,
            ``storage_options``).
        continue_run: save into a directory that holds another run's steps, among them
            (without it, and without resuming from one of them, ``train()`` refuses before
            training).

    ``save_total_limit`` keeps the last steps (and the best one, as the Trainer does); a
    manager's own ``keep=`` serves when it is not set. Every other argument is the Trainer's.
    """

    def __init__(self, *args: Any, checkpoint: str | os.PathLike[str] | CheckpointManager | None = None,
                 continue_run: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_bool(continue_run, "continue_run")
        limit = self.args.save_total_limit
        if isinstance(checkpoint, CheckpointManager):
            if checkpoint.read_only:
                raise ConfigError(f"checkpoint: {checkpoint.path} was opened read_only; the "
                                  "Trainer saves into it")
            if checkpoint.keep is not None and limit is not None and limit > 0:
                raise ConfigError(f"save_total_limit={limit} and the manager's keep="
                                  f"'{checkpoint.keep}' both say which steps to keep: set one")
        elif checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
            raise ConfigError(f"checkpoint must be a path, a URL or a CheckpointManager, got "
                              f"{type(checkpoint).__name__}")
        for unsupported, name in ((getattr(self, "is_deepspeed_enabled", False), "DeepSpeed"),
                                  (getattr(self, "is_fsdp_enabled", False), "FSDP"),
                                  (getattr(self, "is_fsdp_xla_enabled", False), "FSDP on XLA")):
            if unsupported:
                raise IntegrationError(f"deltackpt's Trainer saves single-process and DDP "
                                       f"training; under {name} the Trainer's own checkpoints "
                                       "serve (a plain transformers.Trainer)")
        if self.args.push_to_hub:
            log.warning("push_to_hub: deltackpt steps are not pushed to the Hub at each save; "
                        "trainer.push_to_hub() pushes the model as usual")
        self._checkpoint = checkpoint
        self._continue_run = continue_run
        self._manager: CheckpointManager | None = None
        self._keep: RetentionPolicy | None = None  # the manager's own policy
        self._resuming: _Resume | None = None
        self._saved: set[int] = set()  # steps known to be committed (for the best model)

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The manager the steps are saved through (opened at its first use): restore, export
        or list them with it."""
        if self._manager is None:
            given = self._checkpoint
            self._manager = given if isinstance(given, CheckpointManager) else CheckpointManager(
                given if given is not None else os.path.join(self.args.output_dir, FOLDER))
            self._keep = self._manager.keep
        return self._manager

    # -- resuming ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | os.PathLike[str] | bool | int | None = None,
              *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, resuming from a deltackpt step when
        ``resume_from_checkpoint`` is ``True`` (the latest step, or a later ``checkpoint-N``
        folder of ``output_dir``), a step number, a checkpoint directory (its latest step) or
        a step's folder in one (``<dir>/step-000000000500``); a Hugging Face checkpoint folder
        is resumed from by the Trainer itself. Saves still in flight are committed (or their
        failure raised) before it returns."""
        hf_folder, point = self._resume_point(resume_from_checkpoint)
        try:
            return self._train(hf_folder, point, *args, **kwargs)
        finally:
            if point is not None and point.manager is not self._manager:
                point.manager.close()  # the reader of another directory, done with

    def _train(self, hf_folder: str | None, point: _Resume | None, *args: Any,
               **kwargs: Any) -> Any:
        manager = self.checkpoint_manager
        if self.args.save_strategy != SaveStrategy.NO:
            check_same_run(manager, continue_run=self._continue_run,
                           resumed=point is not None and point.manager is manager)
            self._saved = set(manager.steps())
        try:
            if point is None:
                result = super().train(hf_folder, *args, **kwargs)
            else:
                with tempfile.TemporaryDirectory(prefix="deltackpt-resume-") as folder:
                    Path(folder, TRAINER_STATE_NAME).write_text(
                        json.dumps(point.trainer_state, indent=2, sort_keys=True) + "\n",
                        encoding="utf-8")
                    self._resuming = dataclasses.replace(point, folder=folder)
                    result = super().train(folder, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # the training's failure is the one raised
                manager.close()
            raise
        finally:
            self._resuming = None
        try:
            manager.close()  # the last saves committed, the writer lock released
        except (DeltackptError, OSError) as exc:
            raise _save_failed(manager, self.state.global_step, exc) from exc
        return result

    def _resume_point(self, resume: Any) -> tuple[Any, _Resume | None]:
        """What ``resume_from_checkpoint`` names: ``(None, step)`` for a deltackpt step,
        ``(value, None)`` for what the Trainer resumes from itself (nothing, or a folder)."""
        if resume is None or resume is False:
            return None, None
        manager = self.checkpoint_manager
        if resume is True:
            step = manager.latest_step()
            output_dir = self.args.output_dir
            folder = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            if folder is not None and (step is None or _folder_step(folder) > step):
                return folder, None
            if step is None:
                raise StepNotFoundError(f"no checkpoint to resume from: {manager.path} has no "
                                        f"committed steps and {output_dir} no "
                                        f"{PREFIX_CHECKPOINT_DIR}-N folder")
            return None, self._point(manager, step)
        if isinstance(resume, int):
            return None, self._point(manager, manager.resolve_step(resume))
        if not isinstance(resume, (str, os.PathLike)):
            raise ConfigError(f"resume_from_checkpoint must be True, a step, a path or a URL, "
                              f"got {type(resume).__name__}")
        path = os.fspath(resume)
        if os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            return path, None
        directory, step = path.rstrip("/\\") or path, None
        if (match := STEP_DIR_PATTERN.fullmatch(os.path.basename(directory))) is not None:
            directory, step = os.path.dirname(directory) or ".", int(match.group(1))
        reader = CheckpointManager(directory, read_only=True)
        if reader.path == manager.path:
            reader.close()
            reader = manager
        try:
            return None, self._point(reader, reader.resolve_step(step))
        except BaseException:
            if reader is not manager:
                reader.close()
            raise

    def _point(self, manager: CheckpointManager, step: int) -> _Resume:
        """Resuming from ``step`` of ``manager``'s directory; refused where the directory the
        run saves into holds later steps, which its saves would collide with."""
        if manager is self.checkpoint_manager:
            later = [s for s in manager.steps() if s > step]
            if later:
                held = f"step {later[0]}" if len(later) == 1 else \
                    f"{len(later)} steps ({later[0]} to {later[-1]})"
                raise StepExistsError(
                    f"{manager.path} holds {held} after step {step}, which the resumed run's saves "
                    f"would collide with: resume from the latest step, or save into another "
                    f"directory (checkpoint=...) resuming from '{_step_path(manager, step)}'")
        state = _trainer_state(manager, step)
        if state is None:
            raise IntegrationError(f"step {step} of {manager.path} was not saved by deltackpt's "
                                   "Trainer: its extra holds no trainer_state")
        return _Resume(manager, step, state,
                       has_optimizer=manager.metadata(step).state.get("optimizer") is not None)

    def _resumed(self, checkpoint: Any) -> _Resume | None:
        point = self._resuming
        return point if point is not None and checkpoint == point.folder else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resumed(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # a deltackpt step's model is loaded with its optimizer (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        point = self._resumed(checkpoint)
        if point is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer = self.optimizer if point.has_optimizer else None
        point.extra = point.manager.load(point.step, model=self.model, optimizer=optimizer,
                                         rng=False)
        if point.extra.get("scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(point.extra["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        point = self._resumed(checkpoint)
        if point is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and point.extra.get("scaler") is not None:
            scaler.load_state_dict(point.extra["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        point = self._resumed(checkpoint)
        if point is None:
            super()._load_rng_state(checkpoint)
            return
        states = point.extra.get("rng") or []
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank < len(states):
            set_rng_state(states[rank])
        else:  # as the Trainer does without an RNG file for this process
            log.info("step %d of %s holds no RNG states of rank %d (saved by %d process(es)); "
                     "the resumed run draws other random numbers than the saved one would",
                     point.step, point.manager.path, rank, len(states))

    def _load_best_model(self) -> None:
        best, manager = self.state.best_global_step, self.checkpoint_manager
        if self.state.best_model_checkpoint != _step_path(manager, best):
            super()._load_best_model()
            return
        log.info("Loading best model from step %d of %s (score: %s).", best, manager.path,
                 self.state.best_metric)
        manager.load(best, model=self.model, rng=False)

    # -- saving --------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        manager, step = self.checkpoint_manager, self.state.global_step
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        best = self.state.best_global_step
        if self.args.save_strategy in SAVE_STRATEGIES_WITH_BEST and best \
                and (best == step or best in self._saved):
            self.state.best_model_checkpoint = _step_path(manager, best)
        # the stateful callbacks' states go into the trainer state, as the Trainer does
        for callback in [c for c in [*self.callback_handler.callbacks, self.control]
                         if isinstance(c, ExportableState)]:
            name = type(callback).__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(callback.state())
            else:
                self.state.stateful_callbacks[name] = callback.state()
        # the JSON values the Trainer writes to trainer_state.json
        extra: dict[str, Any] = {
            "trainer_state": json.loads(json.dumps(dataclasses.asdict(self.state)))}
        optimizer = None
        if not self.args.save_only_model:
            optimizer = self.optimizer
            if self.lr_scheduler is not None:
                extra["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                extra["scaler"] = scaler.state_dict()
            extra["rng"] = _rank_rng_states()
        manager.keep = self._retention()
        try:
            manager.save(step, model=self.model, optimizer=optimizer, extra=extra, rng=False)
        except (DeltackptError, OSError) as exc:
            raise _save_failed(manager, step, exc) from exc
        self._saved.add(step)

    def _retention(self) -> RetentionPolicy | None:
        """The policy applied after a save: ``save_total_limit`` (else the manager's own
        ``keep``), keeping the best step as the Trainer's rotation does."""
        limit = self.args.save_total_limit
        policy = RetentionPolicy(last=limit) if limit is not None and limit > 0 else self._keep
        if policy is None:
            return None
        best = self.state.best_global_step if self.state.best_model_checkpoint is not None \
            else None
        return TrainerRetention(**{f.name: getattr(policy, f.name) for f in fields(RetentionPolicy)},
                                best=best)


class Trainer(CheckpointMixin, transformers.Trainer):
    """``transformers.Trainer`` saving deltackpt steps: see :class:`CheckpointMixin` for its
    two arguments (``checkpoint``, ``continue_run``) and :meth:`CheckpointMixin.train` for
    ``resume_from_checkpoint``."""


def _trainer_state(manager: CheckpointManager, step: int) -> dict[str, Any] | None:
    """The ``TrainerState`` saved with ``step`` (its ``extra["trainer_state"]``, JSON values),
    from its metadata alone; None for a step saved otherwise."""
    extra = manager.metadata(step).state.get("extra")
    encoded = extra.get("trainer_state") if isinstance(extra, dict) else None  # FORMAT.md 2.5
    state = decode_tree(encoded, _no_tensor) if encoded is not None else None
    return state if isinstance(state, dict) else None


def _no_tensor(name: str) -> torch.Tensor:
    raise IntegrationError(f"a trainer_state holds no tensor, but names {name!r}")


def _rank_rng_states() -> list[dict[str, Any]]:
    """The RNG states of every rank (rank 0's alone in a single process), on every rank."""
    state = rng_state()
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return states


def _step_path(manager: CheckpointManager, step: int | None) -> str | None:
    """Where ``step`` lies (the Trainer's ``best_model_checkpoint``)."""
    return None if step is None else f"{manager.path}/{step_dir_name(step)}"


def _folder_step(folder: str) -> int:
    return int(folder.rsplit("-", 1)[1])


def _save_failed(manager: CheckpointManager, step: int, exc: BaseException) -> OSError:
    """The ``OSError`` a failed save raises in the Trainer's loop (as a failed write of its own
    checkpoint does), with the ``errno`` of the failure, if any."""
    number = next((e.errno for e in _causes(exc) if isinstance(e, OSError) and e.errno), None)
    message = f"saving the checkpoint of global step {step} to {manager.path} failed: {exc}"
    return OSError(number, message) if number is not None else OSError(message)


def _causes(exc: BaseException | None) -> list[BaseException]:
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__
    return chain
