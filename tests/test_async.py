"""Asynchronous saves: ``save(..., blocking=False)`` writes the state at the call while training
goes on, reuses its snapshot buffers, bounds the saves in flight, reports failures and keeps the
closed-loop reference at the last committed step."""

from __future__ import annotations

import copy
import errno
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_state_dicts_equal
from torch import nn

import deltackpt.save.driver
import deltackpt.save.snapshot
from deltackpt import (
    BackgroundSaveError,
    CheckpointManager,
    SaveHandle,
    SaveInFlightError,
    WriteFailedError,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        loss = model(torch.randn(16, 32, dtype=dtype, device=device)).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _mutate_everything(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """What training does right after a save returns: every parameter, moment, step counter,
    hyperparameter and the user's extra change in place."""
    _train(model, optimizer, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    for state in optimizer.state.values():
        for value in state.values():
            value.add_(7.0)
    optimizer.param_groups[0]["lr"] = 123.0
    optimizer.param_groups[0]["betas"] = (0.1, 0.2)
    optimizer.zero_grad()
    other = copy.deepcopy(optimizer.state_dict())  # state tensors replaced, the old ones freed
    for state in other["state"].values():
        for key, value in state.items():
            state[key] = value * 2 + 1
    optimizer.load_state_dict(other)
    extra["epoch"] += 1
    extra["history"].append(99)


def _expected(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> tuple:
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
            copy.deepcopy(extra))


def test_a_step_saved_asynchronously_is_the_state_at_the_call(tmp_path: Path) -> None:
    """Every tensor and value changed right after save returns: the full step restores bit for
    bit to the state at the call, and each delta exactly as a blocking save of the same state
    does (within its recorded error of that state)."""
    model, optimizer = _model()
    extra = {"epoch": 0, "history": [1, 2]}
    with CheckpointManager(tmp_path / "async", full_every=3) as mgr, \
            CheckpointManager(tmp_path / "blocking", full_every=3) as reference:
        for step in range(3):
            _train(model, optimizer, 2)
            expected = _expected(model, optimizer, extra)
            handle = mgr.save(step, model, optimizer, extra=extra, rng=False, blocking=False)
            assert isinstance(handle, SaveHandle) and handle.step == step
            _mutate_everything(model, optimizer, extra)
            info = handle.wait()
            assert handle.done() and handle.exception() is None
            assert info.kind == ("full" if step == 0 else "delta")
            restored = mgr.restore(step)
            # the same state saved by a blocking save of another manager
            model.load_state_dict(expected[0])
            optimizer.load_state_dict(expected[1])
            extra = copy.deepcopy(expected[2])
            assert reference.save(step, model, optimizer, extra=extra, rng=False).kind == info.kind
            blocking = reference.restore(step)
            assert_state_dicts_equal(restored.tensors, blocking.tensors, f"step {step}")
            assert restored.extra == expected[2]
            assert restored.optimizer["param_groups"] == blocking.optimizer["param_groups"]
            if step == 0:
                assert_state_dicts_equal(restored.model, expected[0], "full step")
            else:
                weights = mgr.metadata(step).stats.classes["weights"]
                for name, value in expected[0].items():
                    assert (restored.model[name] - value).abs().max() <= weights["max_abs_error"]


def test_snapshot_buffers_are_allocated_once_and_reused(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    allocated: list[int] = []
    allocate = deltackpt.save.snapshot._allocate

    def counted(shape, dtype, pinned):
        buffer = allocate(shape, dtype, pinned)
        allocated.append(buffer.numel() * buffer.element_size())
        return buffer

    monkeypatch.setattr(deltackpt.save.snapshot, "_allocate", counted)
    with CheckpointManager(tmp_path / "ckpt", blocking=False) as mgr:
        first = mgr.save(0, model, optimizer).wait()
        state_bytes = first.raw_bytes
        assert first.snapshot_bytes == state_bytes == sum(allocated) == mgr.snapshot_bytes
        for step in (1, 2, 3):
            _train(model, optimizer, 1)
            info = mgr.save(step, model, optimizer).wait()
            assert info.kind == "delta" and info.snapshot_bytes == state_bytes
        assert sum(allocated) == state_bytes  # nothing allocated after the first save
        assert mgr.snapshot_bytes == state_bytes
        # a tensor whose shape changed gets a new buffer, and the step is full
        model[2] = nn.Linear(48, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, optimizer, 1)
        info = mgr.save(4, model, optimizer).wait()
        assert info.kind == "full"
        assert mgr.snapshot_bytes == info.snapshot_bytes == info.raw_bytes < state_bytes


def _hold_saves(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every save wait, in its write, until the returned event is set."""
    release = threading.Event()
    write_data = deltackpt.save.driver.write_data

    def held(*args, **kwargs):
        assert release.wait(30)
        return write_data(*args, **kwargs)

    monkeypatch.setattr(deltackpt.save.driver, "write_data", held)
    return release


def _in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_a_save_blocks_only_at_max_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             max_in_flight: int) -> None:
    model, optimizer = _model()
    release = _hold_saves(monkeypatch)
    with CheckpointManager(tmp_path / "ckpt", blocking=False, max_in_flight=max_in_flight) as mgr:
        first = mgr.save(0, model, optimizer)
        with pytest.raises(TimeoutError):
            first.wait(timeout=0.05)
        thread, out = _in_thread(lambda: mgr.save(1, model, optimizer))
        thread.join(0.5 if max_in_flight == 1 else 30)
        assert thread.is_alive() == (max_in_flight == 1)  # waits for the save in flight
        release.set()
        thread.join(30)
        second = out[0].wait()
        assert first.wait().step == 0 and second.step == 1
        if max_in_flight == 1:
            assert second.waited_seconds >= 0.4
            assert second.blocked_seconds >= second.waited_seconds
        else:
            assert second.waited_seconds < 0.4
        assert second.kind == "delta"
        assert mgr.snapshot_bytes == max_in_flight * second.raw_bytes
    assert CheckpointManager(tmp_path / "ckpt").steps() == [0, 1]


def test_reads_wait_for_the_saves_in_flight_and_bad_steps_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    release = _hold_saves(monkeypatch)
    with CheckpointManager(tmp_path / "ckpt", max_in_flight=2) as mgr:
        handle = mgr.save(5, model, optimizer, blocking=False)
        for step, what in ((5, "is being saved"), (3, "is older than step 5")):
            for blocking in (False, True):
                with pytest.raises(SaveInFlightError, match=f"cannot save step {step}: it {what}"):
                    mgr.save(step, model, optimizer, blocking=blocking)
        reads = {5: mgr.steps, 6: mgr.latest_step, 7: lambda: mgr.restore(7).step,
                 8: lambda: mgr.load(8, model, optimizer), 9: lambda: mgr.dependents(8)}
        for step, read in reads.items():
            if step > 5:
                handle = mgr.save(step, model, optimizer, blocking=False)
            thread, out = _in_thread(read)
            thread.join(0.3)
            assert thread.is_alive()  # waits for the save in flight
            release.set()
            thread.join(30)
            assert handle.done() and handle.wait().step == step
            assert out[0] == {5: [5], 6: 6, 7: 7, 8: None, 9: [9]}[step]
            release.clear()


def _fail_writes_of(mgr: CheckpointManager, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the data files of ``step`` fail as on a full disk."""
    create = mgr.storage.create

    def failing(rel, *args, **kwargs):
        if rel.startswith(f"step-{step:012d}/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(rel, *args, **kwargs)

    monkeypatch.setattr(mgr.storage, "create", failing)


def _states(count: int) -> list[tuple[dict, dict]]:
    """``count`` successive training states (model, optimizer state dicts)."""
    model, optimizer = _model()
    states = []
    for _ in range(count):
        _train(model, optimizer, 2)
        states.append(_expected(model, optimizer, {})[:2])
    return states


def _save(mgr: CheckpointManager, step: int, state: tuple[dict, dict],
          blocking: bool) -> SaveHandle | deltackpt.SaveInfo:
    model, optimizer = _model()
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    return mgr.save(step, model, optimizer, rng=False, blocking=blocking)


@pytest.mark.parametrize("blocking", [False, True])
def test_after_a_failed_delta_the_next_codes_against_the_last_committed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool) -> None:
    """A delta that fails while written commits nothing; the next save is a delta on the last
    committed step, coded as it would have been had the failed save never happened (a chain
    of single steps: ``depth=9``)."""
    states = _states(4)
    with CheckpointManager(tmp_path / "ref", full_every=10, depth=9) as ref:
        for step in (0, 1, 3):
            _save(ref, step, states[step], True)
        expected = ref.restore(3).tensors
    with CheckpointManager(tmp_path / "ckpt", full_every=10, blocking=blocking, depth=9) as mgr:
        for step in (0, 1):
            _save(mgr, step, states[step], blocking)
        with monkeypatch.context() as patch:
            _fail_writes_of(mgr, 2, patch)
            if blocking:
                with pytest.raises(WriteFailedError, match="step 2"):
                    _save(mgr, 2, states[2], blocking)
            else:
                failed = _save(mgr, 2, states[2], blocking)
                with pytest.raises(WriteFailedError, match="step 2"):
                    failed.wait()
                assert isinstance(failed.exception(), WriteFailedError)
        assert mgr.steps() == [0, 1]
        info = _save(mgr, 3, states[3], blocking)
        info = info if blocking else info.wait()
        assert (info.kind, info.base_step) == ("delta", 1)
        assert_state_dicts_equal(mgr.restore(3).tensors, expected, "step 3")
    assert not (tmp_path / "ckpt" / "step-000000000002").exists()


def test_a_failure_not_taken_from_its_handle_is_raised_by_the_next_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    states = _states(3)
    for call in ("save", "wait", "close"):
        root = tmp_path / call
        mgr = CheckpointManager(root, blocking=False)
        _save(mgr, 0, states[0], False)
        with monkeypatch.context() as patch:
            _fail_writes_of(mgr, 1, patch)
            handle = _save(mgr, 1, states[1], False)
            while not handle.done():
                time.sleep(0.01)
        with pytest.raises(BackgroundSaveError, match="step 1 failed") as raised:
            if call == "save":
                _save(mgr, 2, states[2], False)
            elif call == "wait":
                mgr.wait()
            else:
                mgr.close()
        assert isinstance(raised.value.__cause__, WriteFailedError)
        mgr.wait()  # raised once
        if call != "close":
            _save(mgr, 2, states[2], False).wait()
        mgr.close()
        assert CheckpointManager(root).steps() == ([0] if call == "close" else [0, 2])


def test_close_and_exit_wait_for_the_saves_in_flight(tmp_path: Path) -> None:
    model, optimizer = _model()
    with CheckpointManager(tmp_path / "ckpt", blocking=False) as mgr:
        handle = mgr.save(0, model, optimizer)
    assert handle.done() and handle.wait().kind == "full"
    assert mgr.snapshot_bytes == 0  # closing freed the snapshot buffers
    assert CheckpointManager(tmp_path / "ckpt").steps() == [0]


def test_a_process_exiting_with_a_save_in_flight_finishes_it(tmp_path: Path) -> None:
    """The interpreter exits right after save returns, while the step is still being written:
    the step is committed and whole."""
    script = tmp_path / "exit_early.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import torch
        import deltackpt.save.driver
        from deltackpt import CheckpointManager

        write_data = deltackpt.save.driver.write_data
        def slow(*args, **kwargs):
            time.sleep(1.0)  # still writing when the main thread is done
            return write_data(*args, **kwargs)
        deltackpt.save.driver.write_data = slow

        mgr = CheckpointManager(sys.argv[1], blocking=False)
        handle = mgr.save(7, extra={"w": torch.arange(1000.0)}, rng=False)
        assert not handle.done()
        print("returned", flush=True)
    """))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["returned"]
    with CheckpointManager(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.steps() == [7]
        assert torch.equal(reader.restore(7).extra["w"], torch.arange(1000.0))
        assert reader.verify(deep=True) == {7: []}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_before_the_training_stream_changes_them(tmp_path: Path) -> None:
    """CUDA state is copied into pinned buffers on a side stream; kernels queued on the training
    stream right after the call (in-place updates) run after the copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 16)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
        optimizer.step()
    expected = _expected(model, optimizer, {})
    with CheckpointManager(tmp_path / "ckpt", blocking=False) as mgr:
        handle = mgr.save(0, model, optimizer, rng=False)
        with torch.no_grad():
            for _ in range(20):  # long enough to overtake an unordered copy
                for p in model.parameters():
                    p.mul_(-1.5).add_(p.square())
        info = handle.wait()
        assert info.snapshot_bytes == info.raw_bytes
        restored = mgr.restore(0)
    assert_state_dicts_equal(restored.model, {k: v.cpu() for k, v in expected[0].items()},
                             "full step")


def _exit_child(mgr: CheckpointManager) -> None:
    assert mgr._queue.in_flight() == []  # the parent's save is not in flight here
    # ... and the child exits (threading's exit hooks wait for no save of the parent's)


def test_a_child_forked_while_a_save_is_in_flight_exits(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader worker forked during a save neither waits for it nor inherits it."""
    import multiprocessing

    model, optimizer = _model()
    release = _hold_saves(monkeypatch)
    with CheckpointManager(tmp_path / "ckpt", blocking=False) as mgr:
        handle = mgr.save(0, model, optimizer)
        child = multiprocessing.get_context("fork").Process(target=_exit_child, args=(mgr,))
        child.start()
        child.join(30)
        alive = child.is_alive()
        if alive:
            child.kill()
        release.set()
        assert handle.wait().step == 0
    assert not alive and child.exitcode == 0


def test_async_saves_through_a_cache_upload_in_order(tmp_path: Path) -> None:
    """With ``cache=``, the save thread commits each step in the cache and its upload follows;
    a restore waits for both, and reads the remote's steps."""
    import uuid

    model, optimizer = _model()
    url = f"memory://t{uuid.uuid4().hex[:12]}/run"
    states = []
    with CheckpointManager(url, full_every=3, blocking=False, cache=tmp_path / "cache") as mgr:
        for step in range(3):
            _train(model, optimizer, 2)
            states.append(copy.deepcopy(model.state_dict()))
            mgr.save(step, model, optimizer, rng=False)
        assert mgr.steps() == [0, 1, 2]
    with CheckpointManager(url, read_only=True) as remote:
        assert [remote.info(s).kind for s in remote.steps()] == ["full", "delta", "delta"]
        assert_state_dicts_equal(remote.restore(0).model, states[0], "step 0")
