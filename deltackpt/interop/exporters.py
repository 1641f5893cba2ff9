"""Writing a training state in other formats: safetensors, ``torch.save``, DCP, or a standalone
deltackpt directory.

Every exporter takes a :class:`~deltackpt.format.state.CapturedState` (a restored
step's :meth:`~deltackpt.UniversalCheckpoint.captured`, or what a reader of
:mod:`deltackpt.interop.sources` produced) and a step number, so
``deltackpt restore --format`` and ``deltackpt convert`` share them. File
formats are written into a temporary sibling directory and moved into place
when complete (:func:`~deltackpt.io.publish.publish_directory`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltackpt.format.metadata import ROOT_MARKER, step_dir_name, tensor_name
from deltackpt.format.state import CapturedState
from deltackpt.interop.formats import OUT_FORMATS
from deltackpt.interop.layouts import OPTIMIZER_CLASS_KEY, TORCH_FILE, native_optimizer, weights_only_loadable
from deltackpt.io.publish import publish_directory
from deltackpt.save.standalone import save_standalone


@dataclass
class Export:
    """What an export wrote, and the parts of the state its format has no place for."""

    files: list[Path]
    left_out: list[str]


def export(captured: CapturedState, step: int, out: Path, out_format: str, *,
           overwrite: bool = False) -> Export:
    """Write ``captured`` as step ``step`` in ``out_format`` (one of :data:`OUT_FORMATS`) into ``out``.

    ``out`` is created if needed. Files of the same name in it are replaced
    (for ``deltackpt``: the same step, with ``overwrite``); other files stay.
    """
    if out_format == "deltackpt":
        return Export(_export_deltackpt(captured, step, out, overwrite), [])
    writers: dict[str, tuple[Callable[[CapturedState, int, Path], None], str | None]] = {
        "safetensors": (_write_safetensors, None), "torch": (_write_torch, None),
        "dcp": (_write_dcp, ".metadata")}
    if out_format not in writers:
        raise ValueError(f"unknown output format {out_format!r}; choose one of {', '.join(OUT_FORMATS)}")
    write, commit_file = writers[out_format]
    files = publish_directory(out, lambda tmp: write(captured, step, tmp), commit_file)
    return Export(files, ["rng"] if captured.tree.get("rng") is not None else [])


def _export_deltackpt(captured: CapturedState, step: int, out: Path, overwrite: bool) -> list[Path]:
    save_standalone(captured, step, out, overwrite=overwrite)
    return [out / ROOT_MARKER, *sorted((out / step_dir_name(step)).iterdir())]


# -- safetensors -------------------------------------------------------------------------------


def _rename_refs(obj: Any, names: dict[str, str]) -> Any:
    """Tagged JSON with its tensor references (``$tensor``/``$ndarray``) renamed by ``names``."""
    if isinstance(obj, list):
        return [_rename_refs(v, names) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        tag, body = next(iter(obj.items()))
        if tag in ("$tensor", "$ndarray") and isinstance(body, str):
            return {tag: names.get(body, body)}
    return {k: _rename_refs(v, names) for k, v in obj.items()}


def _safetensors_key(name: str, fqn: str | None, state_key: str | None) -> str:
    """The key of an optimizer tensor in ``optimizer.safetensors``: ``<fqn>/<state_key>`` for a
    top-level optimizer state tensor, else its universal name."""
    if fqn is not None and state_key is not None and (
            name == tensor_name("optimizer", "state", fqn, state_key)):
        return f"{fqn}/{state_key}"
    return name


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors stores them: contiguous, and no two sharing memory (a tied
    weight is written under each of its names)."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if ptr in seen and tensor.numel() else tensor.contiguous()
        seen.add(ptr)
    return out


def _write_safetensors(captured: CapturedState, step: int, out: Path) -> None:
    """``model.safetensors`` (state dict by FQN; its metadata lists the buffers and tied names),
    ``optimizer.safetensors`` and ``extra.safetensors`` (tensors, and the section as tagged JSON
    in the metadata) when the state has them."""
    from safetensors.torch import save_file

    fqn_of = {t.name: t.fqn for t in captured.tensors}
    model = [t for t in captured.tensors if t.role in ("param", "buffer")]
    metadata = {"format": "pt", "step": str(step),
                "buffers": json.dumps([t.fqn for t in model if t.role == "buffer"]),
                "aliases": json.dumps({t.fqn: fqn_of[t.alias_of] for t in model if t.alias_of})}
    save_file(_unshared({t.fqn: t.tensor for t in model}), out / "model.safetensors", metadata=metadata)
    for section in ("optimizer", "extra"):
        if captured.tree.get(section) is None:
            continue
        keys = {t.name: _safetensors_key(t.name, t.fqn, t.state_key) if section == "optimizer" else t.name
                for t in captured.tensors if t.role == section}
        tensors = {keys[t.name]: t.tensor for t in captured.tensors if t.role == section}
        save_file(_unshared(tensors), out / f"{section}.safetensors", metadata={
            "step": str(step),
            section: json.dumps(_rename_refs(captured.tree[section], keys), allow_nan=False)})


# -- torch.save --------------------------------------------------------------------------------


def _write_torch(captured: CapturedState, step: int, out: Path) -> None:
    """``checkpoint.pt``: ``{"step", "model", "optimizer", "optimizer_class", "extra"}``, loadable
    with ``torch.load(weights_only=True)``; ``optimizer`` is an ``Optimizer.state_dict()``."""
    optimizer = captured.decoded("optimizer")
    document = weights_only_loadable({
        "step": step,
        "model": captured.model,
        "optimizer": None if optimizer is None else native_optimizer(optimizer),
        OPTIMIZER_CLASS_KEY: None if optimizer is None else optimizer["class"],
        "extra": captured.decoded("extra"),
    })
    torch.save(document, out / TORCH_FILE)


# -- DCP ---------------------------------------------------------------------------------------


def _dcp_state_dict(captured: CapturedState, step: int) -> dict[str, Any]:
    """The state dict a DCP export saves: ``model`` (by FQN), ``optimizer`` in the layout of
    ``get_optimizer_state_dict`` (state by FQN, groups listing FQNs), ``optimizer_class``,
    ``extra`` (when present) and ``step``."""
    state: dict[str, Any] = {"model": captured.model, "step": step}
    optimizer = captured.decoded("optimizer")
    if optimizer is not None:
        state["optimizer"] = {"state": optimizer["state"], "param_groups": optimizer["param_groups"]}
        state[OPTIMIZER_CLASS_KEY] = optimizer["class"]
    extra = captured.decoded("extra")
    if extra is not None:
        state["extra"] = extra
    return weights_only_loadable(state)  # non-tensor entries are read back with weights_only


def _write_dcp(captured: CapturedState, step: int, out: Path) -> None:
    """A DCP checkpoint directory, written by ``torch.distributed.checkpoint.save`` in this process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process without a process group is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_dcp_state_dict(captured, step), storage_writer=dcp.FileSystemWriter(out), no_dist=True)

