"""Shards under torch.distributed: which box of each tensor a rank writes and loads, and the
DTensor helpers behind it (the ranks' collectives: :mod:`deltackpt.dist.group`).

A step saved by several ranks stores every tensor in global coordinates
(docs/FORMAT.md 2): each rank writes the boxes it holds, as fragments, and
one rank commits the metadata that lists them all. Which boxes:

* a ``DTensor`` contributes its local shard, at the global offset its
  placements give it. Ranks that hold the same shard (``Replicate`` mesh
  dimensions) split it along its first dimension, each writing one part,
  so a replicated tensor is written once and its coding is shared out;
* a plain tensor is taken to be replicated on every rank (as DDP and the
  step counters of FSDP2 optimizers are) and split the same way. Its bytes
  are compared across ranks first: a plain tensor that differs between
  ranks (a hand-sharded layout) is refused rather than stitched together;
* a tensor captured with a :class:`~deltackpt.format.state.Placement` (a
  framework's own sharding, as Megatron-core's) is that box of its global
  tensor, written by the rank whose placement says it writes it;
* RNG states and ``extra`` are rank 0's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import xxhash

from deltackpt.format.dtypes import raw_bytes
from deltackpt.codecs.digest import tensor_digest
from deltackpt.dist.group import Group
from deltackpt.errors import DistributedError

if TYPE_CHECKING:
    from torch import nn

    from deltackpt.format.metadata import TensorRecord
    from deltackpt.format.state import CapturedState, Placement

T = TypeVar("T")

# Roles whose tensors only rank 0 writes (they may differ between ranks, by design).
RANK0_ROLES = frozenset({"rng", "extra"})


@dataclass
class Part:
    """A box of a global tensor that this rank writes: ``offsets`` and ``sizes`` in global
    coordinates, ``values`` the box's elements (a local tensor of shape ``sizes``)."""

    offsets: list[int]
    sizes: list[int]
    values: torch.Tensor


@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed support
        return None
    return DTensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``."""
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """The elements this process holds: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def with_local(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``tensor``'s place: for a DTensor, a DTensor of the same global shape, mesh
    and placements whose local shard is ``local`` (built as ``DTensor.from_local`` builds one,
    without its move to the mesh's device: ``local`` may be a host copy, or a ``meta``
    tensor); else ``local`` itself."""
    if not is_dtensor(tensor):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, tensor._spec, requires_grad=False)


def parts_to_write(name: str, role: str, tensor: torch.Tensor, group: Group | None,
                   placement: Placement | None = None) -> list[Part]:
    """The boxes of ``tensor`` (global shape ``tensor.shape``) that this rank writes.

    Without a group, or with one rank: the whole tensor (a DTensor's local tensor, which on
    a mesh of one rank is all of it). With a ``placement``: ``tensor`` is the box at its
    offsets, written where the placement says so, whatever the group. Raises ``ValueError``
    naming the tensor for a DTensor with ``Partial`` placements (reduce it first), for one
    saved by one rank whose mesh shards it over more, or for a placed box that does not lie
    within its global shape.
    """
    if placement is not None:
        return _placed_part(name, tensor, placement)
    shape = list(tensor.shape)
    if group is None or group.world_size == 1:
        return [Part([0] * len(shape), shape, _whole_values(name, tensor))]
    if role in RANK0_ROLES:
        return [Part([0] * len(shape), shape, tensor)] if group.rank == 0 else []
    if is_dtensor(tensor):
        offsets, sizes, values, replica, replicas = _dtensor_box(name, tensor)
    else:
        offsets, sizes, values = [0] * len(shape), shape, tensor
        replica, replicas = group.rank, group.world_size
    if replica is None:
        return []
    if not sizes:  # a scalar: the first replica writes it
        return [Part(offsets, sizes, values)] if replica == 0 else []
    rows = sizes[0]
    lo, hi = rows * replica // replicas, rows * (replica + 1) // replicas
    if hi == lo:
        return []
    return [Part([offsets[0] + lo, *offsets[1:]], [hi - lo, *sizes[1:]], values[lo:hi])]


def _whole_values(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The elements of the whole of ``tensor``, saved by one rank: a DTensor's local tensor
    (a plain tensor, as the coding and writing of its bytes need), which must hold all of it."""
    if not is_dtensor(tensor):
        return tensor
    local = tensor.to_local()
    if local.shape != tensor.shape:
        raise ValueError(f"tensor {name!r} is a DTensor sharded over the {tensor.device_mesh.size()} "
                         "ranks of its mesh, saved by one rank: save it from every rank of "
                         "its mesh, in one process group")
    return local


def _placed_part(name: str, tensor: torch.Tensor, placement: Placement) -> list[Part]:
    """The box ``tensor`` of a placed tensor, if this rank writes it."""
    offsets, sizes, shape = list(placement.offsets), list(tensor.shape), list(placement.shape)
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)):
        raise ValueError(f"tensor {name!r}: a box of shape {sizes} at offsets {offsets} does not "
                         f"lie within its global shape {shape}")
    return [Part(offsets, sizes, tensor)] if placement.writes else []


def _dtensor_box(name: str, tensor: Any) -> tuple[list[int], list[int], torch.Tensor,
                                                 int | None, int]:
    """Global offsets and sizes of a DTensor's local shard, the shard, and this rank's index
    among the ranks that hold the same shard (None when the rank is outside the mesh)."""
    mesh, placements = tensor.device_mesh, tensor.placements
    if any(p.is_partial() for p in placements):
        raise ValueError(f"tensor {name!r} is a DTensor with Partial placements {placements}: "
                         "reduce it (redistribute to Shard or Replicate) before saving")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return [], [], tensor.to_local(), None, 1
    offsets, sizes = local_box(tensor)
    replicated = [d for d, p in enumerate(placements) if p.is_replicate()]
    replicas = math.prod(mesh.size(d) for d in replicated)
    replica = 0
    for d in replicated:
        replica = replica * mesh.size(d) + coordinate[d]
    return offsets, sizes, tensor.to_local(), replica, replicas


def check_same_state(captured: CapturedState, group: Group, *, at_call: bool = False) -> None:
    """Raise :class:`DistributedError` on every rank unless all ranks captured the same
    tensors (names, roles, dtypes, global shapes, aliases, the kind of device their values
    are on) and equal plain tensors, and plan the save at the same point: ``at_call`` (a
    delta encoded on a device, :func:`deltackpt.save.driver.encode_at_call`) or on the save
    thread. (This check is the first collective of either, so ranks that took different
    paths meet here and fail together instead of mismatching the collectives after it.)

    Every rank sees every rank's description and reaches the same verdict,
    so all of them raise together. A single process agrees with itself.
    """
    if group.world_size == 1:
        return
    mine: dict | str = {}
    try:
        for t in captured.tensors:
            plain = t.alias_of is None and t.role not in RANK0_ROLES \
                and not is_dtensor(t.tensor) and t.placement is None
            digest = tensor_digest(t.tensor) if plain else None
            mine[t.name] = (t.role, str(t.tensor.dtype), t.global_shape, t.alias_of,
                            local_values(t.tensor).device.type, digest)
    except Exception as exc:  # raised on every rank below
        mine = f"{type(exc).__name__}: {exc}"
    stages, everyone = zip(*group.all_gather((at_call, mine)), strict=True)
    if len(set(stages)) > 1:
        from deltackpt.codecs.quant import KERNELS_ENV

        at = [str(r) for r, s in enumerate(stages) if s]
        raise DistributedError(
            f"ranks {', '.join(at)} plan the save at its call (a delta encoded on their device) "
            "and the others on the save thread: every rank must hold its state on the same "
            f"kind of device, with the same {KERNELS_ENV} setting")
    failed = [f"rank {r}: {e}" for r, e in enumerate(everyone) if isinstance(e, str)]
    if failed:
        raise DistributedError("capturing the state failed on " + "; ".join(failed))
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        for name in sorted(everyone[0].keys() ^ theirs.keys()):
            where = "rank 0" if name in everyone[0] else f"rank {rank}"
            problems.append(f"tensor {name!r} is only captured on {where} (of ranks 0, {rank})")
        for name in sorted(everyone[0].keys() & theirs.keys()):
            ours, other = everyone[0][name], theirs[name]
            if ours[:5] != other[:5]:
                problems.append(f"tensor {name!r} is {ours[:5]} on rank 0, {other[:5]} on rank "
                                f"{rank} (role, dtype, shape, alias, device)")
            elif ours[5] != other[5]:
                problems.append(f"tensor {name!r} is a plain tensor whose values differ between "
                                f"ranks 0 and {rank}: only DTensors and placed boxes may hold "
                                "different shards")
    if problems:
        raise DistributedError("ranks disagree on the state to save: " + "; ".join(problems[:20])
                                   + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))


def sharded_targets(records: list[TensorRecord], model: nn.Module | None) -> dict[str, Any]:
    """The DTensors whose layout saved tensors take when loaded into ``model``: by tensor
    name, a parameter or buffer of the model that is a DTensor of the saved shape, for the
    tensor itself and for its optimizer states of the same shape (``exp_avg``, ...)."""
    if model is None:
        return {}
    current = {fqn: t for fqn, t in model.state_dict().items() if is_dtensor(t)}
    targets = {}
    for record in records:
        target = current.get(record.fqn) if record.role in ("param", "buffer", "optimizer") \
            else None
        if target is not None and list(target.shape) == list(record.shape):
            targets[record.name] = target
    return targets


def local_box(target: Any) -> tuple[list[int], list[int]]:
    """Global offsets and sizes of the shard of DTensor ``target`` this rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                           target.placements)
    return list(offsets), list(sizes)


def shard_like(target: Any, local: torch.Tensor) -> torch.Tensor:
    """A DTensor laid out as ``target`` whose shard on this rank is ``local`` (its box)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(target.device), target.device_mesh, target.placements,
                              run_check=False, shape=target.shape, stride=target.stride())


def shard_parts(captured: CapturedState, group: Group | None) -> dict[str, list[Part]]:
    """The boxes of each stored tensor this rank writes (:func:`parts_to_write`; without a
    group or with one rank, every tensor whole), by name; a tensor has at most one, whose values its delta
    encoder codes. This is the rank's layout, an input of a save's plan."""
    return {t.name: parts_to_write(t.name, t.role, t.tensor, group, t.placement)
            for t in captured.tensors if t.alias_of is None}


def local_parts(parts: dict[str, list[Part]]) -> dict[str, torch.Tensor]:
    """The values of the one box of each tensor the rank writes (of :func:`shard_parts`)."""
    return {name: p[0].values for name, p in parts.items() if p}
