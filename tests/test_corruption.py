"""Damaged data files and metadata are detected, reported with step, tensor and file, and contained."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, assert_state_dicts_equal, edit_metadata, step_dir
from torch import nn

from deltackpt import CheckpointManager, CorruptionError, FormatError
from deltackpt.app.cli import main
from deltackpt.format.metadata import Chunk, StepMetadata
from deltackpt.io.storage import open_storage
from deltackpt.ops.verify import Damage

STEPS = (0, 1, 2)
DAMAGED = 1


def _content(step: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors of ``step``: compressible, incompressible, bytes, several chunks each."""
    gen = torch.Generator().manual_seed(step)
    return {
        "weights": torch.randn(40, 100, generator=gen) * 0.02,
        "noise": torch.randint(0, 256, (9000,), generator=gen, dtype=torch.uint8).view(torch.float32)
        .clone(),
        "zeros": torch.zeros(3000, dtype=torch.bfloat16),
        "bytes": torch.randint(0, 4, (10000,), generator=gen, dtype=torch.int8),
        "small": torch.arange(7, dtype=torch.int64) + step,
    }


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    with CheckpointManager(path, full_every=1, chunk_bytes=4096) as mgr:  # independent full steps
        for step in STEPS:
            mgr.save(step, extra=_content(step), rng=False)
    return path


@pytest.fixture
def mgr(ckpt_dir: Path) -> Iterator[CheckpointManager]:
    manager = CheckpointManager(ckpt_dir, full_every=1, chunk_bytes=4096)
    yield manager
    manager.close()


def _chunk(meta: StepMetadata, name: str, index: int) -> Chunk:
    return meta.tensor(name).fragments[0].chunks[index]


def _data_path(root: Path, meta: StepMetadata, chunk: Chunk) -> Path:
    return step_dir(root, meta.step) / meta.files[chunk.file].name


def _assert_intact(mgr: CheckpointManager, steps: tuple[int, ...]) -> None:
    for step in steps:
        assert_state_dicts_equal(mgr.restore(step).extra, _content(step), f"step {step}")


def _assert_names_step_tensor_file(message: str, step: int, tensor: str, path: Path) -> None:
    assert f"step {step}" in message, message
    assert repr(tensor) in message, message
    assert str(path) in message, message


@pytest.mark.parametrize(("tensor", "index"), [("extra/weights", 0), ("extra/weights", 3),
                                               ("extra/noise", 2), ("extra/zeros", 1),
                                               ("extra/bytes", 0), ("extra/small", 0)])
def test_flipped_byte(mgr: CheckpointManager, ckpt_dir: Path, tensor: str, index: int) -> None:
    """One flipped byte inside a chunk: restore raises CorruptionError naming step, tensor and file;
    verify (shallow and deep) reports exactly that step; the other steps restore bit-exactly."""
    meta = mgr.metadata(DAMAGED)
    chunk = _chunk(meta, tensor, index)
    path = _data_path(ckpt_dir, meta, chunk)
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptionError) as info:
        mgr.restore(DAMAGED)
    _assert_names_step_tensor_file(str(info.value), DAMAGED, tensor, path)
    for deep in (False, True):
        report = mgr.verify(deep=deep)
        assert sorted(report) == list(STEPS)
        assert [s for s, problems in report.items() if problems] == [DAMAGED]
        (problem,) = report[DAMAGED]
        _assert_names_step_tensor_file(problem, DAMAGED, tensor, path)
        assert mgr.verify(DAMAGED, deep=deep) == {DAMAGED: report[DAMAGED]}
        assert mgr.verify(0, deep=deep) == {0: []}
    _assert_intact(mgr, (0, 2))


def test_a_data_file_shrunk_after_it_was_opened(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A reader takes a data file's size once, when it opens it: bytes past that size are
    refused before any read, and a file that shrinks later reads short, a CorruptionError
    giving the size it has then."""
    meta = mgr.metadata(DAMAGED)
    last = _chunk(meta, "extra/small", 0)
    path = _data_path(ckpt_dir, meta, last)
    size = path.stat().st_size
    reader = open_storage(str(ckpt_dir)).open_reader(str(path.relative_to(ckpt_dir)))
    try:
        assert reader.read(0, size) == path.read_bytes()
        with pytest.raises(CorruptionError, match=f"it has {size}"):
            reader.read(size - 2, 4)
        with open(path, "r+b") as handle:
            handle.truncate(size - 3)
        with pytest.raises(CorruptionError, match=f"file is truncated .*it has {size - 3}"):
            reader.read(size - 4, 4)
    finally:
        reader.close()


def test_truncated_data_file(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A truncated data file raises CorruptionError naming step, tensor and file; verify flags the step."""
    meta = mgr.metadata(DAMAGED)
    last = _chunk(meta, "extra/small", 0)
    path = _data_path(ckpt_dir, meta, last)
    size = path.stat().st_size
    assert size == meta.files[last.file].size
    with open(path, "r+b") as handle:
        handle.truncate(size - 3)
    with pytest.raises(CorruptionError) as info:
        mgr.restore(DAMAGED)
    _assert_names_step_tensor_file(str(info.value), DAMAGED, "extra/small", path)
    assert "truncated" in str(info.value)
    report = mgr.verify()
    assert report[0] == [] and report[2] == []
    (problem,) = report[DAMAGED]
    _assert_names_step_tensor_file(problem, DAMAGED, "extra/small", path)

    with open(path, "r+b") as handle:  # cut deeper: every chunk from there on is reported
        handle.truncate(size // 2)
    damaged_chunks = [c for r in meta.tensors for f in r.fragments for c in f.chunks
                      if c.file == last.file and c.offset + c.length > size // 2]
    assert len(mgr.verify(deep=True)[DAMAGED]) == len(damaged_chunks) > 1
    _assert_intact(mgr, (0, 2))


def test_deleted_data_file(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A missing data file raises CorruptionError naming step, tensor and file; verify flags every chunk."""
    meta = mgr.metadata(DAMAGED)
    path = step_dir(ckpt_dir, DAMAGED) / meta.files[0].name
    path.unlink()
    with pytest.raises(CorruptionError) as info:
        mgr.restore(DAMAGED)
    message = str(info.value)
    assert "missing" in message and f"step {DAMAGED}" in message and str(path) in message
    assert re.search(r"tensor 'extra/\w+'", message)
    report = mgr.verify()
    n_chunks = sum(c.file == 0 for r in meta.tensors for f in r.fragments for c in f.chunks)
    assert len(report[DAMAGED]) == n_chunks
    assert all(str(path) in p for p in report[DAMAGED])
    assert report[0] == [] and report[2] == []
    _assert_intact(mgr, (0, 2))


def test_wrong_decoded_checksum_needs_deep_verify(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """Stored bytes intact but decoding to other bytes (raw_xxh3 mismatch): restore and deep verify fail,
    shallow verify (stored bytes only) does not see it."""
    def edit(obj: dict) -> None:
        record = next(t for t in obj["tensors"] if t["name"] == "extra/weights")
        record["fragments"][0]["chunks"][1]["raw_xxh3"] = "0123456789abcdef"

    edit_metadata(step_dir(ckpt_dir, DAMAGED) / "metadata.json", edit)
    with pytest.raises(CorruptionError, match="decoded bytes") as info:
        mgr.restore(DAMAGED)
    assert "'extra/weights'" in str(info.value) and f"step {DAMAGED}" in str(info.value)
    assert mgr.verify() == {0: [], 1: [], 2: []}
    deep = mgr.verify(deep=True)
    assert deep[0] == [] and deep[2] == [] and len(deep[DAMAGED]) == 1
    assert "'extra/weights'" in deep[DAMAGED][0]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "wrong type"])
def test_damaged_metadata(mgr: CheckpointManager, ckpt_dir: Path, damage: str) -> None:
    """A damaged metadata.json: restore raises FormatError (not JSON) or CorruptionError (a key renamed:
    its checksum no longer matches) naming the file (and so the step directory); verify reports that
    step only, from the open manager and from a freshly opened one."""
    path = step_dir(ckpt_dir, DAMAGED) / "metadata.json"
    text = path.read_bytes()
    damaged = {"garbage": b"\x00garbage{", "truncated": text[: len(text) // 2], "empty": b"",
               "wrong type": text.replace(b'"shape"', b'"shap"', 1)}[damage]
    path.write_bytes(damaged)
    with pytest.raises(CorruptionError if damage == "wrong type" else FormatError) as info:
        mgr.restore(DAMAGED)
    assert str(path) in str(info.value) and f"step-{DAMAGED:012d}" in str(info.value)
    assert mgr.steps() == list(STEPS)
    report = mgr.verify()
    assert report[0] == [] and report[2] == [] and len(report[DAMAGED]) == 1
    assert str(path) in report[DAMAGED][0]
    _assert_intact(mgr, (0, 2))
    mgr.close()

    reader = CheckpointManager(ckpt_dir, read_only=True)
    assert reader.verify() == report
    # A writer opened afterwards (it cleans up leftovers) must cope with the damaged step too:
    # report it, keep its files, restore and save the others.
    files_before = sorted(p.name for p in step_dir(ckpt_dir, DAMAGED).iterdir())
    with CheckpointManager(ckpt_dir, full_every=1, chunk_bytes=4096) as writer:
        assert writer.verify() == report
        assert sorted(p.name for p in step_dir(ckpt_dir, DAMAGED).iterdir()) == files_before
        _assert_intact(writer, (0, 2))
        writer.save(3, extra=_content(3), rng=False)
        _assert_intact(writer, (3,))


def test_damage_reaches_the_deltas_coded_against_it(tmp_path: Path) -> None:
    """In a delta chain (full step 0, delta 1 on 0, delta 2 on 1), one flipped byte in step 1 makes step 1
    and step 2 unrestorable, both errors naming step 1, the tensor and the file; verify (shallow and deep)
    reports the damage for step 1 and, as a dependency, for step 2; step 0 stays intact."""
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Linear(100, 40)
    with CheckpointManager(root, chunk_bytes=4096) as writer:  # default: deltas between full steps
        for step in STEPS:
            with torch.no_grad():
                model.weight.add_(torch.randn(model.weight.shape) * 1e-3)
            writer.save(step, model=model, rng=False)
    mgr = CheckpointManager(root, read_only=True)
    assert [(mgr.metadata(s).kind, mgr.metadata(s).base_step) for s in STEPS] == [
        ("full", None), ("delta", 0), ("delta", 1)]
    step0 = mgr.restore(0).model["weight"]
    meta = mgr.metadata(DAMAGED)
    chunk = _chunk(meta, "model/weight", 0)
    path = _data_path(root, meta, chunk)
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x01
    path.write_bytes(bytes(data))

    for step in (DAMAGED, 2):
        with pytest.raises(CorruptionError) as info:
            mgr.restore(step)
        _assert_names_step_tensor_file(str(info.value), DAMAGED, "model/weight", path)
    for deep in (False, True):
        report = mgr.verify(deep=deep)
        assert report[0] == []
        (problem,) = report[DAMAGED]
        _assert_names_step_tensor_file(problem, DAMAGED, "model/weight", path)
        assert report[2] == [f"depends on step {DAMAGED}, which is damaged (1 problem)"]
        assert report.damage == [Damage(DAMAGED, str(path), [problem], [2])]
        assert mgr.verify(2, deep=deep) == {2: report[2]}
    assert_bitwise_equal(mgr.restore(0).model["weight"], step0)


def test_undamaged_checkpoint_verifies_clean(mgr: CheckpointManager) -> None:
    """Without damage, verify (shallow and deep) reports nothing and every step restores exactly."""
    assert mgr.verify() == {s: [] for s in STEPS}
    assert mgr.verify(deep=True) == {s: [] for s in STEPS}
    _assert_intact(mgr, STEPS)
    ckpt = mgr.restore(2)
    assert_bitwise_equal(ckpt.tensors["extra/small"], _content(2)["small"])


def _adamw_chain(root: Path, steps: tuple[int, ...]) -> CheckpointManager:
    """A full step and deltas on it (``steps``) of a small model trained with AdamW, opened to read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(root, full_every=len(steps), chunk_bytes=4096) as writer:
        for step in steps:
            model(torch.randn(4, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            writer.save(step, model=model, optimizer=optimizer)
    return CheckpointManager(root, read_only=True)


def test_damaged_base_is_reported_once_with_its_dependents(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated data file of the full step under three deltas: verify reports its damaged chunks
    once, under the file, followed by the steps that depend on it; each of those names the damaged
    step in one line instead of repeating its problems."""
    root = tmp_path / "ckpt"
    mgr = _adamw_chain(root, (0, 1, 2, 3))
    meta = mgr.metadata(0)
    chunks = [c for r in meta.tensors for f in r.fragments for c in f.chunks]
    # the file most chunks went to (the writer's threads share them out as they finish), cut
    # inside its middle chunk
    index = max(range(len(meta.files)), key=lambda i: sum(c.file == i for c in chunks))
    in_file = sorted((c for c in chunks if c.file == index), key=lambda c: c.offset)
    middle = in_file[len(in_file) // 2]
    data_file = step_dir(root, 0) / meta.files[index].name
    with open(data_file, "r+b") as handle:
        handle.truncate(middle.offset + middle.length // 2)
    cut = in_file[len(in_file) // 2:]
    assert len(cut) >= 2

    report = mgr.verify()
    problems = report[0]
    assert len(problems) == len(cut)
    assert all(p.count(f"{data_file}: file is truncated") == 1 for p in problems), problems
    for step in (1, 2, 3):
        assert report[step] == [f"depends on step 0, which is damaged ({len(cut)} problems)"]
    assert report.damage == [Damage(0, str(data_file), problems, [1, 2, 3])]
    # one step asked for: the damage of its chain is still reported, with it as the dependent
    one = mgr.verify(3)
    assert one == {3: report[3]} and one.damage == [Damage(0, str(data_file), problems, [3])]

    assert main(["verify", str(root)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"step 0: DAMAGED ({len(cut)} problems)",
        f"  in {data_file}:",
        *(f"    {p}" for p in problems),
        "  steps that depend on it: 1, 2, 3",
        "step 1: DAMAGED (depends on damaged step 0)",
        "step 2: DAMAGED (depends on damaged step 0)",
        "step 3: DAMAGED (depends on damaged step 0)",
        "4 steps checked: 4 damaged"]
    assert main(["verify", str(root), "--step", "2", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["steps"] == [{"step": 2, "ok": False, "damaged": True, "could_not_check": [],
                                  "problems": report[2]}]
    assert document["damage"] == [{"step": 0, "file": str(data_file), "problems": problems,
                                   "dependents": [2]}]


def test_truncated_delta_names_its_context_once(tmp_path: Path) -> None:
    """A delta's data file cut inside each of its chunks in turn (weights, scaled first moments,
    second moments, exact state): the error of restore and of deep verify names the step, tensor
    and file once, with the truncation, not wrapped in the same context again."""
    root = tmp_path / "ckpt"
    mgr = _adamw_chain(root, (0, 1, 2))
    meta = mgr.metadata(2)
    chunks = [c for r in meta.tensors for f in r.fragments for c in f.chunks]
    assert {"quant", "raw"} <= {c.codec for c in chunks}
    for chunk in chunks:
        data_file = step_dir(root, 2) / meta.files[chunk.file].name
        intact = data_file.read_bytes()
        data_file.write_bytes(intact[: chunk.offset + chunk.length - 1])
        with pytest.raises(CorruptionError) as info:
            mgr.restore(2)
        for message in [str(info.value), *mgr.verify(2, deep=True)[2]]:
            assert message.startswith("step 2, tensor '") and message.count("step 2") == 1, message
            assert message.count(str(data_file)) == 1 and "file is truncated" in message, message
        data_file.write_bytes(intact)
