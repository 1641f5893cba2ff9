"""Conversions between deltackpt and torch.save, DCP, safetensors and DeepSpeed universal checkpoints.

Every round trip is compared bit for bit (dtype, shape, bytes) with its
source: the restored step, or the live model and optimizer a foreign
checkpoint was saved from. Bad input must raise an error naming the file or
entry and leave no output behind.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same_value, assert_state_dicts_equal
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

from deltackpt import CheckpointManager, UniversalCheckpoint, load_universal
from deltackpt.app.cli import main
from deltackpt.errors import ConversionError
from deltackpt.interop import convert, export, read_checkpoint

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "only_torch_safe_globals"),
              # torch's dcp.save and dcp.load in one process, as the tests mean to call them
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

STEP = 2


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Embedding, linear, batch norm (buffers), an output layer tied to the embedding; AdamW with
    two param groups."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Linear(8, 16, bias=False))
    model[3].weight = model[0].weight
    optimizer = torch.optim.AdamW([
        {"params": [model[0].weight, model[1].weight]},
        {"params": [model[1].bias, model[2].weight, model[2].bias], "lr": 5e-3, "weight_decay": 0.0}],
        lr=1e-2)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEP) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 16, (8,))
        nn.functional.cross_entropy(model(tokens), torch.roll(tokens, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model, optimizer = make_model()
    train(model, optimizer)
    return model, optimizer


@pytest.fixture(scope="module")
def restored(trained: tuple[nn.Module, torch.optim.Optimizer],
             tmp_path_factory: pytest.TempPathFactory) -> UniversalCheckpoint:
    """The trained state saved as a deltackpt step (with extra and RNG states) and restored."""
    model, optimizer = trained
    path = tmp_path_factory.mktemp("interop") / "ckpt"
    extra = {"epoch": 3, "tokens": torch.arange(4), "history": [(1, 0.5), (2, 0.25)]}
    with CheckpointManager(path) as mgr:
        mgr.save(STEP, model=model, optimizer=optimizer, extra=extra)
    return load_universal(path)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``root`` (or of ``root`` itself)."""
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def assert_model_equal(ckpt: UniversalCheckpoint, model: nn.Module) -> None:
    assert_state_dicts_equal(ckpt.model, model.state_dict(), "model")


def assert_optimizer_equal(ckpt: UniversalCheckpoint, model: nn.Module,
                           optimizer: torch.optim.Optimizer) -> None:
    """The checkpoint's optimizer is ``optimizer``: class, FQN-keyed state and param groups."""
    expected = get_optimizer_state_dict(model, optimizer)
    saved = ckpt.optimizer
    assert saved["class"] == type(optimizer).__qualname__
    assert_same_value(saved["state"], expected["state"], "optimizer state")
    assert_same_value(saved["param_groups"], expected["param_groups"], "param groups")


def assert_loads_into_fresh(ckpt: UniversalCheckpoint, model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
    """Strict loading into a new model and optimizer gives the very same state."""
    fresh_model, fresh_optimizer = make_model()
    ckpt.load_into(fresh_model, fresh_optimizer, rng=False)
    assert_state_dicts_equal(fresh_model.state_dict(), model.state_dict(), "loaded model")
    assert_same_value(fresh_optimizer.state_dict(), optimizer.state_dict(), "loaded optimizer")


def assert_nothing_written(out: Path) -> None:
    """``out`` was not created, and no temporary sibling of it was left behind."""
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


# -- deltackpt -> X -> deltackpt -------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_round_trip_through_format(restored: UniversalCheckpoint, tmp_path: Path, fmt: str) -> None:
    exported = export(restored.captured(), STEP, tmp_path / fmt, fmt)
    assert exported.left_out == ["rng"]
    assert all(p.is_file() and p.parent == tmp_path / fmt for p in exported.files)
    source = snapshot(tmp_path / fmt)

    report = convert(tmp_path / fmt, tmp_path / "back")
    assert (report.source_format, report.out_format, report.step) == (fmt, "deltackpt", STEP)
    assert report.notes == []
    assert snapshot(tmp_path / fmt) == source  # the source is never modified
    back = load_universal(tmp_path / "back")
    assert back.step == STEP and back.metadata.kind == "full"
    expected = {n: t for n, t in restored.tensors.items() if not n.startswith("rng/")}
    assert_state_dicts_equal(back.tensors, expected, fmt)
    # the optimizer (class, groups, state) and extra come back as the same tagged JSON
    assert back.metadata.state["optimizer"] == restored.metadata.state["optimizer"]
    assert back.metadata.state["extra"] == restored.metadata.state["extra"]
    assert back.metadata.state["rng"] is None
    roles = {r.name: (r.role, r.alias_of) for r in restored.metadata.tensors if r.role != "rng"}
    back_roles = {r.name: (r.role, r.alias_of) for r in back.metadata.tensors}
    if fmt == "dcp":  # DCP stores a tied weight twice and records no buffers
        assert back_roles.pop("model/3.weight") == ("buffer", None)
        roles.pop("model/3.weight")
    else:
        assert back.tensors["model/3.weight"] is back.tensors["model/0.weight"]
    assert back_roles == roles


def test_torch_export_loads_into_torch(restored: UniversalCheckpoint,
                                       trained: tuple[nn.Module, torch.optim.Optimizer],
                                       tmp_path: Path) -> None:
    model, optimizer = trained
    export(restored.captured(), STEP, tmp_path, "torch")
    document = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert (document["step"], document["optimizer_class"]) == (STEP, "AdamW")
    fresh_model, fresh_optimizer = make_model()
    fresh_model.load_state_dict(document["model"])
    fresh_optimizer.load_state_dict(document["optimizer"])
    assert_state_dicts_equal(fresh_model.state_dict(), model.state_dict())
    expected = copy.deepcopy(optimizer.state_dict())
    loaded = fresh_optimizer.state_dict()
    assert [g.pop("param_names") for g in loaded["param_groups"]] == [
        ["0.weight", "1.weight"], ["1.bias", "2.weight", "2.bias"]]
    assert_same_value(loaded, expected)


# -- DCP interop with torch's own dcp.save / dcp.load ------------------------------------------


def test_dcp_export_loads_with_dcp_load(restored: UniversalCheckpoint,
                                        trained: tuple[nn.Module, torch.optim.Optimizer],
                                        tmp_path: Path) -> None:
    model, optimizer = trained
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / ".metadata").write_text("an older checkpoint's index")
    export(restored.captured(), STEP, out, "dcp", overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"  # overwriting keeps unrelated files

    fresh_model, fresh_optimizer = make_model()
    state = {"model": fresh_model.state_dict(),
             "optimizer": get_optimizer_state_dict(fresh_model, fresh_optimizer)}
    dcp.load(state, checkpoint_id=out)
    set_state_dict(fresh_model, fresh_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    assert_state_dicts_equal(fresh_model.state_dict(), model.state_dict(), "model")
    assert_same_value(fresh_optimizer.state_dict(), optimizer.state_dict(), "optimizer")


def test_dcp_saved_by_torch_converts(trained: tuple[nn.Module, torch.optim.Optimizer],
                                     tmp_path: Path) -> None:
    model, optimizer = trained
    source = tmp_path / "dcp"
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer),
              "step": 7, "epoch": 3}, checkpoint_id=source)
    report = convert(source, tmp_path / "out")
    assert (report.source_format, report.step) == ("dcp", 7)
    ckpt = load_universal(tmp_path / "out")
    assert_model_equal(ckpt, model)
    assert_optimizer_equal(ckpt, model, optimizer)  # the class is recognized as AdamW
    assert ckpt.extra == {"epoch": 3}
    assert_loads_into_fresh(ckpt, model, optimizer)


# -- torch.save sources ------------------------------------------------------------------------


def test_torch_save_sources(trained: tuple[nn.Module, torch.optim.Optimizer], tmp_path: Path) -> None:
    model, optimizer = trained
    # a bare state dict
    torch.save(model.state_dict(), tmp_path / "model.pt")
    bare = read_checkpoint(tmp_path / "model.pt")
    assert (bare.format, bare.step, bare.state.tree["optimizer"]) == ("torch", None, None)
    assert_state_dicts_equal(bare.state.model, model.state_dict())
    assert {t.fqn for t in bare.state.tensors if t.role == "buffer"} == {"2.num_batches_tracked"}

    # a training loop's dict: model, an optimizer built from named_parameters (index-keyed with
    # param_names), the step and other entries (extra)
    named = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters()], "param_names": [
            n for n, _ in model.named_parameters()]}], lr=1e-2)
    named.load_state_dict({"state": optimizer.state_dict()["state"],
                           "param_groups": [{**optimizer.state_dict()["param_groups"][0],
                                             "params": list(range(5)),
                                             "param_names": [n for n, _ in model.named_parameters()]}]})
    document = {"model": model.state_dict(), "optim": named.state_dict(), "step": 11, "epoch": 3,
                "losses": [0.5, 0.25]}
    torch.save(document, tmp_path / "train.pt")
    before = snapshot(tmp_path / "train.pt")
    convert(tmp_path / "train.pt", tmp_path / "out")
    assert snapshot(tmp_path / "train.pt") == before
    ckpt = load_universal(tmp_path / "out")
    assert ckpt.step == 11
    assert_model_equal(ckpt, model)
    assert ckpt.tensors["model/3.weight"] is ckpt.tensors["model/0.weight"]  # torch.save keeps the tie
    assert ckpt.optimizer["class"] == "AdamW"
    expected = get_optimizer_state_dict(model, named)
    assert_same_value(ckpt.optimizer["state"], expected["state"])
    assert [g["params"] for g in ckpt.optimizer["param_groups"]] == [
        [n for n, _ in model.named_parameters()]]
    assert ckpt.extra == {"epoch": 3, "losses": [0.5, 0.25]}

    # an optimizer whose class neither the file records nor its hyperparameters tell
    custom = get_optimizer_state_dict(model, optimizer)
    custom["param_groups"] = [{"lr": 0.1, "momentum_decay": 0.5, "params": g["params"]}
                              for g in custom["param_groups"]]
    torch.save({"model": model.state_dict(), "optimizer": custom}, tmp_path / "custom.pt")
    with pytest.raises(ConversionError, match=r"custom\.pt: the optimizer's class is not recorded and "
                                              r"its hyperparameters \['lr', 'momentum_decay'\]"):
        read_checkpoint(tmp_path / "custom.pt")
    named_class = read_checkpoint(tmp_path / "custom.pt", optimizer_class_name="MyOptimizer")
    assert named_class.state.decoded("optimizer")["class"] == "MyOptimizer"


class Net(nn.Module):
    """A model whose state dict mixes parameters and buffers: a float buffer of its own before its
    children's parameters, a frozen layer, batch norm statistics, a layer that never runs (no
    gradient, so no optimizer state) and an output layer (tied to the embedding)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8))
        self.embed = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.norm = nn.BatchNorm1d(8)
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.frozen(self.embed(tokens))) * self.scale)


def index_keyed(optimizer_class: type[torch.optim.Optimizer], tied: bool, **hyper: Any
                ) -> tuple[Net, torch.optim.Optimizer]:
    """A trained Net and its optimizer built from ``model.parameters()``: its state dict lists the
    parameters by index, without names."""
    torch.manual_seed(0)
    model = Net(tied)
    optimizer = optimizer_class(model.parameters(), **hyper)
    for _ in range(2):
        tokens = torch.randint(0, 16, (8,))
        nn.functional.cross_entropy(model(tokens), torch.roll(tokens, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert "param_names" not in optimizer.state_dict()["param_groups"][0]
    return model, optimizer


@pytest.mark.parametrize(("optimizer_class", "hyper"), [(torch.optim.AdamW, {"lr": 1e-2}),
                                                        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_index_keyed_optimizer_is_named_after_the_model(
        tmp_path: Path, optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any],
        fmt: str) -> None:
    """``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` with the optimizer
    built from ``model.parameters()``: the indices are named after the model's parameters (buffers,
    frozen and unused parameters, the tie all placed right), the report says so, and the result
    loads into a fresh model and optimizer as the original state. (DCP stores a tied weight twice,
    so the two could not be told apart there: untied.)"""
    tied = fmt == "torch"
    model, optimizer = index_keyed(optimizer_class, tied, **hyper)
    document = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}
    source = tmp_path / "plain.pt"
    if fmt == "torch":
        torch.save(document, source)
    else:
        source = tmp_path / "plain"
        dcp.save(document, checkpoint_id=source)
    report = convert(source, tmp_path / "out")
    assert report.notes == [
        f"the optimizer lists its {7 if tied else 8} parameters by index, without names: named after "
        "the model's "
        "parameters in state dict order, which agree with the shapes of the optimizer state "
        "(floating-point tensors taken to be buffers: scale, norm.running_mean, norm.running_var)"]
    ckpt = load_universal(tmp_path / "out")
    assert_model_equal(ckpt, model)
    assert ckpt.optimizer["class"] == optimizer_class.__qualname__
    expected = get_optimizer_state_dict(model, optimizer)
    assert_same_value(ckpt.optimizer["state"], expected["state"], "optimizer state")
    assert_same_value(ckpt.optimizer["param_groups"], expected["param_groups"], "param groups")
    assert sorted(ckpt.optimizer["state"]) == ["embed.weight", *([] if tied else ["head.weight"]),
                                               "norm.bias", "norm.weight"]
    assert {r.fqn for r in ckpt.metadata.tensors if r.role == "buffer"} == {
        "scale", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    fresh = Net(tied)
    fresh_optimizer = optimizer_class(fresh.parameters(), **hyper)
    ckpt.load_into(fresh, fresh_optimizer, rng=False)
    assert_state_dicts_equal(fresh.state_dict(), model.state_dict(), "loaded model")
    assert_same_value(fresh_optimizer.state_dict(), optimizer.state_dict(), "loaded optimizer")


def test_index_keyed_optimizer_that_does_not_fit_the_model_is_refused(
        trained: tuple[nn.Module, torch.optim.Optimizer], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Indices whose optimizer state disagrees in shape with the model's parameters in order, or
    that fit them in more than one way, are refused with an error saying where; --model-only
    converts the model of such a file and leaves the rest out."""
    model, _ = trained
    # the groups list the parameters out of the model's order: index 3 is the embedding
    swapped = torch.optim.AdamW([{"params": [model[1].bias, model[2].weight, model[2].bias]},
                                 {"params": [model[0].weight, model[1].weight]}], lr=1e-2)
    train(model, swapped, steps=1)
    out = tmp_path / "out"
    torch.save({"model": model.state_dict(), "optimizer": swapped.state_dict(), "epoch": 3},
               tmp_path / "swapped.pt")
    with pytest.raises(ConversionError, match=r"swapped\.pt: the optimizer lists its 5 parameters by "
                                              r"index, without names, and the model's state dict does "
                                              r"not match them in order: the state of parameter 3 has "
                                              r"shape \[16, 8\], which no model tensor after '2\.bias' "
                                              r"\(parameter 2\) has; .*--model-only"):
        convert(tmp_path / "swapped.pt", out)
    assert_nothing_written(out)

    # no optimizer state yet: a float buffer and a parameter both fit the first index
    torch.manual_seed(0)
    scaled = nn.Sequential(nn.Linear(4, 4))
    scaled.register_buffer("scale", torch.ones(4))
    fresh = torch.optim.SGD(scaled.parameters(), lr=0.1)
    torch.save({"model": scaled.state_dict(), "optimizer": fresh.state_dict()}, tmp_path / "fresh.pt")
    with pytest.raises(ConversionError, match=r"fresh\.pt: .* matches them in more than one way: "
                                              r"parameter 0 is '(scale|0\.weight)' or '(scale|0\.weight)'"):
        convert(tmp_path / "fresh.pt", out)
    assert_nothing_written(out)

    assert main(["convert", str(tmp_path / "swapped.pt"), "--out", str(out), "--model-only",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == ["model only: left out 'optimizer', 'epoch'"]
    ckpt = load_universal(out)
    assert_model_equal(ckpt, model)
    assert (ckpt.optimizer, ckpt.extra) == (None, None)


def test_model_only_of_every_source(restored: UniversalCheckpoint,
                                    trained: tuple[nn.Module, torch.optim.Optimizer],
                                    tmp_path: Path) -> None:
    """--model-only reads the model alone from safetensors, DCP and DeepSpeed sources too."""
    model, optimizer = trained
    export(restored.captured(), STEP, tmp_path / "st", "safetensors")
    export(restored.captured(), STEP, tmp_path / "dcp", "dcp")
    folder, ds_model = deepspeed_folder(tmp_path / "ds", model, optimizer)
    sources = {tmp_path / "st": [f"model only: left out the {s} in {tmp_path / 'st' / s}.safetensors"
                                 for s in ("extra", "optimizer")],
               tmp_path / "dcp": ["model only: left out 'optimizer', 'optimizer_class', 'extra'"],
               folder: ["model only: left out the optimizer state (exp_avg.pt, exp_avg_sq.pt, step.pt "
                        "of the parameters)"]}
    for i, (source, notes) in enumerate(sources.items()):
        report = convert(source, tmp_path / f"out{i}", model_only=True)
        assert report.notes == notes
        ckpt = load_universal(tmp_path / f"out{i}")
        assert_state_dicts_equal(ckpt.model, ds_model if source == folder else restored.model)
        assert (ckpt.optimizer, ckpt.extra) == (None, None)


# -- safetensors sources -----------------------------------------------------------------------


def _hf_directory(model: nn.Module, tmp_path: Path, metadata: dict[str, str] | None = None
                  ) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face checkpoint directory of ``model``: two safetensors shards (with
    ``metadata``) and their index; and the state it holds."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    source = tmp_path / "hf"
    source.mkdir()
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, source / file, metadata=metadata)
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    return source, state


def test_sharded_safetensors_with_index(trained: tuple[nn.Module, torch.optim.Optimizer],
                                        tmp_path: Path) -> None:
    model, _ = trained
    source, state = _hf_directory(model, tmp_path)

    for paths in (source, source / "model.safetensors.index.json",
                  sorted(source.glob("*.safetensors"))):
        read = read_checkpoint(paths)
        assert read.format == "safetensors"
        assert_state_dicts_equal(read.state.model, state)
    report = convert(source, tmp_path / "out", step=5)
    assert report.step == 5
    assert_model_equal(load_universal(tmp_path / "out"), model)

    # an index naming a shard that is not there
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"0.weight": "model-00003-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"model-00003-of-00002\.safetensors does not exist"):
        read_checkpoint(source)


# -- DeepSpeed universal checkpoint ------------------------------------------------------------


def deepspeed_folder(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     *, unsafe_model_states: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DeepSpeed universal checkpoint of ``model`` and ``optimizer`` laid out as ds_to_universal.py
    writes it: ``global_step2/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
    ``zero/optimizer_state.pt``, the copied ``mp_rank_00_model_states.pt`` (bfloat16 module with
    its buffers), and ``latest_universal`` beside the folder. Returns the folder and the model
    state dict DeepSpeed's consolidation gives: fp32 masters, the module's bfloat16 buffers."""
    folder = root / f"global_step{STEP}"
    sd = get_optimizer_state_dict(model, optimizer)
    for name, param in model.named_parameters():  # each tied parameter once, as DeepSpeed names it
        param_dir = folder / "zero" / name
        param_dir.mkdir(parents=True)
        torch.save({"param": param.detach().clone(), "cat_dim": 0}, param_dir / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": sd["state"][name][key].clone(), "cat_dim": 0}, param_dir / f"{key}.pt")
        torch.save(sd["state"][name]["step"].clone(), param_dir / "step.pt")
    torch.save({"param_groups": [{k: v for k, v in g.items()} | {"params": [i]}
                                 for i, g in enumerate(optimizer.state_dict()["param_groups"])],
                "clip_grad": 1.0, "ds_version": "0.16.4"}, folder / "zero" / "optimizer_state.pt")
    module = {k: v.to(torch.bfloat16) if v.is_floating_point() else v.clone()
              for k, v in model.state_dict().items()}
    module["3.weight"] = module["0.weight"]  # tied: one tensor
    param_shapes = [collections.OrderedDict((n, model.get_parameter(n).shape) for n in group)
                    for group in (["0.weight", "1.weight"], ["1.bias", "2.weight", "2.bias"])]
    states: dict[str, Any] = {"module": module, "buffer_names": ["2.running_mean", "2.running_var",
                                                                 "2.num_batches_tracked"],
                              "param_shapes": param_shapes, "global_steps": STEP, "ds_version": "0.16.4"}
    if unsafe_model_states:
        states["args"] = argparse.Namespace(lr=1e-2)  # Megatron-DeepSpeed keeps its arguments
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    (root / "latest_universal").write_text(folder.name)
    return folder, {k: module[k] if k in states["buffer_names"] else v
                    for k, v in model.state_dict().items()}


def test_deepspeed_universal_checkpoint(trained: tuple[nn.Module, torch.optim.Optimizer],
                                        tmp_path: Path) -> None:
    model, optimizer = trained
    _, expected = deepspeed_folder(tmp_path / "ds", model, optimizer)
    report = convert(tmp_path / "ds", tmp_path / "out")  # the folder holding latest_universal
    assert (report.source_format, report.step, report.notes) == ("deepspeed", STEP, [])
    ckpt = load_universal(tmp_path / "out")
    # fp32 masters for the parameters, the module's own buffers, the tie kept
    assert_state_dicts_equal(ckpt.model, expected, "model")
    assert ckpt.tensors["model/2.running_mean"].dtype == torch.bfloat16
    assert ckpt.tensors["model/3.weight"] is ckpt.tensors["model/0.weight"]
    assert {r.fqn for r in ckpt.metadata.tensors if r.role == "buffer"} == {
        "2.running_mean", "2.running_var", "2.num_batches_tracked"}
    assert_optimizer_equal(ckpt, model, optimizer)  # class recognized, groups and state kept


def test_deepspeed_model_states_weights_only_refuses(trained: tuple[nn.Module, torch.optim.Optimizer],
                                                     tmp_path: Path) -> None:
    model, optimizer = trained
    folder, _ = deepspeed_folder(tmp_path / "ds", model, optimizer, unsafe_model_states=True)
    read = read_checkpoint(folder, "deepspeed")
    assert any("argparse.Namespace" in note for note in read.notes), read.notes
    assert any("buffers and frozen parameters are missing" in note for note in read.notes)
    params = dict(model.named_parameters())
    assert_state_dicts_equal(read.state.model, {k: v.detach() for k, v in params.items()})
    assert read.step == STEP  # from the folder's name
    # without the module, membership of the groups is unknown: one group of the parameter
    # folders in name order, and the two groups' hyperparameters cannot be placed
    assert read.state.decoded("optimizer")["param_groups"] == [{"params": sorted(params)}]
    assert any("2 param groups' hyperparameters could not be matched" in note for note in read.notes)


# -- foreign files that carry deltackpt's own keys -------------------------------------------
# Each reader recognizes keys deltackpt's own exports write: safetensors metadata (step, buffers,
# aliases, optimizer, extra), torch.save and DCP entries (model/state_dict/model_state_dict,
# optimizer/optim/optimizer_state_dict, optimizer_class, step, extra). A file of another program
# carrying them converts with every tensor, or is refused naming the file and key; never both
# exit 0 and lose tensors. (DeepSpeed's files hold only DeepSpeed's own keys.)


def by_value(tensors: Iterable[torch.Tensor]) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Tensors as sorted (dtype, shape, bytes): what a conversion must carry over, whatever it
    names them."""
    return sorted((str(t.dtype), tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8)
                   .numpy().tobytes()) for t in tensors)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples (one held twice, twice)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in tensor_leaves(item)]


def assert_converts_whole(source: Path, tensors: list[torch.Tensor], out: Path,
                          capsys: pytest.CaptureFixture[str], model_only: bool = False) -> list[str]:
    """``source`` converts, by :func:`convert` and by ``deltackpt convert``, into checkpoints
    holding every one of ``tensors``; returns the notes."""
    report = convert(source, out / "api", model_only=model_only)
    assert by_value(load_universal(out / "api").tensors.values()) == by_value(tensors)
    options = ["--model-only"] if model_only else []
    assert main(["convert", str(source), "--out", str(out / "cli"), "--json", *options]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == report.notes
    assert by_value(load_universal(out / "cli").tensors.values()) == by_value(tensors)
    return report.notes


def assert_refused(source: Path, message: str, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``source`` is refused with a ConversionError matching ``message`` that names it, by
    :func:`convert` and by ``deltackpt convert`` (exit code 2), and nothing is written."""
    with pytest.raises(ConversionError, match=message) as info:
        convert(source, out)
    assert str(source) in str(info.value)
    assert_nothing_written(out)
    assert main(["convert", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deltackpt: error: {source}") and re.search(message, err), err
    assert_nothing_written(out)


FOREIGN = {"w": torch.arange(9.0).reshape(3, 3), "b": torch.tensor([1, 2, 3]),
           "c": torch.arange(9.0).reshape(3, 3)}


@pytest.mark.parametrize(("metadata", "message"), [
    # a Hugging Face file whose writer kept notes under names deltackpt's export uses
    ({"format": "pt", "extra": "fine-tuned on wikitext", "optimizer": "adamw, lr 3e-4"}, None),
    ({"format": "pt", "extra": '{"note": "hi"}'}, None),
    ({"format": "pt", "extra": '"hi"'}, None),
    ({"format": "pt", "optimizer": '{"class": "AdamW", "param_groups": [], "state": {}}'}, None),
    ({"extra": "null"}, None),
    ({"format": "pt", "step": "100", "buffers": "running stats", "aliases": "none", "by": "me"}, None),
    # exactly the metadata of a file of a deltackpt export: that file, which must then be valid
    ({"format": "pt", "step": "4", "buffers": '["b"]', "aliases": '{"c": "w"}'}, None),
    ({"format": "pt", "step": "4", "buffers": "running stats", "aliases": "{}"},
     "metadata 'buffers' is not JSON"),
    ({"format": "pt", "step": "last", "buffers": "[]", "aliases": "{}"},
     "metadata 'step' is 'last', not a step number"),
    ({"step": "4", "extra": '{"note": "hi"}'}, "holds tensors its extra metadata does not refer to: "
                                               "'b', 'c', 'w'"),
    ({"step": "4", "extra": '{"w": {"$tensor": "w"}}'}, "holds tensors its extra metadata does not "
                                                        "refer to: 'b', 'c'"),
    ({"step": "4", "optimizer": "adamw"}, "metadata 'optimizer' is not JSON"),
])
def test_safetensors_with_deltackpt_keys_converts_whole_or_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], metadata: dict[str, str],
        message: str | None) -> None:
    """A safetensors file is one of a deltackpt export's files only when its metadata holds
    exactly the keys that file has; any other is read as model tensors, whatever its metadata
    holds (a note names the keys of an export it held), with --model-only too."""
    source = tmp_path / "model.safetensors"
    save_file(FOREIGN, source, metadata=metadata)
    if message is not None:
        assert_refused(source, message, tmp_path / "out", capsys)
        return
    notes = assert_converts_whole(source, list(FOREIGN.values()), tmp_path / "out", capsys)
    own = sorted(set(metadata) & {"step", "buffers", "aliases", "optimizer", "extra"})
    assert notes == ([] if set(metadata) == {"format", "step", "buffers", "aliases"} else [
        f"{source}: metadata {', '.join(map(repr, own))} not read, as the file's metadata is not that "
        "of a deltackpt export; its tensors are read as model tensors"])
    assert_converts_whole(source, list(FOREIGN.values()), tmp_path / "model-only", capsys, model_only=True)


def test_sharded_safetensors_with_deltackpt_keys_converts_whole(
        trained: tuple[nn.Module, torch.optim.Optimizer], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face directory (shards and their index) whose shards' metadata holds ``extra``
    and ``optimizer`` converts with every tensor."""
    model, _ = trained
    source, state = _hf_directory(model, tmp_path,
                                  {"format": "pt", "extra": "{}", "optimizer": "{}"})
    assert_converts_whole(source, list(state.values()), tmp_path / "out", capsys)


Document = Callable[[dict[str, torch.Tensor], dict[str, Any]], tuple[dict[str, Any], str | None]]
DOCUMENTS: dict[str, Document] = {
    # entries under the names deltackpt's own torch and DCP exports use, meaning something else
    "optimizer_class without an optimizer": lambda sd, opt: (
        {"model": sd, "optimizer_class": torch.tensor([3.0]), "step": 5}, None),
    "extra and step of the loop's own": lambda sd, opt: (
        {"model": sd, "extra": {"ema": torch.ones(2)}, "step": torch.tensor(7), "optimizer_class": "SGD"},
        None),
    "model and state_dict": lambda sd, opt: ({"model": sd, "state_dict": {"w": torch.ones(3)}}, None),
    "optimizer beside optim": lambda sd, opt: ({"model": sd, "optimizer": opt, "optim": {"w": torch.ones(3)}},
                                               None),
    "a bare state dict with such names": lambda sd, opt: (
        {"optimizer": torch.ones(2), "extra": torch.zeros(2), "step": torch.tensor(3),
         "optimizer_class": torch.ones(1)}, None),
    "model that is a tensor": lambda sd, opt: ({"model": torch.ones(2), "w": torch.ones(2)},
                                               "entry 'model' is a Tensor, not a state dict"),
    # what no reader interprets: an optimizer entry with more than an optimizer state dict holds
    "optimizer with a loss scale": lambda sd, opt: (
        {"model": sd, "optimizer": {**opt, "loss_scale": torch.tensor(1024.0)}},
        "holds {n} tensors, but reading it as {fmt} keeps only {kept}; refusing to lose 1 of them"),
}


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
@pytest.mark.parametrize("case", list(DOCUMENTS))
def test_torch_and_dcp_with_deltackpt_keys_convert_whole_or_fail(
        trained: tuple[nn.Module, torch.optim.Optimizer], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], fmt: str, case: str) -> None:
    """A torch.save file or DCP directory whose entries carry the names deltackpt's exports use
    converts with every tensor, or fails with a ConversionError naming it (``message``, with the
    count of the document's tensors ``n`` and of one fewer, ``kept``)."""
    model, optimizer = trained
    document, message = DOCUMENTS[case](model.state_dict(), get_optimizer_state_dict(model, optimizer))
    source = tmp_path / ("checkpoint.pt" if fmt == "torch" else "dcp")
    if fmt == "torch":
        torch.save(document, source)
    else:
        dcp.save(document, checkpoint_id=source)
    if message is None:
        assert_converts_whole(source, tensor_leaves(document), tmp_path / "out", capsys)
    else:
        n = len(tensor_leaves(document))
        assert_refused(source, message.format(n=n, kept=n - 1, fmt=fmt), tmp_path / "out", capsys)


def test_reading_that_would_lose_a_tensor_is_refused(restored: UniversalCheckpoint, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever a reader misses, read_checkpoint and convert refuse to go on without a tensor of
    the source: here one that a safetensors export's optimizer tree keeps under a key no
    optimizer state dict has."""
    export(restored.captured(), STEP, tmp_path / "st", "safetensors")
    rewrite_metadata(tmp_path / "st" / "optimizer.safetensors", optimizer=edit_json(moved_to_scaler))
    held = sum(len(load_file(file)) for file in (tmp_path / "st").iterdir())
    message = f"holds {held} tensors, but reading it as safetensors keeps only {held - 1}; refusing"
    with pytest.raises(ConversionError, match=message):
        read_checkpoint(tmp_path / "st")
    assert_refused(tmp_path / "st", message, tmp_path / "out", capsys)


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input_fails_clearly_and_writes_nothing(trained: tuple[nn.Module, torch.optim.Optimizer],
                                                   tmp_path: Path) -> None:
    model, optimizer = trained
    out = tmp_path / "out"

    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope.pt'} does not exist"):
        convert(tmp_path / "nope.pt", out)
    assert_nothing_written(out)

    # a DeepSpeed parameter folder without its fp32 weights
    folder, _ = deepspeed_folder(tmp_path / "ds", model, optimizer)
    (folder / "zero" / "1.bias" / "fp32.pt").unlink()
    with pytest.raises(ConversionError, match=r"zero/1\.bias: DeepSpeed parameter folder without fp32\.pt"):
        convert(folder, out)
    assert_nothing_written(out)

    # objects weights_only refuses are never unpickled, in a torch.save file or in a DCP entry
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1)}, tmp_path / "unsafe.pt")
    with pytest.raises(ConversionError, match=r"unsafe\.pt: torch\.load\(weights_only=True\) refuses it, "
                                              r"as it holds argparse\.Namespace"):
        convert(tmp_path / "unsafe.pt", out)
    dcp.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1)}, checkpoint_id=tmp_path / "d")
    with pytest.raises(ConversionError, match=r"d: entry 'args': torch\.load\(weights_only=True\) refuses "
                                              r"it, as it holds argparse\.Namespace"):
        convert(tmp_path / "d", out)
    assert_nothing_written(out)

    # DCP's index is unpickled with only the globals an index holds: a crafted one runs nothing
    marker = tmp_path / "pwned"

    class Crafted:
        def __reduce__(self) -> tuple:
            return os.mkdir, (str(marker),)

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Crafted()))
    with pytest.raises(ConversionError, match=r"d/\.metadata refers to (posix|os)\.mkdir, which no DCP"):
        convert(tmp_path / "d", out)
    assert not marker.exists()
    assert_nothing_written(out)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "d2")
    (tmp_path / "d2" / "__0_0.distcp").unlink()
    with pytest.raises(ConversionError, match=r"d2: DCP cannot read it: .*__0_0\.distcp"):
        convert(tmp_path / "d2", out)
    assert_nothing_written(out)

    # a truncated safetensors file
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConversionError, match=r"m\.safetensors: not a readable safetensors file"):
        convert(tmp_path / "m.safetensors", out)
    assert_nothing_written(out)

    # a deltackpt directory is exported with restore, not converted
    with CheckpointManager(tmp_path / "dk") as mgr:
        mgr.save(1, model=model)
    with pytest.raises(ConversionError, match="is a deltackpt checkpoint directory; export a step of it"):
        convert(tmp_path / "dk", out)
    assert_nothing_written(out)

    # an output directory that is not empty, without overwrite
    torch.save(model.state_dict(), tmp_path / "good.pt")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty; refusing to write into it"):
        convert(tmp_path / "good.pt", out, out_format="safetensors")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    convert(tmp_path / "good.pt", out, out_format="safetensors", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "model.safetensors"]
    assert_state_dicts_equal(load_file(out / "model.safetensors"), model.state_dict())

    # an output inside the source, or holding it
    with pytest.raises(ValueError, match="contains the checkpoint"):
        convert(tmp_path / "good.pt", tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="is inside the checkpoint directory"):
        convert(tmp_path / "d", tmp_path / "d" / "x")
    assert not (tmp_path / "d" / "x").exists()


# -- sources that point outside themselves, or nest too deep ---------------------------------------


def test_index_paths_outside_the_source_are_refused(trained: tuple[nn.Module, torch.optim.Optimizer],
                                                    tmp_path: Path) -> None:
    """A DCP index, a safetensors index or DeepSpeed's latest_universal naming a file outside the
    source directory (``..``, absolute, or through a symbolic link) is refused, naming the index and
    the path; nothing outside is read and nothing is written."""
    model, _ = trained
    out = tmp_path / "out"
    other = tmp_path / "other"  # a checkpoint beside the source: readable, but not the source's
    dcp.save({"model": model.state_dict()}, checkpoint_id=other)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, other / "model.safetensors")

    source = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=source)
    index = source / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # the test's own file
    for name in {info.relative_path for info in metadata.storage_data.values()}:
        for outside in (f"../other/{name}", str(other / name)):
            changed = copy.deepcopy(metadata)
            changed.storage_data = {k: dataclasses.replace(v, relative_path=outside)
                                    for k, v in changed.storage_data.items()}
            index.write_bytes(pickle.dumps(changed))
            with pytest.raises(ConversionError, match=f"{re.escape(str(index))} names .*other/{name}, "
                                                      "which is outside the checkpoint directory"):
                convert(source, out)
            assert_nothing_written(out)
        index.write_bytes(pickle.dumps(metadata))
        (source / name).unlink()
        (source / name).symlink_to(other / name)  # inside by name, outside once resolved
        with pytest.raises(ConversionError, match=f"{re.escape(str(source / name))}, which is outside "
                                                  f"the checkpoint directory .*it leads to "
                                                  f"{re.escape(str(other / name))}"):
            convert(source, out)
        assert_nothing_written(out)

    shards = tmp_path / "hf"
    shards.mkdir()
    shard_index = shards / "model.safetensors.index.json"
    weight_map = {k: "../other/model.safetensors" for k in model.state_dict()}
    shard_index.write_text(json.dumps({"weight_map": weight_map}))
    for source in (shards, shard_index):
        with pytest.raises(ConversionError, match=f"{re.escape(str(shard_index))} names "
                                                  ".*other/model.safetensors, which is outside"):
            convert(source, out)
    shard_index.unlink()
    (shards / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.safetensors, which is outside the checkpoint "
                                              r"directory"):
        convert(shards, out)
    assert_nothing_written(out)

    ds = tmp_path / "ds"
    ds.mkdir()
    (tmp_path / "global_step2" / "zero").mkdir(parents=True)
    (ds / "latest_universal").write_text("../global_step2")
    with pytest.raises(ConversionError, match=r"latest_universal names .*global_step2, which is outside"):
        convert(ds, out)
    assert_nothing_written(out)


def test_crafted_dcp_index_allocates_nothing_and_fails_clearly(
        trained: tuple[nn.Module, torch.optim.Optimizer], tmp_path: Path) -> None:
    """A DCP index stating a terabyte bytearray or a memo index of four billion, or holding a
    storage record without its fields, gives a ConversionError, with nothing allocated for it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    model, _ = trained
    source = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=source)
    metadata = pickle.loads((source / ".metadata").read_bytes())  # the test's own file
    bare = object.__new__(_StorageInfo)
    bare.relative_path = "__0_0.distcp"
    metadata.storage_data = dict.fromkeys(metadata.storage_data, bare)
    payloads = {pickle.PROTO + b"\x05" + pickle.BYTEARRAY8 + struct.pack("<Q", 1 << 40) + pickle.STOP:
                    "a DCP index holds no bytearray",
                pickle.PROTO + b"\x05" + pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", 2**32 - 16)
                + pickle.STOP: "holds a NoneType, not DCP metadata",
                pickle.dumps(metadata): r"a storage record holds \['__0_0\.distcp', None, None\]"}
    for payload, message in payloads.items():
        (source / ".metadata").write_bytes(payload)
        with pytest.raises(ConversionError, match=message):
            convert(source, tmp_path / "out")
        assert_nothing_written(tmp_path / "out")


def rewrite_metadata(file: Path, **entries: str | Callable[[str], str]) -> None:
    """Replace entries of a safetensors file's metadata (by a text, or a function of the entry's
    text), keeping its tensors."""
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    changed = {k: v(metadata[k]) if callable(v) else v for k, v in entries.items()}
    save_file(load_file(file), file, metadata={**metadata, **changed})


def edit_json(edit: Callable[[Any], Any]) -> Callable[[str], str]:
    """A function of a metadata entry's JSON text: the text of ``edit`` of its value."""
    return lambda text: json.dumps(edit(json.loads(text)))


def moved_to_scaler(tree: dict[str, Any]) -> dict[str, Any]:
    """An optimizer tree with one state tensor moved under a key no optimizer state dict has."""
    return {**tree, "scaler": tree["state"]["0.weight"].pop("exp_avg")}


@pytest.mark.parametrize(("file", "entries", "message"), [
    ("model.safetensors", {"aliases": "[" * 100_000 + "]" * 100_000}, "metadata 'aliases' nests more than"),
    ("extra.safetensors", {"extra": '{"a":' * 200 + "1" + "}" * 200}, "metadata 'extra' nests more than"),
    ("model.safetensors", {"aliases": '{"3.weight": ["0.weight"]}'}, "metadata 'aliases' is not a map"),
    ("model.safetensors", {"aliases": '["3.weight"]'}, "metadata 'aliases' is not a map"),
    ("model.safetensors", {"aliases": '{"3.weight": "1.weight"}'}, "'3.weight' is recorded as tied to "
                                                                   "'1.weight', but the tensors differ"),
    ("model.safetensors", {"buffers": '[["2.running_mean"]]'}, "metadata 'buffers' is not a list"),
    ("optimizer.safetensors", {"optimizer": '{"$float": "x"}'}, "optimizer metadata is not a valid state "
                                                                "tree .*invalid tagged value"),
    ("optimizer.safetensors", {"optimizer": edit_json(lambda tree: [tree])}, "not an optimizer state dict"),
    ("optimizer.safetensors", {"optimizer": edit_json(lambda tree: {**tree, "class": 3})},
     "recorded class 3 is not a name"),
    ("optimizer.safetensors", {"optimizer": "[1, 2]"}, "holds tensors its optimizer metadata does not "
                                                       "refer to: '0.weight/exp_avg', "),
    ("extra.safetensors", {"extra": "{}"}, "holds tensors its extra metadata does not refer to"),
    ("optimizer.safetensors", {"optimizer": "adamw"}, "metadata 'optimizer' is not JSON"),
    ("model.safetensors", {"step": "final"}, "metadata 'step' is 'final', not a step number"),
    ("model.safetensors", {"step": "\u00b2"}, "metadata 'step' is '\u00b2', not a step number"),
    ("extra.safetensors", {"extra": '{"a": {"$bytes": "AAA"}}'}, "extra metadata is not a valid state tree"),
    ("extra.safetensors", {"extra": '{"a": {"$npscalar": ["<nope", 1]}}'},
     "extra metadata is not a valid state tree"),
])
def test_malformed_safetensors_metadata_names_the_file(restored: UniversalCheckpoint, tmp_path: Path,
                                                       file: str,
                                                       entries: dict[str, str | Callable[[str], str]],
                                                       message: str) -> None:
    """Metadata of a safetensors export that is nested too deeply, or whose aliases, buffers,
    step or state trees are malformed, or whose state tree leaves tensors of its file out, gives
    a ConversionError naming the file and what is wrong."""
    export(restored.captured(), STEP, tmp_path / "st", "safetensors")
    rewrite_metadata(tmp_path / "st" / file, **entries)
    with pytest.raises(ConversionError, match=message) as info:
        convert(tmp_path / "st", tmp_path / "out")
    assert str(tmp_path / "st" / file) in str(info.value)
    assert_nothing_written(tmp_path / "out")


def test_failed_export_leaves_nothing(restored: UniversalCheckpoint, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        export(restored.captured(), STEP, tmp_path / "out", "torch")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_outputs_get_the_umask_and_no_lock(restored: UniversalCheckpoint, tmp_path: Path, umask: int) -> None:
    """Every exported file has the mode a new file gets under the user's umask, as ``open`` gives
    it (safetensors writes through a private temporary file, 0600), and a standalone deltackpt
    export holds no writer lock file."""
    previous = os.umask(umask)
    try:
        outs = {fmt: export(restored.captured(), STEP, tmp_path / fmt, fmt)
                for fmt in ("deltackpt", "safetensors", "torch", "dcp")}
        restored.save_universal(tmp_path / "universal")
    finally:
        os.umask(previous)
    assert load_universal(tmp_path / "universal").step == STEP
    for out in [*map(tmp_path.joinpath, outs), tmp_path / "universal"]:
        assert not (out / ".writer.lock").exists(), out
        modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in out.rglob("*")}
        expected = {name: oct((0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask) for name in modes}
        assert modes == expected
    assert [p.name for p in outs["deltackpt"].files[:1]] == ["deltackpt.json"]
