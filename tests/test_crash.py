"""Crash safety: writers killed with SIGKILL at random points never damage committed steps.

A small server process (its script is written into tmp_path and run with
sys.executable) imports torch and deltackpt once, then forks one writer per
round; each writer opens a CheckpointManager and saves steps in a loop,
printing ``begin S V`` before and ``done S V`` after each save returns. The
test SIGKILLs the writer at random points, including in the middle of a save
and in the middle of an ``overwrite=True`` save, then checks the directory.
Forking from one warm process keeps the rounds cheap (importing torch takes
seconds); every writer is still a separate process killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import assert_state_dicts_equal, step_dir

from deltackpt import CheckpointManager, WriterLockedError
from deltackpt.io.retired import read_record

CONTENT_SOURCE = '''
def content(step, version):
    """Deterministic state of ``step`` as written by save number ``version`` of it."""
    gen = torch.Generator().manual_seed(step * 1000 + version)
    return {
        "weights": torch.randn(128, 200, generator=gen) * 0.02,
        "noise": torch.randint(0, 256, (80000,), generator=gen, dtype=torch.uint8),
        "ints": torch.randint(0, 9, (3000,), generator=gen),
        "scalar": torch.tensor(float(step)),
        "meta": {"step": step, "version": version},
    }
'''

SERVER_SOURCE = '''
import os
import sys
import time

import numpy as np
import torch

from deltackpt import CheckpointManager
from deltackpt.format.metadata import step_dir_name
from deltackpt.kernels.byteplane import merge_planes, sampled_entropy_bits, split_planes

# load the compiled kernels once, here, so that every forked writer starts warm (no threads yet)
for dtype in (np.uint16, np.uint32, np.uint64):
    words = np.arange(8, dtype=dtype)
    planes = np.empty((words.itemsize, 8), dtype=np.uint8)
    split_planes(words, True, planes)
    merge_planes(planes, True, words)
sampled_entropy_bits(np.zeros((2, 8), dtype=np.uint8), 1)
# and import what a save imports at its first use: torch's DTensor, which its check of sharded
# tensors looks up (most of a second, else paid again by every writer's first save)
import torch.distributed.tensor  # noqa: E402, F401

CONTENT

ROOT = sys.argv[1]


def say(text):
    """One line in one write(2), so a SIGKILL can never leave half a line in the pipe."""
    os.write(1, (text + "\\n").encode())


def hold_in_save(mgr, step):
    """Stop the writer for good inside its save of ``step``, once that save created its first
    file: a kill after ``held`` lands mid-save however loaded the machine."""
    create = mgr.storage.create
    prefix = step_dir_name(step) + "/"

    def create_then_hold(rel):
        handle = create(rel)
        if rel.startswith(prefix):
            say(f"held {step}")
            time.sleep(120)
        return handle

    mgr.storage.create = create_then_hold


def writer(command):
    torch.set_num_threads(1)
    # full steps only: the overwrite rounds replace steps that deltas would depend on
    mgr = CheckpointManager(ROOT, full_every=1, chunk_bytes=4096)
    if command[-2] == "hold":  # "... hold STEP"
        hold_in_save(mgr, int(command.pop()))
        command.pop()
    say("ready")
    if command[0] == "async":  # each save returns at its snapshot; the content then changes
        step, pending = int(command[1]), None
        while True:
            state = content(step, 0)
            say(f"begin {step} 0")
            handle = mgr.save(step, extra=state, rng=False, blocking=False)
            if pending is not None:  # ended: the save above waited for it (max_in_flight=1)
                pending.wait()
                say(f"done {pending.step} 0")
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
            state["meta"]["version"] = -1
            pending, step = handle, step + 1
    if command[0] == "new":
        step = int(command[1])
        while True:
            say(f"begin {step} 0")
            mgr.save(step, extra=content(step, 0), rng=False)
            say(f"done {step} 0")
            step += 1
    count, version = int(command[1]), int(command[2])
    while True:
        for step in range(count):
            say(f"begin {step} {version}")
            mgr.save(step, extra=content(step, version), rng=False, overwrite=True)
            say(f"done {step} {version}")
        version += 1


say("server")
for line in sys.stdin:
    command = line.split()
    if not command or command[0] == "quit":
        break
    pid = os.fork()
    if pid == 0:
        try:
            say(f"pid {os.getpid()}")
            writer(command)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    say(f"exited {pid} {status}")
'''.replace("CONTENT", CONTENT_SOURCE)

_namespace: dict = {"torch": torch}
exec(CONTENT_SOURCE, _namespace)
content = _namespace["content"]


class WriterServer:
    """The server process and the lines it and its writers print."""

    def __init__(self, script: Path, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(script), str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue[list[str]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.writer_pid: int | None = None
        self.begun: dict[int, set[int]] = defaultdict(set)
        self.done: dict[int, int] = {}
        self.next_line(lambda w: w[0] == "server", timeout=60)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def next_line(self, want, timeout: float = 30) -> list[str]:
        """Read lines (recording begin/done) until one satisfies ``want``."""
        deadline = time.monotonic() + timeout
        while True:
            words = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if words[0] == "eof":
                raise AssertionError("the writer server exited")
            if words[0] == "begin":
                self.begun[int(words[1])].add(int(words[2]))
            elif words[0] == "done":
                step, version = int(words[1]), int(words[2])
                self.done[step] = max(version, self.done.get(step, -1))
            if want(words):
                return words

    def round(self, command: str, kill_after, delay: float) -> None:
        """Start a writer, wait for the line ``kill_after`` selects, sleep ``delay``, SIGKILL it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        pid = self.writer_pid = int(self.next_line(lambda w: w[0] == "pid")[1])
        self.next_line(kill_after)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        exited = self.next_line(lambda w: w[0] == "exited")
        assert int(exited[1]) == pid
        self.writer_pid = None
        assert os.WIFSIGNALED(int(exited[2])) and os.WTERMSIG(int(exited[2])) == signal.SIGKILL, \
            "the writer died before it was killed"

    def close(self) -> None:
        if self.writer_pid is not None:  # a failed round left its writer running
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.writer_pid, signal.SIGKILL)
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _leftovers(root: Path, mgr: CheckpointManager) -> list[str]:
    """Everything in the directory that is neither the marker, the lock, part of a committed step,
    nor kept for readers (a record of retired files, and what it names: FORMAT.md 1.4)."""
    found = []
    retired = {f for record in root.glob("retired-*.json")
               for f in read_record(mgr.storage, record.name).files}
    for path in root.iterdir():
        if path.name in ("deltackpt.json", ".writer.lock") or path.name.startswith("retired-"):
            continue
        if not (path.is_dir() and path.name.startswith("step-") and (path / "metadata.json").exists()):
            if not (path.is_dir() and {f"{path.name}/{p.name}" for p in path.iterdir()} <= retired):
                found.append(path.name)
            continue
        meta = mgr.metadata(int(path.name[5:]))
        referenced = {"metadata.json"} | {f.name for f in meta.files}
        found.extend(f"{path.name}/{p.name}" for p in path.iterdir()
                     if p.name not in referenced and f"{path.name}/{p.name}" not in retired)
    found.extend(str(p.relative_to(root)) for p in root.rglob("*.tmp"))
    return sorted(set(found))


def _check_committed(mgr: CheckpointManager, server: WriterServer) -> None:
    """Every listed step restores bit-exactly; every step whose save returned is listed."""
    steps = mgr.steps()
    assert set(server.done) <= set(steps), f"returned saves {sorted(server.done)} not all in {steps}"
    for step in steps:
        extra = mgr.restore(step).extra
        version = extra["meta"]["version"]
        assert version in server.begun[step], f"step {step} holds version {version} never saved"
        assert version >= server.done.get(step, -1), f"step {step} lost the returned save of it"
        _assert_content(extra, step, version)


def _check_after_crash(root: Path, server: WriterServer) -> bool:
    """Check a directory right after a kill; returns whether the crash left leftovers behind."""
    reader = CheckpointManager(root, read_only=True)  # readers see intact steps even before cleanup
    before = set(root.rglob("*"))
    had_leftovers = bool(_leftovers(root, reader))
    _check_committed(reader, server)
    assert set(root.rglob("*")) == before, "a read-only manager modified the directory"
    with CheckpointManager(root) as mgr:
        assert set(root.rglob("*")) == before, "opening a manager modified the directory"
        mgr.acquire()  # taking the writer lock removes the leftovers
        assert _leftovers(root, mgr) == []
        for step in mgr.steps():
            meta = mgr.metadata(step)
            for file in meta.files:
                assert (step_dir(root, step) / file.name).stat().st_size == file.size
        _check_committed(mgr, server)
        assert all(problems == [] for problems in mgr.verify().values())
    return had_leftovers


def _kill_rounds(tmp_path: Path) -> tuple[random.Random, Path, WriterServer]:
    """The random kill points (their seed printed, shown by pytest if the test fails), the
    checkpoint root and a writer server saving into it."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"kill points drawn with random.Random({seed})")
    script = tmp_path / "writer_server.py"
    script.write_text(SERVER_SOURCE)
    root = tmp_path / "ckpt"
    return random.Random(seed), root, WriterServer(script, root)


def _kill_held_round(root: Path, server: WriterServer, command: str, step: int) -> None:
    """A writer stopped inside its save of ``step`` and killed there leaves leftovers that a new
    writer removes, and every committed step intact."""
    server.round(f"{command} hold {step}", lambda w: w[:2] == ["held", str(step)], 0)
    assert _check_after_crash(root, server), f"a writer killed inside its save of {step} left nothing"


def test_sigkill_at_random_points(tmp_path: Path) -> None:
    """Writers killed at random points (between saves, mid-save, mid-overwrite) leave every committed
    step intact and every returned save committed; a new writer removes all leftovers."""
    rng, root, server = _kill_rounds(tmp_path)
    try:
        for round_number in range(8):
            start = (max(server.begun) + 1) if server.begun else 0
            with CheckpointManager(root) as mgr:
                start = max(start, (mgr.latest_step() or -1) + 1)
            target = start + rng.randrange(3)
            if round_number == 1:  # surely inside a save, whatever the machine's load
                _kill_held_round(root, server, f"new {start}", target)
                continue
            if round_number % 2 == 0:  # anywhere: after some saves returned, a random delay later
                server.round(f"new {start}", lambda w, t=target: w[:2] == ["done", str(t)],
                             rng.uniform(0, 0.08))
            else:  # inside a save: shortly after it began
                server.round(f"new {start}", lambda w, t=target: w[:2] == ["begin", str(t)],
                             rng.uniform(0, 0.03))
            _check_after_crash(root, server)

        count = 3
        for round_number in range(3):  # kill overwrite=True saves of existing steps
            version = max(max(v) for v in server.begun.values()) + 1
            target = rng.randrange(count)
            if round_number == 0:
                _kill_held_round(root, server, f"overwrite {count} {version}", target)
                continue
            server.round(f"overwrite {count} {version}",
                         lambda w, t=target, v=version: w == ["begin", str(t), str(v)],
                         rng.uniform(0, 0.03))
            _check_after_crash(root, server)
    finally:
        server.close()
    assert len(server.done) >= 4, "the writers hardly saved anything"  # rounds 0, 2, 4, 6


def test_sigkill_during_async_saves(tmp_path: Path) -> None:
    """Writers saving with blocking=False, killed while a save runs in the background (its
    caller already changing the state it saved) or between saves, leave every committed step
    intact and whole, each the state at its call."""
    rng, root, server = _kill_rounds(tmp_path)
    try:
        for round_number in range(6):
            start = (max(server.begun) + 1) if server.begun else 0
            target = start + 1 + rng.randrange(2)
            if round_number == 1:  # surely inside a background save
                _kill_held_round(root, server, f"async {start}", target)
                continue
            kill_after = "begin" if round_number % 3 else "done"
            server.round(f"async {start}", lambda w, t=target, k=kill_after: w[:2] == [k, str(t)],
                         rng.uniform(0, 0.03))
            _check_after_crash(root, server)
    finally:
        server.close()
    # A save's "done" comes after the next save's "begin" (it returns once the one before it
    # ended): a kill after a "begin" may come before any "done" of its round on a loaded
    # machine. The rounds killed after a "done" (0 and 3) each saw one.
    assert len(server.done) >= 2, "the writers hardly saved anything"


# -- deterministic leftovers ------------------------------------------------------------------------

def _assert_content(extra: dict, step: int, version: int) -> None:
    """``extra`` is exactly what ``content(step, version)`` saved."""
    extra = dict(extra)
    assert extra.pop("meta") == {"step": step, "version": version}
    expected = content(step, version)
    del expected["meta"]
    assert_state_dicts_equal(extra, expected, f"step {step} version {version}")


def _save_steps(root: Path, steps: range) -> None:
    with CheckpointManager(root, chunk_bytes=4096) as mgr:
        for step in steps:
            mgr.save(step, extra=content(step, 0), rng=False)


def _make_leftovers(root: Path) -> None:
    """What interrupted saves leave: an uncommitted step, a tmp metadata, an orphan data file, a tmp."""
    (step_dir(root, 9)).mkdir()
    (step_dir(root, 9) / "d-0123456789abcdef-r00000-000.bin").write_bytes(b"half written")
    (step_dir(root, 10)).mkdir()
    (step_dir(root, 10) / "metadata.json.tmp").write_text("{")
    (step_dir(root, 1) / "metadata.json.tmp").write_text(json.dumps({"partial": True}))
    (step_dir(root, 1) / "d-fedcba9876543210-r00000-000.bin").write_bytes(b"orphan")
    (root / "deltackpt.json.tmp").write_text("{}")


def test_leftovers_removed_by_a_writer_only(tmp_path: Path) -> None:
    """Leftovers are invisible to readers and left alone by read_only managers; a writer removes them
    and the committed steps stay intact."""
    root = tmp_path / "ckpt"
    _save_steps(root, range(3))
    _make_leftovers(root)
    before = set(root.rglob("*"))
    reader = CheckpointManager(root, read_only=True)
    assert reader.steps() == [0, 1, 2]
    assert set(root.rglob("*")) == before
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [0, 1, 2]
        assert set(root.rglob("*")) == before  # opening takes no lock and removes nothing
        mgr.acquire()
        assert _leftovers(root, mgr) == []
        assert not step_dir(root, 9).exists() and not step_dir(root, 10).exists()
        for step in range(3):
            _assert_content(mgr.restore(step).extra, step, 0)


def test_opening_while_another_writer_holds_the_lock_removes_nothing(tmp_path: Path) -> None:
    """A manager opened while another one holds the writer lock must not touch its in-progress files."""
    root = tmp_path / "ckpt"
    _save_steps(root, range(1))
    with CheckpointManager(root, chunk_bytes=4096) as holder:
        holder.save(1, extra=content(1, 0), rng=False)  # now holds the lock
        _make_leftovers(root)  # stand-ins for the holder's save in progress
        before = set(root.rglob("*"))
        other = CheckpointManager(root)
        with pytest.raises(WriterLockedError):
            other.acquire()
        assert set(root.rglob("*")) == before
        assert other.steps() == [0, 1]
    with CheckpointManager(root) as mgr:
        mgr.acquire()
        assert _leftovers(root, mgr) == []


@pytest.mark.parametrize("stage", ["data", "metadata_tmp", "committed_before_cleanup"])
def test_overwrite_interrupted_at_each_stage(tmp_path: Path, stage: str) -> None:
    """The states an interrupted overwrite can leave (FORMAT.md 1.1) all read as one intact version."""
    root = tmp_path / "ckpt"
    _save_steps(root, range(2))
    old_files = sorted(p.name for p in step_dir(root, 1).iterdir())
    with CheckpointManager(root, chunk_bytes=4096) as mgr:
        mgr.save(1, extra=content(1, 1), rng=False, overwrite=True)
        new_meta = (step_dir(root, 1) / "metadata.json").read_bytes()
    new_files = sorted(p.name for p in step_dir(root, 1).iterdir())
    new_data = [n for n in new_files if n.endswith(".bin")]
    old_data = [n for n in old_files if n.endswith(".bin")]
    assert new_data != old_data
    # rebuild the on-disk state of each stage by hand: old data is still there (it is only deleted
    # after the commit), so put it back from a fresh save of version 0 into another directory
    scratch = tmp_path / "scratch"
    _save_steps(scratch, range(2))
    for name in (p.name for p in step_dir(scratch, 1).glob("*.bin")):
        os.link(step_dir(scratch, 1) / name, step_dir(root, 1) / name)
    old_meta = (step_dir(scratch, 1) / "metadata.json").read_bytes()
    if stage == "data":  # new data written, metadata not yet: the old version is committed
        (step_dir(root, 1) / "metadata.json").write_bytes(old_meta)
        expected_version = 0
    elif stage == "metadata_tmp":  # new metadata written to .tmp, rename not done
        (step_dir(root, 1) / "metadata.json").write_bytes(old_meta)
        (step_dir(root, 1) / "metadata.json.tmp").write_bytes(new_meta)
        expected_version = 0
    else:  # renamed (committed), old data not yet deleted
        expected_version = 1
    reader = CheckpointManager(root, read_only=True)
    assert reader.restore(1).extra["meta"]["version"] == expected_version
    with CheckpointManager(root) as mgr:
        mgr.acquire()
        assert _leftovers(root, mgr) == []
        _assert_content(mgr.restore(1).extra, 1, expected_version)
        assert mgr.verify(deep=True) == {0: [], 1: []}


class _Crash(BaseException):
    """Stands for the process dying at this point (raised from inside the library)."""


@pytest.mark.parametrize("point", ["makedirs", "create", "finish", "replace", "fsync_dir", "remove"])
def test_overwrite_interrupted_by_failure_keeps_one_whole_version(tmp_path: Path, point: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An overwrite that dies at any storage operation leaves the step readable as the old version
    (before the commit's rename) or the new one (after it), never a mix or a damaged step."""
    import deltackpt.io.storage as storage_module

    root = tmp_path / "ckpt"
    _save_steps(root, range(2))
    # the old version's files are removed at once, so "remove" fails after the commit
    mgr = CheckpointManager(root, chunk_bytes=4096, reader_grace=0)
    mgr.save(2, extra=content(2, 0), rng=False)  # take the lock before injecting the failure

    def crash(*args: object, **kwargs: object) -> None:
        raise _Crash(point)

    if point == "replace":  # the rename that commits metadata.json
        monkeypatch.setattr(storage_module.os, "replace", crash)
        monkeypatch.setattr(storage_module.os, "rename", crash)
    elif point == "fsync_dir":  # after the rename: the directory fsync that makes it durable
        monkeypatch.setattr(storage_module, "_fsync_dir", crash)
    else:
        monkeypatch.setattr(mgr.storage, point, crash)
    with pytest.raises(_Crash):
        mgr.save(1, extra=content(1, 1), rng=False, overwrite=True)
    monkeypatch.undo()
    mgr.close()

    committed = point in ("fsync_dir", "remove")
    expected_version = 1 if committed else 0
    reader = CheckpointManager(root, read_only=True)
    assert reader.steps() == [0, 1, 2]
    _assert_content(reader.restore(1).extra, 1, expected_version)
    assert reader.verify(deep=True) == {0: [], 1: [], 2: []}
    with CheckpointManager(root) as writer:
        writer.acquire()
        assert _leftovers(root, writer) == []
        _assert_content(writer.restore(1).extra, 1, expected_version)
        writer.save(1, extra=content(1, 2), rng=False, overwrite=True)
        _assert_content(writer.restore(1).extra, 1, 2)
