"""Sharding patterns: how the tensors of a hand-sharded (Megatron-style) model relate to whole ones.

Frameworks that shard a model by hand (tensor parallelism without
DTensor) save one state dict per rank whose tensors are slices, copies or
averages of the model's real parameters; nothing in the files says which.
A :class:`ShardingSpec` says it, per name pattern, and serves both
directions with the same rules:

* :meth:`ShardingSpec.merge` turns the state dicts of ``tp_size`` ranks into
  whole tensors (the universal form deltackpt stores);
* :meth:`ShardingSpec.split` cuts whole tensors into the slices of rank
  ``tp_rank`` of ``tp_size``, for loading into a hand-sharded model.

``split`` then ``merge`` gives back the whole tensors bit for bit. The rule
kinds are those of DeepSpeed Universal Checkpointing's pattern lists
(BACKGROUND.md 1): replicated, averaged, partitioned along a dimension,
vocabulary-padded, and fused sub-parameters of uneven widths (QKV with
grouped-query attention, SwiGLU's gate and up). docs/PATTERNS.md documents
the spec with a Megatron-style GPT example.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deltackpt.dist.shards import local_values
from deltackpt.errors import StateMismatchError
from deltackpt.format.state import CapturedState, CapturedTensor
from deltackpt.restore.universal import UniversalCheckpoint

KINDS = ("replicated", "averaged", "partitioned")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShardRule:
    """How the tensors whose name matches ``pattern`` (an ``fnmatch`` glob) are sharded.

    Attributes:
        pattern: glob matched against the whole name (``*`` also matches dots).
        kind: ``"replicated"`` (every rank holds the same tensor; merging
            checks that they agree), ``"averaged"`` (ranks hold copies that
            drift apart, such as layer norms under sequence parallelism;
            merging averages them) or ``"partitioned"`` (each rank holds a
            slice along ``dim``).
        dim: the dimension a partitioned tensor is sliced along (0 for a
            column-parallel weight, 1 for a row-parallel one).
        parts: widths along ``dim`` of the fused sub-parameters of the whole
            tensor (``[q, k, v]`` rows of a fused QKV weight, ``[ffn, ffn]``
            for gate and up): each sub-parameter is sliced on its own and a
            rank holds its slices of all of them, concatenated. Widths may
            differ (grouped-query attention); each must divide by ``tp_size``.
        vocab_size: the true size along ``dim`` of a vocabulary-padded tensor
            (embedding, output layer): ranks hold slices of a tensor padded to
            a multiple of ``pad_multiple * tp_size`` rows; merging strips the
            padding, splitting pads with zeros.
        pad_multiple: Megatron's ``make_vocab_size_divisible_by``.
    """

    pattern: str
    kind: str = "partitioned"
    dim: int = 0
    parts: tuple[int, ...] | None = None
    vocab_size: int | None = None
    pad_multiple: int = 1

    def __post_init__(self) -> None:
        where = f"sharding rule {self.pattern!r}"
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"sharding rule pattern must be a non-empty string, got {self.pattern!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not _is_int(self.dim) or self.dim < 0:
            raise ValueError(f"{where}: dim must be a non-negative int, got {self.dim!r}")
        if self.parts is not None:
            object.__setattr__(self, "parts", tuple(self.parts))
            if not self.parts or not all(_is_int(w) and w > 0 for w in self.parts):
                raise ValueError(f"{where}: parts must be positive ints, got {list(self.parts)}")
        if self.vocab_size is not None and (not _is_int(self.vocab_size) or self.vocab_size < 1):
            raise ValueError(f"{where}: vocab_size must be a positive int, got {self.vocab_size!r}")
        if not _is_int(self.pad_multiple) or self.pad_multiple < 1:
            raise ValueError(f"{where}: pad_multiple must be a positive int, got {self.pad_multiple!r}")
        if self.kind != "partitioned" and (self.parts or self.vocab_size or self.dim):
            raise ValueError(f"{where}: dim, parts and vocab_size only apply to partitioned tensors")
        if self.parts and self.vocab_size:
            raise ValueError(f"{where}: a tensor is either fused (parts) or vocabulary-padded, not both")

    def matches(self, name: str) -> bool:
        """Whether this rule applies to ``name``."""
        return fnmatch.fnmatchcase(name, self.pattern)

    def padded_size(self, tp_size: int) -> int:
        """Rows along ``dim`` of the padded vocabulary on ``tp_size`` ranks (Megatron's rule)."""
        multiple = self.pad_multiple * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def merge(self, name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensor ``name`` from its ranks' ``shards`` (in rank order)."""
        if self.kind == "replicated":
            return _agreed(name, shards, self)
        _check_alike(name, shards, dim=self.dim if self.kind == "partitioned" else None)
        if self.kind == "averaged":
            if not shards[0].is_floating_point():
                raise ValueError(f"tensor {name!r}: only floating-point tensors can be averaged "
                                 f"(rule {self.pattern!r}), it is {shards[0].dtype}")
            # Summed in float64, so identical copies average to themselves exactly.
            return (sum(s.double() for s in shards) / len(shards)).to(shards[0].dtype)
        self._check_dim(name, shards[0])
        tp = len(shards)
        if self.parts:
            local = [w // tp for w in self._part_widths(name, tp)]
            if shards[0].shape[self.dim] != sum(local):
                raise ValueError(f"tensor {name!r}: each rank should hold {sum(local)} of dim "
                                 f"{self.dim} (parts {list(self.parts)} over {tp} ranks), rank 0 "
                                 f"holds {shards[0].shape[self.dim]}")
            pieces = [s.split(local, self.dim) for s in shards]
            return torch.cat([torch.cat([p[i] for p in pieces], self.dim)
                              for i in range(len(self.parts))], self.dim)
        whole = torch.cat(list(shards), self.dim)
        if self.vocab_size is not None:
            if whole.shape[self.dim] < self.vocab_size:
                raise ValueError(f"tensor {name!r}: the ranks hold {whole.shape[self.dim]} rows of "
                                 f"dim {self.dim}, fewer than vocab_size {self.vocab_size}")
            whole = whole.narrow(self.dim, 0, self.vocab_size)
        return whole

    def split(self, name: str, whole: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """The slice of ``whole`` that rank ``tp_rank`` of ``tp_size`` holds: a new tensor, or
        ``whole`` itself for a replicated or averaged one."""
        if self.kind != "partitioned":
            return whole
        self._check_dim(name, whole)
        size = whole.shape[self.dim]
        if self.parts:
            widths = self._part_widths(name, tp_size, size)
            return torch.cat([p.chunk(tp_size, self.dim)[tp_rank]
                              for p in whole.split(widths, self.dim)], self.dim).clone()
        if self.vocab_size is not None:
            if size != self.vocab_size:
                raise ValueError(f"tensor {name!r}: dim {self.dim} is {size}, not vocab_size "
                                 f"{self.vocab_size} (rule {self.pattern!r})")
            pad = [0, 0] * (whole.dim() - 1 - self.dim) + [0, self.padded_size(tp_size) - size]
            whole = torch.nn.functional.pad(whole, pad)
            size = whole.shape[self.dim]
        if size % tp_size:
            raise ValueError(f"tensor {name!r}: dim {self.dim} of size {size} cannot be split "
                             f"into {tp_size} equal slices (rule {self.pattern!r})")
        step = size // tp_size
        return whole.narrow(self.dim, tp_rank * step, step).clone()

    def _check_dim(self, name: str, tensor: torch.Tensor) -> None:
        if self.dim >= tensor.dim():
            raise ValueError(f"tensor {name!r} of shape {list(tensor.shape)} has no dim {self.dim} "
                             f"to partition (rule {self.pattern!r})")

    def _part_widths(self, name: str, tp_size: int, size: int | None = None) -> list[int]:
        widths = list(self.parts)
        if size is not None and sum(widths) != size:
            raise ValueError(f"tensor {name!r}: parts {widths} add up to {sum(widths)}, but dim "
                             f"{self.dim} is {size} (rule {self.pattern!r})")
        uneven = [w for w in widths if w % tp_size]
        if uneven:
            raise ValueError(f"tensor {name!r}: fused parts {widths} cannot be split over "
                             f"{tp_size} ranks ({uneven} not divisible; rule {self.pattern!r})")
        return widths

    def as_dict(self) -> dict[str, Any]:
        """The JSON form :meth:`ShardingSpec.from_dict` reads (defaults left out)."""
        out: dict[str, Any] = {"pattern": self.pattern, "kind": self.kind}
        if self.kind == "partitioned":
            out["dim"] = self.dim
        if self.parts:
            out["parts"] = list(self.parts)
        if self.vocab_size is not None:
            out.update(vocab_size=self.vocab_size, pad_multiple=self.pad_multiple)
        return out


# The rule of names no rule matches: they must be equal on every rank.
UNMATCHED = ShardRule("*", "replicated")


@dataclass(frozen=True)
class ShardingSpec:
    """The rules of a hand-sharded layout. A name may match at most one rule, and every rule
    must match some name of the state it is applied to (so a typo cannot pass silently).
    Names no rule matches must be replicated: equal on every rank.

    >>> spec = ShardingSpec.from_dict({"rules": [
    ...     {"pattern": "*.qkv.weight", "kind": "partitioned", "dim": 0, "parts": [512, 128, 128]},
    ...     {"pattern": "*.proj.weight", "kind": "partitioned", "dim": 1}]})
    >>> whole = spec.merge([rank0_state_dict, rank1_state_dict])
    >>> model.load_state_dict(spec.split(whole, tp_rank=1, tp_size=2))
    """

    rules: tuple[ShardRule, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        if not all(isinstance(r, ShardRule) for r in self.rules):
            raise TypeError("ShardingSpec takes ShardRule objects")

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ShardingSpec:
        """A spec from its JSON form: ``{"rules": [{"pattern": ..., "kind": ..., ...}, ...]}``."""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("rules"), list):
            raise ValueError('a sharding spec is {"rules": [...]}, got ' + repr(obj)[:80])
        fields = {"pattern", "kind", "dim", "parts", "vocab_size", "pad_multiple"}
        rules = []
        for i, rule in enumerate(obj["rules"]):
            if not isinstance(rule, Mapping):
                raise ValueError(f"sharding rule {i} must be an object, got {rule!r}")
            unknown = sorted(set(rule) - fields)
            if unknown or "pattern" not in rule:
                raise ValueError(f"sharding rule {i}: " + (f"unknown field(s) {unknown}; known: "
                                 f"{sorted(fields)}" if unknown else "needs a 'pattern'"))
            rules.append(ShardRule(**rule))
        unknown = sorted(set(obj) - {"rules"})
        if unknown:
            raise ValueError(f"sharding spec: unknown field(s) {unknown}")
        return cls(tuple(rules))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardingSpec:
        """A spec from a JSON file."""
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"sharding spec {os.fspath(path)}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(obj)
        except ValueError as exc:
            raise ValueError(f"sharding spec {os.fspath(path)}: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form of this spec."""
        return {"rules": [r.as_dict() for r in self.rules]}

    def rules_for(self, names: Sequence[str]) -> dict[str, ShardRule]:
        """The rule of each name of ``names`` (unmatched names map to a replicated rule).

        Raises ``ValueError`` listing every name two rules match and every
        rule that matches none of ``names``.
        """
        matched: dict[str, list[ShardRule]] = {n: [r for r in self.rules if r.matches(n)]
                                               for n in names}
        problems = [f"{name!r} matches {len(rules)} rules: "
                    + ", ".join(repr(r.pattern) for r in rules)
                    for name, rules in matched.items() if len(rules) > 1]
        used = {r for rules in matched.values() for r in rules}
        problems += [f"rule {r.pattern!r} matches no tensor" for r in self.rules if r not in used]
        if problems:
            raise ValueError("sharding spec does not fit the state: " + "; ".join(problems))
        return {n: rules[0] if rules else UNMATCHED for n, rules in matched.items()}

    def merge(self, shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Whole tensors from the state dicts of ranks 0..tp_size-1, which must hold the same names.

        Raises :class:`StateMismatchError` for names not held by every rank,
        ``ValueError`` for a spec that does not fit (a rule that matches no
        name or a name two rules match, unmatched tensors that differ between
        ranks, slices that do not fit their rule), naming the tensor.
        """
        if not shards:
            raise ValueError("merge needs the state dict of at least one rank")
        _check_same_names([list(s) for s in shards])
        rules = self.rules_for(list(shards[0]))
        return {name: rule.merge(name, [s[name] for s in shards]) for name, rule in rules.items()}

    def split(self, whole: Mapping[str, torch.Tensor], tp_rank: int,
              tp_size: int) -> dict[str, torch.Tensor]:
        """The state dict of rank ``tp_rank`` of ``tp_size`` cut from whole tensors.

        Raises ``ValueError`` naming the tensor when a partitioned dimension
        (or a fused part) cannot be split into ``tp_size`` equal slices, and
        for a spec that does not fit (see :meth:`merge`).
        """
        _check_rank(tp_rank, tp_size)
        rules = self.rules_for(list(whole))
        return {name: rule.split(name, whole[name], tp_rank, tp_size) for name, rule in rules.items()}


def _check_rank(tp_rank: Any, tp_size: Any) -> None:
    if not _is_int(tp_size) or tp_size < 1 or not _is_int(tp_rank) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, tp_size={tp_size!r}")


def _check_same_names(names: list[list[str]]) -> None:
    first = set(names[0])
    problems = []
    for rank, theirs in enumerate(names[1:], start=1):
        problems += [f"{n!r} only on rank 0 (not rank {rank})" for n in sorted(first - set(theirs))]
        problems += [f"{n!r} only on rank {rank} (not rank 0)" for n in sorted(set(theirs) - first)]
    if problems:
        raise StateMismatchError("the ranks' state dicts hold different tensors: "
                                 + "; ".join(problems[:20])
                                 + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))


def _check_alike(name: str, shards: Sequence[torch.Tensor], dim: int | None) -> None:
    """Every rank's ``name`` has rank 0's dtype and shape (except along ``dim``)."""
    first = shards[0]
    for rank, s in enumerate(shards[1:], start=1):
        shape, other = list(first.shape), list(s.shape)
        if dim is not None and len(shape) == len(other) and dim < len(shape):
            shape[dim] = other[dim] = -1
        if s.dtype != first.dtype or shape != other:
            raise ValueError(f"tensor {name!r} is {first.dtype}{list(first.shape)} on rank 0 but "
                             f"{s.dtype}{list(s.shape)} on rank {rank}")


def _agreed(name: str, shards: Sequence[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """Rank 0's ``name`` after checking every rank holds the same (bitwise equal) tensor."""
    _check_alike(name, shards, dim=None)
    differ = [r for r, s in enumerate(shards[1:], start=1) if not _same_bits(shards[0], s)]
    if differ:
        why = ("no rule of the spec matches it" if rule is UNMATCHED
               else f"rule {rule.pattern!r} says it is replicated")
        raise ValueError(f"tensor {name!r} differs between rank 0 and rank(s) {differ}, but {why}: "
                         "replicated tensors must be equal on every rank (if this one is not, "
                         "give it an averaged or partitioned rule)")
    return shards[0]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():  # NaNs compare unequal; their bits do not
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def _rule_of(fqn: str | None, role: str, shape: torch.Size, rules: Mapping[str, ShardRule],
             param_shapes: Mapping[str, torch.Size]) -> ShardRule | None:
    """The rule a tensor of the state takes (None: taken from rank 0 as is). Optimizer state
    shaped like its parameter (``exp_avg``, ...) is sharded as the parameter; anything else
    (step counters, RNG states, ``extra``) is replicated or rank 0's."""
    if role in ("rng", "extra"):
        return None
    if role in ("param", "buffer"):
        return rules[fqn]
    if fqn in rules and param_shapes.get(fqn) == shape:
        return rules[fqn]
    return UNMATCHED


def merge_states(states: Sequence[CapturedState], spec: ShardingSpec) -> CapturedState:
    """The universal state of a hand-sharded run from the captured state of each of its
    tensor-parallel ranks, in rank order (what :meth:`CheckpointManager.save_captured` writes).

    Parameters and buffers are merged by the rule their FQN matches;
    optimizer state shaped like its parameter follows the parameter's
    rule; other tensors must be equal on every rank. RNG states, ``extra``
    and the optimizer's param groups are rank 0's.
    """
    if not states:
        raise ValueError("merge_states needs the state of at least one rank")
    _check_same_names([[t.name for t in s.tensors] for s in states])
    first = states[0]
    rules = spec.rules_for([t.fqn for t in first.tensors if t.role in ("param", "buffer")])
    params = {t.fqn: t.tensor.shape for t in first.tensors if t.role == "param"}
    by_name = [{t.name: t.tensor for t in s.tensors} for s in states]
    merged: dict[str, torch.Tensor] = {}
    out = []
    for t in first.tensors:
        rule = _rule_of(t.fqn, t.role, t.tensor.shape, rules, params)
        if t.alias_of is not None:
            value = merged[t.alias_of]
        elif rule is None:
            value = t.tensor
        else:
            value = rule.merge(t.name, [local_values(names[t.name]) for names in by_name])
        merged[t.name] = value
        out.append(CapturedTensor(t.name, t.role, value, t.fqn, t.state_key, t.alias_of))
    return CapturedState(out, first.tree)


def split_checkpoint(ckpt: UniversalCheckpoint, spec: ShardingSpec, tp_rank: int,
                     tp_size: int) -> UniversalCheckpoint:
    """``ckpt`` with every tensor cut to what rank ``tp_rank`` of ``tp_size`` holds in the
    hand-sharded layout ``spec`` describes, ready for ``load_into(model, optimizer)``.

    The inverse of :func:`merge_states` (the same rules). Raises
    ``ValueError`` naming the tensor when it cannot be split into
    ``tp_size`` slices, and for a spec that does not fit the checkpoint.
    """
    _check_rank(tp_rank, tp_size)
    records = ckpt.metadata.tensors
    rules = spec.rules_for([r.fqn for r in records if r.role in ("param", "buffer")])
    params = {r.fqn: ckpt.tensors[r.name].shape for r in records if r.role == "param"}
    tensors: dict[str, torch.Tensor] = {}
    for r in records:
        whole = ckpt.tensors[r.name]
        rule = _rule_of(r.fqn, r.role, whole.shape, rules, params)
        if r.alias_of is not None:
            tensors[r.name] = tensors[r.alias_of]
        else:
            tensors[r.name] = whole if rule is None else rule.split(r.name, whole, tp_rank, tp_size)
    return UniversalCheckpoint(ckpt.step, tensors, ckpt.metadata)
