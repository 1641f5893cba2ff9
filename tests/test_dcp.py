"""deltackpt as a torch.distributed.checkpoint storage layer (deltackpt.dcp.Writer/Reader), driven
by the real dcp.save, dcp.async_save and dcp.load: full and delta steps by the manager's policy,
moments named by meaning, values stored exactly, a chain continued by a new Writer or a new
process, FSDP2 saves on 2 gloo ranks loaded in 1 process and on 3 ranks, and on 1 rank, and bad
input."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import chain_depths, free_port, manual_examples, run_ranks
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import deltackpt.dcp
from deltackpt import CheckpointManager, IntegrationError, OtherRunError, StepExistsError
from deltackpt.app.cli import main
from deltackpt.integrations import dcp as dcp_module

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")]


@pytest.fixture(autouse=True)
def _new_process():
    """Each test starts as a new process would: no manager kept, no directory touched."""
    dcp_module.runs.managers.clear()
    dcp_module.runs.touched.clear()
    yield
    dcp_module.runs.managers.clear()
    dcp_module.runs.touched.clear()


def _failure(raised: pytest.ExceptionInfo) -> BaseException:
    """The error rank 0 raised inside DCP, which reports it in a CheckpointException."""
    return raised.value.failures[0][0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """A few steps of a regression the model can learn (targets from a fixed linear map)."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(12, 5, generator=torch.Generator().manual_seed(99))
    for _ in range(steps):
        x = torch.randn(32, 12, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x @ target).backward()
        optimizer.step()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd,
            "train": {"step": step, "losses": (1.5, float("nan")), "blob": b"\x00\xff",
                      "tokens": torch.tensor(step * 1000)}}


def _blank(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd,
            "train": {"step": None, "losses": None, "blob": None, "tokens": torch.tensor(-1)}}


def _saved_run(path: Path, saves: int = 4, full_every: int = 3, **options) -> list:
    """``saves`` steps saved through dcp.save (the Writer's ``options``); returns the Writer's
    info and a copy of the model and optimizer state of each."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for step in range(saves):
        _train(model, optimizer, 3, seed=step)
        writer = deltackpt.dcp.Writer(path, step=step, full_every=full_every, **options)
        dcp.save(_state(model, optimizer, step), storage_writer=writer)
        msd, osd = get_state_dict(model, optimizer)
        out.append((writer.info, {k: v.clone() for k, v in msd.items()},
                    {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in osd["state"].items()}))
    return out


def _loaded(path: Path, step: int | None) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    _train(model, optimizer, 1, seed=50)  # state to be replaced
    state = _blank(model, optimizer)
    dcp.load(state, storage_reader=deltackpt.dcp.Reader(path, step=step))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return model, optimizer, state["train"]


def test_saves_are_full_or_delta_steps_that_load_back(tmp_path: Path) -> None:
    saved = _saved_run(tmp_path / "ckpt")
    assert [info.kind for info, _, _ in saved] == ["full", "delta", "delta", "full"]
    assert [info.base_step for info, _, _ in saved] == [None, 0, 1, None]
    for step in (0, 3):  # full steps: exact
        model, optimizer, train = _loaded(tmp_path / "ckpt", step)
        _, weights, moments = saved[step]
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
        osd = get_state_dict(model, optimizer)[1]
        for fqn, state in moments.items():
            for key, value in state.items():
                assert torch.equal(osd["state"][fqn][key], value), (step, fqn, key)
        assert optimizer.param_groups[0]["lr"] == 3e-3
        assert train["step"] == step and train["blob"] == b"\x00\xff"
        assert train["losses"][0] == 1.5 and train["losses"][1] != train["losses"][1]
        assert train["tokens"].item() == step * 1000
    # A delta loads what a restore gives, as close to the saved values as the manager's own
    # delta of the same run: the same coding, moments by meaning.
    model, optimizer, train = _loaded(tmp_path / "ckpt", 2)
    restored = CheckpointManager(tmp_path / "ckpt").restore(2)
    plain = _model()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    manager = CheckpointManager(tmp_path / "plain", full_every=3)
    for step in range(3):
        _train(plain, plain_optimizer, 3, seed=step)
        manager.save(step, model=plain, optimizer=plain_optimizer)
    reference = manager.restore(2)
    for fqn, value in saved[2][1].items():
        assert torch.equal(model.state_dict()[fqn], restored.model[fqn])
        error = (model.state_dict()[fqn] - value).abs().max()
        assert error <= 1.25 * (reference.model[fqn] - value).abs().max() + 1e-7, fqn
        for key, moment in saved[2][2][fqn].items():
            error = (get_state_dict(model, optimizer)[1]["state"][fqn][key] - moment).abs().max()
            expected = (reference.optimizer["state"][fqn][key] - moment).abs().max()
            assert error <= 1.25 * expected + 1e-7, (fqn, key)
    assert train["step"] == 2


def test_depth_bounds_every_chain_and_a_writer_of_another_depth_has_its_own_manager(
        tmp_path: Path) -> None:
    saved = _saved_run(tmp_path / "ckpt", saves=3, full_every=4, depth=1)
    # step 2 on step 0, which the manager kept: a read back of step 1 would make it full
    assert [info.base_step for info, _, _ in saved] == [None, 0, 0]  # depth 8: [None, 0, 1]
    assert chain_depths(tmp_path / "ckpt") == {0: 0, 1: 1, 2: 1}
    path = tmp_path / "switched"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, depth in enumerate((8, 8, 1)):
        _train(model, optimizer, 1, seed=step)
        writer = deltackpt.dcp.Writer(path, step=step, full_every=4, depth=depth)
        dcp.save(_state(model, optimizer, step), storage_writer=writer)
    # not the depth-8 writers' manager: step 1 is as deep as depth 1 allows
    assert writer.info.kind == "full"
    assert chain_depths(path) == {0: 0, 1: 1, 2: 0}


def test_a_dcp_step_is_an_ordinary_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _saved_run(tmp_path / "ckpt", saves=2)
    ckpt = CheckpointManager(tmp_path / "ckpt").restore(1)
    assert sorted(ckpt.model) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert ckpt.optimizer["param_groups"][0]["betas"] == (0.9, 0.999)
    assert ckpt.optimizer["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight",
                                                           "2.bias"]
    assert set(ckpt.optimizer["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    roles = {r.name: (r.role, r.state_key) for r in ckpt.metadata.tensors}
    assert roles["optimizer/state/0.weight/exp_avg_sq"] == ("optimizer", "exp_avg_sq")
    assert roles["model/0.weight"] == ("param", None)
    assert main(["verify", str(tmp_path / "ckpt")]) == 0
    assert main(["ls", str(tmp_path / "ckpt")]) == 0
    assert "delta" in capsys.readouterr().out
    assert main(["restore", str(tmp_path / "ckpt"), "--step", "1", "--format", "safetensors",
                 "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_new_writer_or_process_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, optimizer, 2, seed=0)
    dcp.save(_state(model, optimizer, 0), storage_writer=deltackpt.dcp.Writer(path, step=0))
    dcp_module.runs.managers.clear()  # a restarted process: nothing kept in memory
    dcp_module.runs.touched.clear()
    _train(model, optimizer, 2, seed=1)
    with pytest.raises(CheckpointException) as refused:
        dcp.save(_state(model, optimizer, 1), storage_writer=deltackpt.dcp.Writer(path, step=1))
    assert isinstance(_failure(refused), OtherRunError)
    assert "another run" in str(refused.value) and "continue_run=True" in str(refused.value)
    assert CheckpointManager(path).steps() == [0]
    writer = deltackpt.dcp.Writer(path, step=1, continue_run=True)
    dcp.save(_state(model, optimizer, 1), storage_writer=writer)
    assert (writer.info.kind, writer.info.base_step) == ("delta", 0)  # read back from step 0
    dcp_module.runs.managers.clear()
    dcp_module.runs.touched.clear()
    model, optimizer, _ = _loaded(path, None)  # resuming from the directory continues its run
    _train(model, optimizer, 2, seed=2)
    writer = deltackpt.dcp.Writer(path, step=2)
    dcp.save(_state(model, optimizer, 2), storage_writer=writer)
    assert (writer.info.kind, writer.info.base_step) == ("delta", 1)
    writer = deltackpt.dcp.Writer(path, step=3)  # kept in memory: no read back
    dcp.save(_state(model, optimizer, 3), storage_writer=writer)
    assert (writer.info.kind, writer.info.base_step) == ("delta", 2)
    assert main(["verify", str(path)]) == 0


class _Custom:
    pass


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_bad_input_is_refused_and_leaves_no_step(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, optimizer, 1, seed=0)
    state = _state(model, optimizer, 0)
    dcp.save(state, storage_writer=deltackpt.dcp.Writer(path, step=0))
    before = CheckpointManager(path).restore(0).model
    with pytest.raises(CheckpointException) as exists:
        dcp.save(state, storage_writer=deltackpt.dcp.Writer(path, step=0))
    assert isinstance(_failure(exists), StepExistsError) and "overwrite" in str(exists.value)
    with pytest.raises(CheckpointException) as unsafe:
        dcp.save({**state, "custom": _Custom()}, storage_writer=deltackpt.dcp.Writer(path, step=1))
    assert isinstance(_failure(unsafe), IntegrationError) and "'custom'" in str(unsafe.value)
    with pytest.raises(CheckpointException) as unstorable:
        dcp.save({**state, "odd": torch.zeros(2, dtype=torch.complex128).to(torch.complex32)},
                 storage_writer=deltackpt.dcp.Writer(path, step=1))
    assert "complex32" in str(unstorable.value)
    assert CheckpointManager(path).steps() == [0]
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("step")) == ["step-000000000000"]
    after = CheckpointManager(path).restore(0).model
    assert all(torch.equal(before[k], after[k]) for k in before)
    CheckpointManager(tmp_path / "plain").save(0, model=model)
    with pytest.raises(BaseException) as plain:
        dcp.load(_blank(model, optimizer),
                 storage_reader=deltackpt.dcp.Reader(tmp_path / "plain", step=0))
    assert "not saved through deltackpt.dcp.Writer" in str(plain.value)


def test_stored_bytes_are_checked_before_dcp_unpickles_them(tmp_path: Path) -> None:
    """A value kept as bytes (not JSON) reaches DCP's planner, which unpickles it, only if a
    weights-only load accepts it: a step edited to hold a pickled class is refused."""
    holder = io.BytesIO()
    torch.save({"kept": torch.ones(2)}, holder)  # a tensor inside: kept as DCP's bytes
    objects = {"a": dcp_module._object("a", holder.getvalue())}
    assert set(objects["a"]) == {"bytes"}
    assert torch.equal(torch.load(io.BytesIO(dcp_module.serialised("a", {"a": {
        "bytes": {"$bytes": __import__("base64").b64encode(holder.getvalue()).decode()}}})),
        weights_only=True)["kept"], torch.ones(2))
    evil = pickle.dumps(_Custom(), protocol=2)
    with pytest.raises(IntegrationError, match="weights_only"):
        dcp_module.serialised("b", {"b": {"bytes": {
            "$bytes": __import__("base64").b64encode(evil).decode()}}})


# -- FSDP2 on gloo ranks ---------------------------------------------------------------------


def _fsdp_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _fsdp_save(rank: int, world: int, path: str, expected: str) -> None:
    model, optimizer = _fsdp_model()
    background = dist.new_group(backend="gloo")
    kinds = []
    for step in range(4):
        _train(model, optimizer, 2, seed=step + rank * 100)
        state = _state(model, optimizer, step)
        state["rank"] = {f"loader_{rank}": [rank, step]}  # a per-rank value, as dataloaders keep
        if step == 1:
            writer = deltackpt.dcp.Writer(path, step=step, full_every=3,
                                          process_group=background)
            dcp.async_save(state, storage_writer=writer, process_group=background).result()
        else:
            writer = deltackpt.dcp.Writer(path, step=step, full_every=3)
            dcp.save(state, storage_writer=writer)
        kinds.append(writer.info.kind)
    assert kinds == ["full", "delta", "delta", "full"]
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, expected)


def _fsdp_load(rank: int, world: int, path: str, expected: str, saved_ranks: int = 2) -> None:
    model, optimizer = _fsdp_model()
    _train(model, optimizer, 1, seed=7)
    state = _blank(model, optimizer)
    last = saved_ranks - 1
    state["rank"] = {f"loader_{last}": None}
    dcp.load(state, storage_reader=deltackpt.dcp.Reader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    restored = CheckpointManager(path).restore()
    for fqn, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), restored.model[fqn]), fqn
    moments = restored.optimizer["state"]
    for param, fqn in zip(model.parameters(), ["0.weight", "0.bias", "2.weight", "2.bias"],
                          strict=True):
        assert torch.equal(optimizer.state[param]["exp_avg"].full_tensor(),
                           moments[fqn]["exp_avg"]), fqn
    assert state["train"]["step"] == 3 and state["rank"] == {f"loader_{last}": [last, 3]}
    saved = torch.load(expected, weights_only=True)
    for fqn, value in saved.items():  # a full step
        assert torch.equal(model.state_dict()[fqn].full_tensor(), value), fqn


@pytest.mark.slow
def test_fsdp_saves_on_2_ranks_load_in_1_process_and_on_3_ranks(tmp_path: Path) -> None:
    path, expected = str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")
    run_ranks(_fsdp_save, 2, path, expected)
    assert main(["verify", path]) == 0
    for step in (2, 3):  # a delta, a full step
        model, _, train = _loaded(Path(path), step)
        restored = CheckpointManager(path).restore(step)
        assert restored.metadata.world_size == 2 and train["step"] == step
        assert all(torch.equal(model.state_dict()[k], restored.model[k]) for k in restored.model)
    saved = torch.load(expected, weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    run_ranks(_fsdp_load, 3, path, expected)


def test_fsdp_saves_on_1_rank_load_in_1_process_and_on_1_rank(tmp_path: Path) -> None:
    """FSDP2 on a single rank (one GPU): its DTensors, on a mesh of one rank, hold whole
    tensors, saved and loaded as a single process's."""
    path, expected = str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")
    run_ranks(_fsdp_save, 1, path, expected)
    for step in (2, 3):  # a delta, a full step
        model, _, train = _loaded(Path(path), step)
        restored = CheckpointManager(path).restore(step)
        assert restored.metadata.world_size == 1 and train["step"] == step
        assert all(torch.equal(model.state_dict()[k], restored.model[k]) for k in restored.model)
    run_ranks(_fsdp_load, 1, path, expected, 1)


@pytest.mark.slow
def test_the_manuals_examples_run(tmp_path: Path) -> None:
    examples = manual_examples("dcp.md")
    assert len(examples) == 2
    for example in examples:  # each in a process of its own: the second starts a process group
        subprocess.run([sys.executable, "-c", example], cwd=tmp_path, check=True,
                       env={**os.environ, "MASTER_PORT": str(free_port())})
    dcp_steps = CheckpointManager(tmp_path / "runs" / "dcp-ckpt").steps()
    assert dcp_steps == [10, 20, 30]
    titan = CheckpointManager(tmp_path / "runs" / "titan-ckpt")
    assert titan.steps() == [20, 30, 40] and titan.info(40).kind == "delta"


def test_optimizer_state_is_recognised_by_its_parameter() -> None:
    """``<prefix>state.<fqn>.<key>`` is optimizer state where one reading of the name finds one
    tensor ending in ``<fqn>`` of its shape, whatever ``state`` components the names hold."""
    w, b = torch.ones(4, 3), torch.ones(4)
    state = {"model.state.proj.weight": w, "model.state.proj.bias": b,
             "optim.state.state.proj.weight.exp_avg": w * 2,
             "optim.state.state.proj.weight.step": torch.tensor(3.0),
             "optim.state.gone.exp_avg": w * 3,  # no parameter ends in "gone"
             "ema.proj.weight": w * 4}  # a tensor of another prefix
    captured = dcp_module.capture_dcp(state, {})
    roles = {t.name: (t.role, t.fqn, t.state_key) for t in captured.tensors}
    assert roles["model/state.proj.weight"] == ("param", "state.proj.weight", None)
    assert roles["model/state.proj.bias"] == ("buffer", "state.proj.bias", None)
    assert roles["optimizer/state/state.proj.weight/exp_avg"] == (
        "optimizer", "state.proj.weight", "exp_avg")
    assert roles["optimizer/state/state.proj.weight/step"][2] == "step"
    assert roles["extra/dcp/values/optim.state.gone.exp_avg"][0] == "extra"
    assert roles["extra/dcp/values/ema.proj.weight"][0] == "extra"
    names = captured.tree["extra"]["dcp"]["tensors"]
    assert names["optim.state.state.proj.weight.exp_avg"] == \
        "optimizer/state/state.proj.weight/exp_avg"
