"""Retention policies and garbage collection (deltackpt.ops.retention, ``CheckpointManager.gc``,
``keep=``, ``deltackpt gc``), and the error statistics ``ls`` and ``info`` show for delta steps.

The property every test checks: after gc every kept step is restorable and
restores to the very same bytes as before, whatever the policy and the
shape of the delta chains. The writers here delete at once (``reader_grace=0``),
so that the tests see what a gc deletes; tests/test_reader_race.py covers the grace.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from deltackpt import CheckpointManager, CompressionConfig, ConfigError, CorruptionError, Quantizer
from deltackpt.app.cli import ERROR_UNITS, main
from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, split_corpus, train_step
from deltackpt.encode.policy import tensor_class
from deltackpt.format.dtypes import spec_named
from deltackpt.format.metadata import step_dir_name
from deltackpt.io.writer import commit_step, new_save_id, step_metadata, write_data
from deltackpt.ops import retention as retention_module
from deltackpt.ops.retention import GCReport, RetentionPolicy
from deltackpt.restore.chain import chain_of

STEPS = list(range(1, 11))

# -- building checkpoint directories ---------------------------------------------------------------


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    for _ in range(2):
        x = torch.randn(8, 8, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _model(dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build(path: Path, full_every: int, dtype: torch.dtype = torch.float32, steps: list[int] = STEPS,
          rng: bool = True, **kwargs: object) -> Path:
    """A directory with ``steps`` saved from a short training run (a few optimizer steps apart),
    with the RNG states if ``rng``."""
    model, optimizer = _model(dtype)
    with CheckpointManager(path, full_every=full_every, reader_grace=0, **kwargs) as mgr:
        for step in steps:
            _train(model, optimizer, dtype)
            mgr.save(step, model, optimizer, rng=rng)
    return path


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``copy(full_every, dtype, to, rng=True)``: a fresh copy of a directory of steps 1..10
    (with RNG states or not), built once."""
    built: dict[tuple[int, torch.dtype, bool], Path] = {}

    def copy(full_every: int, dtype: torch.dtype, to: Path, rng: bool = True) -> Path:
        key = (full_every, dtype, rng)
        if key not in built:
            name = f"f{full_every}-{str(dtype).removeprefix('torch.')}-{'rng' if rng else 'no-rng'}"
            built[key] = build(tmp_path_factory.mktemp(name) / "ckpt", full_every, dtype, rng=rng)
        shutil.copytree(built[key], to)
        return to

    return copy


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def restored(mgr: CheckpointManager, step: int) -> dict[str, tuple[torch.dtype, bytes]]:
    return {name: (t.dtype, raw(t)) for name, t in mgr.restore(step).tensors.items()}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def chains(mgr: CheckpointManager) -> dict[int, tuple[str, int | None]]:
    return {s: (mgr.metadata(s).kind, mgr.metadata(s).base_step) for s in mgr.steps()}


def tensors_of(mgr: CheckpointManager, step: int) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in mgr.restore(step).tensors.items()}


def assert_within_recorded_error(mgr: CheckpointManager, step: int, old: dict[str, torch.Tensor]) -> None:
    """A re-coded step restores to its old values within the error its stats record per class: the
    largest absolute error (linear domain) or relative one (ordinal domain), plus one rounding of
    the tensor's dtype. Tensors of no class (stored exactly) restore bit for bit."""
    meta = mgr.metadata(step)
    assert meta.kind == "delta" and meta.stats.compression["recoded"]["base_step"] is not None
    config = CompressionConfig.preset(meta.stats.compression["name"])
    new = mgr.restore(step).tensors
    for record in meta.tensors:
        a, b = old[record.name], new[record.name]
        cls = tensor_class(record.role, record.state_key, spec_named(record.dtype), record.numel)
        if cls is None:
            assert raw(a) == raw(b), (step, record.name)
            continue
        stats = meta.stats.classes[cls]
        a, b = a.double(), b.double()
        rounding = a.abs() * {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}[record.dtype]
        if getattr(config, cls).domain == "ordinal":
            bound = a.abs() * stats["max_rel_error"] * (1 + 1e-6)
        else:
            bound = torch.full_like(a, stats["max_abs_error"] * (1 + 1e-6))
        excess = (b - a).abs() - bound - rounding
        assert excess.max() <= 0, (step, record.name, cls, float(excess.max()), stats)


# -- RetentionPolicy ---------------------------------------------------------------------------------


def test_parse() -> None:
    policy = RetentionPolicy.parse("last=5,every=100,full_within=1000")
    assert policy == RetentionPolicy(last=5, every=100, full_within=1000)
    assert str(policy) == "last=5,every=100,full_within=1000"
    assert RetentionPolicy.parse(str(policy)) == policy
    assert RetentionPolicy.parse(" every = 7 , full-within=3 ") == RetentionPolicy(every=7, full_within=3)
    assert RetentionPolicy.parse("last=1") == RetentionPolicy(last=1)
    assert RetentionPolicy.parse(policy) is policy
    assert str(RetentionPolicy(every=10)) == "every=10"


@pytest.mark.parametrize(("spec", "message"), [
    ("", "is empty"),
    ("  ", "is empty"),
    ("last", "'last' is not KEY=N"),
    ("last=0", "last must be a positive integer, got '0'"),
    ("last=-3", "last must be a positive integer, got '-3'"),
    ("every=1.5", "every must be a positive integer, got '1.5'"),
    ("every=ten", "every must be a positive integer, got 'ten'"),
    ("last=", "last must be a positive integer, got ''"),
    ("keep=5", "unknown key 'keep'; expected one of last, every, full_within"),
    ("last=2,last=3", "last is given twice"),
    ("last=2,", "entry '' is not KEY=N"),
    ("last=2;every=3", "last must be a positive integer, got '2;every=3'"),
])
def test_parse_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        RetentionPolicy.parse(spec)
    assert repr(spec) in str(info.value)  # the message names the spec


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "set at least one of last, every and full_within"),
    ({"last": 0}, "last must be a positive integer, got 0"),
    ({"every": -1}, "every must be a positive integer, got -1"),
    ({"full_within": True}, "full_within must be a positive integer, got True"),
    ({"last": "3"}, "last must be a positive integer, got '3'"),
    ({"last": 2.0}, "last must be a positive integer, got 2.0"),
])
def test_policy_validation(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RetentionPolicy(**fields)


def test_parse_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match="RetentionPolicy or a string"):
        RetentionPolicy.parse(5)  # type: ignore[arg-type]


def test_select() -> None:
    steps = list(range(21))
    kinds = {s: "full" if s % 4 == 0 else "delta" for s in steps}
    assert RetentionPolicy(last=3).select(steps, kinds) == {18, 19, 20}
    assert RetentionPolicy(every=5).select(steps, kinds) == {0, 5, 10, 15, 20}
    assert RetentionPolicy(every=6).select(steps, kinds) == {0, 6, 12, 18, 20}  # latest always kept
    assert RetentionPolicy(full_within=6).select(steps, kinds) == {16, 20}  # fulls above 20 - 6
    assert RetentionPolicy(full_within=5).select(steps, kinds) == {16, 20}
    assert RetentionPolicy(full_within=4).select(steps, kinds) == {20}
    assert RetentionPolicy(last=2, every=10, full_within=9).select(steps, kinds) == {0, 10, 12, 16, 19, 20}
    assert RetentionPolicy(last=100).select(steps, kinds) == set(steps)
    assert RetentionPolicy(last=2).select([7, 3, 5], {}) == {5, 7}  # order does not matter
    assert RetentionPolicy(full_within=100).select([1, 2, 3], {1: "full", 2: "delta"}) == {1, 3}
    assert RetentionPolicy(last=1).select([], {}) == set()


# -- gc ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("full_every", "keep"), [
    # full_every=3: 1 full, 2 and 3 deltas, 4 full, ..., 10 full
    (3, "last=2"),  # 9 loses its base 8, and no kept step is below it: full
    (3, "every=3"),  # 3, 6, 9: deltas whose bases go
    (3, "last=1"),
    # full_every=5: 1 full, 2..5 deltas, 6 full, 7..10 deltas
    (5, "every=3"),  # 3: full (nothing kept below); 9, and 10 above it, re-coded on 6
    (5, "last=3,every=4"),
    (5, "full_within=4"),
    (5, "full_within=10,every=7"),
    (1, "every=2"),  # only full steps: nothing to replace
])
def test_gc_keeps_every_kept_step_restorable(templates, tmp_path: Path, full_every: int, keep: str) -> None:
    """Kept steps that stay restore bit for bit; full rewrites too; re-coded deltas within the
    error their stats record; the directory does not grow; the dry run says what the run does."""
    path = templates(full_every, torch.float32, tmp_path / "ckpt")
    mgr = CheckpointManager(path, reader_grace=0)
    before = chains(mgr)
    assert list(before) == STEPS
    values = {s: tensors_of(mgr, s) for s in STEPS}
    policy = RetentionPolicy.parse(keep)
    kept = policy.select(STEPS, {s: k for s, (k, _) in before.items()})
    sizes = {s: dir_bytes(path / step_dir_name(s)) for s in STEPS}

    files = snapshot(path)
    dry = mgr.gc(keep, dry_run=True)
    assert snapshot(path) == files  # a dry run changes nothing
    assert dry.dry_run
    assert dry.kept == sorted(kept)
    assert dry.removed == sorted(set(STEPS) - kept)
    assert dry.freed_bytes == sum(sizes[s] for s in dry.removed)
    assert dry.bytes_before == sum(sizes.values())
    assert dry.skipped == dry.held == []

    report = mgr.gc(keep)
    assert not report.dry_run
    assert (report.kept, report.removed, report.rewritten, report.recoded, report.freed_bytes,
            report.bytes_before) == (dry.kept, dry.removed, dry.rewritten, dry.recoded, dry.freed_bytes,
                                     dry.bytes_before)
    assert report.bytes_after == sum(dir_bytes(path / step_dir_name(s)) for s in report.kept)
    assert report.bytes_after <= report.bytes_before
    assert mgr.steps() == report.kept
    assert sorted(p.name for p in path.glob("step-*")) == [step_dir_name(s) for s in report.kept]
    replaced = set(report.rewritten) | set(report.recoded)
    assert not set(report.rewritten) & set(report.recoded)
    # every kept delta whose base goes is replaced
    assert {s for s in kept if before[s][0] == "delta" and before[s][1] not in kept} <= replaced
    assert report.added_bytes == sum(dir_bytes(path / step_dir_name(s)) for s in replaced)
    after = chains(mgr)
    for s in report.kept:
        if after[s][0] == "delta":
            assert after[s][1] in report.kept
        if s in report.recoded:  # on a kept step that gc left as it was, or rewrote as full (float32)
            assert after[s][0] == "delta" and after[s][1] not in report.recoded
            assert_within_recorded_error(mgr, s, values[s])
        else:
            assert after[s] == (("full", None) if s in report.rewritten else before[s])
            assert restored(mgr, s) == {n: (t.dtype, raw(t)) for n, t in values[s].items()}, s
    assert all(not problems for problems in mgr.verify(deep=True).values())
    mgr.close()


def test_chain_shapes(templates, tmp_path: Path) -> None:
    """The cases the parametrized test covers, spelled out on known chains."""
    path = templates(5, torch.float32, tmp_path / "f5")
    mgr = CheckpointManager(path, reader_grace=0)
    assert chains(mgr) == {1: ("full", None), 2: ("delta", 1), 3: ("delta", 2), 4: ("delta", 3),
                           5: ("delta", 4), 6: ("full", None), 7: ("delta", 6), 8: ("delta", 7),
                           9: ("delta", 8), 10: ("delta", 9)}
    report = mgr.gc("every=3")
    assert (report.kept, report.removed) == ([3, 6, 9, 10], [1, 2, 4, 5, 7, 8])
    # 3 sat in the middle of a chain whose lower steps are gone and has no kept step below: full.
    # 9 lost its base 8: re-coded as a delta on 6, the nearest kept step below it; 10, coded
    # against the old 9, too (on 6 as well: a replaced step is never a base)
    assert (report.rewritten, report.recoded) == ([3], [9, 10])
    assert chains(mgr) == {3: ("full", None), 6: ("full", None), 9: ("delta", 6), 10: ("delta", 6)}
    assert mgr.metadata(9).stats.compression["recoded"]["base_step"] == 8
    mgr.close()

    path = templates(3, torch.float32, tmp_path / "f3")
    with CheckpointManager(path, reader_grace=0) as mgr:
        report = mgr.gc("last=2")  # 9 is a delta on 8, which goes; 10 is full
        assert (report.kept, report.removed, report.rewritten, report.recoded) == (
            [9, 10], [1, 2, 3, 4, 5, 6, 7, 8], [9], [])
        assert chains(mgr) == {9: ("full", None), 10: ("full", None)}
        report = mgr.gc("last=1")
        assert (report.kept, report.removed, report.rewritten) == ([10], [9], [])
        # nothing left to do: a second run is a no-op
        again = mgr.gc("last=1")
        assert (again.kept, again.removed, again.rewritten, again.recoded, again.freed_bytes,
                again.added_bytes) == ([10], [], [], [], 0, 0)
        assert again.bytes_before == again.bytes_after


def test_float32_deltas_stay_on_a_full_rewrite(templates, tmp_path: Path) -> None:
    """A full rewrite holds the very values its step restored to, which are the running values of
    float32 tensors: deltas above it stay as they are."""
    path = templates(5, torch.float32, tmp_path / "f32")
    with CheckpointManager(path, reader_grace=0) as mgr:
        values = {s: restored(mgr, s) for s in (8, 9, 10)}
        report = mgr.gc("last=3")
        assert (report.rewritten, report.recoded) == ([8], [])
        assert chains(mgr) == {8: ("full", None), 9: ("delta", 8), 10: ("delta", 9)}
        assert all(restored(mgr, s) == v for s, v in values.items())


def test_bfloat16_rewrites_cascade(templates, tmp_path: Path) -> None:
    """A bfloat16 delta coded against a step rewritten as full, with no kept step to re-code it
    on, is rewritten too (its float32 running values are gone); float32 deltas need not."""
    # Without RNG states: the full steps of this tiny model store them whole (7.7 KB), its deltas
    # as patches of tens of bytes, so rewriting three steps as full would grow the directory.
    path = templates(5, torch.bfloat16, tmp_path / "bf16", rng=False)
    mgr = CheckpointManager(path, reader_grace=0)
    metas = {s: mgr.metadata(s) for s in mgr.steps()}
    assert any(r.dtype == "bfloat16" and c.codec == "quant" and c.params["pred"] == "base"
               for r in metas[4].tensors for f in r.fragments for c in f.chunks)
    values = {s: restored(mgr, s) for s in mgr.steps()}

    dry = mgr.gc("last=3", dry_run=True)
    report = mgr.gc("last=3")
    assert (dry.kept, dry.removed, dry.rewritten) == (report.kept, report.removed, report.rewritten)
    # 8 loses its base 7; 9 and 10 are coded against 8 and 9 in bfloat16
    assert (report.kept, report.rewritten, report.recoded) == ([8, 9, 10], [8, 9, 10], [])
    for s in report.kept:
        assert mgr.metadata(s).kind == "full"
        assert restored(mgr, s) == values[s], s
    assert report.bytes_after <= report.bytes_before
    mgr.close()


def test_bfloat16_deltas_are_recoded_on_float32_running_values(templates, tmp_path: Path) -> None:
    """With a kept step below them, bfloat16 deltas are re-coded as deltas against its float32
    running values (instead of a cascade of full steps that loses them), within their recorded
    error of what they restored to; a manager continuing from the latest one keeps its deltas."""
    path = templates(5, torch.bfloat16, tmp_path / "bf16")
    mgr = CheckpointManager(path, full_every=5, reader_grace=0)
    values = {s: tensors_of(mgr, s) for s in mgr.steps()}
    before = dir_bytes(path)
    report = mgr.gc("every=3")
    assert (report.kept, report.rewritten, report.recoded) == ([3, 6, 9, 10], [3], [9, 10])
    assert chains(mgr) == {3: ("full", None), 6: ("full", None), 9: ("delta", 6), 10: ("delta", 6)}
    assert dir_bytes(path) <= before
    for s in (9, 10):
        assert_within_recorded_error(mgr, s, values[s])
    assert restored(mgr, 3) == {n: (t.dtype, raw(t)) for n, t in values[3].items()}
    assert all(not problems for problems in mgr.verify(deep=True).values())

    # the loaded step's reconstruction holds the re-coded float32 running values: the next save is a
    # delta on it, restored within its error
    model, optimizer = _model(torch.bfloat16)
    mgr.load(10, model, optimizer)
    _train(model, optimizer, torch.bfloat16)
    assert mgr.save(11, model, optimizer).kind == "delta"
    assert mgr.metadata(11).base_step == 10
    saved = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for name, t in mgr.restore(11).model.items():
        assert (t.float() - saved[name].float()).abs().max() < 0.1, name
    mgr.close()


def test_bfloat16_without_cascade_would_break(tmp_path: Path) -> None:
    """Why the cascade: rewrite only the base of a bfloat16 delta and that delta restores to other
    values (caught by its checksums). A fine weights step makes sure the running values of step 8
    are not all bfloat16 values already."""
    fine = dataclasses.replace(CompressionConfig.preset("balanced"), weights=Quantizer(step=0.5))
    path = build(tmp_path / "bf16", 5, torch.bfloat16, compression=fine)
    mgr = CheckpointManager(path, reader_grace=0)
    expected = restored(mgr, 9)
    captured, save_id = mgr.restore(8).captured(), new_save_id()  # a full step 8, behind its back
    written = write_data(mgr.storage, 8, save_id, captured)
    commit_step(mgr.storage, step_metadata(8, save_id, written, captured.tree, kind="full",
                                           base_step=None, world_size=1, seconds=0.0))
    try:
        assert restored(mgr, 9) != expected
    except CorruptionError as exc:
        assert "step 9" in str(exc)


def test_dry_run_on_a_read_only_manager(templates, tmp_path: Path) -> None:
    path = templates(3, torch.float32, tmp_path / "ckpt")
    files = snapshot(path)
    reader = CheckpointManager(path, read_only=True)
    report = reader.gc("every=5", dry_run=True)
    assert isinstance(report, GCReport)
    assert (report.kept, report.removed, report.rewritten) == ([5, 10], [1, 2, 3, 4, 6, 7, 8, 9], [5])
    assert snapshot(path) == files
    assert ("would remove 8 steps (1, 2, 3, 4, 6, 7, 8, 9), re-code 0 delta steps, rewrite 1 delta "
            "step as full (5)" in report.describe())
    with pytest.raises(PermissionError, match="read_only"):
        reader.gc("every=5")
    assert snapshot(path) == files
    with pytest.raises(ValueError, match="needs a retention policy"):
        reader.gc(dry_run=True)


def test_dry_run_reports_recoded_steps_and_sizes(templates, tmp_path: Path) -> None:
    """The dry run names the steps the run re-codes and rewrites, and estimates the bytes after from
    the sizes on disk (a full step as one of its layout, not raw_bytes / 1.2)."""
    path = templates(5, torch.float32, tmp_path / "ckpt")
    with CheckpointManager(path, reader_grace=0) as mgr:
        dry = mgr.gc("every=3", dry_run=True)
        report = mgr.gc("every=3")
    assert (dry.recoded, dry.rewritten, dry.held) == (report.recoded, report.rewritten, []) == (
        [9, 10], [3], [])
    assert dry.bytes_before == report.bytes_before
    assert report.bytes_after == sum(dir_bytes(path / step_dir_name(s)) for s in report.kept)
    # the estimate of what a full step takes is a full step's size: within 10% of the rewrite
    assert abs(dry.added_bytes - report.added_bytes) <= 0.5 * report.added_bytes
    assert abs(dry.bytes_after - report.bytes_after) <= 0.25 * report.bytes_after
    assert "re-code 2 delta steps (9, 10)" in dry.describe()
    assert f"-> about {dry.bytes_after / 1024:.1f} KiB" in dry.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dry_run_estimates_a_full_rewrite_of_values_a_dither_made_dense(
        dtype: torch.dtype, tmp_path: Path) -> None:
    """Adam's moments two steps into training, and those of an embedding's unused rows, are mostly
    zero or alike: a full step stores them in few bytes, but the dithered deltas after it restore
    them as values spread within a step, which a rewrite as full stores whole. The dry run predicts
    that rewrite within 10%, where the nearest full step's size would promise 0.6 of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path, full_every=8, reader_grace=0) as mgr:
        for step in range(1, 25):
            for _ in range(2):
                model(torch.randint(0, 64, (16,))).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            mgr.save(step, model, optimizer)
        dry = mgr.gc("last=1", dry_run=True)
        report = mgr.gc("last=1")
    assert (dry.rewritten, dry.held) == (report.rewritten, report.held) == ([24], [])
    assert abs(dry.added_bytes - report.added_bytes) <= 0.1 * report.added_bytes
    assert abs(dry.bytes_after - report.bytes_after) <= 0.1 * report.bytes_after


def test_describe() -> None:
    report = GCReport(kept=[9, 10], removed=[*range(1, 9), 11, 12], rewritten=[9], freed_bytes=3 << 20,
                      added_bytes=1536, dry_run=False, recoded=[10], bytes_before=4 << 20,
                      bytes_after=(1 << 20) + 1536)
    assert report.describe() == ("removed 10 steps (1, 2, 3, 4, 5, 6, 7, ..., 12), re-coded 1 delta step "
                                 "(10), rewrote 1 delta step as full (9), kept 2 steps; freed 3.0 MiB, "
                                 "wrote 1.5 KiB (4.0 MiB -> 1.0 MiB)")
    assert report.as_dict()["rewritten"] == [9] and report.as_dict()["recoded"] == [10]


def test_replacing_would_grow_the_directory(templates, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """When the replacements would take more bytes than the gc frees, nothing is replaced: the steps
    the kept steps' chains need are held, and only the others go."""
    path = templates(5, torch.float32, tmp_path / "ckpt")
    values = {}
    with CheckpointManager(path, reader_grace=0) as mgr:
        values = {s: restored(mgr, s) for s in STEPS}
        files = snapshot(path)
        huge = 10 << 20  # what every replacement would take
        monkeypatch.setattr(retention_module, "metadata_bytes", lambda meta: bytes(huge))
        monkeypatch.setattr(retention_module, "_full_estimate", lambda plan, step: huge)
        monkeypatch.setattr(retention_module, "_delta_estimate",
                            lambda plan, step, base, slopes: huge)
        dry = mgr.gc("every=3", dry_run=True)
        report = mgr.gc("every=3")
        monkeypatch.undo()
        for r in (dry, report):
            assert (r.kept, r.removed, r.held, r.recoded, r.rewritten, r.added_bytes) == (
                [1, 2, 3, 6, 7, 8, 9, 10], [4, 5], [1, 2, 7, 8], [], [], 0)
        assert "held 4 steps the policy drops" in report.describe()
        assert report.bytes_after == report.bytes_before - report.freed_bytes
        gone = (step_dir_name(4), step_dir_name(5))
        assert snapshot(path) == {k: v for k, v in files.items() if not k.startswith(gone)}
        assert all(restored(mgr, s) == values[s] for s in report.kept)


def test_unreadable_steps_are_left_alone(templates, tmp_path: Path) -> None:
    path = templates(5, torch.float32, tmp_path / "ckpt")
    (path / step_dir_name(2) / "metadata.json").write_text("{not json")
    mgr = CheckpointManager(path, reader_grace=0)
    values = {s: restored(mgr, s) for s in (9, 10)}
    report = mgr.gc("last=2,every=5")
    # 2 is unreadable: kept as is. 5 depends on 4 -> 3 -> 2: its chain is broken already, so it is
    # neither replaced nor able to serve as a base. 9 is rewritten (no kept step to re-code it on);
    # 10, a float32 delta on 9, stays.
    assert report.kept == [2, 5, 9, 10]
    assert report.skipped == [2, 5]
    assert (report.rewritten, report.recoded) == ([9], [])
    assert report.removed == [1, 3, 4, 6, 7, 8]
    assert mgr.steps() == [2, 5, 9, 10]
    assert (path / step_dir_name(2) / "metadata.json").read_text() == "{not json"
    assert restored(mgr, 9) == values[9] and restored(mgr, 10) == values[10]
    assert "left alone 2 steps that cannot be read or restored (2, 5)" in report.describe()
    mgr.close()


def test_kept_steps_with_a_missing_base_are_left_alone(templates, tmp_path: Path) -> None:
    path = templates(5, torch.float32, tmp_path / "ckpt")
    shutil.rmtree(path / step_dir_name(7))  # 8, 9 and 10 cannot be restored any more
    with CheckpointManager(path, reader_grace=0) as mgr:
        values = restored(mgr, 6)
        dry = mgr.gc("last=3,every=6", dry_run=True)
        report = mgr.gc("last=3,every=6")
        assert (report.kept, report.removed, report.rewritten, report.recoded, report.skipped) == (
            [6, 8, 9, 10], [1, 2, 3, 4, 5], [], [], [8, 9, 10])
        assert (dry.kept, dry.removed, dry.rewritten, dry.skipped) == (
            report.kept, report.removed, report.rewritten, report.skipped)
        assert mgr.steps() == [6, 8, 9, 10]
        assert restored(mgr, 6) == values


def test_damaged_chain_stops_gc_before_changing_anything(templates, tmp_path: Path) -> None:
    path = templates(5, torch.float32, tmp_path / "ckpt")
    mgr = CheckpointManager(path, reader_grace=0)
    meta = mgr.metadata(6)
    chunk = meta.tensor("model/0.weight").fragments[0].chunks[0]
    data = path / step_dir_name(6) / meta.files[chunk.file].name
    damaged = bytearray(data.read_bytes())
    damaged[chunk.offset] ^= 0xFF
    data.write_bytes(bytes(damaged))
    files = snapshot(path)
    with pytest.raises(CorruptionError, match=r"gc stopped before changing anything: kept step 9 must be "
                                              r"re-coded .* cannot be restored"):
        mgr.gc("every=3")  # 3 is rewritten first (its chain is intact); 9 is restored through 6
    assert snapshot(path) == files  # 3's new version, written, is deleted again
    mgr.close()


def test_a_crash_at_any_point_leaves_kept_steps_restorable(templates, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupt gc before each of its commits and deletions in turn: every kept step still restores,
    to its old values or (re-coded and committed) within the error its stats record."""
    template = templates(5, torch.float32, tmp_path / "template")
    with CheckpointManager(template, read_only=True) as mgr:
        values = {s: tensors_of(mgr, s) for s in STEPS}
    real_commit = retention_module.commit_step
    point = 0
    while True:
        path = tmp_path / f"crash{point}"
        shutil.copytree(template, path)
        countdown = [point]

        def fail_at_point(real: Callable, *args: object, countdown: list[int] = countdown) -> object:
            if countdown[0] == 0:
                raise KeyboardInterrupt("crash")
            countdown[0] -= 1
            return real(*args)

        mgr = CheckpointManager(path, reader_grace=0)
        monkeypatch.setattr(retention_module, "commit_step",
                            lambda *a, **k: fail_at_point(lambda: real_commit(*a, **k)))
        monkeypatch.setattr(mgr.storage, "remove_tree",
                            lambda rel, real=mgr.storage.remove_tree: fail_at_point(real, rel))
        try:
            mgr.gc("every=3")
            crashed = False
        except KeyboardInterrupt:
            crashed = True
        monkeypatch.undo()
        mgr.close()
        mgr = CheckpointManager(path, reader_grace=0)  # a new writer, as after a crash
        for s in [3, 6, 9, 10]:
            meta = mgr.metadata(s)
            if meta.kind == "delta" and "recoded" in (meta.stats.compression or {}):
                assert_within_recorded_error(mgr, s, values[s])
            else:
                assert restored(mgr, s) == {n: (t.dtype, raw(t)) for n, t in values[s].items()}, (point, s)
        assert all(not problems for problems in mgr.verify(deep=True).values()), point
        mgr.close()
        if not crashed:
            break
        point += 1
    assert point == 3 + 6  # 3 replacements and 6 deletions


# -- keep= on the manager ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_applies_after_every_save(tmp_path: Path, dtype: torch.dtype) -> None:
    """gc after every save: kept steps stay restorable (to the same values, or within the recorded
    error where re-coded), and the saves keep the kinds full_every gives them."""
    model, optimizer = _model(dtype)
    values: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
    with CheckpointManager(tmp_path / "ckpt", full_every=4, keep="last=2,every=5") as mgr:
        assert mgr.keep == RetentionPolicy(last=2, every=5)
        for step in range(1, 12):
            _train(model, optimizer, dtype)
            assert mgr.save(step, model, optimizer).kind == ("full" if step % 4 == 1 else "delta"), step
            expected = {s for s in range(1, step + 1) if s % 5 == 0} | {step - 1, step} - {0}
            # with bfloat16, rewriting a chain as full steps can grow the directory: steps the
            # kept ones need are held instead
            held = set(mgr.steps()) - expected
            assert expected <= set(mgr.steps()) and (dtype == torch.bfloat16 or not held), step
            assert held <= {link.step for s in expected for link in chain_of(mgr.storage, mgr.metadata(s))}
            for s in mgr.steps():
                meta = mgr.metadata(s)
                assert meta.kind == "full" or meta.base_step in mgr.steps()
                if s in values and values[s][0] != meta.save_id:  # replaced by this gc
                    if meta.kind == "delta":
                        assert_within_recorded_error(mgr, s, values[s][1])
                    else:
                        assert restored(mgr, s) == {n: (t.dtype, raw(t)) for n, t in values[s][1].items()}
                elif s in values:
                    assert restored(mgr, s) == {n: (t.dtype, raw(t)) for n, t in values[s][1].items()}
                values[s] = meta.save_id, tensors_of(mgr, s)
        kinds = chains(mgr)
        assert any(kind == "delta" for kind, _ in kinds.values())  # deltas are still written
    with pytest.raises(ValueError, match="unknown key 'lats'"):
        CheckpointManager(tmp_path / "other", keep="lats=2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_every_counts_saves_across_gc(tmp_path: Path, dtype: torch.dtype) -> None:
    """A full step every full_every saves, with gc after every save as without: a replaced step the
    manager codes its next save against is followed, not a reason for a full save."""
    kinds = {}
    for keep in (None, "last=3,every=7"):
        model, optimizer = _model(dtype)
        with CheckpointManager(tmp_path / f"ckpt-{keep}", full_every=6, keep=keep) as mgr:
            kinds[keep] = [mgr.save(step, model, optimizer).kind
                           for step in range(1, 21) if _train(model, optimizer, dtype) is None]
            if keep is not None:
                assert mgr.steps() == [7, 14, 18, 19, 20]
                assert all(not problems for problems in mgr.verify(deep=True).values())
    assert kinds[None] == ["full" if i % 6 == 0 else "delta" for i in range(20)]
    assert kinds["last=3,every=7"] == kinds[None]


def tiny_gpt_run(path: Path, saves: int, keep: str, full_every: int = 10, train_steps: int = 3,
                 ) -> tuple[list[str], list[tuple[int, int, GCReport]], CheckpointManager]:
    """TinyGPT ("tiny") trained with AdamW on real text, saved every ``train_steps`` steps, with gc
    after every save (what ``keep=`` does), measured: the kinds of the saves and, per gc, the bytes
    of the directory before and after it and its report."""
    torch.manual_seed(0)
    model = TinyGPT(SIZES["tiny"])
    optimizer = make_optimizer(model)
    data, _ = split_corpus(load_corpus(1 << 20))
    mgr = CheckpointManager(path, full_every=full_every, reader_grace=0)
    kinds, sizes = [], []
    for step in range(1, saves + 1):
        for _ in range(train_steps):
            train_step(model, optimizer, None, data, 8)
        kinds.append(mgr.save(step, model, optimizer).kind)
        values = {s: (mgr.metadata(s).save_id, tensors_of(mgr, s)) for s in mgr.steps()}
        before = dir_bytes(path)
        report = mgr.gc(keep)
        sizes.append((before, dir_bytes(path), report))
        for s in report.recoded:  # within the recorded error of what it restored to before
            assert_within_recorded_error(mgr, s, values[s][1])
            # and within half the step its chunks record: move_step units of the weights' movement
            restored_now, meta = mgr.restore(s).model, mgr.metadata(s)
            assert meta.stats.compression["weights"]["move_step"] == \
                CompressionConfig.preset("balanced").weights.move_step
            for name, t in values[s][1].items():
                record = meta.tensor(name)
                if record.alias_of is not None:
                    name = record.alias_of
                if name.startswith("model/") and t.dim() >= 2:
                    steps = [c.params["step"] for f in meta.tensor(name).fragments for c in f.chunks
                             if c.codec == "quant"]
                    bound = max(steps, default=0.0) / 2 * (1 + 1e-5)  # none: stored exactly
                    assert (restored_now[name.removeprefix("model/")] - t).abs().max() <= bound, name
        for s in report.kept:
            if s not in report.recoded and s not in report.held:
                assert restored(mgr, s) == {n: (t.dtype, raw(t)) for n, t in values[s][1].items()}
    return kinds, sizes, mgr


def test_gc_of_a_training_run_never_grows_the_directory(tmp_path: Path) -> None:
    """Real training (TinyGPT on real text), keep="last=3,every=20" after every save: no gc makes
    the directory larger, kept deltas are re-coded as deltas (not rewritten as full steps once a
    kept step is below them), and full steps come every full_every saves."""
    kinds, sizes, mgr = tiny_gpt_run(tmp_path / "ckpt", 24, "last=3,every=20")
    outside_steps = (tmp_path / "ckpt" / "deltackpt.json").stat().st_size  # and an empty lock file
    for step, (before, after, report) in enumerate(sizes, 1):
        assert after <= before, (step, before, after, report.describe())
        assert (report.bytes_before, report.bytes_after) == (before - outside_steps, after - outside_steps)
    assert kinds == ["full" if i % 10 == 0 else "delta" for i in range(24)]
    assert mgr.steps() == [20, 22, 23, 24]
    reports = {step: report for step, (*_, report) in enumerate(sizes, 1)}
    # until 20 is rewritten as a full step (it lost its base 19 at the save of 22), no kept step is
    # below the last three: the lowest of them is rewritten; then they are re-coded on 20
    assert (reports[22].rewritten, reports[24].recoded, reports[24].rewritten) == ([20], [22, 23, 24], [])
    assert all(not problems for problems in mgr.verify(deep=True).values())
    mgr.close()


# -- the CLI -----------------------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_gc(templates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = templates(5, torch.float32, tmp_path / "ckpt")
    mgr = CheckpointManager(path, read_only=True)
    values = {s: restored(mgr, s) for s in (3, 9, 10)}
    files = snapshot(path)

    code, out, err = cli(capsys, "gc", path, "--keep", "every=3", "--dry-run", "--json")
    assert (code, err) == (0, "")
    dry = json.loads(out)
    assert dry == {"path": str(path), "policy": "every=3", "kept": [3, 6, 9, 10],
                   "removed": [1, 2, 4, 5, 7, 8], "rewritten": [3], "recoded": [9, 10], "held": [],
                   "freed_bytes": dry["freed_bytes"], "added_bytes": dry["added_bytes"],
                   "bytes_before": sum(dir_bytes(p) for p in path.glob("step-*")),
                   "bytes_after": dry["bytes_after"], "dry_run": True, "skipped": [], "needed_bytes": 0,
                   "chains_kept": False}
    assert dry["freed_bytes"] == sum(dir_bytes(path / step_dir_name(s)) for s in dry["removed"])
    assert dry["bytes_after"] < dry["bytes_before"]

    code, out, err = cli(capsys, "gc", path, "--keep", "every=3", "--dry-run")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"dry run, nothing changed: gc of {path} with --keep every=3"
    assert re.search(r"^  removed +6  1, 2, 4, 5, 7, 8$", out, re.M)
    assert re.search(r"^  re-coded +2  9, 10 ", out, re.M)
    assert re.search(r"^  rewritten +1  3 ", out, re.M)
    assert re.search(r"^would free .*; steps take .*, about .* after$", out, re.M)
    assert snapshot(path) == files

    code, out, err = cli(capsys, "gc", path, "--keep", "every=3")
    assert (code, err) == (0, "")
    assert re.search(r"^  kept +4  3, 6, 9, 10$", out, re.M)
    assert out.splitlines()[-1].startswith("freed ")
    assert mgr.steps() == [3, 6, 9, 10]
    assert restored(mgr, 3) == values[3]
    recoded = {s: restored(mgr, s) for s in (9, 10)}

    code, out, err = cli(capsys, "gc", path, "--keep", "last=1", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["kept"], report["removed"], report["rewritten"], report["dry_run"]) == (
        [10], [3, 6, 9], [10], False)
    assert report["added_bytes"] == dir_bytes(path / step_dir_name(10)) == report["bytes_after"]
    assert mgr.steps() == [10] and mgr.metadata(10).kind == "full"
    assert restored(mgr, 10) == recoded[10]


def test_cli_gc_errors(templates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = templates(3, torch.float32, tmp_path / "ckpt")
    files = snapshot(path)
    for keep, message in [("last=2,evry=3", "unknown key 'evry'"), ("last=0", "last must be a positive"),
                          ("", "is empty")]:
        code, out, err = cli(capsys, "gc", path, "--keep", keep)
        assert (code, out) == (2, ""), keep
        assert err.startswith("deltackpt: error: --keep: retention policy ") and message in err, err
        assert err.count("\n") == 1
    assert snapshot(path) == files

    missing = tmp_path / "missing"
    code, out, err = cli(capsys, "gc", missing, "--keep", "last=1")
    assert (code, out) == (2, "")
    assert err == f"deltackpt: error: {missing} is not a deltackpt checkpoint directory (it does not exist)\n"
    assert not missing.exists()  # gc never creates a directory

    with pytest.raises(SystemExit) as exit_info:  # --keep is required
        main(["gc", str(path)])
    assert exit_info.value.code == 2
    capsys.readouterr()

    lock = CheckpointManager(path).storage.try_lock()  # as a training job holds it
    assert lock is not None
    with lock:
        code, out, err = cli(capsys, "gc", path, "--keep", "last=1")
        assert (code, out) == (2, "")
        assert err.startswith("deltackpt: error: ") and "only one writer at a time" in err, err
        assert "gc deletes steps and needs the writer lock" in err
        assert snapshot(path) == files
        code, out, err = cli(capsys, "gc", path, "--keep", "last=1", "--dry-run", "--json")
        assert (code, err) == (0, "")  # a dry run needs no lock
        assert json.loads(out)["removed"] == list(range(1, 10))
    assert snapshot(path) == files


def test_cli_gc_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: deltackpt gc")
    assert "examples:\n  deltackpt gc " in out and "full_within=T" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "gc" in capsys.readouterr().out


def test_cli_ls_and_info_show_errors(templates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = templates(3, torch.float32, tmp_path / "ckpt")
    mgr = CheckpointManager(path, read_only=True)

    code, out, err = cli(capsys, "ls", path)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert re.split(r"\s{2,}", lines[0].strip())[:7] == ["STEP", "KIND", "BASE", "RAW", "STORED", "RATIO",
                                                          "WEIGHTS ERROR"]
    for line, step in zip(lines[1:11], STEPS, strict=True):
        cells = re.split(r"\s{2,}", line.strip())
        meta = mgr.metadata(step)
        assert cells[:3] == [str(step), meta.kind, "-" if meta.base_step is None else str(meta.base_step)]
        if meta.kind == "full":
            assert cells[6] == "-"
        else:
            weights = meta.stats.classes["weights"]
            assert cells[6] == (f"rms {weights['rms_rel_error']:.1e} rel, "  # each with its unit
                                f"max {weights['max_abs_error']:.1e} abs")
    assert lines[11].strip().startswith("total (10)")

    code, out, err = cli(capsys, "ls", path, "--json")
    assert (code, err) == (0, "")
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    delta = rows[2]
    assert delta["kind"] == "delta" and delta["base_step"] == 1
    assert delta["compression"]["name"] == "balanced" and "scale" in delta["compression"]
    classes = mgr.metadata(2).stats.classes
    order = ("weights", "first_moment", "second_moment", "buffers", "exact")
    assert list(delta["classes"]) == [c for c in order if c in classes]
    for name, stats in classes.items():
        row = delta["classes"][name]
        assert {k: row[k] for k in stats} == stats
        assert row["ratio"] == pytest.approx(stats["raw_bytes"] / stats["stored_bytes"])
        quantized = stats["elements"] - stats["exact_elements"]
        assert row["nonzero_fraction"] == (stats["nonzero"] / quantized if quantized else None)
    assert rows[1]["compression"] is None and rows[1]["classes"]["weights"]["nonzero_fraction"] is None

    code, out, err = cli(capsys, "info", path, "--step", "2")
    assert (code, err) == (0, "")
    assert out.startswith("step            2\nkind            delta\nbase step       1\n")
    assert re.search(r"^compression     balanced, scale 1, target ratio -, expected cost "
                     r"0\.97 steps of progress$", out, re.M)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CLASS"))
    assert lines[header].split() == ["CLASS", "TENSORS", "RAW", "STORED", "RATIO", "NONZERO", "MAX", "ABS",
                                     "ERR", "MAX", "REL", "ERR", "RMS", "REL", "ERR"]
    weights = classes["weights"]
    cells = lines[header + 1].split()
    assert cells[0] == "weights" and cells[1] == str(weights["tensors"])
    quantized = weights["elements"] - weights["exact_elements"]
    assert cells[-4:] == [f"{100 * weights['nonzero'] / quantized:.1f}%",
                          f"{weights['max_abs_error']:.1e}", "-",  # relative: ordinal only
                          f"{weights['rms_rel_error']:.1e}"]
    assert lines[header + len(classes) + 1] == ERROR_UNITS  # what the error columns measure
    assert "TENSOR" in out and "AdamW" in out  # the rest of info is still there

    code, out, err = cli(capsys, "info", path, "--step", "2", "--json")
    doc = json.loads(out)
    assert doc["classes"]["weights"]["rms_rel_error"] == weights["rms_rel_error"]
    assert doc["compression"]["name"] == "balanced"

    code, out, err = cli(capsys, "info", path, "--step", "1")
    assert (code, err) == (0, "")
    assert "compression     " not in out  # a full step has no compression config
    assert re.search(r"^weights +\d+ .*x +- +- +- +-$", out, re.M)


def test_keep_steps_holds_chains_and_replaces_nothing(templates, tmp_path: Path) -> None:
    """KeepSteps keeps the steps it names as they are, with the steps their chains need; a dropped
    step goes once no kept step needs it."""
    path = templates(5, torch.float32, tmp_path / "ckpt")  # full 1 and 6, deltas between
    with CheckpointManager(path, reader_grace=0) as mgr:
        values = {s: restored(mgr, s) for s in STEPS}
        files = snapshot(path)
        dry = mgr.gc(retention_module.KeepSteps(frozenset({3, 7, 99})), dry_run=True)
        report = mgr.gc(retention_module.KeepSteps(frozenset({3, 7, 99})))
        for r in (dry, report):
            assert (r.kept, r.removed, r.held, r.recoded, r.rewritten, r.chains_kept) == (
                [1, 2, 3, 6, 7], [4, 5, 8, 9, 10], [1, 2, 6], [], [], True)
        assert "held 3 steps the kept steps' chains need (1, 2, 6)" in report.describe()
        gone = tuple(step_dir_name(s) for s in report.removed)
        assert snapshot(path) == {k: v for k, v in files.items() if not k.startswith(gone)}
        assert all(restored(mgr, s) == values[s] for s in report.kept)
        assert mgr.gc(retention_module.KeepSteps(frozenset({6}))).removed == [1, 2, 3, 7]
        assert mgr.steps() == [6] and restored(mgr, 6) == values[6]
