"""Readers are isolated from the writer's retention: a CorruptionError means real damage.

The race itself runs in processes of its own (``reader_race.py``); ``bench/metadata_audit.py
--race-seconds 60`` runs it for a minute on each storage.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fsspec
import pytest
import torch
from helpers import step_dir
from reader_race import race
from s3_server import moto_server

from deltackpt import CheckpointManager, CorruptionError, StepNotFoundError
from deltackpt.app.cli import main
from deltackpt.errors import ChainChangedError
from deltackpt.format.metadata import step_dir_name
from deltackpt.io import retired as retired_module
from deltackpt.io.storage import open_storage
from deltackpt.ops import verify as verify_module
from deltackpt.restore import consistent
from deltackpt.restore.chain import restore_chain
from deltackpt.restore.consistent import ChainReads, read_consistently

SECONDS = 20
AT_ONCE = {"reader_grace": 0}  # the races delete at once: the readers' hardest case


def test_readers_see_no_false_damage_while_gc_runs(tmp_path: Path) -> None:
    counts, errors = race(str(tmp_path / "ckpt"), seconds=SECONDS, writer=AT_ONCE)
    assert errors == []
    assert counts["restored"] >= 1000
    assert counts["false_damage"] == counts["other"] == 0


def test_readers_see_no_false_damage_on_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with moto_server(own_process=True) as endpoint:
        options = {"key": "AKIATESTKEYID000", "secret": "not-a-secret", "endpoint_url": endpoint,
                   "skip_instance_cache": True}
        fsspec.filesystem("s3", **options).mkdir("race")
        counts, errors = race("s3://race/run", seconds=SECONDS, options=options, writer=AT_ONCE)
    assert errors == []
    assert counts["restored"] >= 100
    assert counts["false_damage"] == counts["other"] == 0


def _saved(root: Path, steps: int = 3, **settings: object) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    mgr = CheckpointManager(root, full_every=4, **settings)
    for step in range(1, steps + 1):
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        mgr.save(step, model, optimizer)
    mgr.model, mgr.optimizer = model, optimizer
    return mgr


def test_real_damage_is_reported_at_once(tmp_path: Path) -> None:
    mgr = _saved(tmp_path)
    data = next((tmp_path / step_dir_name(2)).glob("d-*.bin"))
    data.unlink()
    attempts = []
    reads = lambda: attempts.append(1) or ChainReads(mgr.storage)  # noqa: E731
    with pytest.raises(CorruptionError, match="data file is missing"):
        read_consistently(mgr.storage, 3, lambda r: restore_chain(mgr.storage, r(3), read=r),
                          reads)
    assert len(attempts) == 1  # nothing it read changed: no second read
    with pytest.raises(CorruptionError, match="data file is missing"):
        CheckpointManager(tmp_path, read_only=True).restore(3)


def test_a_chain_changed_during_a_read_is_read_again(tmp_path: Path) -> None:
    """The step read is replaced (a new version) before the read fails: the second read, of the
    new version, returns."""
    mgr = _saved(tmp_path)
    seen = []

    def attempt(reads: ChainReads) -> int:
        meta = reads(3)
        seen.append(meta.save_id)
        if len(seen) == 1:
            mgr.save(3, mgr.model, mgr.optimizer, overwrite=True)
            raise CorruptionError("step 3: data file is missing")
        return meta.step

    assert read_consistently(mgr.storage, 3, attempt) == 3
    assert len(seen) == 2 and seen[0] != seen[1]


def test_a_step_deleted_during_a_read_is_not_found(tmp_path: Path) -> None:
    mgr = _saved(tmp_path)

    def attempt(reads: ChainReads) -> None:
        reads(2)
        mgr.gc("last=1")
        raise CorruptionError("step 2: data file is missing")

    with pytest.raises(StepNotFoundError, match=r"step 2 was deleted .* while it was being read"):
        read_consistently(mgr.storage, 2, attempt)


def test_a_chain_changed_on_every_read_gives_up(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = _saved(tmp_path)
    monkeypatch.setattr(consistent, "ATTEMPTS", 3)
    calls = []

    def attempt(reads: ChainReads) -> None:
        reads(3)
        calls.append(1)
        mgr.save(3, mgr.model, mgr.optimizer, overwrite=True)
        raise CorruptionError("step 3: data file is missing")

    with pytest.raises(ChainChangedError, match=r"step 3 .* during each of 3 reads"):
        read_consistently(mgr.storage, 3, attempt)
    assert len(calls) == 3
    assert os.path.isdir(tmp_path / step_dir_name(3))


# -- reader_grace: the data of replaced and deleted steps kept for readers ---------------------


def _train_and_save(mgr: CheckpointManager, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, step: int) -> None:
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    mgr.save(step, model, optimizer)


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("grace", [0, 3600])
def test_a_reader_that_read_the_chain_reads_its_data_within_the_grace(
        tmp_path: Path, grace: float, where: str) -> None:
    """The reader reads step 3's chain of metadata, then the writer's gc deletes steps 1 and 2
    and rewrites 3; with a grace the old data is still there and restores to the values
    step 3 had; without, the files are gone. On a directory and on an object store."""
    url = str(tmp_path) if where == "local" else f"memory://grace-{grace}-{tmp_path.name}/run"
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    with CheckpointManager(url, full_every=10, reader_grace=grace) as mgr:
        for step in (1, 2, 3):
            _train_and_save(mgr, model, optimizer, step)
        reader = CheckpointManager(url, read_only=True)
        before = reader.restore(3).tensors
        known = {s: reader.metadata(s) for s in (1, 2, 3)}
        mgr.gc("last=1")
        assert mgr.steps() == [3] and mgr.metadata(3).save_id != known[3].save_id
        if grace:
            tensors, _ = restore_chain(reader.storage, known[3], read=known.__getitem__)
            assert all(torch.equal(tensors[n], t) for n, t in before.items())
        else:
            with pytest.raises(CorruptionError, match="data file is missing"):
                restore_chain(reader.storage, known[3], read=known.__getitem__)


def _retired_records(root: Path) -> list[Path]:
    return sorted(root.glob("retired-*.json"))


def test_retired_data_is_deleted_once_its_grace_has_passed(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    with CheckpointManager(tmp_path, full_every=10, keep="last=2", reader_grace=60) as mgr:
        for step in (1, 2, 3):
            _train_and_save(mgr, model, optimizer, step)
        records = _retired_records(tmp_path)
        retired = [f for r in records for f in json.loads(r.read_text())["files"]]
        assert len(records) >= 1 and retired
        assert all((tmp_path / f).is_file() for f in retired)  # step 1's data, kept for readers
        assert not (step_dir(tmp_path, 1) / "metadata.json").exists()
        assert mgr.verify() == {2: [], 3: []}

    later = time.time() + 61
    monkeypatch.setattr(retired_module.time, "time", lambda: later)
    with CheckpointManager(tmp_path, full_every=10, keep="last=2", reader_grace=60) as mgr:
        mgr.acquire()  # a new writer: what is retired is no leftover to remove
        assert all((tmp_path / f).is_file() for f in retired)
        _train_and_save(mgr, model, optimizer, 4)  # its gc deletes what is due
        assert not any((tmp_path / f).exists() for f in retired)
        assert not step_dir(tmp_path, 1).exists()
        assert not set(_retired_records(tmp_path)) & set(records)


def test_a_hostile_retired_record_deletes_nothing(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    root = tmp_path / "ckpt"
    _saved(root, steps=1).close()
    record = root / "retired-1-0badc0de.json"
    record.write_text(json.dumps({"format": "deltackpt-retired", "retired": 0,
                                  "files": ["../outside.bin", "step-000000000001/metadata.json"]}))
    live = [f"{step_dir_name(1)}/{p.name}" for p in step_dir(root, 1).glob("d-*.bin")]
    (root / "retired-2-0badc0de.json").write_text(json.dumps(
        {"format": "deltackpt-retired", "retired": 0, "files": live}))  # a committed step's data
    with caplog.at_level("WARNING", "deltackpt"), \
            CheckpointManager(root, reader_grace=1) as mgr:
        mgr.acquire()
        mgr._target.retired.purge(everything=True)
    assert outside.read_bytes() == b"keep me" and record.exists()
    assert not (root / "retired-2-0badc0de.json").exists()  # read, and nothing deleted
    assert mgr.steps() == [1] and mgr.verify() == {1: []}
    assert any("retired-1-0badc0de.json" in r.getMessage() and "not data files" in r.getMessage()
               for r in caplog.records)


def test_verify_reports_no_damage_for_steps_the_gc_changed_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify reads every step's metadata, then the writer's gc deletes steps 1..4 (at once:
    no reader_grace) before the data is checked: what the first check found missing is no
    damage, and the check of what is left finds none."""
    mgr = _saved(tmp_path, steps=5, reader_grace=0)
    real, calls = verify_module.verify_step, []

    def verify_step(*args: object, **kwargs: object) -> object:
        if not calls:
            mgr.gc("last=1")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_module, "verify_step", verify_step)
    report = CheckpointManager(tmp_path, read_only=True).verify()
    assert report == {5: []} and report.damage == [] and len(calls) > 1
    monkeypatch.setattr(verify_module, "ATTEMPTS", 1)  # no second check: the damage it saw
    calls.clear()
    mgr.close()
    mgr = _saved(tmp_path / "again", steps=5, reader_grace=0)
    report = CheckpointManager(tmp_path / "again", read_only=True).verify()
    assert report.damaged


def test_ls_verify_and_du_report_no_damage_while_gc_runs(tmp_path: Path) -> None:
    counts, errors = race(str(tmp_path / "ckpt"), seconds=SECONDS / 2, readers=1, commands=True,
                          writer=AT_ONCE)
    assert errors == []
    assert counts["checked"] >= 30 and counts["other"] == 0


def test_cli_gc_frees_the_space_now_unless_given_a_grace(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """A writer's kept data goes at the next ``deltackpt gc`` (grace 0: the space is freed);
    ``--reader-grace`` keeps what that gc deletes."""
    writer = _saved(tmp_path, steps=5)
    writer.gc("last=4")  # the writer's grace: step 1's data kept
    writer.close()
    kept = _retired_records(tmp_path)
    assert kept and step_dir(tmp_path, 1).exists()
    assert main(["gc", str(tmp_path), "--keep", "last=3", "--reader-grace", "60"]) == 0
    assert set(kept) < set(_retired_records(tmp_path))  # step 2's data kept too
    assert main(["gc", str(tmp_path), "--keep", "last=3"]) == 0
    assert _retired_records(tmp_path) == []
    assert not step_dir(tmp_path, 1).exists() and not step_dir(tmp_path, 2).exists()
    assert CheckpointManager(tmp_path, read_only=True).verify() == {3: [], 4: [], 5: []}
    capsys.readouterr()


def test_a_file_retired_twice_keeps_its_first_record(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A version replaced again before its grace ended (a step re-coded by two gcs) is not
    recorded twice: the purge of its first record deletes it, and no record names a file gone."""
    (tmp_path / "step-000000000003").mkdir()
    names = [f"step-000000000003/d-{k:016x}-r00000-000.bin" for k in (1, 2)]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    retired = retired_module.RetiredFiles(open_storage(str(tmp_path)), grace=60)
    retired.retire(names[:1])
    now = time.time()
    monkeypatch.setattr(retired_module.time, "time", lambda: now + 30)
    retired.retire(names)
    assert [r.files for r in retired.records] == [(names[0],), (names[1],)]
    monkeypatch.setattr(retired_module.time, "time", lambda: now + 61)
    retired.purge()
    assert not (tmp_path / names[0]).exists() and (tmp_path / names[1]).exists()
    assert all((tmp_path / f).exists() for f in retired.protected())
