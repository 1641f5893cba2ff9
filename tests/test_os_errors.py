"""OS errors on the read and write paths (issue 27): each becomes a DeltackptError naming the
checkpoint, step and file and keeping its errno; the CLI says it in one line and goes on.

Permissions are real: the checkpoint is read by another user (``nobody``, when the tests run as
root, whom permissions do not stop) or by this one after ``chmod``. A full or read-only disk, and
an I/O error, are injected at the system calls the storage makes.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import edit_metadata, step_dir
from other_user import Ran, as_other_user, checkpoint, cli, shared_dir

from deltackpt import (
    CheckpointManager,
    FormatError,
    ReadFailedError,
    WriteFailedError,
)
from deltackpt.app.cli import EXIT_CLOSED_PIPE, EXIT_UNCHECKED, main


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


def _one_line_error(result: Ran, *parts: str) -> None:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(p in lines[0] for p in parts), result.stderr


def test_an_unreadable_step_is_reported_and_the_others_checked(shared: Path) -> None:
    root = shared / "ckpt"
    checkpoint(root)
    step3 = step_dir(root, 3)
    step3.chmod(0)
    meta3 = f"step 3: {step3}/metadata.json: Permission denied"

    ls = cli("ls", str(root))
    assert ls.returncode == EXIT_UNCHECKED
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:5]] == ["1", "2", "4", "5"]
    _one_line_error(ls, "step 3 could not be read", meta3)

    verify = cli("verify", str(root))
    assert verify.returncode == EXIT_UNCHECKED, verify.stdout + verify.stderr
    lines = verify.stdout.splitlines()
    assert lines[:2] == ["step 1: OK", "step 2: OK"]
    assert lines[2:] == ["step 3: COULD NOT CHECK", f"  {meta3}", "step 4: COULD NOT CHECK",
                         f"  {meta3}", "step 5: COULD NOT CHECK", f"  {meta3}",
                         "5 steps checked: 3 could not be checked"]
    assert cli("verify", str(root), "--step", "2").returncode == 0

    du = cli("du", str(root))
    assert du.returncode == EXIT_UNCHECKED and "Traceback" not in du.stderr
    assert f"not counted, could not be read: step 3: {step3}: Permission denied" in du.stdout

    restore = cli("restore", str(root), "--out", str(shared / "out"))
    assert restore.returncode == 2
    _one_line_error(restore, "deltackpt: error: ", meta3)


def test_damage_outranks_what_could_not_be_read(shared: Path) -> None:
    root = shared / "ckpt"
    checkpoint(root)
    step_dir(root, 3).chmod(0)
    data = sorted(step_dir(root, 1).glob("d-*.bin"))[0]
    data.write_bytes(b"\0" * data.stat().st_size)
    verify = cli("verify", str(root))
    assert verify.returncode == 1
    assert "step 1: DAMAGED" in verify.stdout and "step 3: COULD NOT CHECK" in verify.stdout
    assert verify.stdout.splitlines()[-1] == "5 steps checked: 2 damaged, 3 could not be checked"


def test_an_unreadable_data_file_is_not_damage(shared: Path) -> None:
    root = shared / "ckpt"
    checkpoint(root, steps=2)
    data = sorted(step_dir(root, 2).glob("d-*.bin"))[0]
    data.chmod(0)
    verify = cli("verify", str(root), "--json")
    assert verify.returncode == EXIT_UNCHECKED
    assert f'"step 2: {data}: Permission denied"' in verify.stdout
    assert '"damage": []' in verify.stdout


def test_the_writer_cleanup_leaves_an_unreadable_step_and_says_so(
        shared: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = shared / "ckpt"
    checkpoint(root)
    (step_dir(root, 2) / "metadata.json").chmod(0)
    step_dir(root, 3).chmod(0)

    def save() -> tuple[str, list[int], list[str]]:
        with caplog.at_level(logging.WARNING, "deltackpt"), \
                CheckpointManager(root, full_every=10) as mgr:
            kind = mgr.save(6, torch.nn.Linear(64, 64)).kind
            return kind, mgr.steps(), [r.getMessage() for r in caplog.records]

    kind, steps, warnings = as_other_user(save)
    assert (kind, steps) == ("full", [1, 2, 3, 4, 5, 6])
    assert f"{root}: the writer's cleanup left step-000000000002 as it is: step 2: " \
           f"{step_dir(root, 2)}/metadata.json: Permission denied" in warnings
    assert any("left step-000000000003 as it is" in w for w in warnings)


def test_an_unreadable_checkpoint_names_its_path_in_the_api(shared: Path) -> None:
    root = shared / "ckpt"
    checkpoint(root, steps=2)
    (step_dir(root, 2) / "metadata.json").chmod(0)

    def restore() -> tuple[int, str]:
        try:
            CheckpointManager(root, read_only=True).restore(2)
        except ReadFailedError as exc:
            return exc.errno, str(exc)
        return 0, "restored"

    assert as_other_user(restore) == (
        errno.EACCES, f"step 2: {step_dir(root, 2)}/metadata.json: Permission denied")


def test_an_over_long_data_file_name_is_refused_by_validation(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "ckpt"
    checkpoint(root, steps=2)
    long_name = "d-" + "a" * 300 + "-r00000-000.bin"
    edit_metadata(step_dir(root, 2) / "metadata.json",
                  lambda obj: obj["files"][0].update(name=long_name))
    with pytest.raises(FormatError, match="is 317 characters long, more than a file name may"):
        CheckpointManager(root, read_only=True).restore(2)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "step 2: DAMAGED" in out and "more than a file name may have (255)" in out
    assert main(["restore", str(root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than a file name may have" in err[0]


def _fail_regular_fsync(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_new_directory_on_a_full_disk_leaves_nothing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_regular_fsync(monkeypatch, errno.ENOSPC)
    root = tmp_path / "new"
    with pytest.raises(WriteFailedError) as failure:
        CheckpointManager(root)
    assert failure.value.errno == errno.ENOSPC
    assert str(failure.value) == (f"creating the checkpoint directory {root} failed: "
                                  f"{root}/deltackpt.json: No space left on device")
    assert not root.exists()


def test_a_read_only_file_system_at_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    def mkdir(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "mkdir", mkdir)
    root = tmp_path / "new"
    with pytest.raises(WriteFailedError) as failure:
        CheckpointManager(root)
    assert failure.value.errno == errno.EROFS
    assert str(failure.value).endswith(f"failed: {root}: Read-only file system")
    assert main(["convert", str(tmp_path / "missing.pt"), "--out", str(root)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_io_error_on_read_keeps_its_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "ckpt"
    checkpoint(root, steps=2)

    def pread(*args: object) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", pread)
    # closed on the way out: the error's traceback would keep the manager and its threads
    with pytest.raises(ReadFailedError) as failure, CheckpointManager(root, read_only=True) as mgr:
        mgr.restore(2)
    assert failure.value.errno == errno.EIO and "Input/output error" in str(failure.value)
    assert str(step_dir(root, 1)) in str(failure.value)
    assert main(["verify", str(root)]) == EXIT_UNCHECKED
    assert "2 steps checked: 2 could not be checked" in capsys.readouterr().out


def test_a_closed_pipe_ends_the_cli_quietly(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    checkpoint(root, steps=2)
    child = subprocess.Popen([sys.executable, "-m", "deltackpt.app.cli", "ls", "--json",
                              str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # as `| head` does once it has read enough
    assert child.wait(timeout=120) == EXIT_CLOSED_PIPE
    assert child.stderr.read() == b""
