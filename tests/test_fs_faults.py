"""Faults of the file system under a checkpoint directory.

* Entries deltackpt never writes (symbolic links, FIFOs, directories where files belong) are
  refused with an error naming them by every reader (API and CLI) and left alone by the
  writer's cleanup and by gc: nothing outside the directory is ever read, changed or deleted
  through them, and nothing hangs on a FIFO (each call runs in a thread with a deadline).
* Opening a manager never takes the writer lock, so a process that opens the directory in a
  loop never makes a training job's save fail.
* A full disk (ENOSPC injected into the storage's writes) fails a save with an error naming the
  step and the file, leaves no partial file, and gc still frees space, or leaves the directory
  byte for byte as it was when it fails.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from helpers import step_dir
from test_retention import build, restored

from deltackpt import CheckpointManager, UnsafePathError, WriteFailedError, WriterLockedError
from deltackpt.app.cli import main

T = TypeVar("T")
DEADLINE = 60  # seconds; every call here takes well under one


def _content(step: int) -> dict[str, Any]:
    return {"step": step, "values": torch.arange(3000, dtype=torch.float32) * step}


def _save(root: Path, steps: range | list[int], **kwargs: Any) -> None:
    with CheckpointManager(root, full_every=1, **kwargs) as mgr:
        for step in steps:
            mgr.save(step, extra=_content(step), rng=False)


def _tree(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry below ``path``: its type and, for files, its bytes (links not followed)."""
    out = {}
    for p in sorted(path.rglob("*")):
        mode = p.lstat().st_mode
        kind = "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else \
            "fifo" if stat.S_ISFIFO(mode) else "file"
        out[str(p.relative_to(path))] = (kind, p.read_bytes() if kind == "file" else b"")
    return out


def _bounded(fn: Callable[[], T], fifos: list[Path] = ()) -> T:
    """``fn()``, failing the test if it has not returned within the deadline. A call hung opening
    a FIFO is released (by opening the FIFO's other end) before the test fails."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive():
        for fifo in fifos:
            for flags in (os.O_WRONLY, os.O_RDONLY):
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, flags | os.O_NONBLOCK))
        thread.join(DEADLINE)
        pytest.fail(f"{fn} still runs after {DEADLINE} s (blocked opening a FIFO?)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _cli(capsys: pytest.CaptureFixture[str], *argv: Any, fifos: list[Path] = ()) -> tuple[int, str]:
    """Exit code and output (stdout and stderr) of ``deltackpt ARGV`` run in this process."""
    capsys.readouterr()
    code = _bounded(lambda: main([str(a) for a in argv]), fifos)
    out, err = capsys.readouterr()
    return code, out + err


# -- entries that are not what deltackpt writes ------------------------------------------------------


def _replace(path: Path, entry: str, outside: Path) -> None:
    """Put ``entry`` where file ``path`` is: a link to an identical copy outside the checkpoint,
    a FIFO, or an empty directory."""
    if entry == "symlink":
        copy = outside / path.name
        shutil.copyfile(path, copy)
        path.unlink()
        path.symlink_to(copy)
    elif entry == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.unlink()
        path.mkdir()


WHAT = {"symlink": "is a symbolic link", "fifo": "is a FIFO", "directory": "is a directory"}


@pytest.mark.parametrize("entry", ["symlink", "fifo", "directory"])
@pytest.mark.parametrize("target", ["data", "metadata"])
def test_a_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, entry: str, target: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A data file or metadata.json that is a link, a FIFO or a directory: every reader (API and
    CLI) reports it by path, none hangs or follows it, and a writer opens, cleans up and saves
    around it without touching it."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    _save(root, [1, 2])
    step = step_dir(root, 2)
    path = next(step.glob("*.bin")) if target == "data" else step / "metadata.json"
    _replace(path, entry, outside)
    fifos = [path] if entry == "fifo" else []
    problem = f"{path} {WHAT[entry]}"
    entries, elsewhere = _tree(root), _tree(outside)

    reader = _bounded(lambda: CheckpointManager(root, read_only=True), fifos)
    assert reader.steps() == [1, 2]
    with pytest.raises(UnsafePathError, match=problem):
        _bounded(lambda: reader.restore(2), fifos)
    report = _bounded(reader.verify, fifos)
    assert report[1] == [] and report[2] and all(problem in p for p in report[2]), report
    assert _bounded(lambda: reader.restore(1).extra["step"], fifos) == 1

    code, err = _cli(capsys, "ls", root, fifos=fifos)
    assert (code, problem in err) == ((1, True) if target == "metadata" else (0, False)), err
    code, err = _cli(capsys, "info", root, "--step", 2, fifos=fifos)
    assert (code, problem in err) == ((2, True) if target == "metadata" else (0, False)), err
    code, err = _cli(capsys, "du", root, fifos=fifos)
    assert code == 0 and (problem in err) == (target == "metadata"), err
    code, err = _cli(capsys, "verify", root, fifos=fifos)
    assert code == 1 and problem in err, err
    code, err = _cli(capsys, "restore", root, "--step", 2, "--out", tmp_path / "out", fifos=fifos)
    assert code == 2 and "deltackpt: error: " in err and problem in err, err
    assert _tree(root) == entries and _tree(outside) == elsewhere

    def write() -> None:
        with CheckpointManager(root, full_every=1) as writer:
            writer.acquire()  # cleans up: leaves the entry alone
            writer.save(3, extra=_content(3), rng=False)
            with pytest.raises(UnsafePathError, match=problem):
                writer.restore(2)

    _bounded(write, fifos)
    assert {k: v for k, v in _tree(root).items() if "step-000000000003" not in k} == entries
    assert _tree(outside) == elsewhere


def test_a_step_directory_that_is_a_link_is_refused_and_never_followed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step directory that is a link to a directory elsewhere (holding a committed step and an
    unrelated file): readers refuse it by name; the writer's cleanup, saves and gc never delete,
    write or read anything through it."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    _save(root, [1, 2, 3])
    shutil.move(step_dir(root, 2), elsewhere)
    (elsewhere / "victim.txt").write_text("not part of any checkpoint")
    step_dir(root, 2).symlink_to(elsewhere)
    empty = tmp_path / "empty"
    empty.mkdir()
    step_dir(root, 5).symlink_to(empty)
    (step_dir(root, 1) / "link").symlink_to(elsewhere / "victim.txt")  # gc deletes step 1
    before = _tree(elsewhere)
    problem = f"{step_dir(root, 2)} is a symbolic link, not a directory"

    writer = CheckpointManager(root, full_every=1)  # opening cleaned up (and deleted the victim)
    assert _tree(elsewhere) == before
    writer.acquire()
    assert _tree(elsewhere) == before
    assert writer.steps() == [1, 2, 3, 5]
    with pytest.raises(UnsafePathError, match=problem):
        writer.restore(2)
    report = writer.verify()
    assert report[1] == report[3] == [] and problem in report[2][0], report
    with pytest.raises(UnsafePathError, match=problem):
        writer.save(2, extra=_content(2), rng=False, overwrite=True)
    with pytest.raises(UnsafePathError, match=f"{step_dir(root, 5)} is a symbolic link"):
        writer.save(5, extra=_content(5), rng=False)
    assert list(empty.iterdir()) == []
    writer.save(6, extra=_content(6), rng=False)
    gc = writer.gc("last=1")  # 2 and 5 cannot be read: left alone
    assert gc.removed == [1, 3] and gc.skipped == [2, 5], gc
    writer.close()
    assert _tree(elsewhere) == before and list(empty.iterdir()) == []
    assert step_dir(root, 2).is_symlink()

    for argv, expected in [(["ls"], 1), (["info", "--step", 2], 2), (["verify"], 1),
                           (["restore", "--step", 2, "--out", tmp_path / "out"], 2), (["du"], 0)]:
        code, err = _cli(capsys, argv[0], root, *argv[1:])
        assert code == expected and problem in err, (argv, code, err)
    assert _tree(elsewhere) == before


def test_a_step_directory_removed_while_listed_is_not_a_step(tmp_path: Path) -> None:
    """A step directory listed but gone when looked at (a failed save's, removed by its writer
    meanwhile, as another rank lists the steps) is not listed as a step."""
    root = tmp_path / "ckpt"
    _save(root, [1])
    reader = CheckpointManager(root, read_only=True)
    listdir = reader.storage.listdir
    reader.storage.listdir = lambda rel="": [*listdir(rel), step_dir(root, 2).name]
    assert reader.steps() == [1]


def test_a_fifo_as_root_marker_is_refused(tmp_path: Path) -> None:
    """deltackpt.json that is a FIFO: opening the directory (reader or writer) fails naming it
    instead of waiting for a writer of the FIFO."""
    root = tmp_path / "ckpt"
    _save(root, [1])
    marker = root / "deltackpt.json"
    marker.unlink()
    os.mkfifo(marker)
    for read_only in (True, False):
        with pytest.raises(UnsafePathError, match=f"{marker} is a FIFO"):
            _bounded(lambda read_only=read_only: CheckpointManager(root, read_only=read_only), [marker])


def test_a_link_as_lock_file_is_not_followed(tmp_path: Path) -> None:
    """.writer.lock that is a link to a file elsewhere: a writer refuses it rather than open (and
    create) the file it points at."""
    root, target = tmp_path / "ckpt", tmp_path / "elsewhere.lock"
    _save(root, [1])
    (root / ".writer.lock").unlink()
    (root / ".writer.lock").symlink_to(target)
    with CheckpointManager(root) as mgr, \
            pytest.raises(UnsafePathError, match=f"{root / '.writer.lock'} is a symbolic link"):
        mgr.save(2, extra=_content(2), rng=False)
    assert not target.exists()


# -- opening a manager takes no lock ----------------------------------------------------------------


def test_opening_managers_in_a_loop_never_blocks_a_writer(tmp_path: Path) -> None:
    """A monitor thread opens and closes (writable) managers on the directory as fast as it can
    while a training job opens its manager and saves, twenty times over: no save ever fails."""
    root = tmp_path / "ckpt"
    _save(root, range(20))  # some steps, so that a cleanup would have work to do
    stop = threading.Event()
    opened = [0]

    def monitor() -> None:
        while not stop.is_set():
            CheckpointManager(root).close()
            opened[0] += 1

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    failures = 0
    try:
        for attempt in range(20):
            try:
                with CheckpointManager(root, full_every=1) as job:
                    job.save(100 + attempt, extra=_content(attempt), rng=False)
            except WriterLockedError:
                failures += 1
    finally:
        stop.set()
        thread.join(DEADLINE)
    assert opened[0] > 20
    assert failures == 0, f"{failures} of 20 first saves failed with WriterLockedError"


# -- a full disk ------------------------------------------------------------------------------------


class _Disk:
    """The free space of a file system under one manager's storage, as its writes see it: bytes
    written beyond it fail with ``error`` (ENOSPC: the part that fits is written first, as
    write(2) does), and so does the close of a file whose write failed (as on NFS); deleting
    files gives their bytes back when ``reclaim``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mgr: CheckpointManager, free: int, *,
                 reclaim: bool = True, error: int = errno.ENOSPC) -> None:
        self.free, self.error, self.failures = free, error, 0
        storage, root = mgr.storage, Path(mgr.path)
        create, remove, remove_tree = storage.create, storage.remove, storage.remove_tree

        def removing(real: Callable[[str], None], rel: str) -> None:
            path = root / rel
            size = sum(p.lstat().st_size for p in [path, *path.rglob("*")]
                       if p.exists() and p.is_file()) if path.exists() else 0
            real(rel)
            if reclaim:
                self.free += size

        monkeypatch.setattr(storage, "create", lambda rel: _DiskFile(create(rel), self))
        monkeypatch.setattr(storage, "remove", lambda rel: removing(remove, rel))
        monkeypatch.setattr(storage, "remove_tree", lambda rel: removing(remove_tree, rel))

    def fail(self) -> OSError:
        self.failures += 1
        return OSError(self.error, os.strerror(self.error))


class _DiskFile:
    def __init__(self, handle: Any, disk: _Disk) -> None:
        self.handle, self.disk, self.failed = handle, disk, False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > self.disk.free:
            self.failed = True
            if self.disk.error == errno.ENOSPC:
                self.handle.write(view[: self.disk.free])
                self.disk.free = 0
            raise self.disk.fail()
        self.disk.free -= view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()
        if self.failed:
            raise self.disk.fail()


def _random_content(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"step": step, "values": torch.randn(20000, generator=gen),
            "ints": torch.randint(0, 1000, (5000,), generator=gen)}


def _check_restores(mgr: CheckpointManager, steps: list[int]) -> None:
    assert mgr.steps() == steps
    for step in steps:
        extra, expected = mgr.restore(step).extra, _random_content(step)
        assert extra["step"] == step
        assert torch.equal(extra["values"], expected["values"])
        assert torch.equal(extra["ints"], expected["ints"])
    assert all(problems == [] for problems in mgr.verify().values())


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("free", ["none", "half", "data"])
def test_a_save_on_a_full_disk_fails_cleanly_and_a_retry_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: str, overwrite: bool) -> None:
    """A save that runs out of space (no byte free, half its data, all its data but not its
    metadata): WriteFailedError naming the step and the file with errno ENOSPC, every file it
    wrote removed even though closing them fails too, the earlier steps intact; once there is
    space again the same save succeeds."""
    root, scratch = tmp_path / "ckpt", tmp_path / "scratch"
    settings = {"full_every": 1, "chunk_bytes": 4096, "workers": 2}
    with CheckpointManager(scratch, **settings) as mgr:
        mgr.save(3, extra=_random_content(3), rng=False)
    data = sum(p.stat().st_size for p in step_dir(scratch, 3).glob("*.bin"))
    step = 2 if overwrite else 3
    with CheckpointManager(root, **settings) as mgr:
        for s in (1, 2):
            mgr.save(s, extra=_random_content(s), rng=False)
        before = _tree(root)
        disk = _Disk(monkeypatch, mgr, {"none": 0, "half": data // 2, "data": data + 10}[free])
        with pytest.raises(WriteFailedError) as failure:
            mgr.save(step, extra=_random_content(3), rng=False, overwrite=overwrite)
        assert failure.value.errno == errno.ENOSPC and isinstance(failure.value, OSError)
        file = r"metadata\.json" if free == "data" else r"d-[0-9a-f]+-r00000-00[01]\.bin"
        assert re.fullmatch(rf"writing step {step} failed: {re.escape(str(step_dir(root, step)))}/"
                            rf"{file}: No space left on device; committed steps are intact",
                            str(failure.value))
        assert disk.failures >= 1
        assert _tree(root) == before  # no partial file, no new directory
        _check_restores(mgr, [1, 2])

        monkeypatch.undo()  # space again
        mgr.save(step, extra=_random_content(step), rng=False, overwrite=overwrite)
        mgr.save(3 if overwrite else 4, extra=_random_content(3 if overwrite else 4), rng=False)
    _check_restores(CheckpointManager(root, read_only=True), [1, 2, 3] if overwrite else [1, 2, 3, 4])


@pytest.fixture(scope="module")
def training_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1..10 of a short training run, full every 5: gc every=3 keeps 3, 6, 9, 10, rewrites
    3 as a full step and re-codes 9 and 10 on 6."""
    return build(tmp_path_factory.mktemp("run") / "ckpt", 5)


def _gc_on_disk(path: Path, monkeypatch: pytest.MonkeyPatch, free: int,
                **disk: Any) -> tuple[CheckpointManager, _Disk]:
    """A writer of ``path`` (holding the lock) whose storage has ``free`` bytes left."""
    mgr = CheckpointManager(path, full_every=5)
    mgr.acquire()
    return mgr, _Disk(monkeypatch, mgr, free, **disk)


def _assert_only_committed_files(root: Path, mgr: CheckpointManager) -> None:
    for step in mgr.steps():
        names = {"metadata.json"} | {f.name for f in mgr.metadata(step).files}
        assert {p.name for p in step_dir(root, step).iterdir()} == names, step


def test_gc_on_a_full_disk_deletes_first_then_replaces(training_run: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A gc whose replacements do not fit in the free space, but do once the steps no kept step
    needs (4 and 5) are deleted, does all its work: the same steps as on a roomy disk."""
    roomy = shutil.copytree(training_run, tmp_path / "roomy")
    with CheckpointManager(roomy, full_every=5) as mgr:
        expected = mgr.gc("every=3")
    freed_first = sum(p.stat().st_size for s in (4, 5) for p in step_dir(training_run, s).iterdir())
    assert expected.added_bytes > freed_first > 0
    path = shutil.copytree(training_run, tmp_path / "full")
    values = {s: restored(CheckpointManager(path, read_only=True), s) for s in (3, 6)}
    mgr, disk = _gc_on_disk(path, monkeypatch, expected.added_bytes - freed_first // 2)
    report = mgr.gc("every=3")
    assert disk.failures >= 1  # the first try ran out of space
    assert (report.removed, report.rewritten, report.recoded, report.held, report.needed_bytes) \
        == ([1, 2, 4, 5, 7, 8], [3], [9, 10], [], 0)
    assert mgr.steps() == [3, 6, 9, 10]
    assert {s: restored(mgr, s) for s in (3, 6)} == values
    assert all(problems == [] for problems in mgr.verify(deep=True).values())
    _assert_only_committed_files(path, mgr)
    mgr.close()


def test_gc_on_a_full_disk_holds_the_chains_and_says_what_it_needs(
        training_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No byte free, and deleting frees none: gc deletes only what no kept step needs, keeps the
    steps the kept ones need, reports the bytes the replacements need (what a dry run
    estimates), and finishes once there is space."""
    path = shutil.copytree(training_run, tmp_path / "ckpt")
    reader = CheckpointManager(path, read_only=True)
    dry = reader.gc("every=3", dry_run=True)
    values = {s: restored(reader, s) for s in reader.steps()}
    mgr, disk = _gc_on_disk(path, monkeypatch, 0, reclaim=False)
    report = mgr.gc("every=3")
    assert disk.failures >= 2  # before and after deleting 4 and 5
    assert (report.removed, report.held, report.rewritten, report.recoded) == \
        ([4, 5], [1, 2, 7, 8], [], [])
    assert report.needed_bytes == dry.added_bytes > 0
    assert "the disk has no space to replace the steps that need them" in report.describe()
    assert mgr.steps() == [1, 2, 3, 6, 7, 8, 9, 10]
    assert {s: restored(mgr, s) for s in mgr.steps()} == {s: values[s] for s in mgr.steps()}
    _assert_only_committed_files(path, mgr)
    mgr.close()

    monkeypatch.undo()
    code, err = _cli(capsys, "gc", path, "--keep", "every=3")
    assert code == 0, err
    assert reader.steps() == [3, 6, 9, 10]
    assert restored(reader, 3) == values[3]


@pytest.mark.parametrize("free", [0, 0.5, 0.99])
def test_a_failed_gc_leaves_every_file_as_it_was(training_run: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, free: float) -> None:
    """An I/O error while gc writes its replacements (at the first byte, halfway, at the last
    metadata): WriteFailedError naming the step, and every file byte for byte as before."""
    roomy = shutil.copytree(training_run, tmp_path / "roomy")
    with CheckpointManager(roomy, full_every=5) as mgr:
        added = mgr.gc("every=3").added_bytes
    path = shutil.copytree(training_run, tmp_path / "ckpt")
    mgr, _ = _gc_on_disk(path, monkeypatch, int(added * free), error=errno.EIO)
    before = _tree(path)
    with pytest.raises(WriteFailedError, match=rf"writing step (3|9|10) failed: {re.escape(str(path))}/"
                                               r"step-0+(3|9|10)/.*: Input/output error"):
        mgr.gc("every=3")
    assert _tree(path) == before
    mgr.close()
