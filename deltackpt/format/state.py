"""A step's state in memory: its tensors under their universal names (docs/FORMAT.md 2.3) and
the tagged-JSON tree of the rest (2.5), as a save captures it and a restore rebuilds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deltackpt.format.tree import decode_tree


@dataclass(frozen=True)
class Placement:
    """Where a tensor given as its local box lies in its global tensor, for state that a
    framework shards by its own description instead of as DTensors (Megatron-core's
    ``ShardedTensor``): the global ``shape``, the box's ``offsets`` in it, and whether this
    rank ``writes`` the box (False: a replica of a box another rank writes)."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writes: bool = True


@dataclass
class CapturedTensor:
    """A tensor of the state with its universal name and role; with a ``placement``, the tensor
    is this rank's box of a larger global tensor."""

    name: str
    role: str
    tensor: torch.Tensor
    fqn: str | None = None
    state_key: str | None = None
    alias_of: str | None = None
    placement: Placement | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The shape of the tensor as stored: its placement's, else the tensor's (a DTensor's
        global shape)."""
        return self.placement.shape if self.placement is not None else tuple(self.tensor.shape)


@dataclass
class CapturedState:
    """Every tensor of a step, and the tagged-JSON tree of the rest."""

    tensors: list[CapturedTensor]
    tree: dict[str, Any]

    def by_name(self) -> dict[str, torch.Tensor]:
        """Every tensor by its universal name."""
        return {t.name: t.tensor for t in self.tensors}

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """The model's state dict (parameters and buffers) by FQN; tied names share a tensor."""
        return {t.fqn: t.tensor for t in self.tensors if t.role in ("param", "buffer")}

    def decoded(self, key: str) -> Any:
        """Section ``key`` of the tree (``"optimizer"``, ``"rng"``, ``"extra"``) with its tensors."""
        return decode_tree(self.tree.get(key), self.by_name().__getitem__)
