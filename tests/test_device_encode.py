"""Delta steps encoded on the device at the call (deltackpt.encode.device): byte for byte the
host path's step, the state at the call whatever training does after it, chunks the kernels
cannot code stored exactly, the reference kept to the last committed step, and where the
running reconstruction lives.

On a machine without CUDA, ``DELTACKPT_KERNELS=triton`` makes the Triton kernels code every
float tensor, in Triton's interpreter (:mod:`interpreter`): the device is the CPU. Models are
small: the interpreter is slow.
"""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_state_dicts_equal, data_files
from interpreter import (
    DEVICE,
    INTERPRETER_ONLY,
    can_run_here,
    import_kernels,
    interpreter,
    only_in_a_fresh_process,
)
from test_async import _fail_writes_of, _hold_saves, _in_thread, _mutate_everything
from test_distributed import _fsdp_trained, record_collectives, run_ranks, train_after_save
from torch import nn

from deltackpt import CheckpointManager, DistributedError, WriteFailedError
from deltackpt.codecs import quant as quant_codec
from deltackpt.encode import device as device_encode
from deltackpt.errors import ConfigError
from deltackpt.save.capture import capture

IN_PROCESS = can_run_here()
gpu = import_kernels("gpu_quant", IN_PROCESS)
import_kernels("gpu_xxh3", IN_PROCESS)  # device_encode hashes with it
_ = interpreter  # the fixture: TRITON_INTERPRET=1 while the tests run

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the chunks encoded on the device by a save's call."""
    sizes: list[int] = []
    encode = gpu.encode_on_device

    def counted(x, *args, **kwargs):
        sizes.append(x.numel())
        return encode(x, *args, **kwargs)

    monkeypatch.setattr(gpu, "encode_on_device", counted)
    return sizes


def _device(monkeypatch: pytest.MonkeyPatch, on_device: bool) -> str:
    """Where a model coded on the device (or on the host) lives: on a GPU, CUDA (the CPU); on
    the CPU, the CPU, coded by the Triton kernels with the switch (by Numba without)."""
    monkeypatch.setenv(quant_codec.KERNELS_ENV, "triton" if on_device and DEVICE == "cpu"
                       else "auto")
    return DEVICE if on_device else "cpu"


def _model(dtype: torch.dtype, device: str = DEVICE, centered: bool = False,
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model with AdamW (or centered RMSprop with momentum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).to(device, dtype)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True) \
        if centered else torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 32, device=DEVICE, dtype=dtype)
        x[:, 28:] = 0  # inputs never used: their weights' moments stay exactly zero
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _states(dtype: torch.dtype, count: int, centered: bool = False) -> list[tuple[dict, dict]]:
    """``count`` successive training states (model, optimizer state dicts)."""
    model, optimizer = _model(dtype, centered=centered)
    states = []
    for _ in range(count):
        _train(model, optimizer, 2)
        states.append(copy.deepcopy((model.state_dict(), optimizer.state_dict())))
    return states


def _save(mgr: CheckpointManager, step: int, state: tuple[dict, dict], dtype: torch.dtype,
          blocking: bool = False, device: str = DEVICE):
    """Save ``state`` as ``step`` of a model on ``device``; training changes every tensor right
    after the call. Returns the save's handle (or its info, blocking)."""
    model, optimizer = _model(dtype, device, "grad_avg" in state[1]["state"][0])
    model.load_state_dict(state[0])
    optimizer.load_state_dict(copy.deepcopy(state[1]))
    out = mgr.save(step, model, optimizer, rng=False, blocking=blocking)
    _mutate_everything(model, optimizer, {"epoch": 0, "history": []})
    return out


def _run(path: Path, states: list, dtype: torch.dtype, on_device: bool,
         monkeypatch: pytest.MonkeyPatch, **options) -> CheckpointManager:
    """Save ``states`` as steps 0, 1, ... coded on the device (or on the host)."""
    device = _device(monkeypatch, on_device)
    blocking = options.pop("blocking", False)
    mgr = CheckpointManager(path, full_every=10, workers=1, chunk_bytes=1024, **options)
    for step, state in enumerate(states):
        out = _save(mgr, step, state, dtype, blocking, device)
        info = out if blocking else out.wait()
        assert info.kind == ("full" if step == 0 else "delta")
    monkeypatch.delenv(quant_codec.KERNELS_ENV)
    return mgr


def _chunks(mgr: CheckpointManager, step: int) -> list:
    """What a step's metadata records of each chunk (all but the save's identity and time)."""
    return [(r.name, r.dtype, [(c.codec, c.params, c.raw_offset, c.raw_length, c.length,
                                 c.xxh3, c.raw_xxh3) for f in r.fragments for c in f.chunks])
            for r in mgr.metadata(step).tensors]


def _assert_same_steps(a: Path, b: Path, steps: int) -> None:
    with CheckpointManager(a, read_only=True) as ma, CheckpointManager(b, read_only=True) as mb:
        for step in range(steps):
            assert _chunks(ma, step) == _chunks(mb, step), f"step {step}"
            assert [f.read_bytes() for f in data_files(a, step)] == \
                [f.read_bytes() for f in data_files(b, step)], f"step {step}"
            classes_a, classes_b = ma.metadata(step).stats.classes, mb.metadata(step).stats.classes
            assert classes_a.keys() == classes_b.keys()
            for key, stats in classes_a.items():  # sums to float tolerance, maxima exact
                for field, value in stats.items():
                    other = classes_b[key][field]
                    assert value == (other if value is None else pytest.approx(other, rel=1e-9)), \
                        f"step {step} {key} {field}"


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_delta_encoded_on_the_device_is_the_host_paths_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encodes: list[int],
        dtype: torch.dtype, blocking: bool) -> None:
    """Deltas of a model trained with AdamW, every tensor changed right after each call: the
    data files and chunk records of the steps the device path writes are those of the host
    (Numba) path for the same states (the moments of weights whose inputs are always zero
    kept zero through bitmaps of zeros); the steps restore, through Numba, to the writer's
    running reconstruction, within the recorded error of the state at the call."""
    states = _states(dtype, 3)
    _run(tmp_path / "host", states, dtype, False, monkeypatch).close()
    assert not encodes
    mgr = _run(tmp_path / "device", states, dtype, True, monkeypatch, blocking=blocking)
    # every float tensor of at least 16 elements, in chunks of at most 1024 bytes
    big = [t for t in states[0][0].values() if t.numel() >= 16]
    assert len(encodes) == 2 * 3 * sum(-(-t.numel() * t.element_size() // 1024) for t in big)
    assert max(encodes) * dtype.itemsize <= 1024
    _assert_same_steps(tmp_path / "host", tmp_path / "device", 3)
    running = mgr._reference.recon.values
    mgr.close()
    with CheckpointManager(tmp_path / "device", read_only=True) as reader:
        restored = reader.restore(2)
        weights = reader.metadata(2).stats.classes["weights"]
        chunks = reader.metadata(2).tensor("optimizer/state/0.weight/exp_avg").fragments[0].chunks
        assert [c.params.get("zeros") for c in chunks] == \
            [c.raw_length // dtype.itemsize // 32 * 4 for c in chunks]  # 4 idle inputs a row
    for name, values in running.items():
        assert isinstance(values, torch.Tensor) and values.dtype == torch.float32
        expected = values.cpu().to(dtype).reshape(restored.tensors[name].shape)
        assert_state_dicts_equal({name: restored.tensors[name]}, {name: expected})
    errors = [(restored.model[name].float() - value.cpu().float()).abs().max()
              for name, value in states[2][0].items()]
    assert 0 < max(errors) <= weights["max_abs_error"]


def test_centered_rmsprop_on_the_device_is_the_host_paths_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Centered RMSprop's ``grad_avg`` (steps scaled by ``square_avg``), where every other
    element's ``grad_avg**2`` is near ``square_avg``: the device path writes the host path's
    steps, the chunks that would shrink a variance too far stored exactly on both."""
    states = _states(torch.float32, 3, centered=True)
    for _, optimizer_state in states[1:]:
        for state in optimizer_state["state"].values():
            g, v = state["grad_avg"].view(-1), state["square_avg"].view(-1)
            g[1::2] = (0.45 * v[1::2]).sqrt()
    _run(tmp_path / "host", states, torch.float32, False, monkeypatch).close()
    _run(tmp_path / "device", states, torch.float32, True, monkeypatch).close()
    _assert_same_steps(tmp_path / "host", tmp_path / "device", 3)
    with CheckpointManager(tmp_path / "device", read_only=True) as reader:
        codecs = {c.codec for r in reader.metadata(2).tensors if r.name.endswith("/grad_avg")
                  for f in r.fragments for c in f.chunks}
    assert codecs > {"quant"}, codecs  # some coded, some stored exactly


def test_a_chunk_the_kernels_cannot_code_is_the_state_at_the_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in a weight and in a second moment (which scales its first moment's steps): those
    chunks are stored exactly, bit for bit the state at the call although training changed
    it right after, the first moment's chunk too; the steps are the host path's. (The call
    checks the chunks a few at a time here.)"""
    monkeypatch.setattr(device_encode, "BATCH_ELEMENTS", 600)
    states = _states(torch.float32, 2)
    model, optimizer = states[1]
    model["0.weight"][3, 5] = float("nan")
    optimizer["state"][2]["exp_avg_sq"][0, 7] = float("nan")  # 2.weight's
    _run(tmp_path / "host", states, torch.float32, False, monkeypatch).close()
    _run(tmp_path / "device", states, torch.float32, True, monkeypatch).close()
    _assert_same_steps(tmp_path / "host", tmp_path / "device", 2)
    with CheckpointManager(tmp_path / "device", read_only=True) as reader:
        restored = reader.restore(1)
        meta = reader.metadata(1)
    first = {r.name: r.fragments[0].chunks[0] for r in meta.tensors}
    exact = {"model/0.weight": model["0.weight"],
             "optimizer/state/2.weight/exp_avg_sq": optimizer["state"][2]["exp_avg_sq"],
             "optimizer/state/2.weight/exp_avg": optimizer["state"][2]["exp_avg"]}
    for name, value in exact.items():
        assert first[name].codec != "quant", name
        count = first[name].raw_length // 4
        assert_state_dicts_equal({name: restored.tensors[name].reshape(-1)[:count]},
                                 {name: value.cpu().reshape(-1)[:count]})
    assert first["model/2.weight"].codec == "quant"


def _fail_step_dir_of(mgr: CheckpointManager, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the creation of ``step``'s directory, in the save's plan, fail as on a full disk."""
    makedirs = mgr.storage.makedirs

    def failing(rel="", *args, **kwargs):
        if rel == f"step-{step:012d}":
            raise OSError(errno.ENOSPC, "No space left on device")
        return makedirs(rel, *args, **kwargs)

    monkeypatch.setattr(mgr.storage, "makedirs", failing)


@pytest.mark.parametrize("failing", [_fail_writes_of, _fail_step_dir_of])
def test_after_a_failed_delta_the_next_codes_against_the_last_committed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing) -> None:
    """A device delta whose plan (on the save thread) or write fails commits nothing (its
    running values changed at the call); the next delta codes against the last committed
    step, as had the failed save never happened (a chain of single steps: ``depth=9``)."""
    states = _states(torch.float32, 4)
    _device(monkeypatch, True)
    with CheckpointManager(tmp_path / "ref", full_every=10, workers=1, depth=9) as ref:
        for step in (0, 1, 3):
            _save(ref, step, states[step], torch.float32).wait()
        expected = ref.restore(3).tensors
    with CheckpointManager(tmp_path / "ckpt", full_every=10, workers=1, depth=9) as mgr:
        for step in (0, 1):
            _save(mgr, step, states[step], torch.float32).wait()
        with monkeypatch.context() as patch:
            failing(mgr, 2, patch)
            failed = _save(mgr, 2, states[2], torch.float32)
            with pytest.raises(WriteFailedError, match="step 2"):
                failed.wait()
        info = _save(mgr, 3, states[3], torch.float32).wait()
        assert (info.kind, info.base_step) == ("delta", 1)
        assert_state_dicts_equal(mgr.restore(3).tensors, expected, "step 3")
        assert mgr.steps() == [0, 1, 3]


def test_a_delta_after_a_load_is_the_host_paths_step(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager that loaded a delta step (its running values read back on the host) codes the
    next delta on the device against them: the host path's step."""
    states = _states(torch.float32, 3)
    for on_device in (False, True):
        root = tmp_path / str(on_device)
        _run(root, states[:2], torch.float32, on_device, monkeypatch).close()
        device = _device(monkeypatch, on_device)
        with CheckpointManager(root, workers=1, chunk_bytes=1024) as mgr:
            model, optimizer = _model(torch.float32, device)
            mgr.load(1, model, optimizer)
            info = _save(mgr, 2, states[2], torch.float32, device=device).wait()
            assert (info.kind, info.base_step) == ("delta", 1)
            assert all(isinstance(v, torch.Tensor) for v in mgr._reference.recon.values.values()) \
                == on_device
    _assert_same_steps(tmp_path / "False", tmp_path / "True", 3)


def test_a_device_delta_waits_for_the_save_in_flight(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The call of a device delta waits for the save in flight to commit (its reference), and
    says so in SaveInfo.waited_seconds."""
    states = _states(torch.float32, 2)
    _device(monkeypatch, True)
    with CheckpointManager(tmp_path / "ckpt", full_every=10, workers=1) as mgr:
        with monkeypatch.context() as patch:
            release = _hold_saves(patch)
            first = _save(mgr, 0, states[0], torch.float32)
            thread, out = _in_thread(lambda: _save(mgr, 1, states[1], torch.float32))
            thread.join(1.0)  # held a second: its wait begins once the thread has captured
            assert thread.is_alive() and not first.done()
            release.set()
            thread.join(60)
        info = out[0].wait()
        assert (info.kind, info.base_step) == ("delta", 0)
        assert info.waited_seconds >= 0.5 and info.blocked_seconds >= info.waited_seconds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reconstruction_kept_on_the_host_gives_the_same_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """``reconstruction="host"``: the same steps, their error statistics too (of 16-bit
    tensors, from the running values rounded, read on the device after the copy that brings
    them to host memory); the running values of the tensors coded on the device (float32,
    their elements) are reported, on the device by default, in host memory with the option;
    other tensors' (none here) in host memory either way."""
    states = _states(dtype, 3)
    coded = 4 * sum(t.numel() for t in states[0][0].values() if t.numel() >= 16) * 3
    device = _run(tmp_path / "device", states, dtype, True, monkeypatch)
    host = _run(tmp_path / "host", states, dtype, True, monkeypatch, reconstruction="host")
    assert device.reconstruction_bytes == {DEVICE: coded}
    assert host.reconstruction_bytes == {"cpu": coded}
    if DEVICE == "cuda":
        assert all(v.is_pinned() for v in host._reference.recon.values.values())
    device.close()
    host.close()
    _assert_same_steps(tmp_path / "device", tmp_path / "host", 3)
    with pytest.raises(ConfigError, match="reconstruction must be one of 'device', 'host', got 'gpu'"):
        CheckpointManager(tmp_path / "x", reconstruction="gpu")


def test_running_values_stay_in_their_buffers(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The running values of device-coded tensors are float32 tensors (where the option says)
    that a delta on their last use updates in place (``full_every=3``: a chain of two deltas,
    the second on its base's last use; the first's base, the full step, is used once too)."""
    states = _states(torch.float32, 3)
    _device(monkeypatch, True)
    for place in ("device", "host"):
        with CheckpointManager(tmp_path / place, full_every=3, workers=1,
                               reconstruction=place) as mgr:
            buffers = []
            for step, state in enumerate(states[:2]):
                info = _save(mgr, step, state, torch.float32).wait()
                assert info.kind == ("full" if step == 0 else "delta")
                recon = mgr._reference.recon
                assert recon.step == step and all(
                    isinstance(v, torch.Tensor) and v.dtype == torch.float32
                    for v in recon.values.values())
                buffers.append({n: v.data_ptr() for n, v in recon.values.items()})
            assert buffers[1] == buffers[0]
            assert list(mgr._reference.levels) == [1]  # the full step's values became step 1's
            assert _save(mgr, 2, states[2], torch.float32).wait().base_step == 1


def test_bitsandbytes_code_maps_and_absmax_are_coded_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Of an 8-bit optimizer's state, the device codes none: its codes are not a float dtype,
    and the host codes its ``absmax`` from the moment's reconstruction and keeps an unchanged
    code map, against running values in host memory. Its float32 states (of a small bias) and
    the model's tensors are coded on the device."""
    bnb = pytest.importorskip("bitsandbytes")
    _device(monkeypatch, True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 160), nn.ReLU(), nn.Linear(160, 8)).to(DEVICE)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    _train(model, optimizer, 1)
    captured = capture(model, optimizer, None, False)
    host_coded = [t.name for t in captured.tensors if "absmax" in t.name or "qmap" in t.name]
    assert len(host_coded) == 4  # the first weight's 8-bit moments: absmax1/2 and qmap1/2
    float_tensors = {t.name for t in captured.tensors if t.tensor.dtype == torch.float32}
    assert set(device_encode.device_coded(captured)) == float_tensors - set(host_coded)


def _fsdp_saves(rank: int, world: int, path: str, on_device: bool, blocking: bool,
                report: str) -> None:
    """A full step and two deltas of FSDP2 shards, trained right after each call; coded by the
    Triton kernels (the switch: the device path) or by Numba. Reports the chunks each rank
    encoded on the device and the (thread, group) of each collective of the saves."""
    os.environ[quant_codec.KERNELS_ENV] = "triton" if on_device else "auto"
    encodes = []
    encode = gpu.encode_on_device
    gpu.encode_on_device = lambda x, *a, **k: encodes.append(x.numel()) or encode(x, *a, **k)
    model, optimizer = _fsdp_trained(rank, inputs=8, hidden=30)
    calls = record_collectives()
    with CheckpointManager(path, full_every=3, workers=1, chunk_bytes=1024,
                           blocking=blocking) as mgr:
        for step in range(3):
            out = mgr.save(step, model, optimizer, rng=False)
            train_after_save(model, optimizer, step, rank, 3)
            info = out if blocking else out.wait()
            assert info.kind == ("full" if step == 0 else "delta"), (step, info)
    with open(f"{report}.{rank}", "w") as f:
        json.dump({"encodes": encodes, "calls": calls}, f)


@INTERPRETER_ONLY  # gloo ranks of CPU tensors
@pytest.mark.parametrize("blocking", [False, True])
def test_fsdp_ranks_encode_their_shards_on_the_device(tmp_path: Path, blocking: bool) -> None:
    """Two FSDP2 ranks: the steps the device path writes are byte for byte the host path's;
    every rank encodes its own shards of each delta on the device; every collective of a save
    runs on the manager's gloo group, an asynchronous save's plan at the call (the caller's
    thread), the rest on the save thread."""
    report = str(tmp_path / "report")
    run_ranks(_fsdp_saves, 2, str(tmp_path / "host"), False, True, report + "-host")
    run_ranks(_fsdp_saves, 2, str(tmp_path / "device"), True, blocking, report)
    _assert_same_steps(tmp_path / "host", tmp_path / "device", 3)
    for rank in range(2):
        with open(f"{report}-host.{rank}") as f:
            assert json.load(f)["encodes"] == []
        with open(f"{report}.{rank}") as f:
            done = json.load(f)
        # each rank's shards of inner.weight and outer.weight (those of at least 16 elements)
        # and of their 2 moments, coded by the 2 deltas
        assert len(done["encodes"]) == 2 * 2 * 3, done["encodes"]
        threads = {thread for thread, _ in done["calls"]}
        if blocking:
            assert threads == {"MainThread"}
        else:
            assert all(on_own_group for _, on_own_group in done["calls"]), done["calls"]
            assert "MainThread" in threads and any(t.startswith("deltackpt-save") for t in threads)


def _kernels_differ(rank: int, world: int, path: str) -> None:
    """Rank 0 codes its deltas on the device (the switch), rank 1 on the host: the delta's call
    on rank 0 and its save on rank 1 fail with one error; no step is written."""
    os.environ[quant_codec.KERNELS_ENV] = "triton" if rank == 0 else "auto"
    model, optimizer = _fsdp_trained(rank, inputs=8, hidden=30)
    with CheckpointManager(path, full_every=3, workers=1, blocking=False) as mgr:
        mgr.save(0, model, optimizer, rng=False).wait()
        with pytest.raises(DistributedError, match="ranks 0 plan the save at its call"):
            mgr.save(1, model, optimizer, rng=False).wait()
        assert mgr.steps() == [0]


@INTERPRETER_ONLY
def test_ranks_that_would_encode_in_different_places_fail_together(tmp_path: Path) -> None:
    run_ranks(_kernels_differ, 2, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "step-000000000001").exists()


if not IN_PROCESS:  # the tests above run in a fresh process: not here too
    only_in_a_fresh_process(globals(), __file__)
