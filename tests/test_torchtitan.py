"""torchtitan's own CheckpointManager, configured as deltackpt.torchtitan.CheckpointManager, driven
on 2 gloo ranks with an FSDP2 model and torchtitan's optimizer and LR scheduler containers:
saves (blocking and async) become full and delta steps, keep_latest_k is retention that keeps
what deltas need, and a restarted job loads the latest step and continues its chain; and the
same on a single rank, whose FSDP2 DTensors hold whole tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

from helpers import chain_depths, run_ranks

from deltackpt import CheckpointManager, ConfigError
from deltackpt.app.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Counter:
    """A Stateful of the job (torchtitan's ``states``), as its train state is."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": torch.tensor(self.step * 64)}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _job(folder: str, **options):
    """An FSDP2 model with torchtitan's containers and a deltackpt CheckpointManager."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    import deltackpt.torchtitan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 3e-3})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                    training_steps=20)
    counter = Counter()
    config = deltackpt.torchtitan.CheckpointManager.Config(
        enable=True, folder=folder, interval=1, keep_latest_k=3, full_every=3, **options)
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"counter": counter},
                                sd_adapter=None)
    return model, optimizers, schedulers, counter, checkpointer


def _train_step(model, optimizers, schedulers, counter, rank: int) -> None:
    generator = torch.Generator().manual_seed(counter.step * 10 + rank)
    x = torch.randn(8, 16, generator=generator)
    optimizers.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :8].flip(1)).backward()
    optimizers.step()
    schedulers.step()
    counter.step += 1


def _first_run(rank: int, world: int, folder: str, saves: int, options: dict) -> None:
    model, optimizers, schedulers, counter, checkpointer = _job(folder, **options)
    for _ in range(saves):
        _train_step(model, optimizers, schedulers, counter, rank)
        checkpointer.save(counter.step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()


def _restarted(rank: int, world: int, folder: str, async_mode: str) -> None:
    model, optimizers, schedulers, counter, checkpointer = _job(folder, async_mode=async_mode)
    assert checkpointer.load()  # the latest step: 5
    assert counter.step == 5 and schedulers.schedulers[0].last_epoch == 5
    restored = CheckpointManager(folder).restore(5)
    for fqn, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), restored.model[fqn]), fqn
    _train_step(model, optimizers, schedulers, counter, rank)
    checkpointer.save(counter.step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_torchtitan_saves_deltas_keeps_their_chain_and_resumes(tmp_path: Path,
                                                               async_mode: str) -> None:
    folder = str(tmp_path / "checkpoint")
    run_ranks(_first_run, 2, folder, 5, {"async_mode": async_mode})
    # Saves 1 to 5: full, delta, delta, full, delta. keep_latest_k=3 keeps steps 3 to 5; the
    # retention re-codes step 3 as a full step when it deletes step 2, its base.
    manager = CheckpointManager(folder)
    assert manager.steps() == [3, 4, 5]
    assert [manager.info(s).kind for s in (3, 4, 5)] == ["full", "full", "delta"]
    assert main(["verify", folder]) == 0
    run_ranks(_restarted, 2, folder, async_mode)
    info = CheckpointManager(folder).info(6)
    assert (info.kind, info.base_step) == ("delta", 5)  # the restarted job continued the chain
    assert main(["verify", folder]) == 0


def _restarted_on_one_rank(rank: int, world: int, folder: str) -> None:
    model, optimizers, schedulers, counter, checkpointer = _job(folder)
    for step, asked in ((4, 4), (5, -1)):  # a full step, then the latest: a delta on it
        assert checkpointer.load(asked) and counter.step == step
        restored = CheckpointManager(folder).restore(step)
        for fqn, value in model.state_dict().items():
            assert torch.equal(value.full_tensor(), restored.model[fqn]), (step, fqn)
        moments = optimizers.state_dict()  # flattened: state.<fqn>.<key>
        for fqn, state in restored.optimizer["state"].items():
            assert torch.equal(moments[f"state.{fqn}.exp_avg"].full_tensor(), state["exp_avg"]), \
                (step, fqn)
    _train_step(model, optimizers, schedulers, counter, rank)
    checkpointer.save(counter.step)
    checkpointer.close()


def test_fsdp2_on_one_rank_saves_deltas_and_resumes(tmp_path: Path) -> None:
    """torchtitan on one GPU: FSDP2's DTensors on a mesh of one rank hold whole tensors."""
    folder = str(tmp_path / "checkpoint")
    run_ranks(_first_run, 1, folder, 5, {})
    manager = CheckpointManager(folder)
    assert manager.steps() == [3, 4, 5]
    assert [manager.info(s).kind for s in (3, 4, 5)] == ["full", "full", "delta"]
    assert manager.metadata(5).world_size == 1
    run_ranks(_restarted_on_one_rank, 1, folder)
    info = CheckpointManager(folder).info(6)
    assert (info.kind, info.base_step) == ("delta", 5)
    assert main(["verify", folder]) == 0


def test_depth_bounds_every_steps_chain(tmp_path: Path) -> None:
    folder = str(tmp_path / "checkpoint")
    run_ranks(_first_run, 2, folder, 3, {"depth": 1})
    assert chain_depths(folder) == {1: 0, 2: 1, 3: 1}  # depth 8: step 3 on step 2


def test_options_deltackpt_cannot_serve_are_refused() -> None:
    import deltackpt.torchtitan

    config = deltackpt.torchtitan.CheckpointManager.Config
    with pytest.raises(ConfigError, match="deltackpt export"):
        config(enable=True, last_save_model_only=True, last_save_in_hf=True)
    with pytest.raises(ConfigError, match="'async'"):
        config(enable=True, async_mode="async_with_pinned_mem")
    with pytest.raises(ConfigError, match="full_every"):
        config(enable=True, full_every=0)
    for bad in (0, True):
        with pytest.raises(ConfigError, match="depth"):
            config(enable=True, depth=bad)


class _Opaque:
    """An object of the job's own class: no weights-only load makes it back."""


class Unsafe(Counter):
    def state_dict(self) -> dict:
        return {**super().state_dict(), "opaque": _Opaque()}


def _failing_save(rank: int, world: int, folder: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from deltackpt import IntegrationError

    model, optimizers, schedulers, counter, checkpointer = _job(folder)
    checkpointer.states["counter"] = Unsafe()
    _train_step(model, optimizers, schedulers, counter, rank)
    with pytest.raises(CheckpointException) as failed:
        checkpointer.save(1)
    assert isinstance(failed.value.failures[0][0], IntegrationError)
    assert "counter.opaque" in str(failed.value)
    checkpointer.close()


def test_a_failed_save_raises_dcps_exception_and_leaves_no_step(tmp_path: Path) -> None:
    folder = str(tmp_path / "checkpoint")
    run_ranks(_failing_save, 1, folder)
    assert CheckpointManager(folder).steps() == []
    assert [p.name for p in Path(folder).iterdir() if p.name.startswith("step")] == []


def test_a_torchtitan_outside_the_tested_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import importlib.metadata
    import sys

    from deltackpt import IntegrationError

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.5.0" if name == "torchtitan" else real(name))
    monkeypatch.delitem(sys.modules, "deltackpt.integrations.torchtitan", raising=False)
    with pytest.raises(IntegrationError, match=r"torchtitan 0\.5\.0 is installed.*0\.3 up to"):
        importlib.import_module("deltackpt.integrations.torchtitan")
