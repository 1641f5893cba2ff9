"""deltackpt as DeepSpeed's checkpoint engine (``deltackpt.deepspeed.install``), driven by real
DeepSpeed on 2 gloo ranks: resuming from a full step is DeepSpeed's own resume bit for bit, a
delta resumes within its error, and a step saved on 2 ranks loads on 1 under another ZeRO stage."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import chain_depths, manual_examples, run_ranks, unclosed_managers
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from test_deepspeed_convert import Net, batch  # noqa: E402

from deltackpt import (  # noqa: E402
    CheckpointManager,
    IntegrationError,
    NotACheckpointError,
    OtherRunError,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("only_torch_safe_globals")]


def engine_of(stage: int, dtype: str, seed: int) -> Any:
    """A DeepSpeed engine training :class:`Net` with AdamW and a warm-up schedule."""
    import deepspeed.comm.torch  # the module; the attribute deepspeed.comm.torch is torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a 150 s compile, unused on gloo
    torch.manual_seed(seed)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1,
                                                        "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
              "fp16": {"enabled": dtype == "fp16"}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def train(engine: Any, generator: torch.Generator, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(batch(generator)).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 value and Adam moments, by DeepSpeed's own accessors (or,
    without ZeRO, the optimizer's own parameters: the model's, or their fp32 copies)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    masters = {id(lp): hp for lps, hps in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True)
               for lp, hp in zip(lps, hps, strict=True)} if hasattr(optimizer, "fp32_groups") else {}
    out = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if engine.zero_optimization_stage() == 0:
            master = masters.get(id(param), param)
            state = getattr(optimizer, "optimizer", optimizer).state[master]
            out[name] = master.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = state[key].clone()
            continue
        out[name] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
    return out


def rank_env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")


def save_and_resume(rank: int, world: int, root: str, stage: int, dtype: str) -> None:
    """Train 3 steps; save with DeepSpeed's engine and with deltackpt's (full); 2 more steps, a
    delta; 2 more. Then resume from each: deltackpt's full step as DeepSpeed's own resume, bit
    for bit; the delta within its error, with the scheduler and counters restored."""
    rank_env(rank, world)
    from deltackpt.deepspeed import install

    out = Path(root)
    engine = engine_of(stage, dtype, seed=0)
    data = torch.Generator().manual_seed(rank)
    train(engine, data, 3)
    engine.save_checkpoint(str(out / "ds"), tag="global_step3")
    ckpt = install(engine, full_every=4)
    client = {"epoch": 1, "seen": torch.arange(3)}  # the same tensors each save: deltas go on
    engine.save_checkpoint(str(out / "ours"), client_state=client)
    assert ckpt.info.kind == "full" and ckpt.info.step == 3
    if rank == 0:
        torch.save(full_state(engine), out / "step3.pt")
    else:
        full_state(engine)
    train(engine, data, 2)
    at_delta = full_state(engine)
    engine.save_checkpoint(str(out / "ours"), client_state=client)
    assert (ckpt.info.kind, ckpt.info.base_step) == ("delta", 3), ckpt.info
    assert (out / "ours" / "latest").read_text() == "global_step5"

    def resumed(seed: int, load: Callable[[Any], Any]) -> tuple[Any, list[float]]:
        engine = engine_of(stage, dtype, seed)
        load(engine)
        data = torch.Generator().manual_seed(rank)
        train_skip = [batch(data) for _ in range(3)]  # the batches before the save
        assert len(train_skip) == 3
        return engine, train(engine, data, 4)

    theirs, their_losses = resumed(7, lambda e: e.load_checkpoint(str(out / "ds"), "global_step3"))
    client = {}

    def ours_load(e: Any) -> None:
        install(e)
        with unclosed_managers() as unclosed:
            path, state = e.load_checkpoint(str(out / "ours"), tag="global_step3")
            assert unclosed() == []
        assert path == str(out / "ours" / "global_step3") and e.global_steps == 3
        client.update(state)

    ours, our_losses = resumed(8, ours_load)
    assert client["epoch"] == 1 and torch.equal(client["seen"], torch.arange(3))
    assert our_losses == their_losses
    mine, expected = full_state(ours), full_state(theirs)
    for name, value in expected.items():
        assert torch.equal(mine[name], value), name
    assert ours.lr_scheduler.get_lr() == theirs.lr_scheduler.get_lr()

    delta = engine_of(stage, dtype, seed=9)
    install(delta)
    assert delta.load_checkpoint(str(out / "ours"))[0] == str(out / "ours" / "global_step5")
    assert delta.global_steps == 5
    loaded = full_state(delta)
    if rank == 0:
        torch.save({"true": at_delta, "loaded": loaded}, out / "step5.pt")


def load_on_one_rank(rank: int, world: int, root: str, stage: int, dtype: str) -> None:
    """Load step 3, saved on 2 ranks, in one process under ZeRO ``stage``; train on."""
    rank_env(rank, world)
    from deltackpt.deepspeed import install

    engine = engine_of(stage, dtype, seed=3)
    install(engine)
    engine.load_checkpoint(str(Path(root) / "ours"), tag="global_step3")
    expected = torch.load(Path(root) / "step3.pt", weights_only=True)
    loaded = full_state(engine)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    losses = train(engine, torch.Generator().manual_seed(0), 2)
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(("stage", "dtype", "then"), [(0, "fp32", 2), (0, "bf16", 3), (1, "fp32", 2),
                                                      (2, "fp32", 3), (2, "bf16", 1), (3, "fp32", 1)])
def test_resume_matches_deepspeeds_own_and_loads_on_one_rank(tmp_path: Path, stage: int, dtype: str,
                                                             then: int) -> None:
    run_ranks(save_and_resume, 2, str(tmp_path), stage, dtype)
    manager = CheckpointManager(tmp_path / "ours", read_only=True)
    assert manager.steps() == [3, 5] and manager.metadata(3).world_size == 2
    restored = manager.restore(3)
    expected = torch.load(tmp_path / "step3.pt", weights_only=True)
    assert torch.equal(restored.model["l1.weight"], expected["l1.weight"])
    assert sorted(restored.model) == sorted(Net().state_dict())
    # the delta: what the engine loaded is the step as restored, its weights within the
    # balanced preset's bound (12% of a tensor's root mean square) and not exact
    restored, saved = manager.restore(5), torch.load(tmp_path / "step5.pt", weights_only=True)
    state = restored.optimizer["state"]
    for name, value in saved["loaded"].items():
        fqn, _, key = name.partition(".exp_")
        expected = restored.model[name] if not key else state[fqn]["exp_" + key]
        assert torch.equal(value, expected), name
    errors = [((saved["loaded"][n] - v).norm() / v.norm()).item() for n, v in saved["true"].items()
              if ".exp_" not in n]
    assert 0 < max(errors) < 0.12, errors
    run_ranks(load_on_one_rank, 1, str(tmp_path), then, dtype)


def refused(rank: int, world: int, root: str) -> None:
    rank_env(rank, world)
    from deltackpt.deepspeed import install

    engine = engine_of(2, "fp32", seed=0)
    install(engine)
    assert engine.load_checkpoint(root) == (None, None)  # no latest: a fresh start, as DeepSpeed
    with pytest.raises(NotACheckpointError, match=r"has no deltackpt\.json"):
        engine.load_checkpoint(root, tag="global_step1")
    train(engine, torch.Generator().manual_seed(0), 1)
    engine.save_checkpoint(root)
    with pytest.raises(IntegrationError, match=r"already holds step 1: save_checkpoint saves the "
                                               r"step engine\.global_steps"):
        engine.save_checkpoint(root, tag="final")
    assert (Path(root) / "latest").read_text() == "global_step1"
    with pytest.raises(IntegrationError, match="holds no step saved with the tag 'nope'"):
        engine.load_checkpoint(root, tag="nope")
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():  # else DeepSpeed refuses fp16 on this CPU itself
        fp16 = engine_of(2, "fp16", seed=0)
        with pytest.raises(IntegrationError, match="fp16 training"):
            install(fp16)


def another_run(rank: int, world: int, root: str) -> None:
    rank_env(rank, world)
    from deltackpt.deepspeed import install

    other = engine_of(2, "fp32", seed=1)
    install(other)
    with pytest.raises(OtherRunError, match="already holds step 1 of another run"):
        other.save_checkpoint(root)
    assert CheckpointManager(root, read_only=True).steps() == [1]
    data = torch.Generator().manual_seed(0)
    train(other, data, 1)
    install(other, continue_run=True, depth=1).engine.global_steps = 4
    other.save_checkpoint(root)  # a delta on step 1
    train(other, data, 1)
    other.save_checkpoint(root)
    assert CheckpointManager(root, read_only=True).steps() == [1, 4, 5]
    assert chain_depths(root) == {1: 0, 4: 1, 5: 1}  # depth 8: step 5 on step 4


def test_bad_input_is_refused_by_name_and_no_latest_is_a_fresh_start(tmp_path: Path) -> None:
    run_ranks(refused, 1, str(tmp_path))
    run_ranks(another_run, 1, str(tmp_path))  # another process: another run


def async_saves(rank: int, world: int, root: str) -> None:
    """``blocking=False``: the save returns a handle; the next step waits for it and DeepSpeed
    then names it in ``latest``."""
    rank_env(rank, world)
    from deltackpt.deepspeed import install
    from deltackpt.save.queue import SaveHandle

    engine = engine_of(2, "fp32", seed=0)
    ckpt = install(engine, blocking=False, full_every=3)
    data = torch.Generator().manual_seed(rank)
    train(engine, data, 1)
    engine.save_checkpoint(root)
    assert isinstance(ckpt.info, SaveHandle) and not (Path(root) / "latest").exists()
    train(engine, data, 1)
    assert ckpt.info.kind == "full" and (Path(root) / "latest").read_text() == "global_step1"
    engine.save_checkpoint(root)
    saved = full_state(engine)
    engine.destroy()  # waits for the save in flight
    assert ckpt.info.kind == "delta"
    resumed = engine_of(2, "fp32", seed=5)
    install(resumed)
    assert resumed.load_checkpoint(root, tag="global_step2")[0] is not None
    loaded = full_state(resumed)
    assert max(((loaded[n] - v).norm() / v.norm()).item() for n, v in saved.items()
               if ".exp_" not in n) < 0.12


def test_asynchronous_saves_are_named_latest_once_written(tmp_path: Path) -> None:
    run_ranks(async_saves, 2, str(tmp_path))
    assert CheckpointManager(tmp_path, read_only=True).steps() == [1, 2]


def _example(rank: int, world: int, root: str) -> None:
    rank_env(rank, world)
    engine_of(0, "fp32", 0)  # DeepSpeed's CPU set-up, as the manual's example needs it
    os.chdir(root)
    for code in manual_examples("deepspeed.md"):
        exec(compile(code, "docs/deepspeed.md", "exec"), {"__name__": "__main__"})


def test_docs_example(tmp_path: Path) -> None:
    run_ranks(_example, 2, str(tmp_path))
    manager = CheckpointManager(tmp_path / "runs" / "ds", read_only=True)
    assert manager.steps() == [10, 20, 30] and manager.metadata(30).world_size == 2


class Odd(nn.Module):
    """Parameters a row split between 2 ranks leaves one rank without: single rows, partitioned
    elsewhere under ZeRO (DeepSpeed broadcasts no 0-dim parameter); and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor([0.5]))
        self.row = nn.Parameter(torch.randn(1, 7))
        self.proj = nn.Linear(7, 3)
        self.tied = nn.Linear(7, 3, bias=False)
        self.tied.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.row) * self.scale + self.tied(x)


def odd_shapes(rank: int, world: int, root: str, stage: int) -> None:
    rank_env(rank, world)
    import deepspeed.comm.torch

    from deltackpt.deepspeed import install

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    def build() -> Any:
        model = Odd()
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}}
        return deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]

    engine = build()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 7, generator=generator)).square().mean())
        engine.step()
    install(engine)
    engine.save_checkpoint(root)
    saved = full_state(engine)
    if rank == 0:
        torch.save(saved, Path(root) / "saved.pt")
    if world == 1:
        return
    resumed = build()
    install(resumed)
    resumed.load_checkpoint(root)
    loaded = full_state(resumed)
    assert all(torch.equal(loaded[n], v) for n, v in saved.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_parameters_of_fewer_rows_than_ranks(tmp_path: Path, stage: int) -> None:
    run_ranks(odd_shapes, 2, str(tmp_path), stage)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    restored = CheckpointManager(tmp_path, read_only=True).restore(2)
    for name in ("scale", "row", "proj.weight", "proj.bias"):
        assert torch.equal(restored.model[name], saved[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(restored.optimizer["state"][name][key], saved[f"{name}.{key}"])
    plain = Odd()  # the tied weight under both its names: a plain model loads the step strictly
    optimizer = torch.optim.AdamW(plain.parameters())
    CheckpointManager(tmp_path, read_only=True).load(2, plain, optimizer)
    assert torch.equal(plain.tied.weight, saved["proj.weight"]) and plain.tied.weight is plain.proj.weight
