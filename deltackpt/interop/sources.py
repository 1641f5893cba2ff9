"""Reading checkpoints of other formats into a :class:`~deltackpt.format.state.CapturedState`.

One reader per format, registered in :data:`READERS`, and
:func:`detect_format` to pick one from what the path holds:

* ``torch``: a ``torch.save`` file (a state dict, or a dict with model,
  optimizer and other entries; see :func:`~deltackpt.interop.layouts.split_document`);
* ``dcp``: a ``torch.distributed.checkpoint`` directory, read with torch's DCP
  reader, interpreted like a ``torch.save`` dict;
* ``safetensors``: one file, several files, or a directory of them (a
  Hugging Face sharded set with its ``*.safetensors.index.json``), including
  the ``optimizer.safetensors`` and ``extra.safetensors`` deltackpt exports;
* ``deepspeed``: a DeepSpeed universal checkpoint folder (``zero/<param>/fp32.pt``,
  ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``), as ``ds_to_universal.py`` writes it, or a
  checkpoint folder as DeepSpeed's ``save_checkpoint`` writes it (ZeRO stage 0 to 3,
  :mod:`~deltackpt.interop.zero`).

The checkpoints of the ranks of a hand-sharded run (one per tensor-parallel
rank, each in any of these formats) are read with a sharding spec
(docs/PATTERNS.md) that merges them into whole tensors: :func:`read_sharded`.

A new source is a function ``(paths, optimizer_class, model_only) -> Source`` (counting, as
``found``, the tensors it read) added to :data:`READERS` and, if it can be recognized, to
:func:`detect_format`.
Nothing is ever unpickled beyond what ``torch.load(weights_only=True)``
accepts.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from deltackpt.errors import ConversionError, DeltackptError
from deltackpt.format.metadata import ROOT_MARKER
from deltackpt.format.state import CapturedState
from deltackpt.format.tree import decode_tree
from deltackpt.interop.files import inside, load_weights_only
from deltackpt.interop.formats import SOURCE_FORMATS
from deltackpt.interop.layouts import (
    TORCH_FILE,
    Parts,
    count_tensors,
    fqn_optimizer,
    guess_buffers,
    names_text,
    optimizer_class,
    split_document,
)
from deltackpt.interop.patterns import ShardingSpec, merge_states
from deltackpt.interop.zero import is_zero_folder, read_zero, tensor_parallel_ranks
from deltackpt.save.capture import capture_values


@dataclass
class Source:
    """A checkpoint read from another format: its state, its step if it records one, how many
    tensors the reader found in it, and what the reader could not take over (``notes``, one
    sentence each).

    ``found`` counts the tensors as the source's files held them, before they were interpreted,
    so :func:`read_checkpoint` can refuse a read that would lose some; tensors ``model_only``
    leaves unread on purpose (the notes name them) are not counted. Every reader must give it.
    """

    format: str
    state: CapturedState
    step: int | None
    notes: list[str] = field(default_factory=list)
    found: int = field(kw_only=True)


def _captured(parts: Parts, origin: str, buffers: set[str] | None = None) -> CapturedState:
    """``parts`` captured; ``buffers`` None: guessed (:func:`guess_buffers`)."""
    if buffers is None:
        buffers = guess_buffers(parts.model, parts.optimizer)
    try:
        return capture_values(parts.model, parts.optimizer, parts.extra, buffers=buffers)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConversionError(f"{origin}: {exc}") from None


def _one(paths: list[Path], fmt: str) -> Path:
    if len(paths) != 1:
        raise ConversionError(f"a {fmt} checkpoint is one path, got {len(paths)}: "
                              f"{', '.join(map(str, paths))}")
    return paths[0]


def _document_source(fmt: str, document: Any, origin: str, optimizer_class_name: str | None,
                     model_only: bool) -> Source:
    """A ``torch.save`` or DCP dict read as a :class:`Source` (:func:`split_document`); every
    tensor it holds is found (with ``model_only``, those of the model)."""
    parts = split_document(document, origin, optimizer_class_name, model_only)
    found = len(parts.model) if model_only else count_tensors(document)
    return Source(fmt, _captured(parts, origin), parts.step, parts.notes, found=found)


# -- torch.save --------------------------------------------------------------------------------


def read_torch(paths: list[Path], optimizer_class_name: str | None = None,
               model_only: bool = False) -> Source:
    """A ``torch.save`` file (or the directory of a torch export), loaded with
    ``weights_only=True`` on the CPU."""
    path = _one(paths, "torch")
    if path.is_dir():
        path = inside(path, path / TORCH_FILE)
    return _document_source("torch", load_weights_only(path), str(path), optimizer_class_name, model_only)


# -- DCP ---------------------------------------------------------------------------------------


def _dcp_global_allowed(module: str, name: str) -> bool:
    """Whether a DCP index (``.metadata``) may refer to ``module.name``: its own metadata classes,
    torch dtypes, layouts and memory formats, ``torch.Size``, paths and ``OrderedDict``."""
    if module == "torch.distributed.checkpoint.metadata":
        import torch.distributed.checkpoint.metadata as metadata

        return isinstance(getattr(metadata, name, None), type)
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


def _read_dcp_metadata(path: Path) -> Any:
    """The DCP index ``path/.metadata``, unpickled with only the globals an index holds.

    torch's ``FileSystemReader`` unpickles it with plain ``pickle.load``,
    which would run whatever a crafted file asks for.
    """
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    index = inside(path, path / ".metadata")

    def no_bytearray(unpickler: pickle.Unpickler) -> None:
        raise pickle.UnpicklingError("a DCP index holds no bytearray")

    # Python's own unpickler, not the C one: its memo is a dict, so a crafted memo index cannot
    # make it allocate gigabytes; nor can a bytearray's length, the one size it allocates unread
    class IndexUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
        dispatch: ClassVar[dict[int, Callable[..., None]]] = {
            **pickle._Unpickler.dispatch, pickle.BYTEARRAY8[0]: no_bytearray}  # type: ignore[attr-defined]

        def find_class(self, module: str, name: str) -> Any:
            if not _dcp_global_allowed(module, name):
                raise ConversionError(f"{index} refers to {module}.{name}, which no DCP index holds; "
                                      "deltackpt never unpickles arbitrary objects")
            return super().find_class(module, name)

    try:
        # from memory: a length in the pickle is checked against the bytes there are
        metadata = IndexUnpickler(io.BytesIO(index.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError,
            TypeError, ValueError, OverflowError, RecursionError, struct.error) as exc:
        raise ConversionError(f"{index}: not a readable DCP index ({exc!r})") from None
    if not isinstance(metadata, Metadata):
        raise ConversionError(f"{index}: holds a {type(metadata).__qualname__}, not DCP metadata")
    _check_dcp_storage(path, index, metadata.storage_data)
    return metadata


def _check_dcp_storage(path: Path, index: Path, storage_data: Any) -> None:
    """Refuse a DCP index whose entries are not stored in files inside its directory ``path``
    (``_StorageInfo`` records: a relative path, an offset and a length)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(storage_data, dict):
        raise ConversionError(f"{index}: not a readable DCP index (its storage data is a "
                              f"{type(storage_data).__qualname__}, not a dict)")
    for info in storage_data.values():
        fields = [getattr(info, f, None) for f in ("relative_path", "offset", "length")]
        if not (isinstance(info, _StorageInfo) and isinstance(fields[0], str)
                and all(isinstance(n, int) and n >= 0 for n in fields[1:])):
            raise ConversionError(f"{index}: not a readable DCP index (a storage record holds "
                                  f"{fields}, not a file path with an offset and a length)")
        inside(path, path / info.relative_path, str(index))


def _load_dcp(path: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, nested as it was saved, read by torch's own DCP reader.

    The index is read by :func:`_read_dcp_metadata`. Tensors are read as
    DCP reads them (``torch.load(weights_only=True)``); non-tensor entries,
    which DCP's default planner unpickles with ``weights_only=False``, are
    loaded with ``weights_only=True`` and refused, naming the entry, when
    that refuses them.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    metadata = _read_dcp_metadata(path)  # first, so its errors are ours, not logged fallbacks

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            key = read_item.dest_index.fqn
            obj = load_weights_only(value, f"{path}: entry {key!r}")
            set_element(self.original_state_dict, self.mappings[key], obj)

    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state, storage_reader=SafeReader(path), planner=WeightsOnlyPlanner(),
                             no_dist=True)
    except CheckpointException as exc:
        causes = [f[0] if isinstance(f, tuple) else f  # (exception, traceback)
                  for f in exc.failures.values()]
        own = next((c for c in causes if isinstance(c, ConversionError)), None)
        if own is not None:
            raise own from None
        raise ConversionError(f"{path}: DCP cannot read it: {'; '.join(map(str, causes))}") from None
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ConversionError(f"{path}: DCP cannot read it: {exc}") from None
    return state


def read_dcp(paths: list[Path], optimizer_class_name: str | None = None,
             model_only: bool = False) -> Source:
    """A DCP checkpoint directory, interpreted like a ``torch.save`` dict."""
    path = _one(paths, "dcp")
    if not (path / ".metadata").is_file():
        raise ConversionError(f"{path}: not a DCP checkpoint directory (it has no .metadata file)")
    return _document_source("dcp", _load_dcp(path), str(path), optimizer_class_name, model_only)


# -- safetensors -------------------------------------------------------------------------------


MAX_INDEX_BYTES = 1 << 26  # a shard index lists tensor names: a few MB for the largest models
MAX_JSON_DEPTH = 64  # nesting of the JSON a source holds: far beyond any real state, within Python's stack


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and dicts in ``value`` nest more than ``limit`` levels deep (counted level by
    level, without recursion)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [v for item in level if isinstance(item, (list, dict))
                 for v in (item.values() if isinstance(item, dict) else item)]
    return False


def _load_json(text: str | bytes, what: str) -> Any:
    """JSON ``text`` of ``what`` (a file, or a file's metadata entry), refused when it nests more
    than :data:`MAX_JSON_DEPTH` levels deep."""
    try:
        value = json.loads(text)
        too_deep = _nested_deeper(value, MAX_JSON_DEPTH)
    except RecursionError:  # deeper than Python's stack
        too_deep = True
    except ValueError as exc:
        raise ConversionError(f"{what} is not JSON ({exc})") from None
    if too_deep:
        raise ConversionError(f"{what} nests more than {MAX_JSON_DEPTH} levels deep")
    return value


def _safetensors_files(paths: list[Path]) -> tuple[list[Path], dict[str, Path]]:
    """The files to read, and ``tensor -> file`` of the shard indexes met on the way.

    Files in a directory, and those an index names, must be inside that directory.
    """
    files: list[Path] = []
    indexed: dict[str, Path] = {}
    for path in paths:
        if path.is_dir():
            indexes = [inside(path, i) for i in sorted(path.glob("*.safetensors.index.json"))]
            files += [inside(path, f) for f in sorted(path.glob("*.safetensors"))]
        elif path.name.endswith(".safetensors.index.json"):
            indexes = [path]
        else:
            indexes = []
            files.append(path)
        for index in indexes:
            if index.stat().st_size > MAX_INDEX_BYTES:
                raise ConversionError(f"{index}: {index.stat().st_size} bytes, more than a shard index "
                                      f"holds ({MAX_INDEX_BYTES})")
            weight_map = _load_json(index.read_bytes(), str(index))
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                raise ConversionError(f"{index}: not a safetensors index (no 'weight_map' of tensor "
                                      "names to file names)")
            for name, file in weight_map.items():
                indexed[name] = inside(index.parent, index.parent / file, str(index))
            files += sorted(set(indexed[name] for name in weight_map))
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist")
    return list(dict.fromkeys(f.resolve() for f in files)), {k: v.resolve() for k, v in indexed.items()}


SECTIONS = ("optimizer", "extra")  # what a safetensors export's other files hold, in their metadata
EXPORT_FILES = {frozenset({"format", "step", "buffers", "aliases"}): "model",
                **{frozenset({"step", section}): section for section in SECTIONS}}
"""The metadata keys of each file of a deltackpt safetensors export
(:func:`~deltackpt.interop.exporters.export`), and which file they make it."""
OWN_KEYS = frozenset({"step", "buffers", "aliases", *SECTIONS})  # what reading an export uses


def _export_file(metadata: Mapping[str, str]) -> str | None:
    """Which file of a deltackpt safetensors export (``"model"``, ``"optimizer"``, ``"extra"``) a
    file is, by its metadata; None for any other file of tensors, read as model tensors.

    Only metadata holding exactly the keys deltackpt writes counts. Safetensors metadata is free
    text that no one owns: a Hugging Face file whose metadata happens to hold an ``extra`` or
    ``optimizer`` entry is a file of model weights, and whoever converts it expects those
    weights, not a refusal over a note they may not know is there. A file holding exactly an
    export's keys is one, and is refused (naming the file and key) when they are not valid,
    rather than read another way: an optimizer state taken for model weights would be wrong
    without a word.
    """
    return EXPORT_FILES.get(frozenset(metadata))


def _read_safetensors_file(path: Path, model_only: bool
                           ) -> tuple[dict[str, torch.Tensor], dict[str, str], str | None]:
    """The tensors, metadata and export file (:func:`_export_file`) of a safetensors file; with
    ``model_only``, no tensors of an export's optimizer or extra file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
            role = _export_file(metadata)
            if model_only and role in SECTIONS:
                return {}, metadata, role
            names = f.keys()
            return {k: f.get_tensor(k) for k in names}, metadata, role
    except (SafetensorError, OSError) as exc:
        raise ConversionError(f"{path}: not a readable safetensors file ({exc})") from None


def _json_metadata(path: Path, metadata: dict[str, str], key: str) -> Any:
    return _load_json(metadata[key], f"{path}: metadata {key!r}")


def _export_step(path: Path, metadata: dict[str, str]) -> int:
    """The step an export's ``model.safetensors`` records."""
    if re.fullmatch(r"[0-9]{1,20}", metadata["step"]) is None:  # a step fits in 64 bits
        raise ConversionError(f"{path}: metadata 'step' is {metadata['step']!r}, not a step number")
    return int(metadata["step"])


def read_safetensors(paths: list[Path], optimizer_class_name: str | None = None,
                     model_only: bool = False) -> Source:
    """Safetensors files: model tensors by FQN, plus a deltackpt export's optimizer and extra.

    A file whose metadata is that of an export's ``optimizer.safetensors`` or
    ``extra.safetensors`` (:func:`_export_file`: the step, and the section
    as tagged JSON, docs/FORMAT.md 2.5, referring to every tensor of the
    file) is that section; every other file holds model tensors. The
    metadata of an export's ``model.safetensors`` (``step``, ``buffers``,
    ``aliases``) is used; that of other files is not (a note names the keys
    of an export they hold). With ``model_only``, the optimizer and extra
    files are left out.
    """
    files, indexed = _safetensors_files(paths)
    if not files:
        raise ConversionError(f"no .safetensors files in {', '.join(map(str, paths))}")
    model: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    sections: dict[str, tuple[Any, Path]] = {}
    buffers: set[str] | None = None
    aliases: dict[str, tuple[str, Path]] = {}  # name -> (tensor it is tied to, file recording it)
    step = None
    notes: list[str] = []
    found = 0
    for path in files:
        tensors, metadata, role = _read_safetensors_file(path, model_only)
        found += len(tensors)
        if role in SECTIONS:
            if model_only:
                notes.append(f"model only: left out the {role} in {path}")
            elif role in sections:
                raise ConversionError(f"both {sections[role][1]} and {path} hold the {role}")
            else:
                sections[role] = (_decoded_section(path, role, metadata, tensors), path)
            continue
        for name, tensor in tensors.items():
            if name in model:
                raise ConversionError(f"tensor {name!r} is in both {origin[name]} and {path}")
            model[name], origin[name] = tensor, path
        if role is None:
            own = sorted(OWN_KEYS & metadata.keys())
            if own:
                notes.append(f"{path}: metadata {', '.join(map(repr, own))} not read, as the file's "
                             "metadata is not that of a deltackpt export; its tensors are read as "
                             "model tensors")
            continue
        names = _json_metadata(path, metadata, "buffers")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ConversionError(f"{path}: metadata 'buffers' is not a list of tensor names")
        buffers = (buffers or set()) | set(names)
        ties = _json_metadata(path, metadata, "aliases")
        if not (isinstance(ties, dict) and all(isinstance(t, str) for t in ties.values())):
            raise ConversionError(f"{path}: metadata 'aliases' is not a map of tensor names to the "
                                  "names they are tied to")
        aliases.update((name, (target, path)) for name, target in ties.items())
        step = _export_step(path, metadata)
    for name, file in indexed.items():
        if origin.get(name) != file:
            where = f"it is in {origin[name]}" if name in origin else "no file holds it"
            raise ConversionError(f"the index lists tensor {name!r} in {file}, but {where}")
    for name, (target, path) in aliases.items():  # tied weights: one tensor under both names again
        if name not in model or target not in model or not (
                model[name].dtype == model[target].dtype and torch.equal(model[name], model[target])):
            raise ConversionError(f"{path}: {name!r} is recorded as tied to {target!r}, but the tensors "
                                  "differ or are missing")
        model[name] = model[target]
    optimizer = None
    if "optimizer" in sections:
        tree, path = sections["optimizer"]
        recorded = tree.get("class") if isinstance(tree, dict) else None
        optimizer = fqn_optimizer(tree, optimizer_class_name or recorded, str(path))
    extra = sections["extra"][0] if "extra" in sections else None
    parts = Parts(model, optimizer, extra, step)
    return Source("safetensors", _captured(parts, ", ".join(map(str, files)), buffers), step, notes,
                  found=found)


def _decoded_section(path: Path, section: str, metadata: dict[str, str],
                     tensors: dict[str, torch.Tensor]) -> Any:
    """The ``optimizer`` or ``extra`` a safetensors export keeps in its metadata, as tagged JSON
    (docs/FORMAT.md 2.5) whose ``$tensor`` references are the tensors of the file, every one."""
    tree = _json_metadata(path, metadata, section)
    referred: set[str] = set()

    def tensor(name: str) -> torch.Tensor:
        referred.add(name)
        return tensors[name]

    try:
        decoded = decode_tree(tree, tensor)
    except KeyError as exc:
        raise ConversionError(f"{path}: its {section} metadata refers to tensor {exc}, "
                              "which the file does not hold") from None
    except (DeltackptError, TypeError, ValueError) as exc:
        raise ConversionError(f"{path}: its {section} metadata is not a valid state tree ({exc})") from None
    unreferred = [repr(name) for name in tensors if name not in referred]
    if unreferred:
        raise ConversionError(f"{path}: holds tensors its {section} metadata does not refer to: "
                              f"{names_text(unreferred)}")
    return decoded


# -- DeepSpeed universal checkpoint ------------------------------------------------------------


def _universal(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed universal checkpoint folder, or holds the file naming one."""
    return (path / "zero").is_dir() or (path / "latest_universal").is_file()


def _deepspeed_folder(path: Path) -> Path:
    """The universal checkpoint folder: ``path`` if it holds ``zero/``, else the one its
    ``latest_universal`` file names."""
    if (path / "zero").is_dir():
        return path
    latest = path / "latest_universal"
    if latest.is_file():
        folder = inside(path, path / latest.read_text(errors="replace").strip(), str(latest))
        if (folder / "zero").is_dir():
            return folder
        raise ConversionError(f"{latest} names {folder}, which has no zero/ folder")
    raise ConversionError(f"{path}: not a DeepSpeed checkpoint (no mp_rank_00_model_states.pt or "
                          "latest file, no universal zero/ folder and no latest_universal file)")


def _try_load(path: Path, what: str, notes: list[str]) -> Any:
    """``path`` loaded with weights_only, or None with a note when it is absent or refused."""
    if not path.is_file():
        return None
    try:
        return load_weights_only(path)
    except ConversionError as exc:
        notes.append(f"{what} not read: {exc}")
        return None


def _natural(path: Path) -> list[Any]:
    """Sort key of a parameter folder: ``layers.10`` after ``layers.9``."""
    return [(0, int(c)) if c.isdigit() else (1, c) for c in re.split(r"(\d+)", path.name)]


def _param_file(path: Path) -> torch.Tensor:
    value = load_weights_only(path)
    if not isinstance(value, Mapping) or not isinstance(value.get("param"), torch.Tensor):
        raise ConversionError(f"{path}: expected a dict with the tensor under 'param', "
                              f"got {type(value).__qualname__}")
    return value["param"]


def _zero_source(path: Path, optimizer_class_name: str | None, model_only: bool,
                 mp_rank: int | None = None) -> Source:
    """A DeepSpeed ``save_checkpoint`` folder (its tensor-parallel rank ``mp_rank``'s files)."""
    read = read_zero(path, optimizer_class_name, model_only, mp_rank)
    return Source("deepspeed", _captured(read.parts, str(read.folder), read.buffers), read.parts.step,
                  read.parts.notes, found=read.found)


def read_deepspeed(paths: list[Path], optimizer_class_name: str | None = None,
                   model_only: bool = False) -> Source:
    """A DeepSpeed universal checkpoint folder, or a checkpoint folder as DeepSpeed's
    ``save_checkpoint`` writes it (read by :func:`~deltackpt.interop.zero.read_zero`).

    ``zero/<name>/fp32.pt`` is parameter ``name`` (the fp32 master copy);
    its other files (``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``) are its
    optimizer state. ``zero/optimizer_state.pt`` gives the param groups'
    hyperparameters, and ``mp_rank_00_model_states.pt`` the buffers, frozen
    parameters, tied names, param group membership and the training step,
    when they load with ``weights_only=True`` (files holding DeepSpeed
    objects, such as an fp16 loss scaler, do not; the notes say what is
    missing then). The class is recognized from the hyperparameters, else
    taken to be AdamW (DeepSpeed's Adam runs in AdamW mode by default). With
    ``model_only``, the optimizer state is left out unread.
    """
    path = _one(paths, "deepspeed")
    if not _universal(path) and is_zero_folder(path):
        return _zero_source(path, optimizer_class_name, model_only)
    folder = _deepspeed_folder(path)
    notes: list[str] = []
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    left_out: set[str] = set()  # with model_only: the names of the state files not read
    for param_dir in sorted((p for p in (folder / "zero").iterdir() if p.is_dir()), key=_natural):
        files = {p.stem: inside(folder, p) for p in param_dir.glob("*.pt")}
        if "fp32" not in files:
            has = ", ".join(sorted(p.name for p in files.values())) or "no .pt files"
            raise ConversionError(f"{param_dir}: DeepSpeed parameter folder without fp32.pt (it has {has})")
        name = param_dir.name
        params[name] = _param_file(files.pop("fp32"))
        if model_only:
            left_out.update(p.name for p in files.values())
            continue
        per_param: dict[str, Any] = {}
        if "step" in files:
            per_param["step"] = load_weights_only(files.pop("step"))
        for key, file in sorted(files.items()):
            value = _param_file(file)
            if value.shape != params[name].shape:
                raise ConversionError(f"{file}: shape {list(value.shape)} differs from the "
                                      f"parameter's {list(params[name].shape)} (fp32.pt)")
            per_param[key] = value
        if per_param:
            state[name] = per_param
    if not params:
        raise ConversionError(f"{folder / 'zero'}: no parameter folders")
    if left_out:
        notes.append(f"model only: left out the optimizer state ({', '.join(sorted(left_out))} "
                     "of the parameters)")

    model_states = [inside(folder, p) for p in sorted(folder.glob("mp_rank_*_model_states.pt"))]
    states = _try_load(model_states[0], "model states", notes) if model_states else None
    states = states if isinstance(states, Mapping) else {}
    module = states.get("module") if isinstance(states.get("module"), Mapping) else None
    model, buffers = _deepspeed_model(params, module, states.get("buffer_names") or [])
    if module is None:
        notes.append(f"no readable model states in {folder}: buffers and frozen parameters are "
                     "missing, tied names appear once")

    optimizer = None
    if state:
        trained = [n for n in model if n in params]  # the module's order, not the folders'
        state = {n: state[n] for n in trained if n in state}
        groups = _deepspeed_groups(folder, trained, set(state), states.get("param_shapes"), notes)
        class_name = optimizer_class_name or optimizer_class(groups)
        if class_name is None:
            class_name = "AdamW"
            notes.append("the optimizer's class is not recorded: taken to be AdamW")
        optimizer = {"class": class_name, "param_groups": groups, "state": state}
    step = states.get("global_steps")
    if not isinstance(step, int) or isinstance(step, bool):
        match = re.fullmatch(r"global_step(\d+)", folder.name)
        step = int(match.group(1)) if match else None
    parts = Parts(model, optimizer, None, step)
    # found: the model (fp32 masters, the module's buffers and frozen parameters) and the
    # optimizer state of the parameters' files
    found = len(model) + count_tensors(state)
    return Source("deepspeed", _captured(parts, str(folder), buffers), step, notes, found=found)


def _deepspeed_model(params: dict[str, torch.Tensor], module: Mapping[str, Any] | None,
                     buffer_names: list[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The model state dict in the module's order: fp32 masters for the trained parameters, the
    module's own tensors for buffers and frozen parameters, tied names sharing their partner's
    master. Without the module, the trained parameters alone."""
    if module is None:
        return dict(params), set()
    model: dict[str, torch.Tensor] = {}
    by_storage = {module[n].untyped_storage().data_ptr(): n for n in params
                  if isinstance(module.get(n), torch.Tensor) and module[n].numel()}
    for name, tensor in module.items():
        if name in params:
            model[name] = params[name]
        elif isinstance(tensor, torch.Tensor):
            partner = by_storage.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
            model[name] = params[partner] if partner is not None else tensor
    model.update((n, t) for n, t in params.items() if n not in model)
    return model, {n for n in buffer_names if n in model}


def _deepspeed_groups(folder: Path, names: list[str], stateful: set[str], param_shapes: Any,
                      notes: list[str]) -> list[dict[str, Any]]:
    """Param groups: membership from the model states' ``param_shapes`` (one dict per group;
    the other parameter folders, frozen parameters and buffers that ``--inject_missing_state``
    wrote, hold no optimizer state), hyperparameters from ``zero/optimizer_state.pt``; one
    group of every parameter otherwise."""
    saved = _try_load(inside(folder, folder / "zero" / "optimizer_state.pt"), "optimizer hyperparameters",
                      notes)
    hypers = [{k: v for k, v in g.items() if k != "params"}
              for g in (saved or {}).get("param_groups", []) if isinstance(g, Mapping)]
    layout = [names]
    if isinstance(param_shapes, list) and all(isinstance(s, Mapping) for s in param_shapes):
        listed = [n for s in param_shapes for n in s]
        if len(set(listed)) == len(listed) and stateful <= set(listed) <= set(names):
            layout = [list(s) for s in param_shapes]
    if len(hypers) == len(layout):
        return [{**hyper, "params": group} for hyper, group in zip(hypers, layout, strict=True)]
    if hypers:
        notes.append(f"{len(hypers)} param groups' hyperparameters could not be matched to the "
                     f"parameters ({len(layout)} group(s) known): left out")
    elif saved is None:
        notes.append("no readable zero/optimizer_state.pt: the param groups have no hyperparameters")
    return [{"params": group} for group in layout]


READERS: dict[str, Callable[[list[Path], str | None, bool], Source]] = {
    "torch": read_torch,
    "dcp": read_dcp,
    "safetensors": read_safetensors,
    "deepspeed": read_deepspeed,
}  # by the names of SOURCE_FORMATS, in its order


def detect_format(paths: list[Path]) -> str:
    """The format of the checkpoint at ``paths``, where what they hold makes it unambiguous."""
    if len(paths) > 1:
        if all(p.is_file() and p.suffix == ".safetensors" for p in paths):
            return "safetensors"
        raise ConversionError("several paths are read as safetensors files only; "
                              f"got {', '.join(map(str, paths))}")
    path = paths[0]
    if path.is_file():
        return "safetensors" if path.name.endswith((".safetensors", ".safetensors.index.json")) else "torch"
    if (path / ROOT_MARKER).exists():
        raise ConversionError(f"{path} is a deltackpt checkpoint directory; export a step of it with "
                              "deltackpt restore --format (or CheckpointManager.restore)")
    found = {"dcp": (path / ".metadata").is_file(),
             "deepspeed": _universal(path) or is_zero_folder(path),
             "torch": (path / TORCH_FILE).is_file(),
             "safetensors": any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))}
    formats = [f for f, yes in found.items() if yes]
    if len(formats) == 1:
        return formats[0]
    if not formats:
        raise ConversionError(f"{path}: no known checkpoint in it (looked for a DCP .metadata, a "
                              "DeepSpeed zero/ folder, latest_universal or latest file or "
                              f"mp_rank_00_model_states.pt, {TORCH_FILE}, .safetensors files)")
    raise ConversionError(f"{path} looks like {' and '.join(formats)}; name the format (--from)")


def source_paths(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """``source`` (one path, or several) as a list of paths."""
    return [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(p) for p in source]


def read_sharded(paths: list[Path], sharding: ShardingSpec, source_format: str | None = None,
                 optimizer_class_name: str | None = None, model_only: bool = False) -> Source:
    """The checkpoints of the tensor-parallel ranks of a hand-sharded run, one path per rank in
    rank order, merged into whole tensors by ``sharding`` (:func:`~deltackpt.interop.patterns.merge_states`).

    Each rank's checkpoint is read as :func:`read_checkpoint` reads one
    (``source_format`` None: detected per path); a single DeepSpeed ``save_checkpoint`` folder
    holds the files of every tensor-parallel rank, read one rank at a time. The step, RNG
    states, ``extra`` and optimizer param groups are rank 0's.
    """
    if len(paths) == 1 and source_format in (None, "deepspeed") and not _universal(paths[0]) \
            and is_zero_folder(paths[0]):
        ranks = [_zero_source(paths[0], optimizer_class_name, model_only, mp)
                 for mp in range(tensor_parallel_ranks(paths[0]))]
    else:
        ranks = [read_checkpoint(path, source_format, optimizer_class_name, model_only=model_only)
                 for path in paths]
    try:
        state = merge_states([r.state for r in ranks], sharding)
    except (ValueError, DeltackptError) as exc:
        raise ConversionError(f"merging the ranks' checkpoints {', '.join(map(str, paths))} "
                              f"(rank 0 first): {exc}") from None
    notes = list(dict.fromkeys(note for r in ranks for note in r.notes))
    # merge_states makes one tensor of each name every rank holds (and refuses ranks whose names differ)
    return Source(f"{ranks[0].format}, {len(ranks)} ranks merged", state, ranks[0].step, notes,
                  found=ranks[0].found)


def read_checkpoint(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                    source_format: str | None = None, optimizer_class_name: str | None = None,
                    sharding: ShardingSpec | None = None, model_only: bool = False) -> Source:
    """Read the checkpoint at ``source`` (``source_format`` None: detected) into a :class:`Source`.

    ``optimizer_class_name`` names the optimizer's class where the source
    does not record it and its hyperparameters do not tell. With
    ``sharding``, ``source`` lists the checkpoints of the ranks of a
    hand-sharded run, merged by that spec (:func:`read_sharded`). With
    ``model_only``, only the model (parameters and buffers) and the step are
    read; the notes say what was left out.
    """
    paths = source_paths(source)
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
    if sharding is not None:
        read = read_sharded(paths, sharding, source_format, optimizer_class_name, model_only)
    else:
        if source_format is None:
            source_format = detect_format(paths)
        elif source_format not in READERS:
            raise ValueError(f"unknown source format {source_format!r}; choose one of "
                             f"{', '.join(SOURCE_FORMATS)}")
        read = READERS[source_format](paths, optimizer_class_name, model_only)
    _check_nothing_lost(paths, read)
    return read


def _check_nothing_lost(paths: list[Path], read: Source) -> None:
    """Refuse a read whose state holds fewer tensors than its reader found in the source.

    The last guard of a conversion, whatever the cause: an export writes every tensor of the
    state, or names in its ``left_out`` the sections its format has no place for, so a tensor
    missing here would vanish from the output without a word.
    """
    kept = len(read.state.tensors)
    if kept < read.found:
        raise ConversionError(f"{', '.join(map(str, paths))}: holds {read.found} tensors, but reading it "
                              f"as {read.format} keeps only {kept}; refusing to lose "
                              f"{read.found - kept} of them without a word (a layout deltackpt "
                              "misreads: please report it)")
