"""A DeepSpeed checkpoint engine that keeps ``engine.save_checkpoint``'s state as deltackpt steps:

    engine, *_ = deepspeed.initialize(...)
    deltackpt.deepspeed.install(engine)  # full_every=256, depth=8, compression=, keep=
    engine.save_checkpoint("runs/ckpt")        # full or delta steps
    engine.load_checkpoint("runs/ckpt")        # any data-parallel degree

``save_dir`` is the deltackpt checkpoint directory; each save is the step ``engine.global_steps``,
its tag recorded in the step (``latest`` names the last tag, as DeepSpeed keeps it). A save reads
the engine itself, not DeepSpeed's partition files:

* every trained parameter is stored whole, in global coordinates, by name: its fp32 master value
  as the weights and each per-element optimizer state (``exp_avg``, ``exp_avg_sq``) as that
  parameter's state, so deltas code the ZeRO partitions' moments by meaning. Each rank writes
  a block of rows of every parameter, its part gathered from the ranks holding it;
* frozen parameters and buffers are stored as the model holds them (buffers: rank 0's);
* the rest of DeepSpeed's model-states file (scheduler, counters, ``client_state``) exactly.

A load fills the engine's partitions from those tensors, each rank reading the rows its
fragments need, so a step saved under one data-parallel degree or ZeRO stage loads under
another. DeepSpeed's ``zero_to_fp32.py`` does not read these directories: ``deltackpt export``
and :meth:`CheckpointManager.restore` do.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deltackpt.encode.policy import CompressionConfig
from deltackpt.errors import ConfigError, IntegrationError
from deltackpt.format.metadata import Box, StepMetadata
from deltackpt.format.state import CapturedState, Placement
from deltackpt.format.tree import decode_tree
from deltackpt.integrations.dcp import directory_key, ranks_of, read_boxes, runs, saved_section
from deltackpt.integrations.frameworks import require
from deltackpt.integrations.runs import check_same_run
from deltackpt.manager import CheckpointManager
from deltackpt.ops.retention import RetentionPolicy
from deltackpt.save.capture import capture_values
from deltackpt.save.info import SaveInfo
from deltackpt.save.queue import SaveHandle
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY

require("deepspeed")
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # noqa: E402
    CheckpointCommitInfo,
    CheckpointEngine,
)

FORMAT = 1  # of extra["deepspeed"]
MODEL_STATES = re.compile(r"mp_rank_\d+_model_states\.pt$")
# DeepSpeed's description of its own layout, which the step replaces by tensors stored by name
LAYOUT_KEYS = ("module", "optimizer", "buffer_names", "param_shapes", "frozen_param_shapes",
               "frozen_param_fragments", "shared_params")
# what DeepSpeed's load_checkpoint restores itself rather than returning as client state
ENGINE_KEYS = ("skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
               "random_ltd", "lr_scheduler")


@dataclass
class _Slot:
    """A parameter as this rank holds it: elements ``start`` to ``start + count`` of the
    flattened parameter, as 1-D views of its ``weights`` (the fp32 master of a trained
    parameter, the parameter itself for a frozen one) and of each per-element optimizer
    ``state``; ``flat`` is the tensor the optimizer steps (its state is keyed by it)."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    start: int
    count: int
    weights: torch.Tensor
    flat: torch.Tensor | None
    offset: int  # of the elements in ``flat``
    partial: bool = True  # whether the other ranks hold the other elements


class _Holding:
    """How a DeepSpeed engine holds its parameters and their optimizer state: stage 0 (the
    optimizer steps the parameters, or fp32 copies of 16-bit ones), ZeRO-1/2 and the bf16
    optimizer (flat fp32 partitions, ``_hp_mapping``), ZeRO-3 (partitioned parameters,
    ``ds_tensor``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        self.base = getattr(self.optimizer, "optimizer", self.optimizer)
        self.zero3 = bool(engine.zero_optimization_partition_weights())
        self.partitioned = self.base is not self.optimizer
        self.group = getattr(self.optimizer, "dp_process_group", None) if self.partitioned else None
        # 16-bit training without ZeRO: an fp32 copy of each parameter, which the optimizer steps
        unfused = hasattr(self.optimizer, "fp32_groups") and not self.zero3
        self.masters = {id(lp): hp for lps, hps in zip(self.optimizer.fp16_groups,
                                                      self.optimizer.fp32_groups, strict=True)
                        for lp, hp in zip(lps, hps, strict=True)} if unfused else {}

    @property
    def ranks(self) -> tuple[int, int]:
        """This rank's index among those the parameters are partitioned over, and their number."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def slots(self) -> Iterator[_Slot]:
        """Every parameter of the model, as this rank holds it."""
        for name, param in self.engine.module.named_parameters():
            shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
            yield self._slot(name, param, shape)

    def _slot(self, name: str, param: nn.Parameter, shape: tuple[int, ...]) -> _Slot:
        numel = math.prod(shape)
        if self.zero3:
            part = param.ds_tensor.data.view(-1)
            start = self.ranks[0] * part.numel()
            count = max(0, min(part.numel(), numel - start))
            if not param.requires_grad:
                return _Slot(name, param, shape, start, count, part.narrow(0, 0, count), None, 0)
            sub, offset, _ = self.optimizer.grad_position[self.optimizer.get_param_id(param)]
            flat = self.optimizer.fp32_partitioned_groups_flat[sub]
            return _Slot(name, param, shape, start, count, flat.narrow(0, offset, count), flat,
                         offset)
        master = self.masters.get(id(param), param)
        if not param.requires_grad or not self.partitioned or master is not param:
            flat = master if param.requires_grad else None
            return _Slot(name, param, shape, 0, numel, master.data.view(-1), flat, 0, partial=False)
        mapping = getattr(param, "_hp_mapping", None)
        flat = self.base.param_groups[self._group_of[id(param)]]["params"][0]
        if mapping is None:  # another rank's partition holds all of it
            return _Slot(name, param, shape, 0, 0, flat.narrow(0, 0, 0), flat, 0)
        address, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        return _Slot(name, param, shape, address.start, address.numel,
                     flat.data.narrow(0, hp.start, hp.numel), flat, hp.start)

    @functools.cached_property
    def _group_of(self) -> dict[int, int]:
        """The index of the param group (of the engine's optimizer) training each parameter, by
        the parameter's ``id``."""
        return {id(p): g for g, params in enumerate(self._groups()) for p in params}

    def _groups(self) -> list[list[nn.Parameter]]:
        if self.zero3:
            groups: dict[int, list[nn.Parameter]] = {}
            for sub, params in enumerate(self.optimizer.fp16_groups):
                groups.setdefault(self.optimizer.sub_group_to_group_id[sub], []).extend(params)
            return [groups.get(g, []) for g in range(len(self.base.param_groups))]
        if self.masters:
            return self.optimizer.fp16_groups
        if self.partitioned:
            return self.optimizer.bit16_groups
        return [group["params"] for group in self.base.param_groups]

    def group_fqns(self, names: Mapping[int, str]) -> list[list[str]]:
        """The FQNs of each param group's parameters."""
        return [[names[id(p)] for p in params] for params in self._groups()]

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's settings."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.base.param_groups]

    def set_hyperparameters(self, saved: list[dict[str, Any]]) -> None:
        """Set each param group's settings."""
        if len(saved) != len(self.base.param_groups):
            raise IntegrationError(f"the step holds {len(saved)} param groups and the engine's "
                                   f"optimizer {len(self.base.param_groups)}")
        for group, settings in zip(self.base.param_groups, saved, strict=True):
            group.update({k: v for k, v in settings.items() if k != "params"})

    def state_of(self, slot: _Slot) -> dict[str, Any]:
        """The optimizer's state for the tensor ``slot`` is stepped in (empty before a step)."""
        if slot.flat is None:
            return {}
        return self.base.state.get(slot.flat, {})

    def update_model(self, slots: list[_Slot]) -> None:
        """Make the model's own (16-bit or fp32) parameters the loaded fp32 masters."""
        if self.zero3:
            for slot in slots:
                if slot.flat is not None:
                    slot.param.ds_tensor.data.view(-1).narrow(0, 0, slot.count).copy_(slot.weights)
        elif self.masters:
            for slot in slots:
                if slot.flat is not None:
                    slot.param.data.copy_(slot.flat.data)
        elif self.partitioned:
            self.optimizer.update_lp_params()
            # link the parameters to their state now rather than at the next step, so that
            # DeepSpeed's safe_get_full_optimizer_state reads it right after a load
            link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
            if link is not None and self.base.state:
                link()


def _element_keys(state: Mapping[str, Any], flat: torch.Tensor) -> list[str]:
    """The optimizer state keys holding one value per element of ``flat``."""
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == flat.shape and v.dim() > 0]


def _rows(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """The rows of a tensor of ``shape`` that rank ``rank`` of ``world`` writes."""
    return shape[0] * rank // world, shape[0] * (rank + 1) // world


def _fragments(holding: _Holding, slots: list[_Slot]) -> list[list[tuple[int, int]]]:
    """Every rank's ``(start, count)`` of each slot, by rank (one collective, where the
    parameters are partitioned)."""
    mine = [(slot.start, slot.count) for slot in slots]
    world = holding.ranks[1]
    if world == 1 or not any(slot.partial for slot in slots):
        return [mine] * world
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=holding.group)
    return everyone


def _own_rows(holding: _Holding, slot: _Slot, view: torch.Tensor,
              fragments: list[tuple[int, int]]) -> torch.Tensor:
    """This rank's rows (:func:`_rows`) of a value of the parameter, flattened, of which
    ``view`` holds this rank's elements: received from the ranks holding them (``fragments``:
    each rank's start and count), while this rank's elements go to the ranks whose rows hold
    them. Every element moves once, unchanged."""
    rank, world = holding.ranks
    row = math.prod(slot.shape[1:])
    lo, hi = _rows(slot.shape, rank, world)
    first, end = lo * row, hi * row
    if not slot.partial:
        return view[first:end].clone()
    block = torch.empty(end - first, dtype=view.dtype, device=view.device)
    ops, received, covered = [], [], 0
    for q, (start, count) in enumerate(fragments):
        peer = dist.get_global_rank(holding.group, q) if holding.group is not None else q
        x0, x1 = max(first, start), min(end, start + count)  # what rank q holds of these rows
        if x1 > x0:
            covered += x1 - x0
            if q == rank:
                block[x0 - first:x1 - first] = view[x0 - start:x1 - start]
            else:
                buffer = torch.empty(x1 - x0, dtype=view.dtype, device=view.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer, holding.group))
                received.append((x0 - first, buffer))
        q_lo, q_hi = _rows(slot.shape, q, world)
        y0, y1 = max(q_lo * row, slot.start), min(q_hi * row, slot.start + slot.count)
        if q != rank and y1 > y0:  # what this rank holds of rank q's rows
            ops.append(dist.P2POp(dist.isend, view[y0 - slot.start:y1 - slot.start].contiguous(),
                                  peer, holding.group))
    if covered != end - first:
        raise IntegrationError(f"parameter {slot.name!r}: the ranks' partitions hold {covered} of "
                               f"the {end - first} elements of rows {lo} to {hi}; is every rank "
                               "saving?")
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for at, buffer in received:
        block[at:at + len(buffer)] = buffer
    return block


class DeltaCheckpointEngine(CheckpointEngine):
    """The checkpoint engine :func:`install` sets on a DeepSpeed engine. ``info`` is what the
    last save wrote (a :class:`SaveInfo`, or its handle while an asynchronous save runs)."""

    def __init__(self, engine: Any, *, full_every: int, depth: int,
                 compression: str | CompressionConfig, keep: str | RetentionPolicy | None,
                 blocking: bool, continue_run: bool) -> None:
        super().__init__()
        self.name = "deltackpt"
        self.engine = engine
        self.full_every, self.depth = full_every, depth
        self.compression, self.keep = compression, keep
        self.blocking, self.continue_run = blocking, continue_run
        self.storage_options = None
        self.path: str | None = None
        self.info: SaveInfo | SaveHandle | None = None
        self._pending: CheckpointCommitInfo | None = None
        self._commit: CheckpointCommitInfo | None = None

    @property
    def key(self) -> str:
        return directory_key(self.path or "")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing: the step's directory is deltackpt's own (the manager makes it)."""

    def preserves_storage_sharing(self) -> bool:
        return False  # nothing is pickled: no clone of the state to save

    def is_decoupled(self) -> bool:
        return not self.blocking  # DeepSpeed writes ``latest`` once commit() found the step written

    def create(self, info: CheckpointCommitInfo) -> None:
        self._wait()
        self._pending = info

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        """Save the step: called once per rank with DeepSpeed's model states (rank 0's rest is
        what the step keeps of them)."""
        if not MODEL_STATES.search(os.path.basename(path)) or self._pending is None:
            raise IntegrationError(f"deltackpt's DeepSpeed engine saves the model-states file, "
                                   f"not {os.path.basename(path)!r} (pipeline and MoE engines "
                                   "are not supported)")
        info, self._pending = self._pending, None
        self.path = info.save_dir
        group = ranks_of(None)
        manager = runs.manager(self)
        group.together("check of the directory", lambda: self._check_directory(manager, info.tag))
        captured = group.together("capture of the DeepSpeed state",
                                  lambda: capture_engine(self.engine, state_dict, info.tag))
        manager.continue_chain(captured, group)
        self.info = manager.save_captured(self.engine.global_steps, captured,
                                          blocking=self.blocking)
        runs.touched.add(self.key)
        self._commit = info

    def _check_directory(self, manager: CheckpointManager, tag: str) -> None:
        """Refuse another run's directory, and a step the directory holds already."""
        check_same_run(manager, continue_run=self.continue_run, resumed=self.key in runs.touched)
        step = self.engine.global_steps
        if step in manager.steps():
            raise IntegrationError(
                f"{manager.path} already holds step {step}: save_checkpoint saves the step "
                f"engine.global_steps, and the engine has not stepped since that save (tag "
                f"{tag!r} would name the same state)")

    def load(self, path: str, map_location: Any = None) -> Any:
        raise IntegrationError(f"{path}: deltackpt's DeepSpeed engine loads steps through "
                               "engine.load_checkpoint, which deltackpt.deepspeed.install set")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait for the save (an asynchronous one: raising its failure)."""
        self._wait()
        self._commit = None
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self._commit

    def cleanup(self) -> None:
        self._wait()

    def _wait(self) -> None:
        if isinstance(self.info, SaveHandle):
            self.info = self.info.wait()

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None,
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """``engine.load_checkpoint`` for deltackpt directories: the step ``tag`` names (default:
        ``latest``'s; ``(None, None)`` without one, as DeepSpeed does), into the engine at its
        own layout. Returns DeepSpeed's ``(load_path, client_state)``."""
        if custom_load_fn is not None:
            raise ConfigError("deltackpt's DeepSpeed engine loads without custom_load_fn")
        self._wait()
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return None, None
            with open(latest) as fd:
                tag = fd.read().strip()
        with CheckpointManager(load_dir, read_only=True) as manager:
            meta = _tagged(manager, str(tag))
            state = load_engine(self.engine, manager, meta, strict=load_module_strict,
                                optimizer=load_optimizer_states and not load_module_only)
        if not load_module_only:
            if load_lr_scheduler_states and self.engine.lr_scheduler is not None:
                self.engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.engine.global_steps = state["global_steps"]
            self.engine.global_samples = state.get(
                "global_samples", self.engine.global_steps * self.engine.train_batch_size())
            self.engine.skipped_steps = state["skipped_steps"]
        self.engine.loaded_checkpoint_dp_world_size = state["dp_world_size"]
        self.engine.loaded_checkpoint_mp_world_size = state["mp_world_size"]
        runs.touched.add(directory_key(load_dir))
        client = {k: v for k, v in state.items() if k not in ENGINE_KEYS}
        return os.path.join(load_dir, str(tag)), client


def install(engine: Any, *, full_every: int = DEFAULT_FULL_EVERY, depth: int = DEFAULT_DEPTH,
            compression: str | CompressionConfig = "balanced",
            keep: str | RetentionPolicy | None = None, blocking: bool = True,
            continue_run: bool = False) -> DeltaCheckpointEngine:
    """Make ``engine.save_checkpoint(save_dir, tag)`` save deltackpt steps into ``save_dir``
    (full every ``full_every`` saves, deltas at ``compression`` between, restoring through at
    most ``depth`` deltas, retention ``keep``) and ``engine.load_checkpoint`` load them.
    ``blocking=False`` saves in the background: the next ``engine.step()`` waits for it before
    DeepSpeed names it in ``latest``. The first save into a directory holding another run's
    steps refuses unless ``continue_run``."""
    _check_supported(engine)
    ckpt = DeltaCheckpointEngine(engine, full_every=full_every, depth=depth,
                                 compression=compression, keep=keep, blocking=blocking,
                                 continue_run=continue_run)
    engine.checkpoint_engine = ckpt
    engine.save_non_zero_checkpoint = True  # every rank hands its model states to the engine
    engine.save_zero_checkpoint = False  # the partitions are read from the engine itself
    engine.load_checkpoint = ckpt.load_checkpoint
    return ckpt


def _check_supported(engine: Any) -> None:
    """Refuse, by name, the engines whose state a save would not hold entirely."""
    refused = []
    if type(engine).__name__ == "PipelineEngine":
        refused.append("pipeline parallelism")
    if getattr(engine, "has_moe_layers", False):
        refused.append("MoE layers")
    if getattr(engine, "mp_world_size", 1) > 1:
        refused.append(f"tensor parallelism ({engine.mp_world_size} ranks)")
    if engine.fp16_enabled():
        refused.append("fp16 training (its loss scaler's state)")
    if engine.zero_nvme_offload_optimizer() or \
            str(getattr(engine.zero_offload_param(), "device", "")).endswith("nvme"):
        refused.append("NVMe offload")
    if engine.optimizer is None:
        refused.append("an engine without an optimizer")
    if refused:
        raise IntegrationError("deltackpt.deepspeed.install: this engine uses "
                               f"{', '.join(refused)}, which deltackpt's engine does not save; "
                               "keep DeepSpeed's checkpoints and convert them")


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by FQN: its state dict's entries that are not
    parameters."""
    return {name: value for name, value in module.state_dict(keep_vars=True).items()
            if not isinstance(value, nn.Parameter)}


@torch.no_grad()
def capture_engine(engine: Any, model_states: Mapping[str, Any], tag: str) -> CapturedState:
    """The engine's state as a step: each parameter's rows this rank writes (gathered from the
    ranks holding them), their optimizer state, the buffers, and ``model_states`` without
    DeepSpeed's layout (``extra["deepspeed"]``)."""
    holding = _Holding(engine)
    rank, world = holding.ranks
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    placements: dict[tuple[str, str | None], Placement] = {}
    names: dict[int, str] = {}
    slots = list(holding.slots())
    fragments = _fragments(holding, slots)
    for index, slot in enumerate(slots):
        names[id(slot.param)] = slot.name
        stepped = holding.state_of(slot)
        keys = _element_keys(stepped, slot.flat) if slot.flat is not None else []
        views = [slot.weights] + [stepped[k].view(-1).narrow(0, slot.offset, slot.count)
                                  for k in keys]
        lo, hi = _rows(slot.shape, rank, world)
        block = [_own_rows(holding, slot, view, [f[index] for f in fragments]).view(
            hi - lo, *slot.shape[1:]) for view in views]  # DeepSpeed has no 0-dim parameters
        placement = Placement(slot.shape, (lo,) + (0,) * (len(slot.shape) - 1), writes=hi > lo)
        model[slot.name] = block[0]
        placements[slot.name, None] = placement
        if stepped:
            state[slot.name] = {}
            for k, v in stepped.items():
                if k in keys:
                    state[slot.name][k] = block[1 + keys.index(k)]
                    placements[slot.name, k] = placement
                else:
                    state[slot.name][k] = v
    for alias, param in engine.module.named_parameters(remove_duplicate=False):
        first = names[id(param)]
        if alias != first:  # a tied parameter's other name: an alias of its first
            model[alias] = model[first]
            placements[alias, None] = placements[first, None]
    buffers = _buffers(engine.module)
    for name, buffer in buffers.items():
        model[name] = buffer.detach()
        placements[name, None] = Placement(tuple(buffer.shape), (0,) * buffer.dim(),
                                           writes=rank == 0)
    groups = [{**hyper, "params": fqns} for hyper, fqns in
              zip(holding.hyperparameters(), holding.group_fqns(names), strict=True)]
    rest = {k: v for k, v in model_states.items() if k not in LAYOUT_KEYS}
    extra = {"deepspeed": {"format": FORMAT, "tag": tag, "zero_stage": engine.zero_optimization_stage(),
                           "state": rest}}
    try:
        captured = capture_values(model, {"class": type(holding.base).__qualname__,
                                          "param_groups": groups, "state": state},
                                  extra, buffers=buffers)
    except TypeError as exc:
        raise IntegrationError(f"DeepSpeed's checkpoint state cannot be stored: {exc}") from None
    captured.tensors = [replace(t, placement=placements.get((t.fqn, t.state_key)))
                        if t.role != "extra" and (t.fqn, t.state_key) in placements else t
                        for t in captured.tensors]
    return captured


def _tagged(manager: CheckpointManager, tag: str) -> StepMetadata:
    """The metadata of the step saved under ``tag`` (the newest such)."""
    found = re.fullmatch(r"global_step(\d+)", tag)
    steps = manager.steps()[::-1]
    if found is not None and int(found[1]) in steps:  # DeepSpeed's default tag: try its step first
        steps.insert(0, int(found[1]))
    for step in steps:
        meta = manager.metadata(step)
        section = meta.state.get("extra")
        section = section.get("deepspeed") if isinstance(section, dict) else None
        if isinstance(section, dict) and section.get("tag") == tag:
            return meta
    raise IntegrationError(f"{manager.path} holds no step saved with the tag {tag!r} "
                           f"(steps: {manager.steps()})")


@torch.no_grad()
def load_engine(engine: Any, manager: CheckpointManager, meta: StepMetadata, *, strict: bool,
                optimizer: bool) -> dict[str, Any]:
    """Load step ``meta`` into ``engine`` at its own layout (each rank reads the rows of the
    elements it holds) and return DeepSpeed's non-tensor state of the step."""
    saved_section(meta, "deepspeed", FORMAT, "deltackpt.deepspeed")
    holding = _Holding(engine)
    by_key = {(r.fqn, r.state_key): r for r in meta.tensors if r.role in ("param", "buffer",
                                                                         "optimizer")}
    slots = list(holding.slots())
    buffers = _buffers(engine.module)
    wanted = set(dict(engine.module.named_parameters(remove_duplicate=False))) | set(buffers)
    saved = {r.fqn for r in meta.tensors if r.role in ("param", "buffer")}
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or (strict and unexpected):
        raise IntegrationError(f"step {meta.step} of {manager.path} does not match the model: "
                               f"missing {missing}, unexpected {unexpected}")
    keys: dict[str, list[str]] = {}
    # every tensor of the step: none of a tensor no rank needs, all of the scalars and extra's
    boxes: dict[str, Box] = {r.name: ([0] * len(r.shape), [0] * len(r.shape)) for r in meta.tensors
                             if r.shape and r.role != "extra" and r.alias_of is None}
    for slot in slots:
        record = by_key[slot.name, None]
        if tuple(record.shape) != slot.shape:
            raise IntegrationError(f"parameter {slot.name!r} has the shape {list(slot.shape)} "
                                   f"here and {record.shape} in step {meta.step}")
        box = _covering(slot)
        boxes[record.name] = box
        if optimizer and slot.flat is not None:
            keys[slot.name] = [k for (fqn, k), r in by_key.items() if fqn == slot.name
                               and k is not None and list(r.shape) == list(record.shape)]
            for k in keys[slot.name]:
                boxes[by_key[slot.name, k].name] = box
    for name in buffers:
        boxes.pop(by_key[name, None].name, None)

    tensors = read_boxes(manager, meta, boxes)
    saved_optimizer = decode_tree(meta.state.get("optimizer"), tensors.__getitem__) or {}
    for slot in slots:
        record = by_key[slot.name, None]
        slot.weights.copy_(_elements(tensors[record.name], slot, boxes[record.name]))
        if slot.flat is None or not optimizer:
            continue
        stepped = holding.base.state.setdefault(slot.flat, {})
        for k, value in saved_optimizer.get("state", {}).get(slot.name, {}).items():
            if k not in keys[slot.name]:
                stepped[k] = value  # ``step``: alike for every parameter of the partition
                continue
            if k not in stepped:
                stepped[k] = torch.zeros_like(slot.flat)
            stepped[k].view(-1).narrow(0, slot.offset, slot.count).copy_(
                _elements(value, slot, boxes[record.name]))
    for name, buffer in buffers.items():
        buffer.data.copy_(tensors[by_key[name, None].name])
    holding.update_model(slots)
    if optimizer and saved_optimizer:
        holding.set_hyperparameters(saved_optimizer["param_groups"])
    return decode_tree(meta.state["extra"], tensors.__getitem__)["deepspeed"]["state"]


def _covering(slot: _Slot) -> Box:
    """The rows of the parameter that hold this rank's elements of it."""
    row = math.prod(slot.shape[1:])
    first, last = (slot.start // row, -(-(slot.start + slot.count) // row)) if row else (0, 0)
    return [first] + [0] * (len(slot.shape) - 1), [last - first, *slot.shape[1:]]


def _elements(rows: torch.Tensor, slot: _Slot, box: Box) -> torch.Tensor:
    """This rank's elements of the parameter, from the ``rows`` of ``box``."""
    first = box[0][0] * math.prod(slot.shape[1:])
    return rows.reshape(-1).narrow(0, slot.start - first, slot.count)
