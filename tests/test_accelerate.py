"""Accelerate's save_state/load_state through deltackpt (deltackpt.accelerate.Checkpointer),
against the real accelerate on the CPU: a run resumed from a full step is bit for bit the run
resumed by accelerate's own save_state/load_state of the same point (and the run never
interrupted, at an epoch's end), with two models and two optimizers, a scheduler, a registered
object, dropout and a shuffled dataloader; from a delta within the delta's error; the same on 2
gloo processes under DDP, each with its own RNG states; a directory of another run, a failed
write, an untested accelerate version and a step that does not fit are refused clearly."""

from __future__ import annotations

import copy
import errno
import importlib.metadata
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import START_METHOD, assert_same_value, free_port, manual_examples, step_dir
from torch import nn

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, DistributedType, ProjectConfiguration  # noqa: E402
from test_fs_faults import _Disk  # noqa: E402

from deltackpt import CheckpointManager, IntegrationError, OtherRunError, WriteFailedError  # noqa: E402
from deltackpt.accelerate import Checkpointer, SaveStateError  # noqa: E402

BATCHES = 4  # per epoch and process
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Counter:
    """An object registered for checkpointing: a count and a running tensor."""

    def __init__(self) -> None:
        self.count, self.total = 0, torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.total = state["count"], state["total"].clone()


@dataclass
class Run:
    accelerator: Accelerator
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    scheduler: Any
    loader: Any
    counter: Counter
    losses: list[float]


def _build(seed: int = 0, *, pair: bool = False, seedable: bool = False, world: int = 1,
           project: ProjectConfiguration | None = None) -> Run:
    """A fresh accelerator and training objects, initialised from ``seed``: a regressor with
    dropout (and, with ``pair``, a critic of its output with an optimizer of its own), AdamW,
    a scheduler, a shuffled dataloader of ``BATCHES`` batches per process and a Counter."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    loaders = DataLoaderConfiguration(use_seedable_sampler=seedable, data_seed=1 if seedable else None)
    accelerator = Accelerator(cpu=True, project_config=project, dataloader_config=loaders)
    torch.manual_seed(seed)
    models = [nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))]
    if pair:
        models.append(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=3, gamma=0.7)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES * world, 6,
                                                      generator=torch.Generator().manual_seed(1)),
                                          torch.randn(4 * BATCHES * world, 3,
                                                      generator=torch.Generator().manual_seed(2)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    *prepared, scheduler, loader = accelerator.prepare(*models, *optimizers, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return Run(accelerator, prepared[:len(models)], prepared[len(models):], scheduler, loader,
               counter, [])


def _train(run: Run, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer step per batch; the losses go to ``run.losses``."""
    for x, y in batches:
        out = run.models[0](x)
        loss = ((out - y) ** 2).mean()
        if len(run.models) > 1:
            loss = loss + run.models[1](out).pow(2).mean()
        run.accelerator.backward(loss)
        for optimizer in run.optimizers:
            optimizer.step()
            optimizer.zero_grad()
        run.scheduler.step()
        run.counter.count += 1
        run.counter.total += run.accelerator.reduce(loss.detach(), "mean")  # every process's
        run.losses.append(loss.item())


def _epochs(run: Run, start: int, stop: int, *, skip: int = 0) -> Iterator[int]:
    """Train epochs ``start`` to ``stop`` (skipping ``skip`` batches of the first, as a resumed
    run does), yielding after every step the number of steps since epoch 0 began. Each epoch
    sets the loader's epoch first, as accelerate's own resumed runs need."""
    for epoch in range(start, stop):
        run.loader.set_epoch(epoch)
        loader = run.accelerator.skip_first_batches(run.loader, skip) if skip else run.loader
        for i, batch in enumerate(loader, start=skip):
            _train(run, [batch])
            yield epoch * BATCHES + i + 1
        skip = 0


def _snapshot(run: Run) -> dict[str, Any]:
    """Everything a resumed run must match: weights, optimizer, scheduler, the registered
    object, the accelerator's counters and the next draw of each RNG (copies)."""
    return copy.deepcopy({"models": [run.accelerator.unwrap_model(m).state_dict() for m in run.models],
            "optimizers": [o.state_dict() for o in run.optimizers],
            "scheduler": run.scheduler.state_dict(), "counter": run.counter.state_dict(),
            "step": run.accelerator.step, "rng": torch.get_rng_state()})


def _assert_within_delta_error(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    """The weights of snapshot ``loaded`` are those of ``saved`` within the balanced preset's
    bound (12% of a tensor's root mean square), and not all exact."""
    errors = {name: ((loaded["models"][0][name] - value).norm() / value.norm()).item()
              for name, value in saved["models"][0].items()}
    assert max(errors.values()) < 0.12 and max(errors.values()) > 0, errors


def test_a_full_step_resumes_as_accelerates_own_save_state(tmp_path: Path) -> None:
    """Two models, two optimizers, a scheduler, a registered object, dropout, a shuffled
    dataloader: saved mid-epoch by accelerate and by a Checkpointer, both resumed runs end bit
    for bit alike; saved at an epoch's end, the resumed run is the run never interrupted."""
    run = _build(pair=True)
    ckpt = Checkpointer(run.accelerator, tmp_path / "ckpt", full_every=1)
    for done in _epochs(run, 0, 3):
        if done in (6, 8):
            run.accelerator.save_state(tmp_path / f"accelerate-{done}")
            info = ckpt.save_state(done)
            assert info.kind == "full" and info.step == done
            if done == 8:
                iteration, saved_iteration = run.loader.iteration, run.accelerator.save_iteration
    final = _snapshot(run)
    ckpt.close()
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [6, 8]

    # mid-epoch (step 6: 2 batches into epoch 1): the same run as accelerate's own resume
    ends = []
    for load in ("accelerate", "deltackpt"):
        resumed = _build(seed=7, pair=True)
        if load == "accelerate":
            resumed.accelerator.load_state(tmp_path / "accelerate-6")
        else:
            assert Checkpointer(resumed.accelerator, tmp_path / "ckpt").load_state(6) == 6
            assert resumed.loader.iteration == 1
        list(_epochs(resumed, 1, 3, skip=2))
        ends.append(_snapshot(resumed))
    assert_same_value(ends[1], ends[0])

    # at the end of epoch 1 (step 8): the run never interrupted
    resumed = _build(seed=9, pair=True)
    with Checkpointer(resumed.accelerator, tmp_path / "ckpt") as again:
        assert again.load_state() == 8
        assert resumed.loader.iteration == iteration
        assert resumed.accelerator.save_iteration == saved_iteration
        list(_epochs(resumed, 2, 3))
        assert_same_value(_snapshot(resumed), final)
        again.save_state(12)  # continues the run: no other run's steps
    restored = CheckpointManager(tmp_path / "ckpt", read_only=True).restore(12).model
    assert sorted({name.split(".")[0] for name in restored}) == ["model", "model_1"]


def test_a_delta_step_resumes_within_its_error(tmp_path: Path) -> None:
    """Asynchronous saves of every step of two epochs, full every 4: the last, a delta, resumes
    with the weights within the delta's error and everything else exact; the next epoch's
    losses are those of the run never interrupted within 5%, and the next save is a delta on
    the loaded step."""
    run = _build()
    with Checkpointer(run.accelerator, tmp_path / "ckpt", full_every=4, blocking=False) as ckpt:
        for done in _epochs(run, 0, 2):
            ckpt.save_state(done)
        ckpt.wait()
        assert [ckpt.manager.info(s).kind for s in ckpt.manager.steps()] == \
            ["full", "delta", "delta", "delta"] * 2
    saved = _snapshot(run)
    list(_epochs(run, 2, 3))

    resumed = _build(seed=3)
    with Checkpointer(resumed.accelerator, tmp_path / "ckpt") as ckpt:
        assert ckpt.load_state() == 8
        loaded = _snapshot(resumed)
        _assert_within_delta_error(loaded, saved)
        for key in ("scheduler", "counter", "step", "rng"):
            assert_same_value(loaded[key], saved[key], key)
        assert loaded["optimizers"][0]["param_groups"] == saved["optimizers"][0]["param_groups"]
        list(_epochs(resumed, 2, 3))
        # within 5%: a tiny model 8 steps into training, whose weights move most per step
        assert resumed.losses == pytest.approx(run.losses[-BATCHES:], rel=0.05)
        ckpt.save_state(20)
        assert ckpt.manager.info(20).kind == "delta" and ckpt.manager.info(20).base_step == 8


def _rank(rank: int, port: int, root: str) -> None:
    """One process of 2-process DDP runs on gloo, each process's dropout its own.

    With a seedable sampler, saved mid-epoch (step 6) by accelerate and by a Checkpointer: both
    resumed runs end alike. With the shuffle drawn from a generator the ranks share, saved at
    the end of epoch 0 (step 4, full) and at step 6 (a delta): the run resumed from step 4 ends
    as the run never interrupted (accelerate's own save_state keeps no state of that
    generator), and step 6 resumes within the delta's error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")

    def build(seed: int, seedable: bool) -> Run:
        run = _build(seed, seedable=seedable, world=2)
        assert run.accelerator.distributed_type == DistributedType.MULTI_CPU
        torch.manual_seed(100 + rank)  # each process's dropout differs
        return run

    for seedable, saves in ((True, (6,)), (False, (4, 6))):
        path = Path(root) / ("seedable" if seedable else "generator")
        run = build(0, seedable)
        with Checkpointer(run.accelerator, path, full_every=10) as ckpt:
            for done in _epochs(run, 0, 3):
                if done == saves[0]:
                    run.accelerator.save_state(path.with_suffix(".accelerate"))
                    assert ckpt.save_state(done).kind == "full"
                    rng = torch.get_rng_state()
                elif done in saves:
                    assert ckpt.save_state(done).kind == "delta"
                    at_delta = _snapshot(run)
        final = _snapshot(run)

        resumed = build(7, seedable)
        Checkpointer(resumed.accelerator, path).load_state(saves[0])
        assert torch.equal(torch.get_rng_state(), rng)  # this process's own
        list(_epochs(resumed, saves[0] // BATCHES, 3, skip=saves[0] % BATCHES))
        ours = _snapshot(resumed)
        if seedable:  # mid-epoch: a new iterator draws from the torch RNG (PyTorch's DataLoader)
            resumed = build(7, seedable)
            resumed.accelerator.load_state(path.with_suffix(".accelerate"))
            list(_epochs(resumed, 1, 3, skip=2))
            assert_same_value(ours, _snapshot(resumed))
        else:
            assert_same_value(ours, final)
            resumed = build(7, seedable)
            resumed.accelerator.load_state(path.with_suffix(".accelerate"))
            list(_epochs(resumed, 1, 3))
            theirs = _snapshot(resumed)["models"][0]["0.weight"]
            assert not torch.equal(theirs, final["models"][0]["0.weight"])
            resumed = build(8, seedable)
            assert Checkpointer(resumed.accelerator, path).load_state() == 6
            loaded = _snapshot(resumed)
            _assert_within_delta_error(loaded, at_delta)
            assert_same_value(loaded["rng"], at_delta["rng"])
    resumed.accelerator.end_training()


@pytest.mark.slow
def test_two_gloo_processes_resume_as_the_run_never_interrupted(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method=START_METHOD)
    ckpt = CheckpointManager(tmp_path / "generator", read_only=True)
    assert ckpt.steps() == [4, 6] and ckpt.metadata(4).world_size == 2
    processes = ckpt.restore(4).extra["accelerate"]["processes"]
    assert len(processes) == 2 and not torch.equal(processes[0]["rng"]["torch"],
                                                   processes[1]["rng"]["torch"])
    assert processes[0]["dataloaders"][0]["generator"] is not None


def test_another_runs_directory_is_refused_unless_continued_or_resumed(tmp_path: Path) -> None:
    run = _build()
    _train(run, [next(iter(run.loader))])
    with Checkpointer(run.accelerator, tmp_path / "ckpt") as ckpt:
        assert ckpt.save_state().step == 0  # save_iteration, which every save advances
        assert ckpt.save_state().step == 1
    other = _build(seed=1)
    with pytest.raises(OtherRunError, match="already holds 2 steps \\(0 to 1\\) of another run"):
        Checkpointer(other.accelerator, tmp_path / "ckpt").save_state(5)
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [0, 1]
    with Checkpointer(other.accelerator, tmp_path / "ckpt", continue_run=True) as ckpt:
        ckpt.save_state(5)
    with Checkpointer(other.accelerator, tmp_path / "ckpt") as ckpt:
        ckpt.load_state(1)
        assert other.accelerator.save_iteration == 2
        ckpt.save_state()
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [0, 1, 2, 5]


def test_total_limit_keeps_the_last_steps(tmp_path: Path) -> None:
    run = _build(project=ProjectConfiguration(total_limit=2))
    with Checkpointer(run.accelerator, tmp_path / "ckpt", full_every=2) as ckpt:
        for _ in range(4):
            ckpt.save_state()
        assert ckpt.manager.steps() == [2, 3]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_save_raises_a_runtime_error_and_leaves_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool) -> None:
    """A full disk: the RuntimeError accelerate's save_state raises for a failed write, with
    deltackpt's WriteFailedError chained; the directory as it was; a later save works."""
    run = _build()
    with Checkpointer(run.accelerator, tmp_path / "ckpt", full_every=1) as ckpt:
        ckpt.save_state(1)
        before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "ckpt").rglob("*"))
        _Disk(monkeypatch, ckpt.manager, 100)
        with pytest.raises(SaveStateError) as failure:
            ckpt.save_state(2, blocking=blocking)
            ckpt.wait()
        assert isinstance(failure.value, RuntimeError)
        cause = failure.value.__cause__
        cause = cause.__cause__ if not blocking else cause  # BackgroundSaveError's original
        assert isinstance(cause, WriteFailedError) and cause.errno == errno.ENOSPC
        assert re.search("save_state .*failed: .*No space left on device", str(failure.value))
        assert not step_dir(tmp_path / "ckpt", 2).exists()
        assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "ckpt").rglob("*")) == before
        monkeypatch.undo()
        ckpt.save_state(3)
        assert ckpt.manager.steps() == [1, 3]


def test_the_gradient_scaler_is_restored(tmp_path: Path) -> None:
    """A GradScaler (the accelerator's, for fp16 on a GPU; set here on the CPU) comes back, and
    a step saved with one does not load into an accelerator without one."""
    run = _build()
    run.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    scaler, optimizer = run.accelerator.scaler, run.optimizers[0].optimizer
    for x, y in run.loader:  # 4 steps
        scaler.scale(((run.models[0](x) - y) ** 2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    saved = run.accelerator.scaler.state_dict()
    with Checkpointer(run.accelerator, tmp_path / "ckpt") as ckpt:
        ckpt.save_state(1)
    resumed = _build(seed=2)
    resumed.accelerator.scaler = torch.amp.GradScaler("cpu")
    Checkpointer(resumed.accelerator, tmp_path / "ckpt").load_state()
    assert resumed.accelerator.scaler.state_dict() == saved
    assert saved["scale"] == 2048.0 and saved["_growth_tracker"] == 1  # grown after 3 steps, 1 since
    with pytest.raises(IntegrationError, match=r"holds 1 gradient scalers \(the accelerator "
                                               r"has 0\)"):
        Checkpointer(_build().accelerator, tmp_path / "ckpt").load_state()


def test_a_step_that_does_not_fit_is_refused_before_anything_loads(tmp_path: Path) -> None:
    run = _build()
    with Checkpointer(run.accelerator, tmp_path / "ckpt") as ckpt:
        ckpt.save_state(1)
    other = _build(seed=4)
    other.accelerator.register_for_checkpointing(Counter())
    weights = _snapshot(other)["models"]
    with pytest.raises(IntegrationError, match=r"step 1 of .* holds 1 registered objects \(the "
                                               r"accelerator has 2\).*nothing was loaded"):
        Checkpointer(other.accelerator, tmp_path / "ckpt").load_state()
    assert_same_value(_snapshot(other)["models"], weights)

    with CheckpointManager(tmp_path / "plain") as mgr:
        mgr.save(1, run.models[0], run.optimizers[0])
    with pytest.raises(IntegrationError, match=r"not saved by a deltackpt\.accelerate Checkpointer"):
        Checkpointer(run.accelerator, tmp_path / "plain").load_state()


def test_what_cannot_be_saved_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _build()
    run.counter.count = object()
    ckpt = Checkpointer(run.accelerator, tmp_path / "ckpt")
    with pytest.raises(IntegrationError, match=r"registered object 0 \(Counter\) cannot be saved: "
                                               r"state_dict\['count'\]: cannot store a object"):
        ckpt.save_state(1)
    run.counter.count = 0
    monkeypatch.setattr(run.accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    with pytest.raises(IntegrationError, match=r"not DEEPSPEED ones: use accelerator\.save_state"):
        ckpt.save_state(1)
    with pytest.raises(IntegrationError, match=r"needs an accelerate\.Accelerator, got str"):
        Checkpointer("accelerator", tmp_path / "ckpt")
    assert not CheckpointManager(tmp_path / "ckpt", read_only=True).steps()


def test_an_untested_accelerate_version_is_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = _build()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.34.2" if name == "accelerate" else real(name))
    with pytest.raises(IntegrationError, match=r"accelerate 0\.34\.2 is installed; deltackpt is "
                                               r"tested with accelerate 1\.15 up to \(not "
                                               r"including\) 2\.0"):
        Checkpointer(run.accelerator, tmp_path / "ckpt")


def test_the_manuals_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = manual_examples("accelerate.md", after="## Example")
    assert len(example) == 1
    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    exec(compile(example[0], "docs/accelerate.md", "exec"), {})
    ckpt = CheckpointManager(tmp_path / "runs" / "ckpt", read_only=True)
    assert ckpt.steps() == [28, 32, 36]
    assert ckpt.restore(36).extra["accelerate"]["iteration"] == 9  # saves 4, ..., 36
