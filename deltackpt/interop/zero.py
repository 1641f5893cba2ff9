"""Reading DeepSpeed checkpoints as ``engine.save_checkpoint`` writes them (ZeRO stage 0 to 3).

A checkpoint folder (``global_step100``) holds the model states
(``mp_rank_00_model_states.pt``; under ZeRO-3 one per data-parallel rank,
``zero_pp_rank_<dp>_mp_rank_00_model_states.pt``) and, under ZeRO, one
optimizer file per data-parallel rank (``[bf16_]zero_pp_rank_<dp>_mp_rank_00_optim_states.pt``)
holding that rank's slice of the fp32 master weights and of Adam's moments,
flattened. ``param_shapes`` in the model states says which parameter lies
where. This module merges the slices back into one tensor per parameter, as
DeepSpeed's ``zero_to_fp32`` (weights) and ``ds_to_universal`` (moments) do,
with the files read by torch alone: ``torch.load(weights_only=True)`` plus
stand-ins for the few DeepSpeed classes those files pickle (:data:`DEEPSPEED_GLOBALS`),
so nothing of DeepSpeed runs and DeepSpeed need not be installed; any other
class is refused by name.

With tensor parallelism each tensor-parallel rank ``mp`` has files of its own
(``mp_rank_<mp>_...``), read one rank at a time (:func:`read_zero`'s ``mp_rank``) and merged
into whole tensors by a sharding spec (docs/PATTERNS.md).

Read through :func:`~deltackpt.interop.sources.read_deepspeed`, which takes
both these folders and universal ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import ConversionError
from deltackpt.interop.files import inside, load_weights_only
from deltackpt.interop.layouts import Parts, count_tensors, names_text, optimizer_class, parameters_by_index

KNOWN_VERSIONS = ((0, 10), (0, 19))
"""The DeepSpeed versions (major, minor; first and last) whose checkpoint layout this reader knows
(tested with 0.19.8): ``zero_to_fp32`` of 0.19 reads the same keys."""

MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_STATES = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


class DeepSpeedObject:
    """A stand-in for a DeepSpeed class its checkpoints pickle: holds what the pickle gives it
    (constructor arguments in ``args``, state in its attributes) and runs no code of DeepSpeed."""

    args: tuple[Any, ...] = ()

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}{self.args or vars(self)}"


def _stand_in(full_name: str) -> tuple[type, str]:
    cls = type(full_name.rsplit(".", 1)[1], (DeepSpeedObject,), {"__module__": "deltackpt.interop.zero"})
    return cls, full_name


DEEPSPEED_GLOBALS = [_stand_in(name) for name in (
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # zero_stage: an enum of the stage number
    "deepspeed.utils.tensor_fragment.fragment_address",  # param_slice_mappings: numel and start
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # loss_scaler (bf16 and fp16 training)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)]
"""The DeepSpeed classes its checkpoint files pickle, as stand-ins for ``torch.load``'s
``weights_only`` unpickler: the only globals beyond torch's own that a read accepts."""


@contextmanager
def _deepspeed_globals() -> Iterator[None]:
    with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
        yield


def _load(path: Path, folder: Path) -> Mapping[str, Any]:
    """A file of the checkpoint ``folder``: a dict, from a DeepSpeed version of known layout."""
    with _deepspeed_globals():
        value = load_weights_only(inside(folder, path))
    if not isinstance(value, Mapping):
        raise ConversionError(f"{path}: holds a {type(value).__qualname__}, not the dict DeepSpeed writes")
    version = value.get("ds_version")
    match = re.match(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if match is None or not KNOWN_VERSIONS[0] <= (int(match[1]), int(match[2])) <= KNOWN_VERSIONS[1]:
        first, last = (".".join(map(str, v)) for v in KNOWN_VERSIONS)
        raise ConversionError(f"{path}: written by DeepSpeed {version!r}, whose checkpoint layout deltackpt "
                              f"does not know (it reads those of DeepSpeed {first} to {last})")
    return value


def _get(value: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    """``value[key]``, which must be a ``kind``; else an error naming the file and what was expected."""
    item = value.get(key)
    if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        got = "nothing" if key not in value else f"a {type(item).__qualname__}"
        raise ConversionError(f"{path}: expected {key!r} to hold a {names} (the layout of DeepSpeed "
                              f"checkpoints), it holds {got}")
    return item


def is_zero_folder(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder as ``save_checkpoint`` writes it, or the
    folder holding those and the ``latest`` file naming one."""
    return bool(_model_states_files(path)) or (path / "latest").is_file()


def _model_states_files(folder: Path) -> list[tuple[int, int, Path]]:
    """``(dp rank, mp rank, path)`` of the model states files in ``folder``."""
    found = []
    for path in folder.glob("*model_states.pt"):
        match = MODEL_STATES.fullmatch(path.name)
        if match:
            found.append((int(match[1] or 0), int(match[2]), path))
    return sorted(found)


def zero_folder(path: Path) -> Path:
    """The checkpoint folder: ``path``, or the one its ``latest`` file names."""
    if _model_states_files(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        folder = inside(path, path / latest.read_text(errors="replace").strip(), str(latest))
        if folder.is_dir() and _model_states_files(folder):
            return folder
        raise ConversionError(f"{latest} names {folder}, which holds no DeepSpeed model states "
                              "(mp_rank_00_model_states.pt)")
    raise ConversionError(f"{path}: not a DeepSpeed checkpoint (no mp_rank_00_model_states.pt, "
                          "zero_pp_rank_0_mp_rank_00_model_states.pt or latest file)")


def _param_shapes(states: Mapping[str, Any], path: Path) -> list[dict[str, torch.Size]]:
    groups = _get(states, "param_shapes", list, path)
    if not all(isinstance(g, Mapping) and all(isinstance(n, str) and isinstance(s, torch.Size)
                                              for n, s in g.items()) for g in groups):
        raise ConversionError(f"{path}: expected 'param_shapes' to be a list of dicts of parameter "
                              "names to torch.Size, one per param group")
    return [dict(g) for g in groups]


def _optim_files(folder: Path, dp: int, path: Path, mp_rank: int) -> list[Path]:
    """The optimizer files of the ``dp`` data-parallel ranks of tensor-parallel rank ``mp_rank``,
    in rank order."""
    found: dict[int, Path] = {}
    for file in folder.glob("*_optim_states.pt"):
        match = OPTIM_STATES.fullmatch(file.name)
        if match and int(match[3]) == mp_rank:
            found[int(match[2])] = file
    mp = f"mp_rank_{mp_rank:02d}"
    if not found:
        raise ConversionError(f"{folder}: no ZeRO optimizer files "
                              f"(zero_pp_rank_0_{mp}_optim_states.pt), though {path.name} records "
                              "ZeRO training")
    prefix = next(iter(found.values())).name.split("zero_pp_rank_")[0]
    missing = [f"{prefix}zero_pp_rank_{r}_{mp}_optim_states.pt" for r in range(dp) if r not in found]
    if missing:
        raise ConversionError(f"{folder}: missing the optimizer files of data-parallel ranks "
                              f"{names_text(missing)} ({path.name} records {dp} ranks)")
    extra = sorted(r for r in found if r >= dp)
    if extra:
        raise ConversionError(f"{folder}: holds optimizer files of {max(found) + 1} data-parallel ranks, but "
                              f"{path.name} records {dp} (dp_world_size)")
    return [found[r] for r in range(dp)]


def _flat_state(osd: Mapping[str, Any], flats: list[torch.Tensor], paddings: list[int], base_key: str,
                path: Path, model_only: bool
                ) -> tuple[dict[str, list[torch.Tensor]], list[dict[str, Any]], Any]:
    """The moments of one rank's flat partitions (``exp_avg``... one tensor per partition, each
    the partition's size: the padding that ZeRO-1/2 keeps in them, ``paddings``, stripped), its
    param groups' hyperparameters and its step."""
    base = _get(osd, base_key, Mapping, path)
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in _get(base, "param_groups", list, path) if isinstance(g, Mapping)]
    if model_only:
        return {}, groups, None
    state = _get(base, "state", Mapping, path)
    if sorted(state) != list(range(len(flats))):
        raise ConversionError(f"{path}: optimizer state of entries {sorted(state, key=str)}, expected "
                              f"one per flat fp32 partition (0 to {len(flats) - 1})")
    moments: dict[str, list[torch.Tensor]] = {}
    step = None
    for index, (flat, padding) in enumerate(zip(flats, paddings, strict=True)):
        entry = state[index]
        for key, value in entry.items() if isinstance(entry, Mapping) else ():
            if key == "step":
                step = value
            elif isinstance(value, torch.Tensor) and value.dim() == 1 \
                    and value.numel() in (flat.numel(), flat.numel() + padding):
                moments.setdefault(key, []).append(value[:flat.numel()])
            else:
                raise ConversionError(f"{path}: optimizer state {key!r} of partition {index} is not a "
                                      f"tensor of the partition's {flat.numel()} values")
    if any(len(v) != len(flats) for v in moments.values()):
        raise ConversionError(f"{path}: the partitions' optimizer states hold different entries")
    return moments, groups, step


def _merge(flats: list[list[torch.Tensor]], shapes: list[dict[str, torch.Size]], stage: int,
           files: list[Path]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's flat partitions (``flats[rank][partition]``): under
    ZeRO-1/2, one partition per param group, each group's parameters back to back across the
    ranks; under ZeRO-3, each parameter cut in ``ceil(numel / ranks)`` values per rank, the
    last padded."""
    ranks = len(flats)
    values: dict[str, torch.Tensor] = {}
    if stage == 3:
        merged = [torch.cat(rank) if rank else torch.empty(0) for rank in flats]
        if len({m.numel() for m in merged}) != 1:
            raise ConversionError(f"the ZeRO-3 partitions disagree in size: {[m.numel() for m in merged]} "
                                  f"values in {', '.join(f.name for f in files)}")
        offset = 0
        for name, shape in ((n, s) for group in shapes for n, s in group.items()):
            part = math.ceil(shape.numel() / ranks)
            if offset + part > merged[0].numel():
                break
            values[name] = torch.cat([m[offset:offset + part] for m in merged])[:shape.numel()].view(shape)
            offset += part
        if offset != merged[0].numel() or len(values) != sum(map(len, shapes)):
            need = sum(math.ceil(s.numel() / ranks) for g in shapes for s in g.values())
            raise ConversionError(f"{files[0]}: each ZeRO-3 partition holds {merged[0].numel()} values, but "
                                  f"the param_shapes of {ranks} ranks need {need}")
        return values
    if any(len(rank) != len(shapes) for rank in flats):
        raise ConversionError(f"{files[0]}: {len(flats[0])} flat partitions per rank, but param_shapes "
                              f"lists {len(shapes)} param groups")
    for index, group in enumerate(shapes):
        flat = torch.cat([rank[index] for rank in flats])
        need = sum(s.numel() for s in group.values())
        if flat.numel() != need:
            raise ConversionError(f"param group {index}: the partitions of "
                                  f"{', '.join(f.name for f in files)} hold {flat.numel()} values, but its "
                                  f"param_shapes need {need}")
        offset = 0
        for name, shape in group.items():
            values[name] = flat[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
    return values


def _read_partitions(folder: Path, states: Mapping[str, Any], states_path: Path,
                     shapes: list[dict[str, torch.Size]], model_only: bool, mp_rank: int
                     ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]],
                                list[dict[str, Any]], Any]:
    """The fp32 weights and optimizer state (by parameter name) of a ZeRO-1/2/3 checkpoint, the
    param groups' hyperparameters and the step."""
    dp = _get(states, "dp_world_size", int, states_path)
    files = _optim_files(folder, dp, states_path, mp_rank)
    flats: list[list[torch.Tensor]] = []
    moments: list[dict[str, list[torch.Tensor]]] = []
    stage = sizes = None
    hypers: list[dict[str, Any]] = []
    step = None
    for file in files:
        osd = _get(_load(file, folder), "optimizer_state_dict", Mapping, file)
        zero_stage = _get(osd, "zero_stage", DeepSpeedObject, file).args
        rank_stage = zero_stage[0] if zero_stage and isinstance(zero_stage[0], int) else None
        if rank_stage not in (1, 2, 3) or (stage is not None and rank_stage != stage):
            raise ConversionError(f"{file}: ZeRO stage {rank_stage}, expected 1, 2 or 3, the same on every "
                                  "rank")
        stage = rank_stage
        count = _get(osd, "partition_count", (int, list), file)
        if any(c != dp for c in (count if isinstance(count, list) else [count])):
            raise ConversionError(f"{file}: partitioned over {count} data-parallel ranks, but "
                                  f"{states_path.name} records {dp} (dp_world_size)")
        key, base_key = (("fp32_flat_groups", "optimizer_state_dict") if stage == 3 else
                         ("single_partition_of_fp32_groups", "base_optimizer_state"))
        rank_flats = _get(osd, key, list, file)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in rank_flats):
            raise ConversionError(f"{file}: expected {key!r} to be a list of flat fp32 tensors")
        paddings = [0] * len(rank_flats)
        if stage != 3:  # each rank's partition of a group, with its padding, is the same size
            paddings = _get(osd, "group_paddings", list, file)
            if len(paddings) != len(rank_flats) or not all(isinstance(p, int) and p >= 0 for p in paddings):
                raise ConversionError(f"{file}: expected 'group_paddings' to list a padding per partition")
            padded = [t.numel() + p for t, p in zip(rank_flats, paddings, strict=False)]
            if sizes is not None and padded != sizes:
                raise ConversionError(f"{file}: partitions of {padded} values (with padding), but those of "
                                      f"{files[0].name} hold {sizes}")
            sizes = padded
        rank_moments, hypers, rank_step = _flat_state(osd, rank_flats, paddings, base_key, file, model_only)
        step = rank_step if step is None else step
        flats.append(rank_flats)
        moments.append(rank_moments)
    weights = _merge(flats, shapes, stage, files)
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in weights}
    for key in ([] if model_only else moments[0]):
        if any(key not in m for m in moments):
            raise ConversionError(f"{folder}: optimizer state {key!r} is on some ranks only")
        for name, value in _merge([m[key] for m in moments], shapes, stage, files).items():
            state[name][key] = value
    return weights, state, hypers, step


def _stage0_shapes(module: Mapping[str, Any], saved: Mapping[str, Any], buffer_names: set[str],
                   path: Path, notes: list[str]) -> list[dict[str, torch.Size]]:
    """The parameters of each param group of an optimizer that numbers them (without ZeRO,
    DeepSpeed records no ``param_shapes``), named after the module's tensors that are not
    buffers (:func:`~deltackpt.interop.layouts.parameters_by_index`)."""
    groups = _get(saved, "param_groups", list, path)
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise ConversionError(f"{path}: expected the optimizer's 'param_groups' to be dicts listing 'params'")
    candidates = {n: t for n, t in module.items() if isinstance(t, torch.Tensor) and n not in buffer_names}
    named = parameters_by_index(groups, _get(saved, "state", Mapping, path), candidates, str(path),
                                "name the parameters by converting from a torch.save file instead")
    notes.append(f"{path.name} records no param_shapes (DeepSpeed without ZeRO): the optimizer's "
                 f"{len(named.names)} parameters, numbered, are named after the module's tensors in "
                 "order, which agree with the shapes of their state")
    return [{named.names[i]: candidates[named.names[i]].shape for i in g["params"]} for g in groups]


def _read_stage0(states: Mapping[str, Any], path: Path, shapes: list[dict[str, torch.Size]] | None,
                 model_only: bool, notes: list[str]
                 ) -> tuple[list[dict[str, torch.Size]], dict[str, torch.Tensor],
                            dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Param groups (names and shapes), weights, optimizer state and hyperparameters of a
    checkpoint trained without ZeRO: the optimizer's state dict is in the model states, numbering
    the parameters; under bf16 it wraps the torch one, with the fp32 masters in ``fp32_groups``."""
    module = _get(states, "module", Mapping, path)
    saved = _get(states, "optimizer", Mapping, path)
    masters = None
    if "optimizer_state_dict" in saved:
        masters = _get(saved, "fp32_groups", list, path)
        saved = _get(saved, "optimizer_state_dict", Mapping, path)
    if shapes is None:
        shapes = _stage0_shapes(module, saved, set(states.get("buffer_names") or []), path, notes)
    if masters is not None and (not all(isinstance(m, list) for m in masters) or len(masters) != len(shapes)):
        raise ConversionError(f"{path}: expected 'fp32_groups' to be a list of {len(shapes)} lists "
                              "of fp32 tensors, one per param group")
    groups = _get(saved, "param_groups", list, path)
    if len(groups) != len(shapes) or any(
            not isinstance(g, Mapping) or len(g.get("params", ())) != len(s)
            or (masters is not None and len(masters[i]) != len(s))
            for i, (g, s) in enumerate(zip(groups, shapes, strict=True))):
        raise ConversionError(f"{path}: the optimizer's param groups do not match param_shapes "
                              f"({[len(s) for s in shapes]} parameters per group)")
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    saved_state = _get(saved, "state", Mapping, path)
    for g, (group, group_shapes) in enumerate(zip(groups, shapes, strict=True)):
        for i, (index, (name, shape)) in enumerate(zip(group["params"], group_shapes.items(),
                                                           strict=True)):
            value = masters[g][i] if masters is not None else module.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != shape:
                raise ConversionError(f"{path}: no tensor of shape {list(shape)} for parameter {name!r}")
            weights[name] = value
            if not model_only:
                state[name] = dict(saved_state.get(index, {}))
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return shapes, weights, state, hypers


def _frozen(states_files: list[tuple[Mapping[str, Any], Path]], stage: int) -> dict[str, torch.Tensor]:
    """The frozen parameters: whole in the model states, or under ZeRO-3 one slice per rank."""
    states, path = states_files[0]
    shapes = states.get("frozen_param_shapes") or {}
    fragments = [s.get("frozen_param_fragments") or {} for s, _ in states_files]
    frozen = {}
    for name, shape in shapes.items():
        parts = [f.get(name) for f in fragments]
        if not all(isinstance(p, torch.Tensor) for p in parts) or not isinstance(shape, torch.Size):
            raise ConversionError(f"{path}: frozen parameter {name!r} has no fragment on every rank")
        whole = torch.cat([p.flatten() for p in parts]) if stage == 3 else parts[0]
        if whole.numel() < shape.numel():
            raise ConversionError(f"{path}: frozen parameter {name!r} of shape {list(shape)} has "
                                  f"{whole.numel()} values")
        frozen[name] = whole.flatten()[:shape.numel()].view(shape)
    return frozen


@dataclass
class ZeroRead:
    """What :func:`read_zero` read: the state (with its notes), which tensors are buffers, how
    many tensors it found, and the checkpoint folder."""

    parts: Parts
    buffers: set[str]
    found: int
    folder: Path


def tensor_parallel_ranks(path: Path) -> int:
    """The number of tensor-parallel ranks whose files the checkpoint folder at ``path`` holds."""
    return len({mp for _, mp, _ in _model_states_files(zero_folder(path))})


def read_zero(path: Path, optimizer_class_name: str | None = None, model_only: bool = False,
              mp_rank: int | None = None) -> ZeroRead:
    """A DeepSpeed checkpoint folder as ``engine.save_checkpoint`` writes it (or the folder of its
    ``latest`` file): fp32 weights, Adam's moments, step and hyperparameters by parameter name,
    padding stripped; frozen parameters, buffers and tied names from the model states. With
    tensor parallelism, the files of tensor-parallel rank ``mp_rank`` (required then)."""
    folder = zero_folder(path)
    every = _model_states_files(folder)
    tp_ranks = sorted({mp for _, mp, _ in every})
    if tp_ranks != list(range(len(tp_ranks))):
        raise ConversionError(f"{folder}: holds the model states of tensor-parallel ranks {tp_ranks}; "
                              f"expected ranks 0 to {len(tp_ranks) - 1}")
    if mp_rank is None:
        if len(tp_ranks) > 1:
            raise ConversionError(f"{folder}: holds the states of {len(tp_ranks)} tensor-parallel "
                                  "ranks (mp_rank_00 to mp_rank_"
                                  f"{len(tp_ranks) - 1:02d}): pass a sharding spec (--spec, "
                                  "docs/PATTERNS.md) to merge them")
        mp_rank = 0
    states_files = [f for f in every if f[1] == mp_rank]
    if not states_files:
        raise ConversionError(f"{folder}: holds no model states of tensor-parallel rank {mp_rank} "
                              f"(ranks {tp_ranks})")
    states_path = states_files[0][2]
    states = _load(states_path, folder)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if dims.get("pp_degree", 1) != 1:
        raise ConversionError(f"{states_path}: trained with pipeline parallelism ({dict(dims)}); "
                              "convert reads checkpoints without it")
    mp = _get(states, "mp_world_size", int, states_path)
    if mp != len(tp_ranks):
        raise ConversionError(f"{states_path}: records {mp} tensor-parallel ranks "
                              f"(mp_world_size), but {folder} holds the states of {len(tp_ranks)}")
    zero3 = states_files[0][0] != 0 or states_path.name.startswith("zero_pp_rank_")
    loaded = [(states, states_path)]
    if zero3:
        dp = _get(states, "dp_world_size", int, states_path)
        ranks = [r for r, _, _ in states_files]
        if ranks != list(range(dp)):
            raise ConversionError(f"{folder}: model states of data-parallel ranks {ranks}, but "
                                  f"{states_path.name} records {dp} (dp_world_size)")
        loaded += [(_load(p, folder), p) for _, _, p in states_files[1:]]
    notes: list[str] = []
    step_value = None
    if zero3 or any(folder.glob(f"*zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt")):
        shapes = _param_shapes(states, states_path)
        weights, state, hypers, step_value = _read_partitions(folder, states, states_path, shapes,
                                                              model_only, mp_rank)
    else:
        recorded = None if states.get("param_shapes") is None else _param_shapes(states, states_path)
        shapes, weights, state, hypers = _read_stage0(states, states_path, recorded, model_only, notes)
    names = [n for g in shapes for n in g]
    if len(set(names)) != len(names):
        raise ConversionError(f"{states_path}: param_shapes names a parameter twice")
    frozen = _frozen(loaded, 3 if zero3 else 0)
    module = _get(states, "module", Mapping, states_path)
    buffer_names = set(states.get("buffer_names") or [])
    shared = states.get("shared_params") or {}
    model: dict[str, torch.Tensor] = {}
    for name, tensor in module.items():
        if name in weights or name in frozen:
            model[name] = weights.get(name, frozen.get(name))
        elif name in shared and shared[name] in weights:
            model[name] = weights[shared[name]]
        elif isinstance(tensor, torch.Tensor):
            model[name] = tensor
    model.update((n, t) for n, t in {**weights, **frozen}.items() if n not in model)
    if model_only:
        notes.append("model only: left out the optimizer state")
    optimizer = None
    if not model_only:
        if step_value is not None:  # one step for all, as torch's Adam keeps per parameter
            for per_param in state.values():
                per_param.setdefault("step", step_value.clone() if isinstance(step_value, torch.Tensor)
                                     else step_value)
        if len(hypers) != len(shapes):
            raise ConversionError(f"{states_path}: {len(hypers)} param groups' hyperparameters for the "
                                  f"{len(shapes)} groups of param_shapes")
        groups = [{**h, "params": list(g)} for h, g in zip(hypers, shapes, strict=True)]
        class_name = optimizer_class_name or optimizer_class(groups)
        if class_name is None:
            class_name = "AdamW"
            notes.append("the optimizer's class is not recorded: taken to be AdamW")
        optimizer = {"class": class_name, "param_groups": groups,
                     "state": {n: state[n] for n in names if state.get(n)}}
    left = [k.replace("_", " ") for k in ("lr_scheduler", "data_sampler") if states.get(k) is not None]
    if left:
        notes.append(f"not converted: DeepSpeed's {' and '.join(left)} state")
    step = states.get("global_steps")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    found = len(model) + (count_tensors(optimizer["state"]) if optimizer else 0)
    return ZeroRead(Parts(model, optimizer, None, step, notes), {n for n in buffer_names if n in model},
                    found, folder)
