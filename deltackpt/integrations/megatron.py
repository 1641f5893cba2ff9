"""Megatron-core ``dist_checkpointing`` save and load strategies that keep its sharded state as
deltackpt steps:

    dist_checkpointing.save(sharded_state_dict, "ckpt/iter_0000100",
                            sharded_strategy=SaveStrategy("runs/ckpt"))
    dist_checkpointing.load(sharded_state_dict, "ckpt/iter_0000100")  # after register()

A save is an ordinary step of a :class:`~deltackpt.manager.CheckpointManager` at ``path``
(full or delta by its policy), numbered as the iteration in Megatron's checkpoint directory name
(``iter_0000100`` is step 100) unless ``step`` is given. Megatron's own files (``common.pt``,
``metadata.json``) stay in that directory, with ``deltackpt.json`` naming the step, so that
``dist_checkpointing.load`` finds it there.

* Every ``ShardedTensor`` is a tensor of the step under its key (``model/<key>``), of its global
  shape: each rank writes its box at its global offset (prepended axes included), a box that
  several ranks hold (``replica_id`` not all zero) once. Floating-point tensors are coded as
  weights (deltas between full steps), the others exactly.
* ``ShardedObject`` values are stored exactly, as :mod:`deltackpt.integrations.dcp` stores DCP's
  values (tagged JSON, else their bytes, re-checked with ``torch.load(weights_only=True)``).
* A load asks for the box of each requested ``ShardedTensor``, at any tensor-, pipeline- or
  data-parallel layout: each rank decodes only the chunks of its boxes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltackpt.encode.policy import CompressionConfig
from deltackpt.errors import ConfigError, IntegrationError
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import Box, StepMetadata
from deltackpt.format.state import CapturedState, Placement
from deltackpt.format.tree import encode_tree
from deltackpt.integrations.dcp import (
    capture_dcp,
    directory_key,
    ranks_of,
    read_boxes,
    runs,
    saved_section,
    serialised,
    spanning,
)
from deltackpt.integrations.frameworks import require
from deltackpt.integrations.runs import check_same_run
from deltackpt.manager import CheckpointManager
from deltackpt.ops.retention import RetentionPolicy
from deltackpt.save.info import SaveInfo
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY

require("megatron.core")
from megatron.core.dist_checkpointing.dict_utils import (  # noqa: E402
    dict_list_map_inplace,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.base import (  # noqa: E402
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

BACKEND, VERSION = "deltackpt", 1  # Megatron's metadata.json names this backend
FORMAT = 1  # of extra["megatron"]
POINTER = "deltackpt.json"  # in Megatron's checkpoint directory: the step it holds
_ITERATION = re.compile(r"(\d+)$")



def _box(tensor: ShardedTensor) -> Box:
    """Global offsets and sizes of a ShardedTensor's local data (prepended axes of size 1)."""
    if tensor.flattened_range is not None:
        raise IntegrationError(f"ShardedTensor {tensor.key!r} has a flattened_range, which "
                               "megatron-core 0.16 no longer supports; save it unflattened")
    return list(tensor.global_offset), [1] * tensor.prepend_axis_num + list(tensor.local_shape)


def _is_replica(replica_id: Any) -> bool:
    """Whether ``replica_id`` marks a copy another rank writes (any non-zero component)."""
    ids = replica_id if isinstance(replica_id, (tuple, list)) else (replica_id,)
    return any(int(i) != 0 for i in ids)


class SaveStrategy(SaveShardedStrategy):
    """Saves ``dist_checkpointing.save``'s sharded state dict as a step of the deltackpt
    checkpoint at ``path`` (a directory, ``file://`` or fsspec URL): pass it as
    ``sharded_strategy=``.

    ``step``: the step number (default: the trailing digits of Megatron's checkpoint directory
    name, ``iter_0000100`` -> 100). ``full_every``, ``depth`` (restore through at most this many
    deltas), ``compression`` and ``keep`` are :class:`CheckpointManager`'s; a strategy saving
    into a directory this process wrote to or loaded from continues its chain, and the first
    save into a directory holding another run's steps refuses
    (:class:`~deltackpt.errors.OtherRunError`) unless ``continue_run``. ``overwrite`` replaces
    an existing step. ``info`` is what the last save wrote.
    """

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 full_every: int = DEFAULT_FULL_EVERY, depth: int = DEFAULT_DEPTH,
                 compression: str | CompressionConfig = "balanced",
                 keep: str | RetentionPolicy | None = None, continue_run: bool = False,
                 overwrite: bool = False, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(BACKEND, VERSION)
        self.path, self.step = path, step
        self.full_every, self.depth = full_every, depth
        self.compression, self.keep = compression, keep
        self.continue_run, self.overwrite = continue_run, overwrite
        self.storage_options = storage_options
        self.info: SaveInfo | None = None

    @property
    def key(self) -> str:
        return directory_key(self.path)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Save the sharded state dict as the step, every rank together (each its boxes; rank 0
        commits), and name the step in ``checkpoint_dir``."""
        step = self.step if self.step is not None else _iteration(checkpoint_dir)
        group = ranks_of(None)
        tensors, placements, payloads = _local_state(sharded_state_dict)
        described = {k: (list(p.shape), str(t.dtype)) for k, (t, p) in
                     ((k, (tensors[k], placements[k])) for k in tensors)}
        everyone = group.all_gather((described, payloads))
        merged: dict[str, bytes] = {}
        for theirs, objects in everyone:
            merged.update(objects)
            for key, (shape, dtype) in theirs.items():  # a tensor this rank holds no box of
                if key not in tensors:
                    tensors[key] = torch.empty([0] * len(shape), dtype=getattr(torch, dtype[6:]))
                    placements[key] = Placement(tuple(shape), (0,) * len(shape), writes=False)
        captured = group.together("capture of the Megatron state",
                                  lambda: capture_megatron(tensors, placements, merged))
        manager = runs.manager(self)
        try:
            group.together("check of the directory", lambda: check_same_run(
                manager, continue_run=self.continue_run, resumed=self.key in runs.touched))
            manager.continue_chain(captured, group)
            self.info = manager.save_captured(step, captured, overwrite=self.overwrite,
                                              group=group)
        finally:
            manager.close()  # the writer lock, until the next save; the reference stays
        runs.touched.add(self.key)
        if group.rank == 0:
            pointer = {"path": self.path if "://" in os.fspath(self.path) else self.key,
                       "step": step}
            (Path(checkpoint_dir) / POINTER).write_text(json.dumps(pointer) + "\n")


def _iteration(checkpoint_dir: str | Path) -> int:
    """The iteration a Megatron checkpoint directory's name ends in (``iter_0000100``)."""
    found = _ITERATION.search(Path(checkpoint_dir).name)
    if found is None:
        raise ConfigError(f"deltackpt.megatron.SaveStrategy: the checkpoint directory "
                          f"{os.fspath(checkpoint_dir)!r} does not end in an iteration number "
                          "(iter_0000100); pass step= to number the step")
    return int(found[1])


def _local_state(sharded_state_dict: Any) -> tuple[dict[str, torch.Tensor], dict[str, Placement],
                                                   dict[str, bytes]]:
    """This rank's boxes (by key: the data, its placement) and the serialised values of the
    ShardedObjects it writes (by unique key)."""
    tensors: dict[str, torch.Tensor] = {}
    placements: dict[str, Placement] = {}
    payloads: dict[str, bytes] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            if value.key in tensors:
                raise IntegrationError(f"ShardedTensor {value.key!r} has several boxes on one "
                                       "rank; deltackpt stores one box of a tensor per "
                                       "rank (merge them, or give them their own keys)")
            offsets, sizes = _box(value)
            tensors[value.key] = value.data.detach().reshape(sizes)
            placements[value.key] = Placement(tuple(value.global_shape), tuple(offsets),
                                              writes=not _is_replica(value.replica_id))
        elif isinstance(value, ShardedObject):
            if not _is_replica(value.replica_id):
                buffer = io.BytesIO()
                torch.save(value.data, buffer)
                payloads[value.unique_key] = buffer.getvalue()
        else:
            raise IntegrationError(f"deltackpt.megatron.SaveStrategy saves ShardedTensors and "
                                   f"ShardedObjects, not {type(value).__qualname__}")
    return tensors, placements, payloads


def capture_megatron(tensors: Mapping[str, torch.Tensor], placements: Mapping[str, Placement],
                     payloads: Mapping[str, bytes]) -> CapturedState:
    """Capture Megatron's sharded state: the boxes ``tensors`` (by key) at their ``placements``,
    and the ShardedObjects' serialised values ``payloads`` (of every rank, by unique key)."""
    captured = capture_dcp(tensors, payloads)
    names = {name: key for key, name in captured.decoded("extra")["dcp"]["tensors"].items()}
    captured.tensors = [replace(t, placement=placements[names[t.name]]) if t.name in names else t
                        for t in captured.tensors]
    captured.tree["extra"]["megatron"] = encode_tree({"format": FORMAT}, ("extra", "megatron"),
                                                     _no_tensor)
    return captured


def _no_tensor(path: tuple[str, ...], tensor: torch.Tensor) -> str:
    raise AssertionError(f"the Megatron section names tensor {path}")


class LoadStrategy(LoadShardedStrategy):
    """Loads a step saved by :class:`SaveStrategy` into ``dist_checkpointing.load``'s sharded
    state dict, at any layout: each requested ShardedTensor's box, each ShardedObject's value.

    ``path`` and ``step``: the deltackpt checkpoint and step (default: those named in Megatron's
    checkpoint directory, as :class:`SaveStrategy` left them; ``step=None`` with a ``path``: its
    latest step). :func:`register` makes it the strategy ``dist_checkpointing.load`` picks for
    checkpoints :class:`SaveStrategy` wrote."""

    def __init__(self, path: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.path, self.step, self.storage_options = path, step, storage_options

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise IntegrationError(f"the checkpoint was saved with Megatron's {loaded_backend!r} "
                                   f"strategy, not deltackpt's; load it with that strategy")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise IntegrationError(f"the checkpoint's deltackpt strategy version is "
                                   f"{loaded_version}; this deltackpt reads version {VERSION}")

    @contextlib.contextmanager
    def _step(self, checkpoint_dir: str | Path) -> Iterator[tuple[CheckpointManager, StepMetadata]]:
        """A reader of the checkpoint (closed at the block's end) and the metadata of the step
        to load."""
        path, step = self.path, self.step
        if path is None:
            pointer = Path(checkpoint_dir) / POINTER
            try:
                named = json.loads(pointer.read_text())
                path, step = named["path"], int(named["step"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise IntegrationError(f"{pointer} does not name a deltackpt step ({exc}); was "
                                       "the checkpoint saved by deltackpt.megatron.SaveStrategy?"
                                       ) from None
        with CheckpointManager(path, read_only=True,
                               storage_options=self.storage_options) as manager:
            meta = manager.metadata(manager.resolve_step(step))
            saved_section(meta, "megatron", FORMAT, "deltackpt.megatron.SaveStrategy")
            yield manager, meta

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Fill the sharded state dict from the step: each ShardedTensor becomes its box as a
        tensor (into its ``data`` where that has the box's shape), each ShardedObject its value."""
        with self._step(checkpoint_dir) as (manager, meta):
            return self._read(manager, meta, sharded_state_dict)

    def _read(self, manager: CheckpointManager, meta: StepMetadata, sharded_state_dict: Any) -> Any:
        dcp = meta.state["extra"]["dcp"]
        names, records = dcp["tensors"], {r.name: r for r in meta.tensors}
        wanted: dict[str, list[Box]] = {}
        for value in nested_values(sharded_state_dict):
            if isinstance(value, ShardedTensor):
                name = names.get(value.key)
                if name is None:
                    raise IntegrationError(f"step {meta.step} of {manager.path} holds no tensor "
                                           f"{value.key!r}")
                if list(records[name].shape) != list(value.global_shape):
                    raise IntegrationError(
                        f"tensor {value.key!r} has the global shape {list(value.global_shape)} "
                        f"here and {records[name].shape} in step {meta.step} of {manager.path}")
                wanted.setdefault(name, []).append(_box(value))
            elif isinstance(value, ShardedObject) and value.unique_key not in dcp["objects"]:
                raise IntegrationError(f"step {meta.step} of {manager.path} holds no "
                                       f"ShardedObject {value.unique_key!r}")
        boxes = {name: spanning(found) for name, found in wanted.items()}

        tensors = read_boxes(manager, meta, boxes)
        runs.touched.add(directory_key(manager.path))

        def loaded(value: Any) -> Any:
            if isinstance(value, ShardedObject):
                return torch.load(io.BytesIO(serialised(value.unique_key, dcp["objects"])),
                                  weights_only=True)
            if not isinstance(value, ShardedTensor):
                return value
            name = names[value.key]
            source, origin = tensors[name], boxes[name][0]
            offsets, sizes = _box(value)
            for dim, (offset, length) in enumerate(zip(offsets, sizes, strict=True)):
                source = source.narrow(dim, offset - origin[dim], length)
            source = source.reshape(value.local_shape)
            if value.data is not None and tuple(value.data.shape) == tuple(value.local_shape):
                return value.data.detach().copy_(source)
            return source.to(value.dtype).clone()

        return dict_list_map_inplace(loaded, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        """Every ShardedTensor of the step, by key, with its global shape and dtype (no data)."""
        with self._step(checkpoint_dir) as (_, meta):
            records = {r.name: r for r in meta.tensors}
            out = {}
            for key, name in meta.state["extra"]["dcp"]["tensors"].items():
                record = records[name]
                empty = torch.empty(record.shape, dtype=spec_named(record.dtype, name).torch_dtype,
                                    device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return out


def register(save: SaveStrategy | None = None) -> None:
    """Register :class:`LoadStrategy` as the strategy ``dist_checkpointing.load`` picks for
    checkpoints :class:`SaveStrategy` wrote (their ``metadata.json`` names backend
    ``"deltackpt"``), and ``save``, if given, as the one ``sharded_strategy=("deltackpt", 1)``
    names."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
    if save is not None:
        register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save)
