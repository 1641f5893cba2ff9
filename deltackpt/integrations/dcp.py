"""A storage layer for ``torch.distributed.checkpoint`` (DCP): ``dcp.save``, ``dcp.async_save``
and ``dcp.load`` of deltackpt steps, for the code that checkpoints through DCP (torchtitan,
torchtune, FSDP2 training loops).

    dcp.save(state_dict, storage_writer=Writer("runs/ckpt", step=N))
    dcp.load(state_dict, storage_reader=Reader("runs/ckpt", step=N))

A save is an ordinary step of a :class:`~deltackpt.manager.CheckpointManager`, full or delta by
its policy. DCP's state dict, flattened by its planner, is named as deltackpt names state:

* ``<prefix>state.<fqn>.<key>`` is optimizer state ``key`` (``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer``, ``step``...) of the parameter stored under ``<model prefix><fqn>``, where
  exactly one tensor of the state dict ends in ``<fqn>`` (``optim.state.0.weight.exp_avg`` of
  ``model.0.weight``); ``<prefix>param_groups.<i>.<name>`` are its hyperparameters. So moments
  are coded by meaning and the model is stored under its own FQNs (``model/0.weight``);
* the other tensors under the model prefix are buffers (stored exactly), and the rest is kept
  under ``extra["dcp"]``: plain tensors, and every non-tensor value, exactly;
* DTensors (FSDP2, tensor parallel) are written shard by shard in global coordinates, a
  replicated tensor once (:mod:`deltackpt.dist.shards`).

``extra["dcp"]["tensors"]`` maps every DCP key to its tensor's name, which is how
:class:`Reader` serves DCP its items, at any world size and layout. Non-tensor values are
what ``torch.load(weights_only=True)`` makes of DCP's bytes, stored as tagged JSON where they
fit (else as those bytes) and handed back to DCP's planner as DCP serialises them.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from deltackpt.dist.group import Group
from deltackpt.dist.shards import is_dtensor
from deltackpt.encode.policy import CompressionConfig, as_config
from deltackpt.errors import ConfigError, IntegrationError
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import Box, StepMetadata, tensor_name
from deltackpt.format.state import CapturedState
from deltackpt.format.tree import decode_tree, encode_tree
from deltackpt.integrations.runs import check_same_run
from deltackpt.manager import CheckpointManager
from deltackpt.ops.retention import RetentionPolicy
from deltackpt.restore.chain import restore_chain
from deltackpt.restore.consistent import ChainReads, read_consistently
from deltackpt.save.capture import capture_values
from deltackpt.save.info import SaveInfo
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY

FORMAT = 1  # of extra["dcp"]
_INDEXED_GROUP = re.compile(r"(?:.*\.)?param_groups\.(?P<index>\d+)\.(?P<name>[^.]+)")
_FLAT_GROUP = re.compile(r"(?:.*\.)?param_groups\.(?P<fqn>.+)\.(?P<name>[^.]+)")


class _Runs:
    """The managers this process saves through (one per directory: the reference its next delta
    is coded against lives there between saves) and the directories it read or wrote, which
    its run continues."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.managers: dict[str, CheckpointManager] = {}
        self.touched: set[str] = set()

    def manager(self, writer: Writer) -> CheckpointManager:
        with self.lock:
            manager = self.managers.get(writer.key)
            if manager is None or (manager.full_every, manager.depth, manager.compression,
                                   manager.keep) != _settings(writer):
                manager = CheckpointManager(writer.path, writer.full_every, depth=writer.depth,
                                            compression=writer.compression, keep=writer.keep,
                                            storage_options=writer.storage_options)
                self.managers[writer.key] = manager
            return manager


runs = _Runs()


def _settings(writer: Writer) -> tuple[Any, ...]:
    """The writer's ``full_every``, ``depth``, ``compression`` and ``keep`` as a manager made
    with them holds them (a preset's config, a parsed policy)."""
    keep = None if writer.keep is None else RetentionPolicy.parse(writer.keep)
    return writer.full_every, writer.depth, as_config(writer.compression), keep


def directory_key(path: str | os.PathLike[str]) -> str:
    """The identity of a checkpoint directory within this process."""
    text = os.fspath(path)
    return text if "://" in text and not text.startswith("file://") else \
        os.path.realpath(text.removeprefix("file://"))


def ranks_of(process_group: Any) -> Group:
    """The ranks DCP saves or loads with: those of ``process_group`` (default: the default
    group), or this process alone outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return Group.single()
    world = dist.get_world_size(process_group)
    return Group.single() if world == 1 else \
        Group(dist.get_rank(process_group), world, process_group)


class Writer(StorageWriter):
    """Saves ``dcp.save``'s (or ``dcp.async_save``'s) state dict as step ``step`` of the
    deltackpt checkpoint at ``path`` (a directory, ``file://`` or fsspec URL).

    ``full_every``, ``depth`` (restore through at most this many deltas), ``compression`` and
    ``keep`` are :class:`CheckpointManager`'s. A new Writer for the same directory continues its
    chain: from the step this process last committed there, kept in memory, or else read back
    from the last committed step. The first save into a directory holding steps this process
    neither read (:class:`Reader`) nor wrote refuses (:class:`~deltackpt.errors.OtherRunError`)
    unless ``continue_run``. ``overwrite`` replaces an existing step. ``process_group``: the one
    given to ``dcp.save``/``dcp.async_save`` (default: the default group); the save's
    collectives run on it. ``info`` is what the last save wrote (:class:`SaveInfo`).
    """

    def __init__(self, path: str | os.PathLike[str], step: int, *, full_every: int = DEFAULT_FULL_EVERY,
                 depth: int = DEFAULT_DEPTH, compression: str | CompressionConfig = "balanced",
                 keep: str | RetentionPolicy | None = None, continue_run: bool = False,
                 overwrite: bool = False, process_group: Any = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.path, self.step = path, step
        self.full_every, self.depth = full_every, depth
        self.compression, self.keep = compression, keep
        self.continue_run, self.overwrite = continue_run, overwrite
        self.process_group, self.storage_options = process_group, storage_options
        self.info: SaveInfo | None = None

    @property
    def key(self) -> str:
        return directory_key(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's ``checkpoint_id``, if given, is the checkpoint directory."""
        if checkpoint_id is not None:
            self.path = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """``use_collectives=False`` is refused: the ranks commit one step together."""
        if kwargs.get("use_collectives") is False:
            raise ConfigError("deltackpt.dcp.Writer: every rank writes its shards of one step "
                              "and rank 0 commits it, which needs use_collectives=True")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save the planner's state dict as the step, every rank together (its own shards;
        rank 0 commits), and report each item of ``plan`` written."""
        state = getattr(planner, "state_dict", None)
        if not isinstance(state, Mapping):
            raise IntegrationError(f"deltackpt.dcp.Writer needs a planner that keeps the state "
                                   f"dict it plans (DefaultSavePlanner does); "
                                   f"{type(planner).__qualname__} has none")
        group = ranks_of(self.process_group)
        mine = {item.index.fqn: planner.resolve_data(item).getvalue()
                for item in plan.items if item.type == WriteItemType.BYTE_IO}
        payloads: dict[str, bytes] = {}
        for theirs in group.all_gather(mine):
            payloads.update(theirs)
        captured = group.together("capture of the DCP state", lambda: capture_dcp(state, payloads))
        manager = runs.manager(self)
        try:
            group.together("check of the directory", lambda: self._check_run(manager))
            manager.continue_chain(captured, group)
            self.info = manager.save_captured(self.step, captured, overwrite=self.overwrite,
                                              group=group)
        finally:
            manager.close()  # the writer lock, until the next save; the reference stays
        runs.touched.add(self.key)
        done: Future[list[WriteResult]] = Future()
        done.set_result([WriteResult(index=item.index, size_in_bytes=_item_bytes(item, mine),
                                     storage_data=None) for item in plan.items])
        return done

    def _check_run(self, manager: CheckpointManager) -> None:
        check_same_run(manager, continue_run=self.continue_run, resumed=self.key in runs.touched)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing is left to do: rank 0 committed the step in :meth:`write_data`."""


def _item_bytes(item: Any, payloads: Mapping[str, bytes]) -> int:
    """The raw bytes of a write item: its payload's, or its tensor chunk's."""
    if item.type == WriteItemType.BYTE_IO:
        return len(payloads[item.index.fqn])
    chunk = item.tensor_data.chunk.sizes
    return int(torch.Size(chunk).numel()) * item.tensor_data.properties.dtype.itemsize


def capture_dcp(state: Mapping[str, Any], payloads: Mapping[str, bytes]) -> CapturedState:
    """Capture DCP's flattened state dict (``payloads``: the serialised non-tensor values of
    every rank, by key) as deltackpt names state (see the module doc)."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    objects = {k: _object(k, data) for k, data in sorted(payloads.items())}
    states = _optimizer_states(tensors)
    prefixes = Counter(owner[: len(owner) - len(fqn)] for owner, (fqn, _) in states.values())
    prefix = prefixes.most_common(1)[0][0] if prefixes else ""
    states = {k: s for k, s in states.items() if s[0] == prefix + s[1][0]}  # under one prefix
    trained = {owner for owner, _ in states.values()}
    model: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    buffers, values = set(), {}
    for key, tensor in tensors.items():
        if key in states:
            continue
        fqn = key[len(prefix):] if key.startswith(prefix) else key
        if key.startswith(prefix) or is_dtensor(tensor):
            if fqn in model:  # an FQN the prefix made ambiguous
                fqn = key
            model[fqn] = tensor
            names[key] = tensor_name("model", fqn)
            if (states and key not in trained) or not tensor.is_floating_point():
                buffers.add(fqn)
        else:
            values[key] = tensor
            names[key] = tensor_name("extra", "dcp", "values", key)
    optimizer = None
    if states:
        state_of: dict[str, dict[str, torch.Tensor]] = {}
        for key, (_, (fqn, state_key)) in states.items():
            state_of.setdefault(fqn, {})[state_key] = tensors[key]
            names[key] = tensor_name("optimizer", "state", fqn, state_key)
        optimizer = {"class": "DCP", "param_groups": _param_groups(objects, state_of),
                     "state": state_of}
    extra = {"dcp": {"format": FORMAT, "tensors": names, "values": values, "objects": objects}}
    return capture_values(model, optimizer, extra, buffers=buffers)


def _optimizer_states(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple]]:
    """``key -> (model key, (fqn, state key))`` of the optimizer state tensors: those named
    ``<prefix>state.<fqn>.<key>`` for which exactly one reading of the name finds exactly one
    other tensor whose key ends in ``<fqn>``, the parameter, of the state's shape (or the
    state a scalar, as ``step``); the others are not recognised, and stored as they are."""
    parts = {k: k.split(".") for k in tensors}
    readings = {k: [(".".join(p[i + 1:-1]), p[-1]) for i in range(len(p) - 2) if p[i] == "state"]
                for k, p in parts.items()}
    out = {}
    for key, options in readings.items():
        found = []
        for fqn, state_key in options:
            owners = [c for c in tensors if (c == fqn or c.endswith("." + fqn)) and (
                tensors[c].shape == tensors[key].shape or tensors[key].numel() == 1)]
            if len(owners) == 1:
                found.append((owners[0], (fqn, state_key)))
        if len(found) == 1:
            out[key] = found[0]
    return out


def _param_groups(objects: Mapping[str, Any], state_of: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups from DCP's values: ``param_groups.<i>.<name>`` (whose
    ``params`` list FQNs, as ``get_state_dict`` gives them) or, flattened
    (``flatten_optimizer_state_dict``, torchtitan), ``param_groups.<fqn>.<name>``, parameters
    of equal hyperparameters making a group; else one group of every parameter with state."""
    indexed: dict[int, dict[str, Any]] = {}
    flat: dict[str, dict[str, Any]] = {}
    for key, stored in objects.items():
        if "value" not in stored:
            continue
        if m := _INDEXED_GROUP.fullmatch(key):
            indexed.setdefault(int(m["index"]), {})[m["name"]] = stored["value"]
        if (m := _FLAT_GROUP.fullmatch(key)) and m["fqn"] in state_of:
            flat.setdefault(m["fqn"], {})[m["name"]] = stored["value"]
    groups = [g for _, g in sorted(indexed.items())]
    if groups and all(isinstance(g.get("params"), list) for g in groups):
        params = [p for g in groups for p in g["params"]]
        if sorted(params) == sorted(state_of) and len(set(params)) == len(params):
            return groups
    by_values: dict[str, dict[str, Any]] = {}
    for fqn in state_of:
        hyper = flat.get(fqn, {})
        group = by_values.setdefault(repr(sorted(hyper.items())), {**hyper, "params": []})
        group["params"].append(fqn)
    return list(by_values.values())


def _no_tensor(name: str) -> torch.Tensor:
    raise AssertionError(f"a non-tensor value of DCP's state names tensor {name!r}")


class _TensorInside(Exception):
    """A value holds a tensor: kept as DCP's bytes, not as JSON."""


def _refuse_tensor(path: tuple[str, ...], tensor: torch.Tensor) -> str:
    raise _TensorInside


def _object(key: str, data: bytes) -> dict[str, Any]:
    """DCP's serialised value of ``key`` as stored: ``{"value": value}`` where the value fits
    tagged JSON (FORMAT.md 2.5) without tensors, else ``{"bytes": data}``. Raises
    :class:`IntegrationError` for a value ``torch.load(weights_only=True)`` refuses (a pickled
    class of the user's)."""
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise IntegrationError(f"DCP state {key!r} is not a value deltackpt can store and load "
                               f"safely (torch.load(weights_only=True) refuses it: {exc}); store "
                               "plain Python values, tensors or numpy arrays there") from None
    try:
        encode_tree(value, ("extra", "dcp", "objects", key), _refuse_tensor)
    except (TypeError, _TensorInside):
        return {"bytes": data}
    return {"value": value}


class Reader(StorageReader):
    """Loads step ``step`` (default: the latest) of the deltackpt checkpoint at ``path`` into
    ``dcp.load``'s state dict, at any world size and layout: each rank decodes only the chunks
    of the boxes it asks for. Reads that race the writer's retention read again
    (:func:`~deltackpt.restore.consistent.read_consistently`)."""

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.path, self.step = path, step
        self.storage_options = storage_options
        self._manager: CheckpointManager | None = None
        self._meta: StepMetadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's ``checkpoint_id``, if given, is the checkpoint directory."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._manager = self._meta = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's view of the step: every DCP key with its global shape and dtype, as one chunk
        (any box of it can be read), or as a value."""
        if self._manager is None:
            self._manager = CheckpointManager(self.path, read_only=True,
                                              storage_options=self.storage_options)
        step = self._manager.resolve_step(self.step)
        self._meta = meta = self._manager.metadata(step)
        dcp = saved_section(meta, "dcp", FORMAT, "deltackpt.dcp.Writer")
        records = {r.name: r for r in meta.tensors}
        items: dict[str, Any] = {}
        for key, name in dcp["tensors"].items():
            record = records[name]
            dtype = spec_named(record.dtype, name).torch_dtype
            items[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(record.shape),
                [ChunkStorageMetadata(torch.Size([0] * len(record.shape)),
                                      torch.Size(record.shape))])
        for key in dcp["objects"]:
            items[key] = BytesStorageMetadata()
        runs.touched.add(directory_key(self.path))
        return Metadata(state_dict_metadata=items)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Decode the boxes of the step ``plan`` asks for (each tensor's box spanning its
        items) and hand each item to ``planner``."""
        manager, meta = self._manager, self._meta
        if manager is None or meta is None:
            raise IntegrationError("deltackpt.dcp.Reader: read_data before read_metadata")
        dcp = saved_section(meta, "dcp", FORMAT, "deltackpt.dcp.Writer")
        names = dcp["tensors"]
        wanted: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(serialised(item.storage_index.fqn,
                                                                dcp["objects"])))
            else:
                wanted.setdefault(names[item.storage_index.fqn], []).append(item)
        boxes = {name: spanning([(list(i.storage_offsets), list(i.lengths)) for i in items])
                 for name, items in wanted.items()}
        tensors = read_boxes(manager, meta, boxes)
        for name, items in wanted.items():
            origin = boxes[name][0]
            for item in items:
                source = tensors[name]
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                           strict=True)):
                    source = source.narrow(dim, offset - origin[dim], length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(source)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def read_boxes(manager: CheckpointManager, meta: StepMetadata,
               boxes: Mapping[str, Box]) -> dict[str, torch.Tensor]:
    """Every tensor of step ``meta`` rebuilt through its chain, those in ``boxes`` only over
    their box; :class:`IntegrationError` if the step was replaced since ``meta`` was read (a
    load that planned on ``meta`` must plan again)."""
    def restore(reads: ChainReads) -> dict[str, torch.Tensor]:
        current = reads(meta.step)
        if current.save_id != meta.save_id:
            raise IntegrationError(f"step {meta.step} of {manager.path} was replaced while it was "
                                   "being loaded; load it again")
        return restore_chain(manager.storage, current, boxes=dict(boxes), read=reads)[0]

    return read_consistently(manager.storage, meta.step, restore)


def saved_section(meta: StepMetadata, key: str, version: int, saved_by: str) -> dict[str, Any]:
    """``extra[key]`` of a step an integration saved (``saved_by`` names it), of format
    ``version``; :class:`IntegrationError` for another step."""
    extra = meta.state.get("extra")
    section = extra.get(key) if isinstance(extra, dict) else None
    if not isinstance(section, dict) or section.get("format") != version:
        raise IntegrationError(f"step {meta.step} was not saved through {saved_by}; load it "
                               "with CheckpointManager.load")
    return section


def serialised(key: str, objects: Mapping[str, Any]) -> bytes:
    """DCP's serialisation of the value stored under ``key`` (a JSON value is saved again as
    DCP does; stored bytes only if ``torch.load(weights_only=True)`` reads them)."""
    stored = objects[key]
    if "value" in stored:
        buffer = io.BytesIO()
        torch.save(decode_tree(stored["value"], _no_tensor), buffer)
        return buffer.getvalue()
    data = decode_tree(stored["bytes"], _no_tensor)
    _object(key, data)  # refuses what a weights-only load refuses
    return data


def spanning(boxes: list[Box]) -> Box:
    """The box (offsets, sizes) spanning ``boxes``."""
    lo = [min(offsets[d] for offsets, _ in boxes) for d in range(len(boxes[0][0]))]
    hi = [max(offsets[d] + sizes[d] for offsets, sizes in boxes) for d in range(len(lo))]
    return lo, [h - low for h, low in zip(hi, lo, strict=True)]
