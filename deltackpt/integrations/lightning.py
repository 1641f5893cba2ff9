"""Lightning's checkpoints as deltackpt steps: a ``CheckpointIO`` plugin.

    trainer = Trainer(plugins=[deltackpt.lightning.CheckpointIO("runs/ckpt")], ...)

Every checkpoint Lightning saves (``ModelCheckpoint``, ``trainer.save_checkpoint``) becomes the
step of its ``global_step`` in the deltackpt directory: full or delta by the manager's policy,
the model by FQN, the optimizers' state by parameter FQN and state key, so that moments are
coded by meaning. At Lightning's path the plugin writes a small file (Lightning's own format,
``torch.save``) naming that step, with the rest of the checkpoint: loops, callbacks,
schedulers, hyperparameters, as Lightning saved them for that path. So Lightning's file logic
works as it is: the version suffixes, ``ckpt_path="last"``, ``save_last="link"``,
``best_model_path``.

Lightning hands ``optimizer_states`` keyed by parameter index. Their parameters are named after
the LightningModule's own: Lightning gives a ``CheckpointIO`` no handle on its strategy, so the
plugin takes the strategy whose ``save_checkpoint`` calls it from the call stack, and names each
optimizer's parameters, in any param groups, by ``named_parameters()``. Called otherwise (by a
loop of the user's), it names them by the ``param_names`` torch records for an optimizer built
from ``named_parameters()``, else after the checkpoint's state dict
(:func:`~deltackpt.interop.layouts.parameters_by_index`), refusing a mapping the shapes leave
ambiguous. Several optimizers are merged into the step's one optimizer tree (each parameter held
by one of them), and split again on load.

Two saves of one global step (``ModelCheckpoint``'s top-k and ``last``, two callbacks) share
its step: the second writes only its file, unless the model or optimizer state changed in
between (told by each tensor's storage and version counter, which every in-place change bumps,
and the bytes of the norm layers' running statistics, which batch norm updates without
bumping it): the step is then saved again, full, and the first file loads it too.

``remove_checkpoint`` (top-k rotation) drops the step unless another file names it; a dropped
step is deleted once no kept step's chain needs it (:class:`~deltackpt.ops.retention.KeepSteps`),
so a rotation never breaks a kept step. Which files name which steps is written in each file,
so that a run resumed from one knows them. Resuming from a step (``fit(ckpt_path=...)``; a load
for ``validate`` or ``test`` changes nothing) continues the run from there: the first save after
it drops the steps no file known at that step names, among them those saved after it by the run
it resumed.

Under DDP Lightning saves on global rank 0 only, which holds the whole replicated state: the
plugin saves there as a single process (``save_captured`` on a group of one), and every rank
loads alone (a restore takes no collective).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import xxhash

from deltackpt.dist.group import Group
from deltackpt.encode.policy import CompressionConfig, as_config
from deltackpt.errors import ConfigError, ConversionError, DeltackptError, IntegrationError, OtherRunError
from deltackpt.format.checks import check_bool, check_int, check_number
from deltackpt.format.metadata import metadata_file
from deltackpt.format.state import CapturedState
from deltackpt.integrations.frameworks import require
from deltackpt.integrations.runs import check_same_run
from deltackpt.interop.layouts import (
    NORM_BUFFERS,
    fqn_optimizer,
    guess_buffers,
    names_text,
    native_optimizer,
    optimizer_class,
)
from deltackpt.manager import CheckpointManager
from deltackpt.ops.retention import KeepSteps
from deltackpt.restore.universal import UniversalCheckpoint
from deltackpt.save.capture import capture_values
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY

lightning = require("lightning")
from lightning.fabric.plugins.io import CheckpointIO as _LightningCheckpointIO  # noqa: E402
from lightning.fabric.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

log = logging.getLogger("deltackpt")

FORMAT = 1  # version of the file the plugin writes at Lightning's path
TRAINING_STATE = ("state_dict", "optimizer_states")  # what the step holds; the file the rest
NAMING_ADVICE = ("in configure_optimizers, build the optimizer from self.named_parameters(), so "
                 "that torch records the parameters' names")


class CheckpointSaveError(DeltackptError, OSError):
    """A save through :class:`CheckpointIO` that failed: an ``OSError``, as Lightning's own
    ``TorchCheckpointIO`` raises when its write fails, with deltackpt's error chained
    (``__cause__``) and its ``errno``, if any. Neither the step nor the file at Lightning's path
    was left behind; earlier checkpoints are intact."""


class CheckpointIO(_LightningCheckpointIO):
    """Saves Lightning's checkpoints as steps of the deltackpt directory ``path``
    (``Trainer(plugins=[CheckpointIO(path)])``; see the module doc).

    Args:
        path: the checkpoint directory, or an fsspec URL (``s3://bucket/run1``).
        full_every: a full step every this many saves, deltas in between.
        depth: restore through at most this many deltas.
        compression: ``"balanced"`` (default), ``"aggressive"``, ``"lossless"`` or a
            :class:`~deltackpt.CompressionConfig`.
        continue_run: let the first save go into a directory that holds steps of a run this
            one did not resume from (else :class:`~deltackpt.OtherRunError`).
        workers: encoding and decoding threads (default: the usable CPUs).
        storage_options: options of an fsspec ``path``'s file system.
        reader_grace: seconds the data of a deleted step stays for readers that began reading it.

    A failed save raises :class:`CheckpointSaveError` (an ``OSError``); state it cannot map or
    store, :class:`~deltackpt.IntegrationError`; a directory of another run,
    :class:`~deltackpt.OtherRunError`; nothing is written then.
    """

    def __init__(self, path: str | os.PathLike[str], full_every: int = DEFAULT_FULL_EVERY, *,
                 depth: int = DEFAULT_DEPTH, compression: str | CompressionConfig = "balanced",
                 continue_run: bool = False, workers: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, reader_grace: float | None = None) -> None:
        check_bool(continue_run, "continue_run")
        check_int(full_every, "full_every")
        check_int(depth, "depth")
        if workers is not None:
            check_int(workers, "workers")
        if reader_grace is not None:
            check_number(reader_grace, "reader_grace", least=0)
        as_config(compression)  # refused here, not at the first save
        self.path = os.fspath(path)
        self.continue_run = continue_run
        grace = {} if reader_grace is None else {"reader_grace": reader_grace}
        self._options = dict(full_every=full_every, depth=depth, compression=compression,
                             workers=workers, storage_options=storage_options, **grace)
        self._manager: CheckpointManager | None = None  # the writer, made at the first save
        self._readers: dict[str, CheckpointManager] = {}
        self._files: dict[str, int] = {}  # the files naming steps of the directory -> their step
        self._dropped: set[int] = set()  # steps no file names any more, deleted once not needed
        self._last: tuple[int, Any] | None = None  # the last step saved, its state's fingerprints
        self._resumed: int | None = None  # the step of this directory the run resumed from
        self._cleanup = False  # drop what the files known at the resumed step do not name
        self._checked = False  # the directory was checked for another run's steps
        self._files_io = TorchCheckpointIO()

    def __repr__(self) -> str:
        return f"deltackpt.lightning.CheckpointIO({self.path!r})"

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~deltackpt.CheckpointManager` the plugin saves through."""
        if self._manager is None:
            self._manager = CheckpointManager(self.path, **self._options)
        return self._manager

    # -- Lightning's interface ---------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the step of its ``global_step`` and write the file at ``path``
        that names it. A dict that is no training checkpoint (no ``state_dict`` and
        ``global_step``: the weights ``ddp_spawn`` hands to the main process) is written as
        ``TorchCheckpointIO`` writes it."""
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` is not supported "
                            "by deltackpt.lightning.CheckpointIO; give the plugin storage_options=")
        if not ("state_dict" in checkpoint and "global_step" in checkpoint):
            self._files_io.save_checkpoint(checkpoint, path)
            return
        file = _file_key(path)
        step = checkpoint["global_step"]
        created = False
        try:
            state = _training_state(checkpoint, _calling_strategy())
            manager = self.manager
            if not self._checked:
                check_same_run(manager, continue_run=self.continue_run,
                               resumed=self._resumed is not None)
                self._checked = True
            if self._cleanup:
                self._drop_unnamed(manager)
            saved, created = self._save_step(manager, step, state)
            self._write_file(file, checkpoint, step, saved, "optimizer_states" in checkpoint)
        except (IntegrationError, OtherRunError, ConfigError):
            raise
        except Exception as exc:
            if created:  # a step no file names: gone
                self._dropped.add(step)
                self._collect()
            raise _save_failed(path, step, exc) from exc

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint the file at ``path`` names: its step restored (the model and
        optimizer states) with the rest of the checkpoint the file holds (read with
        ``weights_only`` as ``torch.load`` reads it). Another file is read as
        ``TorchCheckpointIO`` reads it, so a run can resume from Lightning's own checkpoint.
        ``map_location``: None (the CPU) or a device. Loaded by a Trainer's ``fit``, a step of
        the plugin's directory is the one the run resumes from (see the module doc); otherwise
        (``validate``, ``test``, a direct call) a load changes nothing."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise IntegrationError(f"map_location={map_location!r}: deltackpt.lightning restores "
                                   "to the CPU or moves to one device (a str or torch.device)")
        if not get_filesystem(path).exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        header = self._header(path)
        if header is None:
            return self._files_io.load_checkpoint(path, map_location=map_location,
                                                  weights_only=weights_only)
        ref = header["deltackpt"]
        manager = self._reader(ref["checkpoint"])
        ckpt = manager.restore(ref["step"])
        if ckpt.metadata.save_id != ref["save_id"]:
            raise IntegrationError(
                f"{path} names step {ref['step']} of {manager.path}, which was saved again since "
                "(by a run resumed from an earlier checkpoint); it holds another state now")
        rest = torch.load(io.BytesIO(header["lightning"]), map_location=map_location,
                          weights_only=weights_only)
        rest.update(_training_dict(ckpt, ref["optimizers"], map_location))
        checkpoint = {key: rest[key] for key in ref["keys"]}  # in the order Lightning made it
        if _same_directory(manager.path, self.path) and _fitting(_calling_strategy()):
            self._resumed, self._cleanup, self._last = ref["step"], True, None
            self._files = {**ref["files"], _file_key(path): ref["step"]}
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the file at ``path``; the step it names is dropped when no other file names it
        (deleted once no kept step's chain needs it). A link, or a file of before the run's
        resumed step that it does not know, is only deleted."""
        file = _file_key(path)
        step = self._files.pop(file, None)
        fs = get_filesystem(path)
        if os.path.islink(path):  # Lightning's save_last="link": the link alone
            os.remove(path)
        elif fs.exists(path):
            fs.rm(path, recursive=True)
        if step is not None and step not in self._files.values():
            self._dropped.add(step)
            self._collect()

    def teardown(self) -> None:
        """Close the manager: wait for its saves, release the writer lock and its threads."""
        if self._manager is not None:
            self._manager.close()
        for reader in self._readers.values():
            reader.close()

    # -- saving ------------------------------------------------------------------------

    def _save_step(self, manager: CheckpointManager, step: int, state: _State
                   ) -> tuple[str, bool]:
        """Save ``state`` as ``step``, unless it is the state that step already holds; return
        the step's save id and whether this save created the step."""
        exists = manager.storage.exists(metadata_file(step))
        if self._last is not None and self._last[0] == step and exists:
            if _holds(self._last[1], state.fingerprint):
                return manager.metadata(step).save_id, False
            others = sorted(f for f, s in self._files.items() if s == step)
            log.warning("global step %d was saved again with another model or optimizer state "
                        "(changed without an optimizer step); step %d of %s now holds it, and "
                        "%s load it too", step, step, manager.path, names_text(others) or "no file")
            save_id = self._save(manager, step, state, overwrite=True)
            for other in others:
                self._repoint(other, save_id)
            return save_id, False
        if step == self._resumed and exists:
            self._last = step, state.fingerprint  # the state loaded from it, saved as it was
            return manager.metadata(step).save_id, False
        if exists:
            raise IntegrationError(
                f"global step {step} is a step of {manager.path} already, of the run this one "
                f"continues (continue_run=True saves after its steps, the latest "
                f"{manager.steps()[-1]}); resume from one of its checkpoints or save into an "
                "empty directory")
        return self._save(manager, step, state, overwrite=False), True

    def _save(self, manager: CheckpointManager, step: int, state: _State, *,
              overwrite: bool) -> str:
        single = Group.single()  # rank 0 alone, under DDP too: it holds the whole state
        manager.continue_chain(state.captured, single)
        manager.save_captured(step, state.captured, overwrite=overwrite, group=single)
        self._dropped.discard(step)
        self._last = step, state.fingerprint
        return manager.metadata(step).save_id

    def _write_file(self, file: str, checkpoint: Mapping[str, Any], step: int, save_id: str,
                    optimizers: bool) -> None:
        """Write the file at Lightning's path naming ``step``, with the rest of ``checkpoint``
        and every file now known to name a step; drop the step the path named before."""
        before = self._files.get(file)
        files = {**self._files, file: step}
        rest = {k: v for k, v in checkpoint.items() if k not in TRAINING_STATE}
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        header = {"checkpoint": self.manager.path, "step": step, "save_id": save_id,
                  "optimizers": optimizers, "keys": list(checkpoint), "files": files,
                  "format": FORMAT}
        self._files_io.save_checkpoint({"deltackpt": header, "lightning": buffer.getvalue()},
                                       file)
        self._files = files
        if before is not None and before != step and before not in files.values():
            self._dropped.add(before)
            self._collect()

    def _repoint(self, file: str, save_id: str) -> None:
        """Give the file at ``file`` the save id of its step's new version."""
        header = self._header(file)
        if header is not None:
            header["deltackpt"]["save_id"] = save_id
            self._files_io.save_checkpoint(header, file)

    def _drop_unnamed(self, manager: CheckpointManager) -> None:
        """At the first save after resuming: drop the steps that no file known at the resumed
        step names (those the run it resumed saved after it, and those it had dropped)."""
        self._cleanup = False
        steps = manager.steps()
        named = set(self._files.values())
        later = [s for s in steps if s not in named and self._resumed is not None
                 and s > self._resumed]
        if later:
            log.warning("resumed from step %d of %s: the steps saved after it by the run it "
                        "resumed go (%s)", self._resumed, manager.path, names_text(
                            [str(s) for s in later]))
        self._dropped.update(s for s in steps if s not in named)
        self._collect()

    def _collect(self) -> None:
        """Delete the dropped steps that no kept step's chain needs."""
        if not self._dropped:
            return
        manager = self.manager
        steps = set(manager.steps())
        self._dropped &= steps
        if self._dropped:
            report = manager.gc(KeepSteps(frozenset(steps - self._dropped)))
            self._dropped -= set(report.removed)

    # -- reading -----------------------------------------------------------------------

    def _header(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The contents of the file at ``path`` if the plugin wrote it, else None."""
        try:
            contents = torch.load(io.BytesIO(get_filesystem(path).cat_file(os.fspath(path))),
                                  weights_only=True)
        except Exception:  # not a file of the plugin's: no torch.save file of plain values
            return None
        if isinstance(contents, dict) and isinstance(contents.get("deltackpt"), dict) \
                and isinstance(contents.get("lightning"), bytes):
            if contents["deltackpt"].get("format") != FORMAT:
                raise IntegrationError(f"{path} was written by a deltackpt.lightning of another "
                                       f"format ({contents['deltackpt'].get('format')!r})")
            return contents
        return None

    def _reader(self, path: str) -> CheckpointManager:
        if path not in self._readers:
            options = {k: v for k, v in self._options.items() if k in ("workers", "storage_options")}
            self._readers[path] = CheckpointManager(path, read_only=True, **options)
        return self._readers[path]


class _State:
    """The training state of a Lightning checkpoint as deltackpt captures it, and the
    fingerprints of its model and of its optimizers (None without them), which tell whether
    they changed since they were last saved."""

    def __init__(self, captured: CapturedState, fingerprint: tuple[list[Any], list[Any] | None]
                 ) -> None:
        self.captured, self.fingerprint = captured, fingerprint


def _holds(saved: tuple[list[Any], list[Any] | None], new: tuple[list[Any], list[Any] | None]
           ) -> bool:
    """Whether the state of fingerprints ``saved`` holds that of ``new``: the same model, and
    the same optimizers or none (a save of the weights only)."""
    return saved[0] == new[0] and (new[1] is None or saved[1] == new[1])


def _calling_strategy() -> Any | None:
    """The Lightning strategy whose ``save_checkpoint`` called the plugin's, or None: Lightning
    hands a ``CheckpointIO`` only the checkpoint, and the strategy holds the module and its
    optimizers (it calls the plugin directly, or through a wrapping plugin)."""
    strategy_class = lightning.pytorch.strategies.Strategy
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, strategy_class):
            return caller
        frame = frame.f_back
    return None


def _fitting(strategy: Any | None) -> bool:
    """Whether ``strategy`` (of :func:`_calling_strategy`) runs a Trainer's ``fit``: a load
    there resumes training; one of ``validate``, ``test`` or ``predict`` does not."""
    try:
        return strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
    except (AttributeError, RuntimeError):  # no strategy, module or trainer
        return False


def _module_names(strategy: Any, states: Any) -> list[list[list[str]] | None]:
    """For each optimizer of ``states`` (Lightning's ``optimizer_states``), the FQN of every
    parameter of every param group, named by the strategy's LightningModule (None where the
    strategy does not tell: no strategy, or not the optimizers of these states)."""
    unknown: list[list[list[str]] | None] = [None] * len(states) if isinstance(states, list) else []
    module = getattr(strategy, "lightning_module", None)
    if module is None or not isinstance(states, list) or len(strategy.optimizers) != len(states):
        return unknown
    names = {id(p): name for name, p in module.named_parameters()}
    out: list[list[list[str]] | None] = []
    for i, (optimizer, sd) in enumerate(zip(strategy.optimizers, states, strict=True)):
        listed = sd.get("param_groups") if isinstance(sd, Mapping) else None
        groups = optimizer.param_groups
        if not isinstance(listed, list) or len(listed) != len(groups) or any(
                not isinstance(g, Mapping) or len(g.get("params", ())) != len(live["params"])
                for g, live in zip(listed, groups, strict=True)):
            out.append(None)
            continue
        missing = [tuple(p.shape) for g in groups for p in g["params"] if id(p) not in names]
        if missing:
            raise IntegrationError(f"optimizer {i} holds {len(missing)} tensor(s) that are no "
                                   f"parameter of the LightningModule (shapes {missing[:4]}); "
                                   "deltackpt.lightning names optimizer state by the module's "
                                   "parameters")
        out.append([[names[id(p)] for p in g["params"]] for g in groups])
    return out


def _training_state(checkpoint: Mapping[str, Any], strategy: Any | None = None) -> _State:
    """The model state dict and the optimizers of ``checkpoint`` as deltackpt captures them,
    their parameters named by ``strategy``'s module where it is given."""
    model = checkpoint["state_dict"]
    if not isinstance(model, Mapping):
        raise IntegrationError(f"the checkpoint's state_dict is a {type(model).__qualname__}, not "
                               "a state dict")
    stray = [name for name, value in model.items() if not isinstance(value, torch.Tensor)]
    if stray:
        raise IntegrationError(f"the model's state dict holds values that are not tensors: "
                               f"{names_text(stray)} (a module's extra state); deltackpt.lightning "
                               "saves tensors only")
    states = checkpoint.get("optimizer_states")
    optimizer, layout = (None, None) if states is None else \
        _merged_optimizers(states, model, _module_names(strategy, states))
    # the module versions torch's state dicts carry (Module._load_from_state_dict reads them)
    versions = getattr(model, "_metadata", None)
    extra = {"lightning": {"global_step": checkpoint["global_step"],
                           "epoch": checkpoint.get("epoch"), "optimizers": layout,
                           "state_dict_metadata": dict(versions) if versions is not None else None}}
    try:
        captured = capture_values(model, optimizer, extra, buffers=guess_buffers(model, optimizer))
    except (TypeError, ValueError) as exc:
        raise IntegrationError(f"the checkpoint's training state cannot be stored: {exc}") from None
    return _State(captured, (list(_fingerprint(model)),
                             None if states is None else list(_fingerprint(states))))


def _merged_optimizers(states: Any, model: Mapping[str, torch.Tensor],
                       names: list[list[list[str]] | None]
                       ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Lightning's ``optimizer_states`` (index-keyed) as one optimizer tree by FQN (None without
    optimizers), and how to split it again: each optimizer's class, the keys of each of its
    param groups (with ``param_names`` or not), and its other entries. ``names``: each optimizer's
    parameters' FQNs by group, where known (else by ``param_names`` or after ``model``)."""
    if not isinstance(states, list):
        raise IntegrationError(f"the checkpoint's optimizer_states is a {type(states).__qualname__}, "
                               "not a list of optimizer state dicts")
    if not states:
        return None, []
    groups, by_fqn, layout, holder = [], {}, [], {}
    for i, sd in enumerate(states):
        origin = f"optimizer_states[{i}]"
        listed = sd.get("param_groups") if isinstance(sd, Mapping) else None
        plain = isinstance(listed, list) and all(isinstance(g, Mapping) for g in listed)
        cls = (optimizer_class(listed) if plain else None) or "Optimizer"
        named = sd if names[i] is None else {**sd, "param_groups": [
            {**group, "param_names": fqns} for group, fqns in zip(listed, names[i], strict=True)]}
        try:
            tree = fqn_optimizer(named, cls, origin, model, advice=NAMING_ADVICE)
        except ConversionError as exc:
            raise IntegrationError(str(exc)) from None
        for fqn in (p for g in tree["param_groups"] for p in g["params"]):
            if fqn in holder:
                raise IntegrationError(f"optimizers {holder[fqn]} and {i} both hold parameter "
                                       f"{fqn!r}; deltackpt.lightning saves optimizers over "
                                       "disjoint parameters")
            holder[fqn] = i
        groups += tree["param_groups"]
        by_fqn.update(tree["state"])
        layout.append({"class": cls, "keys": [list(g) for g in listed],
                       "other": {k: v for k, v in sd.items() if k not in ("state", "param_groups")}})
    classes = sorted({entry["class"] for entry in layout})
    return {"class": "+".join(classes), "param_groups": groups, "state": by_fqn}, layout


def _fingerprint(value: Any, path: str = "") -> Iterator[Any]:
    """What tells whether the tensors of ``value`` (nested in dicts, lists and tuples) changed:
    each one's storage, layout and version counter (which every in-place change bumps), and
    for the norm layers' running statistics (batch norm updates them without bumping it) their
    bytes; other values as they are."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        token = (path, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                 t.stride(), t.dtype, t.device, t._version)
        if path.rpartition(".")[2] in NORM_BUFFERS:
            data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            token += (xxhash.xxh3_64_intdigest(data),)
        yield token
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _fingerprint(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _fingerprint(item, f"{path}[{i}]")
    else:
        yield path, repr(value)


def _training_dict(ckpt: UniversalCheckpoint, optimizers: bool, map_location: Any
                   ) -> dict[str, Any]:
    """``state_dict`` and (where the file's save had them) ``optimizer_states`` of a restored
    step, as Lightning handed them over."""
    def placed(t: torch.Tensor) -> torch.Tensor:
        return t if map_location is None else t.to(map_location)

    saved = (ckpt.extra or {}).get("lightning", {})
    model = OrderedDict((fqn, placed(t)) for fqn, t in ckpt.model.items())  # as Module.state_dict
    if saved.get("state_dict_metadata") is not None:
        model._metadata = OrderedDict(saved["state_dict_metadata"])  # type: ignore[attr-defined]
    out: dict[str, Any] = {"state_dict": model}
    layout = saved.get("optimizers") if optimizers else None
    if layout is None:
        if optimizers:
            raise IntegrationError(f"step {ckpt.step} holds no optimizer state any more: it was "
                                   "saved again, by a save of the weights only, after the model "
                                   "changed without an optimizer step")
        return out
    tree = ckpt.optimizer
    states, start = [], 0
    for entry in layout:
        groups = tree["param_groups"][start:start + len(entry["keys"])]
        start += len(entry["keys"])
        fqns = [fqn for g in groups for fqn in g["params"]]
        sd = native_optimizer({"param_groups": groups,
                               "state": {f: tree["state"][f] for f in fqns if f in tree["state"]}})
        sd["param_groups"] = [{key: group[key] for key in keys}  # param_names where it had them
                              for group, keys in zip(sd["param_groups"], entry["keys"], strict=True)]
        sd["state"] = {i: {k: placed(v) if isinstance(v, torch.Tensor) else v
                           for k, v in s.items()} for i, s in sd["state"].items()}
        states.append({**sd, **entry["other"]})
    out["optimizer_states"] = states
    return out


def _file_key(path: str | os.PathLike[str]) -> str:
    """A file's path as the plugin records it: absolute, or the URL as it is."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)


def _same_directory(a: str, b: str) -> bool:
    return _file_key(a).rstrip("/") == _file_key(b).rstrip("/")


def _save_failed(path: str | os.PathLike[str], step: int, exc: BaseException) -> CheckpointSaveError:
    """The error a failed save raises in Lightning's loop, with the ``errno`` of the failure."""
    number, cause = None, exc
    while cause is not None and number is None:
        number = cause.errno if isinstance(cause, OSError) and cause.errno else None
        cause = cause.__cause__
    message = f"saving the checkpoint of global step {step} to {os.fspath(path)} failed: {exc}"
    error = CheckpointSaveError(message)
    error.errno = number
    return error
