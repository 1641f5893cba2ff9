"""The ``deltackpt`` command, run in subprocesses on a real (small) training checkpoint.

Each Python start with torch costs seconds, so the checks share processes:
:func:`test_entry_point` runs ``python -m deltackpt`` itself (stdout, stderr,
exit codes 0/1/2), and every other invocation runs once, in one fresh
interpreter that calls ``deltackpt.app.cli.main(argv)`` per command line (the
``runs`` fixture); the tests then check their outputs.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from deltackpt import CheckpointManager, load_universal
from deltackpt.format.metadata import step_dir_name
from deltackpt.format.tree import decode_tree
from deltackpt.io.progress import human_bytes

FQNS = ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]  # parameters, the tied one once


@dataclass
class Result:
    """Exit code and output of one invocation."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def cli_processes(*argvs: list[Any]) -> list[Result]:
    """Run ``python -m deltackpt ARGV`` for every ARGV, as concurrent processes."""
    procs = [subprocess.Popen([sys.executable, "-m", "deltackpt", *map(str, argv)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in argvs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(Result(proc.returncode, out, err))
    return results


_DRIVER = """
import contextlib, io, json, sys, traceback
from deltackpt.app.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help, --version and usage errors
            code = 0 if exc.code is None else exc.code
        except Exception:  # a crash fails the tests of this command only
            code = -1
            traceback.print_exc()
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def cli_in_one_process(*argvs: list[Any]) -> list[Result]:
    """Run ``deltackpt.app.cli.main(ARGV)`` for every ARGV, one after another in one fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([list(map(str, a)) for a in argvs])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [Result(*r) for r in json.loads(proc.stdout)]


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Embedding, linear, batch norm (buffers) and an output layer tied to the embedding; AdamW."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Linear(8, 16, bias=False))
    model[3].weight = model[0].weight
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@dataclass
class Checkpoint:
    """Steps 1 and 2 (full steps) of a short training run, the live state that step 2 saved, and the files."""

    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any]
    files: dict[str, tuple[int, int]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    torch.manual_seed(0)
    model, optimizer = make_model()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    with CheckpointManager(path, full_every=1) as mgr:  # full (lossless) steps: exact restores
        for step in (1, 2):
            tokens = torch.randint(0, 16, (8,))
            nn.functional.cross_entropy(model(tokens), torch.roll(tokens, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            extra = {"scheduler": scheduler.state_dict(), "epoch": 3, "mask": np.arange(4, dtype=np.int32)}
            mgr.save(step, model=model, optimizer=optimizer, extra=extra)
    return Checkpoint(path, {k: v.clone() for k, v in model.state_dict().items()},
                      copy.deepcopy(optimizer.state_dict()), copy.deepcopy(extra), snapshot(path))


def damage(ckpt: Checkpoint, copy_to: Path) -> tuple[Path, str, Path]:
    """A copy of the checkpoint with one bit flipped in step 2; returns it, the tensor and the file hit."""
    shutil.copytree(ckpt.path, copy_to)
    meta = CheckpointManager(copy_to, read_only=True).metadata(2)
    name = "optimizer/state/0.weight/exp_avg"
    chunk = meta.tensor(name).fragments[0].chunks[0]
    data_file = copy_to / step_dir_name(2) / meta.files[chunk.file].name
    raw = bytearray(data_file.read_bytes())
    raw[chunk.offset + chunk.length // 2] ^= 0x01
    data_file.write_bytes(bytes(raw))
    return copy_to, name, data_file


@dataclass
class Runs:
    """Outputs of the invocations the tests check, by name, and the directories they used."""

    results: dict[str, Result]
    work: Path

    def __getitem__(self, name: str) -> Result:
        return self.results[name]


COMMANDS = ["ls", "info", "restore", "convert", "verify", "du", "demo", "warm"]


@pytest.fixture(scope="module")
def runs(ckpt: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("runs")
    damaged, _, _ = damage(ckpt, work / "damaged")
    occupied = work / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    p = ckpt.path
    argvs = {
        "help": ["--help"], **{f"help {c}": [c, "--help"] for c in COMMANDS}, "version": ["--version"],
        "ls": ["ls", p], "ls json": ["ls", p, "--json"],
        "info": ["info", p, "--step", "1"], "info json": ["info", p, "--json"],
        "du": ["du", p], "du json": ["du", p, "--json"],
        "restore universal": ["restore", p, "--out", work / "u"],
        "restore safetensors": ["restore", p, "--out", work / "s", "--format", "safetensors", "--json",
                                "--progress"],
        "restore torch": ["restore", p, "--out", work / "t", "--format", "torch", "--step", "2",
                          "--progress"],
        "restore dcp": ["restore", p, "--out", work / "dcp", "--format", "dcp", "--json"],
        "convert torch": ["convert", work / "t", "--out", work / "ct", "--json"],
        "convert dcp": ["convert", work / "dcp", "--to", "safetensors", "--out", work / "cs", "--step", "9"],
        "convert missing": ["convert", work / "nope.pt", "--out", work / "cx"],
        "verify deep": ["verify", p, "--deep"],
        "verify damaged": ["verify", damaged],
        "verify damaged json": ["verify", damaged, "--step", "2", "--json"],
        "missing dir": ["ls", work / "nope"],
        "missing step": ["info", p, "--step", "7"],
        "occupied": ["restore", p, "--out", occupied, "--format", "torch"],
        "inside": ["restore", p, "--out", p / "export", "--force"],
        "bad step": ["verify", p, "--step", "-1"],
    }
    return Runs(dict(zip(argvs, cli_in_one_process(*argvs.values()), strict=True)), work)


# -- tests -----------------------------------------------------------------------------------


def test_entry_point(ckpt: Checkpoint, tmp_path: Path) -> None:
    damaged, tensor, data_file = damage(ckpt, tmp_path / "damaged")
    ok, broken, error = cli_processes(["ls", ckpt.path, "--json"], ["verify", damaged],
                                      ["info", ckpt.path, "--step", "7"])
    assert (ok.code, ok.err) == (0, "")
    assert [row["step"] for row in ok.json()["steps"]] == [1, 2]
    assert broken.code == 1, broken.err
    assert f"step 2, tensor {tensor!r}, file {data_file}" in broken.out
    assert (error.code, error.out) == (2, "")
    assert error.err == f"deltackpt: error: step 7 not found in {ckpt.path}; available steps: 1, 2\n"


def test_ls(ckpt: Checkpoint, runs: Runs) -> None:
    mgr = CheckpointManager(ckpt.path, read_only=True)
    listing = runs["ls json"].json()
    assert [row["step"] for row in listing["steps"]] == mgr.steps() == [1, 2]
    for row in listing["steps"]:
        saved = mgr.info(row["step"])
        assert (row["kind"], row["base_step"], row["raw_bytes"], row["stored_bytes"], row["seconds"]) == (
            saved.kind, saved.base_step, saved.raw_bytes, saved.stored_bytes, saved.seconds)
        assert row["ratio"] == pytest.approx(saved.ratio)
        assert row["created"] == mgr.metadata(row["step"]).created
    assert listing["total"]["raw_bytes"] == sum(mgr.info(s).raw_bytes for s in (1, 2))
    assert listing["total"]["stored_bytes"] == sum(mgr.info(s).stored_bytes for s in (1, 2))

    text = runs["ls"]
    assert (text.code, text.err) == (0, "")
    rows = text.out.splitlines()
    assert rows[0].split()[:6] == ["STEP", "KIND", "BASE", "RAW", "STORED", "RATIO"]
    for line, step in zip(rows[1:3], (1, 2), strict=True):
        saved = mgr.info(step)
        assert re.split(r"\s{2,}", line.strip())[:6] == [
            str(step), "full", "-", human_bytes(saved.raw_bytes), human_bytes(saved.stored_bytes),
            f"{saved.ratio:.2f}x"]
    raw, stored = (sum(getattr(mgr.info(s), key) for s in (1, 2)) for key in ("raw_bytes", "stored_bytes"))
    assert re.split(r"\s{2,}", rows[3].strip())[:4] == [
        "total (2)", human_bytes(raw), human_bytes(stored), f"{raw / stored:.2f}x"]


def test_info(ckpt: Checkpoint, runs: Runs) -> None:
    mgr = CheckpointManager(ckpt.path, read_only=True)
    doc = runs["info json"].json()
    assert (doc["step"], doc["kind"], doc["base_step"], doc["world_size"]) == (2, "full", None, 1)
    restored = mgr.restore(2)
    assert [t["name"] for t in doc["tensors"]] == list(restored.tensors)
    for t in doc["tensors"]:
        actual = restored.tensors[t["name"]]
        assert t["dtype"] == str(actual.dtype).removeprefix("torch."), t["name"]
        assert t["shape"] == list(actual.shape), t["name"]
        assert t["raw_bytes"] == actual.numel() * actual.element_size()
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/3.weight"]["alias_of"] == "model/0.weight"
    assert by_name["model/3.weight"]["stored_bytes"] == 0
    assert by_name["model/2.running_mean"]["role"] == "buffer"
    assert by_name["optimizer/state/1.weight/exp_avg"]["shape"] == [8, 8]
    assert sum(t["stored_bytes"] for t in doc["tensors"]) == mgr.info(2).stored_bytes
    state = doc["state"]
    assert state["optimizer"]["class"] == "AdamW"
    assert len(state["optimizer"]["param_groups"]) == 1
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-2
    assert state["optimizer"]["params_with_state"] == len(FQNS)
    assert set(state["rng"]) >= {"torch", "numpy", "python"}
    assert list(state["extra"]["keys"]) == ["scheduler", "epoch", "mask"]

    text = runs["info"]
    assert text.code == 0
    assert text.out.startswith("step            1\nkind            full\n")
    assert "alias of model/0.weight" in text.out
    assert "AdamW: 1 param group(s), 5 parameter(s) with state (step, exp_avg, exp_avg_sq)" in text.out
    assert "epoch: 3" in text.out


def test_restore_universal_is_bit_exact(ckpt: Checkpoint, runs: Runs) -> None:
    assert (runs["restore universal"].code, runs["restore universal"].err) == (0, "")
    source = CheckpointManager(ckpt.path, read_only=True).restore(2)
    out = runs.work / "u"
    assert CheckpointManager(out, read_only=True).steps() == [2]
    assert not (out / ".writer.lock").exists()  # a standalone directory that nothing writes to
    copied = load_universal(out)
    assert copied.tensors.keys() == source.tensors.keys()
    for name, tensor in source.tensors.items():
        assert copied.tensors[name].dtype == tensor.dtype
        assert torch.equal(copied.tensors[name].reshape(-1).view(torch.uint8),
                           tensor.reshape(-1).view(torch.uint8)), name
    assert copied.tensors["model/3.weight"] is copied.tensors["model/0.weight"]
    assert copied.metadata.state == source.metadata.state


def test_restore_safetensors(ckpt: Checkpoint, runs: Runs) -> None:
    result = runs["restore safetensors"]
    assert (result.code, result.err) == (0, "")  # no progress bar with --json
    report = result.json()
    out = runs.work / "s"
    assert [f["path"] for f in report["files"]] == [
        str(out / name) for name in ("extra.safetensors", "model.safetensors", "optimizer.safetensors")]
    assert report["left_out"] == ["rng"]

    model = load_file(out / "model.safetensors")
    assert model.keys() == ckpt.model.keys()  # both names of the tied weight
    for fqn, tensor in ckpt.model.items():
        assert torch.equal(model[fqn], tensor), fqn

    optimizer = load_file(out / "optimizer.safetensors")
    expected = {f"{FQNS[i]}/{key}": value for i, per_param in ckpt.optimizer["state"].items()
                for key, value in per_param.items()}
    assert optimizer.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(optimizer[key], value), key
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        saved = decode_tree(json.loads(f.metadata()["optimizer"]), optimizer.__getitem__)
    assert saved["class"] == "AdamW"
    assert saved["param_groups"][0]["params"] == FQNS
    assert saved["param_groups"][0]["betas"] == (0.9, 0.999)
    assert saved["state"]["1.weight"]["exp_avg"] is optimizer["1.weight/exp_avg"]

    extra_tensors = load_file(out / "extra.safetensors")
    with safe_open(out / "extra.safetensors", "pt") as f:
        extra = decode_tree(json.loads(f.metadata()["extra"]), extra_tensors.__getitem__)
    assert extra["epoch"] == 3 and extra["scheduler"] == ckpt.extra["scheduler"]
    np.testing.assert_array_equal(extra["mask"], ckpt.extra["mask"])


def test_restore_torch_loads_with_weights_only(ckpt: Checkpoint, runs: Runs) -> None:
    result = runs["restore torch"]
    assert result.code == 0, result.err
    assert "restore step 2" in result.err  # --progress
    assert "not exported (torch has no place for it): rng" in result.out
    document = torch.load(runs.work / "t" / "checkpoint.pt", weights_only=True)
    assert document["step"] == 2
    assert document["extra"]["epoch"] == 3
    assert document["extra"]["scheduler"] == ckpt.extra["scheduler"]
    assert torch.equal(document["extra"]["mask"], torch.arange(4, dtype=torch.int32))

    model, optimizer = make_model()
    model.load_state_dict(document["model"])
    for fqn, tensor in ckpt.model.items():
        assert torch.equal(model.state_dict()[fqn], tensor), fqn
    optimizer.load_state_dict(document["optimizer"])
    loaded = optimizer.state_dict()
    assert loaded["state"].keys() == ckpt.optimizer["state"].keys()
    for index, per_param in ckpt.optimizer["state"].items():
        for key, value in per_param.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)
    group = dict(loaded["param_groups"][0])
    assert group.pop("param_names") == FQNS
    assert group == ckpt.optimizer["param_groups"][0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, as meant
def test_restore_dcp_loads_with_torch_dcp(ckpt: Checkpoint, runs: Runs) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

    result = runs["restore dcp"]
    assert (result.code, result.err) == (0, "")
    report = result.json()
    assert [Path(f["path"]).name for f in report["files"]] == [".metadata", "__0_0.distcp"]
    assert report["left_out"] == ["rng"]
    model, optimizer = make_model()
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=runs.work / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for fqn, tensor in ckpt.model.items():
        assert torch.equal(model.state_dict()[fqn], tensor), fqn
    for index, per_param in ckpt.optimizer["state"].items():
        for key, value in per_param.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value), (index, key)


def test_convert(ckpt: Checkpoint, runs: Runs) -> None:
    result = runs["convert torch"]  # the torch export of step 2, back to deltackpt
    assert (result.code, result.err) == (0, "")
    report = result.json()
    assert (report["source_format"], report["format"], report["step"], report["left_out"],
            report["notes"]) == ("torch", "deltackpt", 2, [], [])
    source = CheckpointManager(ckpt.path, read_only=True).restore(2)
    back = load_universal(runs.work / "ct")
    for name, tensor in source.tensors.items():
        if name.startswith("model/") or name.startswith("optimizer/"):
            assert back.tensors[name].dtype == tensor.dtype and torch.equal(back.tensors[name], tensor), name
    assert back.metadata.state["optimizer"] == source.metadata.state["optimizer"]
    assert back.extra["scheduler"] == ckpt.extra["scheduler"]
    assert torch.equal(back.extra["mask"], torch.arange(4, dtype=torch.int32))  # numpy became a tensor

    text = runs["convert dcp"]
    assert text.code == 0, text.err
    assert text.out.startswith(f"converted {runs.work / 'dcp'} (dcp) into {runs.work / 'cs'} as "
                               "safetensors, step 9\n")
    model = load_file(runs.work / "cs" / "model.safetensors")
    assert model.keys() == ckpt.model.keys()
    for fqn, tensor in ckpt.model.items():
        assert torch.equal(model[fqn], tensor), fqn


def test_commands_never_modify_the_checkpoint(ckpt: Checkpoint, runs: Runs) -> None:
    assert runs.results  # every command has run
    assert snapshot(ckpt.path) == ckpt.files


def test_verify(runs: Runs) -> None:
    intact = runs["verify deep"]
    assert intact.code == 0, intact.out + intact.err
    assert intact.out.splitlines() == ["step 1: OK", "step 2: OK", "2 steps checked (deep): all intact"]

    damaged = runs["verify damaged"]
    assert damaged.code == 1
    lines = damaged.out.splitlines()
    assert lines[:2] == ["step 1: OK", "step 2: DAMAGED (1 problem)"]
    meta = CheckpointManager(runs.work / "damaged", read_only=True).metadata(2)
    chunk = meta.tensor("optimizer/state/0.weight/exp_avg").fragments[0].chunks[0]
    data_file = runs.work / "damaged" / step_dir_name(2) / meta.files[chunk.file].name
    assert lines[2] == f"  in {data_file}:"
    assert lines[3].startswith(f"    step 2, tensor 'optimizer/state/0.weight/exp_avg', file {data_file}: "
                               "checksum mismatch")
    assert lines[4] == "2 steps checked: 1 damaged"

    report = runs["verify damaged json"]
    assert report.code == 1
    assert report.json()["ok"] is False
    assert [(s["step"], s["ok"], len(s["problems"])) for s in report.json()["steps"]] == [(2, False, 1)]
    assert report.json()["damage"] == [{"step": 2, "file": str(data_file),
                                        "problems": report.json()["steps"][0]["problems"],
                                        "dependents": []}]


def test_du(ckpt: Checkpoint, runs: Runs) -> None:
    mgr = CheckpointManager(ckpt.path, read_only=True)
    usage = runs["du json"].json()
    assert usage["directory_bytes"] == sum(size for size, _ in ckpt.files.values())
    for row in usage["steps"]:
        step_dir = ckpt.path / step_dir_name(row["step"])
        meta = mgr.metadata(row["step"])
        assert row["metadata_bytes"] == (step_dir / "metadata.json").stat().st_size
        assert row["data_bytes"] == sum((step_dir / f.name).stat().st_size for f in meta.files)
        assert row["total_bytes"] == row["metadata_bytes"] + row["data_bytes"]
    params = [r for s in (1, 2) for r in mgr.metadata(s).tensors if r.role == "param" and not r.alias_of]
    assert usage["by_role"]["param"]["tensors"] == len(params) == 2 * len(FQNS)
    assert usage["by_role"]["param"]["stored_bytes"] == sum(r.stored_bytes for r in params)
    assert sum(r["stored_bytes"] for r in usage["by_role"].values()) == sum(
        mgr.info(s).stored_bytes for s in (1, 2))

    text = runs["du"]
    assert text.code == 0
    assert text.out.splitlines()[0].split() == ["STEP", "FILES", "DATA", "METADATA", "TOTAL"]
    assert f"directory  {human_bytes(usage['directory_bytes'])}" in text.out
    assert any(line.split()[:2] == ["optimizer", "30"] for line in text.out.splitlines())


def test_errors(ckpt: Checkpoint, runs: Runs) -> None:
    for name in ("missing dir", "missing step", "occupied", "inside", "convert missing"):
        r = runs[name]
        assert (r.code, r.out) == (2, ""), name
        assert r.err.startswith("deltackpt: error: ") and r.err.count("\n") == 1, r.err
    nope = runs.work / "nope"
    assert runs["missing dir"].err == (
        f"deltackpt: error: {nope} is not a deltackpt checkpoint directory (it does not exist)\n")
    assert "available steps: 1, 2" in runs["missing step"].err
    assert "is not empty; refusing to write into it (pass --force" in runs["occupied"].err
    assert [p.name for p in (runs.work / "occupied").iterdir()] == ["keep.txt"]
    assert "inside the checkpoint directory" in runs["inside"].err
    assert runs["convert missing"].err == f"deltackpt: error: {runs.work / 'nope.pt'} does not exist\n"
    assert not (runs.work / "cx").exists()
    assert runs["bad step"].code == 2
    assert "argument --step: step must be a non-negative integer, got '-1'" in runs["bad step"].err


def test_help_and_version(runs: Runs) -> None:
    for command in ["", *COMMANDS]:
        r = runs[f"help {command}".strip()]
        assert r.code == 0, (command, r.err)
        assert r.out.startswith(f"usage: deltackpt {command}".strip()), r.out
        if command != "demo":  # the demo's options and text come from deltackpt.app.demo
            assert "examples:\n  deltackpt " in r.out, command
    assert "weights_only=True" in runs["help restore"].out and "--force" in runs["help restore"].out
    for command in COMMANDS:
        assert command in runs["help"].out
    assert (runs["version"].code, runs["version"].out) == (0, "deltackpt 0.1.0\n")


def test_demo_unavailable_is_reported(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Without an importable deltackpt.app.demo the other commands work and ``demo`` says why."""
    import deltackpt.app
    from deltackpt.app.cli import main

    # An earlier import of the demo left it an attribute of its package, where `from
    # deltackpt.app import demo` finds it before sys.modules.
    monkeypatch.delattr(deltackpt.app, "demo", raising=False)
    monkeypatch.setitem(sys.modules, "deltackpt.app.demo", None)  # makes the import fail
    assert main(["demo", "--steps", "3"]) == 2
    assert "the demo is unavailable: cannot import deltackpt.app.demo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
