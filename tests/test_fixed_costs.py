"""The fixed costs of saves and restores, which dominate at small states: what a save reads,
computes and fsyncs once, and no more; the metadata a restore of its chain reads again."""

from __future__ import annotations

import functools
import gc
import json
import os

import pytest
import torch
from torch import nn

import deltackpt.directory
import deltackpt.encode.encoder
import deltackpt.encode.optimizers
import deltackpt.io.reader
import deltackpt.io.storage
import deltackpt.manager
import deltackpt.save.driver
from deltackpt import CheckpointManager, DeltackptError, FormatError
from deltackpt.format.metadata import parse_step_metadata, seal_json
from deltackpt.save.capture import capture


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _count_calls(monkeypatch, name: str, modules: tuple) -> list[int]:
    """Count the calls of ``deltackpt.encode.optimizers.<name>`` through any of ``modules``."""
    calls = [0]
    original = getattr(deltackpt.encode.optimizers, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, name, counted, raising=False)
    return calls


def test_a_delta_save_reads_the_optimizer_state_once(tmp_path, monkeypatch) -> None:
    model, optimizer = _trained()
    with CheckpointManager(tmp_path / "ckpt", workers=2) as mgr:
        mgr.save(0, model, optimizer, rng=False)
        _train(model, optimizer, 3)
        modules = (deltackpt.encode.optimizers, deltackpt.encode.encoder)
        by_parameter = _count_calls(monkeypatch, "state_by_parameter", modules)
        bnb = _count_calls(monkeypatch, "captured_bnb_states", modules)
        assert mgr.save(1, model, optimizer, rng=False).kind == "delta"
    assert by_parameter[0] == 1
    assert bnb[0] == 1


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_units_from_a_state_read_once_are_those_read_anew(optimizer_class) -> None:
    """``movement_units`` and ``adam_bias_corrections`` given the state a save read once
    agree with reading it themselves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = optimizer_class(model.parameters(), lr=1e-2, **(
        {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}))
    _train(model, optimizer, 2)
    captured = capture(model, optimizer, None, False)
    states = deltackpt.encode.optimizers.state_by_parameter(captured)
    assert deltackpt.encode.optimizers.movement_units(captured, states) == \
        deltackpt.encode.optimizers.movement_units(captured)
    assert deltackpt.encode.optimizers.adam_bias_corrections(captured, states) == \
        deltackpt.encode.optimizers.adam_bias_corrections(captured)
    assert deltackpt.encode.optimizers.movement_units(captured)  # a unit for every parameter


def _count_reads(monkeypatch) -> list[int]:
    """Count every read of a step's metadata file (parsed, or its save_id alone)."""
    calls = [0]
    for module, name in ((deltackpt.io.reader, "read_metadata"), (deltackpt.directory, "read_metadata"),
                         (deltackpt.save.reference, "read_metadata"),
                         (deltackpt.save.target, "read_metadata"), (deltackpt.save.driver, "read_save_id")):
        original = getattr(module, name)

        def counted(*args, original=original, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_the_writer_reads_no_metadata_it_wrote(tmp_path, monkeypatch) -> None:
    """Saves check their base, and restores walk their chain, without reading again the metadata
    the manager committed (while its file is the one committed); another manager reads it."""
    model, optimizer = _trained()
    with CheckpointManager(tmp_path / "ckpt", full_every=4, workers=2) as mgr:
        mgr.save(0, model, optimizer, rng=False)
        reads = _count_reads(monkeypatch)
        for step in (1, 2, 3):
            _train(model, optimizer, 2)
            assert mgr.save(step, model, optimizer, rng=False).kind == "delta"
        assert reads[0] == 0
        restored = mgr.restore(3)
        assert reads[0] == 0
        with CheckpointManager(tmp_path / "ckpt", read_only=True) as reader:
            fresh = reader.restore(3)
        assert reads[0] == 4  # the chain's four steps
        for name, tensor in fresh.tensors.items():
            assert torch.equal(restored.tensors[name], tensor), name
        # A file changed since it was written is read again: damaged, it is no base, and a
        # restore reports it.
        metadata = tmp_path / "ckpt" / "step-000000000003" / "metadata.json"
        metadata.write_bytes(metadata.read_bytes()[:-1])
        with pytest.raises(DeltackptError, match="000003"):
            mgr.restore(3)
        _train(model, optimizer, 2)
        assert mgr.save(4, model, optimizer, rng=False).kind == "full"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced files by /proc")
def test_a_save_fsyncs_each_file_once_and_its_new_directory_with_them(tmp_path, monkeypatch) -> None:
    """What crash safety needs (FORMAT.md 1.1), once each: every data file, the metadata file,
    the step's directory (the commit) and, for a new step's directory, the root. The root's
    fsync waits for no encoding: it runs once the data files are written, beside theirs."""
    model, optimizer = _trained()
    root = tmp_path / "ckpt"
    with CheckpointManager(root, workers=2, chunk_bytes=4096) as mgr:
        mgr.save(0, model, optimizer, rng=False)
        _train(model, optimizer, 2)
        synced: list[tuple[str, set[str]]] = []  # each fsync, and the data files there by then
        fsync = os.fsync

        def recorded(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            step = root / "step-000000000001"
            synced.append((path, {p.name for p in step.glob("*.bin")}))
            fsync(fd)

        monkeypatch.setattr(deltackpt.io.storage.os, "fsync", recorded)
        assert mgr.save(1, model, optimizer, rng=False).kind == "delta"
        monkeypatch.undo()
        meta = mgr.metadata(1)
    step = str(root / "step-000000000001")
    paths = [path for path, _ in synced]
    data = [f"{step}/{f.name}" for f in meta.files]
    assert sorted(p for p in paths if p.endswith(".bin")) == sorted(data)
    assert len([p for p in paths if p.startswith(f"{step}/metadata.json.")]) == 1  # its .tmp
    assert paths.count(step) == 1 and paths.count(str(root)) == 1
    assert len(paths) == len(data) + 3
    written = next(names for path, names in synced if path == str(root))
    assert written == {f.name for f in meta.files}  # the data are written by then


@pytest.mark.parametrize("enabled", [True, False])
def test_parsing_metadata_runs_no_collection_and_leaves_the_collector_as_it_was(
        tmp_path, enabled: bool) -> None:
    """A step's parsed objects all live on: the garbage collections their allocation would
    trigger (four for these 200 tensors) free nothing and walk the whole heap, so the parse
    pauses the collector, and leaves it as it found it, also when the metadata is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, model, rng=False)
    text = (tmp_path / "ckpt" / "step-000000000000" / "metadata.json").read_bytes()
    damaged = json.loads(text)
    del damaged["xxh3"]
    damaged["kind"] = 3
    damaged = seal_json(json.dumps(damaged, separators=(",", ":")))
    collections = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    def parse(data: bytes | str):
        gc.collect()  # nothing pending: a collection during the parse is one it triggered
        gc.callbacks.append(count)
        try:
            return parse_step_metadata(data, "metadata.json")
        finally:
            gc.callbacks.remove(count)

    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        assert len(parse(text).tensors) == 200
        assert gc.isenabled() == enabled
        with pytest.raises(FormatError):
            parse(damaged)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
    # At most the one young collection the allocations trigger once the collector resumes.
    assert collections == ([0, 0] if enabled else [])
