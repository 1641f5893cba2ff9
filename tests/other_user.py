"""Running deltackpt as a user whom file permissions stop (shared by tests/test_os_errors.py and
bench/metadata_audit.py): ``nobody`` in a forked child when the caller is root, whom permissions
do not stop, else the caller itself."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from deltackpt import CheckpointManager
from deltackpt.app.cli import main

NOBODY = 65534
AS_ROOT = os.geteuid() == 0
T = TypeVar("T")


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory the other user can reach (pytest's tmp_path is private to this one)."""
    path = Path(tempfile.mkdtemp(prefix="deltackpt-os-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint(root: Path, steps: int = 5) -> None:
    """Steps 1..steps of a small model and Adam: 1 full, the others deltas on the one before;
    owned by the user that :func:`as_other_user` runs as."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    with CheckpointManager(root, full_every=10) as mgr:
        for step in range(1, steps + 1):
            model(torch.randn(2, 64)).square().sum().backward()
            optimizer.step()
            mgr.save(step, model, optimizer)
        mgr.restore(steps)  # its kernels compiled here: a forked reader finds them in memory
    if AS_ROOT:
        for path in [root, *root.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)


def as_other_user(fn: Callable[[], T]) -> T:
    """``fn()``, run by a user whom permissions stop: ``nobody`` in a forked child when this is
    root (the result comes back pickled), else this process."""
    if not AS_ROOT:
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report, and leave without cleaning up the parent's
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = ("ok", fn())
        except BaseException as exc:  # reported to the parent
            result, code = ("error", f"{type(exc).__name__}: {exc}"), 1
        with os.fdopen(write, "wb") as out:
            pickle.dump(result, out)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        kind, value = pickle.load(answer)
    os.waitpid(pid, 0)
    if kind == "error":
        raise AssertionError(f"as another user: {value}")
    return value


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def cli(*argv: str) -> Ran:
    """The ``deltackpt`` command run as :func:`as_other_user` runs ``fn``."""
    def run() -> Ran:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        return Ran(code, out.getvalue(), err.getvalue())
    return as_other_user(run)
