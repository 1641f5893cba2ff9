"""The manager's thread pool: kept across saves and restores, stopped on close, safe across
fork, and a failed call leaves none of its tasks running."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
from helpers import data_files
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.format.metadata import step_dir_name
from deltackpt.io.pool import INLINE_BYTES, THREAD_NAME_PREFIX
from deltackpt.io.writer import encode_exact, new_save_id, write_data
from deltackpt.save.capture import capture


def _pool_threads() -> set[int]:
    """Identities of the live threads deltackpt started."""
    return {t.ident for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)}


def _others_stopped() -> set[int]:
    """Let the pools of managers that earlier tests dropped stop (collected, their threads
    exit: joined here, so that no identity of theirs comes back as one of ours); the identities
    of the threads still running then, of managers something still holds."""
    gc.collect()
    deadline = time.monotonic() + 5
    for thread in threading.enumerate():
        if thread.name.startswith(THREAD_NAME_PREFIX):
            thread.join(max(0.0, deadline - time.monotonic()))
    return _pool_threads()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def test_threads_are_kept_across_saves_and_restores_and_stopped_on_close(tmp_path) -> None:
    others = _others_stopped()
    model = _model()
    # 16 chunks that go to the workers (with a few, one worker may finish before the next comes,
    # and the pool starts no second thread)
    model[0] = nn.Linear(64, 16 * INLINE_BYTES // 256)
    model[2] = nn.Linear(16 * INLINE_BYTES // 256, 8)
    mgr = CheckpointManager(tmp_path / "ckpt", full_every=3, workers=2, chunk_bytes=INLINE_BYTES)
    threads = []
    for step in range(4):
        with torch.no_grad():
            model[0].weight.add_(0.01)
        mgr.save(step, model, rng=False)
        threads.append(_pool_threads() - others)
    mgr.restore(2)
    threads.append(_pool_threads() - others)
    assert len(threads[0]) == 2  # one per worker, started by the first save
    assert all(t == threads[0] for t in threads), "a save or restore started threads of its own"
    mgr.close()
    assert not _pool_threads() - others, "close left threads running"
    # A closed manager still works: it starts a pool anew, which the with block stops again.
    with mgr:
        assert torch.equal(mgr.restore(3).model["2.bias"], model[2].bias.detach())
        assert len(_pool_threads() - others) == 2
    assert not _pool_threads() - others


def test_chunks_under_inline_bytes_are_decoded_on_the_calling_thread(tmp_path) -> None:
    """Restores of chunks of under ``INLINE_BYTES`` hand none to a worker: the hand-off would
    cost more than the chunk (saves code them on the calling thread too, and fsync their files
    on the workers)."""
    model = _model()
    first = model[0].weight.detach().clone()
    with CheckpointManager(tmp_path / "ckpt", workers=2, chunk_bytes=4096) as mgr:
        for step in range(3):  # a full step, then deltas
            mgr.save(step, model, rng=False)
            with torch.no_grad():
                model[0].weight.add_(0.01)
    others = _others_stopped()
    with CheckpointManager(tmp_path / "ckpt", read_only=True, workers=2) as mgr:
        assert torch.equal(mgr.restore(0).model["0.weight"], first)
        assert mgr.restore(2).metadata.kind == "delta"
        assert not _pool_threads() - others


def test_a_forked_child_runs_on_threads_of_its_own(tmp_path) -> None:
    model = _model()
    with CheckpointManager(tmp_path / "ckpt", workers=2, chunk_bytes=4096) as mgr:
        mgr.save(0, model, rng=False)  # the parent's pool is running (and idle)
        assert _pool_threads()
        pid = os.fork()
        if pid == 0:  # the child: the parent's threads do not exist here
            code = 1
            try:
                code = 0 if torch.equal(mgr.restore(0).model["0.weight"],
                                        model[0].weight.detach()) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's threads")
        assert os.waitstatus_to_exitcode(status[1]) == 0
        assert torch.equal(mgr.restore(0).model["0.weight"], model[0].weight.detach())


def test_a_failed_save_stops_its_tasks_before_removing_its_files(tmp_path) -> None:
    """The chunks still being coded when one fails finish before the save deletes its files,
    so none of them writes a file afterwards; the pool serves the next save."""
    model = _model()
    slow = threading.Event()

    def encoder(record, spec, raw_offset, raw):
        if record.name == "model/0.weight" and raw_offset == 0:
            slow.wait(5)
            raise OSError("disk on fire")
        slow.set()
        time.sleep(0.2)  # still coding when the failure is raised
        return encode_exact(record, spec, raw_offset, raw)

    with CheckpointManager(tmp_path / "ckpt", workers=2, chunk_bytes=1024) as mgr:
        mgr.save(0, model, rng=False)
        mgr.storage.makedirs(step_dir_name(1))
        with pytest.raises(OSError, match="disk on fire"):
            write_data(mgr.storage, 1, new_save_id(), capture(model, None, None, False),
                       encoder=encoder, chunk_bytes=1024, workers=mgr._workers())
        time.sleep(0.5)  # a task left running would create its file by now
        assert data_files(tmp_path / "ckpt", 1) == []
        mgr.save(1, model, rng=False)
        assert mgr.steps() == [0, 1]
