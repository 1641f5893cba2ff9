"""The Hugging Face Trainer saving deltackpt steps (deltackpt.integrations.hf_trainer, issue 28 item
4): a tiny GPT-2 trained by the real Trainer on synthetic tokens, resumed from a full step exactly as
the Trainer's own resume of the same step continues (model, optimizer, scheduler, scaler, RNG,
TrainerState, the data skipped), from a delta within the preset's fidelity; ``save_total_limit``
keeps what the Trainer's rotation keeps; another run's directory, a failed save and an untested
transformers version are refused clearly. No download: the config is built here."""

from __future__ import annotations

import errno
import importlib
import importlib.metadata
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_same_value,
    assert_state_dicts_equal,
    files_under,
    manual_examples,
    step_dir,
    unclosed_managers,
)

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from deltackpt import (  # noqa: E402
    BackgroundSaveError,
    CheckpointManager,
    ConfigError,
    IntegrationError,
    OtherRunError,
    StepExistsError,
    StepNotFoundError,
    WriteFailedError,
)
from deltackpt.transformers import Trainer, export_hf  # noqa: E402

SAMPLES, BATCH = 24, 4  # 6 optimizer steps an epoch
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same every time (inputs are their own labels)."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 96, (SAMPLES, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _model() -> Any:
    """A 2-layer GPT-2 with dropout (so the RNG states matter), seeded."""
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0,
        eos_token_id=0))


def _args(out: Path, **overrides: Any) -> Any:
    settings = dict(output_dir=str(out), use_cpu=True, report_to=[], save_steps=2, max_steps=10,
                    per_device_train_batch_size=BATCH, learning_rate=1e-3, warmup_steps=2,
                    logging_steps=1, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **overrides})


def _trainer(cls: type, out: Path, *, scaler: bool = False, **kwargs: Any) -> Any:
    """A Trainer of ``cls``; ``scaler``: with a gradient scaler, which accelerate makes for fp16
    on GPUs only (a CPU one here: its state changes every few steps)."""
    extra = {k: kwargs.pop(k) for k in ("checkpoint", "continue_run") if k in kwargs}
    trainer = cls(_model(), _args(out, **kwargs), train_dataset=Tokens(), eval_dataset=Tokens(),
                  **extra)
    if scaler:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20,
                                                          growth_interval=3)
    return trainer


def _assert_same_run(ours: Any, theirs: Any) -> None:
    """The two trainers ended in the very same state: weights, optimizer, scheduler, scaler,
    the TrainerState's step and losses."""
    assert_state_dicts_equal(ours.model.state_dict(), theirs.model.state_dict(), "model")
    assert_same_value(ours.optimizer.state_dict(), theirs.optimizer.state_dict(), "optimizer")
    assert_same_value(ours.lr_scheduler.state_dict(), theirs.lr_scheduler.state_dict(), "scheduler")
    if theirs.accelerator.scaler is not None:
        assert ours.accelerator.scaler.state_dict() == theirs.accelerator.scaler.state_dict()
    assert ours.state.global_step == theirs.state.global_step
    assert [h.get("loss") for h in ours.state.log_history] == \
        [h.get("loss") for h in theirs.state.log_history]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 10 steps (1.7 epochs, with a gradient scaler) saved every 2 by the Trainer
    (``hf/checkpoint-N``) and by deltackpt's (``ours/ckpt``, full every 2 saves: steps 2, 6, 10
    full, 4 and 8 deltas); each ran to the same weights."""
    root = tmp_path_factory.mktemp("runs")
    theirs = _trainer(transformers.Trainer, root / "hf", scaler=True)
    theirs.train()
    ours = _trainer(Trainer, root / "ours", scaler=True,
                    checkpoint=CheckpointManager(root / "ours" / "ckpt", full_every=2))
    ours.train()
    _assert_same_run(ours, theirs)  # saving changed nothing in the run
    return root


@pytest.mark.parametrize("step", [2, 6])  # mid-epoch (batches skipped), at an epoch's end
def test_a_resume_from_a_full_step_continues_as_the_trainers_own(runs: Path, tmp_path: Path,
                                                                  step: int) -> None:
    reader = CheckpointManager(runs / "ours" / "ckpt", read_only=True)
    assert [reader.info(s).kind for s in reader.steps()] == ["full", "delta"] * 2 + ["full"]
    theirs = _trainer(transformers.Trainer, tmp_path / "hf", scaler=True)
    theirs.train(resume_from_checkpoint=str(runs / "hf" / f"checkpoint-{step}"))
    ours = _trainer(Trainer, tmp_path / "ours", scaler=True)
    with unclosed_managers() as unclosed:
        ours.train(resume_from_checkpoint=str(step_dir(runs / "ours" / "ckpt", step)))
        assert unclosed() == []  # the reader of the other directory too
    _assert_same_run(ours, theirs)
    # a run in another directory: its own chain, from a full step
    saved = ours.checkpoint_manager
    assert saved.path == str(tmp_path / "ours" / "deltackpt")
    assert saved.steps() == list(range(step + 2, 11, 2)) and saved.info(step + 2).kind == "full"


def test_a_resume_from_a_delta_is_within_the_presets_fidelity(runs: Path, tmp_path: Path) -> None:
    """Step 4 is a delta (``balanced``): its weights are within 12% of each tensor's root mean
    square of the Trainer's own checkpoint (the preset's relative bound), everything else the
    Trainer saved is exact, and the run resumed from it ends within 1% of the loss of the run
    resumed from the Trainer's checkpoint (docs/fidelity.md: at most 0.98% over 41 runs)."""
    restored = CheckpointManager(runs / "ours" / "ckpt", read_only=True).restore(4)
    assert restored.metadata.kind == "delta"
    exact = load_file(runs / "hf" / "checkpoint-4" / "model.safetensors")
    for name, tensor in exact.items():
        error = (restored.model[name] - tensor).pow(2).mean().sqrt()
        assert error <= 0.12 * tensor.pow(2).mean().sqrt(), name
    assert restored.extra["scheduler"] == torch.load(runs / "hf" / "checkpoint-4" / "scheduler.pt")
    theirs = _trainer(transformers.Trainer, tmp_path / "hf", scaler=True)
    theirs.train(resume_from_checkpoint=str(runs / "hf" / "checkpoint-4"))
    ours = _trainer(Trainer, tmp_path / "ours", scaler=True)
    ours.train(resume_from_checkpoint=str(step_dir(runs / "ours" / "ckpt", 4)))
    assert ours.state.global_step == theirs.state.global_step == 10
    assert ours.accelerator.scaler.state_dict() == theirs.accelerator.scaler.state_dict()
    assert_same_value(ours.lr_scheduler.state_dict(), theirs.lr_scheduler.state_dict())
    ours_loss, their_loss = ours.state.log_history[-2]["loss"], theirs.state.log_history[-2]["loss"]
    assert ours_loss != their_loss and math.isclose(ours_loss, their_loss, rel_tol=0.01)


def test_resume_true_takes_the_latest_step_and_continues_its_chain(tmp_path: Path) -> None:
    """``resume_from_checkpoint=True`` (or the directory, or a step number) resumes from the
    latest step of the Trainer's directory: the run is continued, not another one, and its next
    saves are deltas on that step (asynchronous saves here, committed when train returns)."""
    manager = CheckpointManager(tmp_path / "ckpt", blocking=False)
    first = _trainer(Trainer, tmp_path, max_steps=4, checkpoint=manager)
    first.train()
    assert manager.steps() == [2, 4]
    with pytest.raises(StepNotFoundError, match=r"has no committed steps .* no checkpoint-N folder"):
        _trainer(Trainer, tmp_path / "empty").train(resume_from_checkpoint=True)
    for resume, steps in ((True, 6), (str(tmp_path / "ckpt"), 8), (8, 10)):
        again = _trainer(Trainer, tmp_path, max_steps=steps, checkpoint=manager)
        again.train(resume_from_checkpoint=resume)
        assert again.state.global_step == steps
        assert manager.info(steps).kind == "delta" and manager.info(steps).base_step == steps - 2
    assert manager.steps() == [2, 4, 6, 8, 10]
    assert manager.restore(10).extra["trainer_state"]["global_step"] == 10


def test_save_total_limit_keeps_what_the_trainers_rotation_keeps(tmp_path: Path) -> None:
    """With ``save_total_limit=2`` and the best model kept (the first evaluation's, as
    ``greater_is_better`` asks for the highest loss): the Trainer keeps checkpoint-2 and
    checkpoint-10; so does deltackpt's, whose kept steps restore (step 10 was a delta on a
    deleted step) and whose best step is loaded at the end."""
    settings = dict(save_total_limit=2, eval_strategy="steps", eval_steps=2,
                    load_best_model_at_end=True, metric_for_best_model="loss",
                    greater_is_better=True)
    theirs = _trainer(transformers.Trainer, tmp_path / "hf", **settings)
    theirs.train()
    assert sorted(p.name for p in (tmp_path / "hf").glob("checkpoint-*")) == \
        ["checkpoint-10", "checkpoint-2"]
    ours = _trainer(Trainer, tmp_path / "ours", **settings)
    ours.train()
    manager = ours.checkpoint_manager
    assert manager.steps() == [2, 10]
    assert ours.state.best_global_step == theirs.state.best_global_step == 2
    assert ours.state.best_model_checkpoint == str(step_dir(manager.path, 2))
    assert all(problems == [] for problems in manager.verify(deep=True).values())
    assert_state_dicts_equal(ours.model.state_dict(), theirs.model.state_dict(), "best model")
    assert_state_dicts_equal(manager.restore(2).model, ours.model.state_dict(), "step 2")


def test_another_runs_directory_is_refused_unless_continued(tmp_path: Path) -> None:
    _trainer(Trainer, tmp_path, max_steps=2).train()
    before = files_under(tmp_path / "deltackpt")
    other = _trainer(Trainer, tmp_path, max_steps=2)
    with pytest.raises(OtherRunError, match=r"holds step 2 of another run: resume from"):
        other.train()
    assert other.state.global_step == 0 and files_under(tmp_path / "deltackpt") == before
    _trainer(Trainer, tmp_path, max_steps=4, save_steps=3, continue_run=True).train()  # 3, and 4 at the end
    assert CheckpointManager(tmp_path / "deltackpt", read_only=True).steps() == [2, 3, 4]
    # a step with later steps after it: the resumed run's saves would collide with them
    with pytest.raises(StepExistsError, match=r"holds 2 steps \(3 to 4\) after step 2, which the resumed"):
        _trainer(Trainer, tmp_path).train(resume_from_checkpoint=2)
    with pytest.raises(StepNotFoundError, match=r"step 5 not found in .*; available steps: 2, 3, 4"):
        _trainer(Trainer, tmp_path).train(resume_from_checkpoint=5)
    with CheckpointManager(tmp_path / "plain") as plain:
        plain.save(1, _model())
    with pytest.raises(IntegrationError, match=r"step 1 of .*plain was not saved by deltackpt's "
                                               r"Trainer"):
        _trainer(Trainer, tmp_path / "elsewhere").train(resume_from_checkpoint=str(tmp_path / "plain"))


def test_settings_that_cannot_be_used_are_refused_naming_them(tmp_path: Path) -> None:
    CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"ckpt was opened read_only; the Trainer saves into it"):
        _trainer(Trainer, tmp_path, checkpoint=CheckpointManager(tmp_path / "ckpt", read_only=True))
    with pytest.raises(ConfigError, match=r"save_total_limit=2 and the manager's keep='last=3' both"):
        _trainer(Trainer, tmp_path, save_total_limit=2,
                 checkpoint=CheckpointManager(tmp_path / "ckpt", keep="last=3"))
    with pytest.raises(ConfigError, match=r"checkpoint must be a path, a URL or a CheckpointManager"):
        _trainer(Trainer, tmp_path, checkpoint=3)
    with pytest.raises(ConfigError, match=r"continue_run must be True or False, got 'yes'"):
        _trainer(Trainer, tmp_path, continue_run="yes")
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint must be True, a step, a path"):
        _trainer(Trainer, tmp_path).train(resume_from_checkpoint=2.5)


def test_a_run_checkpointed_by_the_trainer_resumes_from_its_folder(tmp_path: Path) -> None:
    """``resume_from_checkpoint=True`` finds the Trainer's own latest checkpoint-N where the
    deltackpt directory has no later step; the Trainer loads it and deltackpt saves from there."""
    _trainer(transformers.Trainer, tmp_path, max_steps=4).train()
    theirs = _trainer(transformers.Trainer, tmp_path / "hf", max_steps=6)
    theirs.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    ours = _trainer(Trainer, tmp_path, max_steps=6)
    ours.train(resume_from_checkpoint=True)
    assert_state_dicts_equal(ours.model.state_dict(), theirs.model.state_dict(), "model")
    assert ours.checkpoint_manager.steps() == [6]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_save_raises_an_os_error_and_leaves_no_step(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              blocking: bool) -> None:
    """A disk that fills at the second save: ``train`` raises the ``OSError`` a failed write of
    the Trainer's own checkpoint raises, with errno ENOSPC and deltackpt's error chained (an
    asynchronous save's at the next save); step 4 left nothing behind, and the run resumes from
    step 2."""
    manager = CheckpointManager(tmp_path / "ckpt", blocking=blocking)
    storage, create = manager.storage, manager.storage.create

    class Full:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

    trainer = _trainer(Trainer, tmp_path, checkpoint=manager)
    original, before = trainer._save_checkpoint, set()

    def save(model: Any, trial: Any) -> None:
        if trainer.state.global_step == 4:  # the disk is full from now on (step 2 committed)
            manager.wait()
            before.update(files_under(tmp_path / "ckpt"))
            monkeypatch.setattr(storage, "create", lambda rel: Full(create(rel)))
        original(model, trial)

    monkeypatch.setattr(trainer, "_save_checkpoint", save)
    with pytest.raises(OSError) as failure:
        trainer.train()
    raised_at = 4 if blocking else 6
    assert type(failure.value) is OSError and failure.value.errno == errno.ENOSPC
    cause = failure.value.__cause__
    assert isinstance(cause if blocking else cause.__cause__, WriteFailedError)
    assert isinstance(cause, WriteFailedError if blocking else BackgroundSaveError)
    assert re.match(rf"saving the checkpoint of global step {raised_at} to "
                    rf"{re.escape(manager.path)} failed: .*writing step 4 failed: .*No space left "
                    r"on device", failure.value.strerror)
    assert trainer.state.global_step == raised_at
    assert files_under(tmp_path / "ckpt") == before
    monkeypatch.undo()
    assert manager.steps() == [2]
    resumed = _trainer(Trainer, tmp_path, max_steps=4, checkpoint=manager)
    resumed.train(resume_from_checkpoint=True)
    assert manager.steps() == [2, 4] and manager.info(4).base_step == 2


def test_the_facade_reexports_the_export_and_an_untested_version_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import deltackpt.transformers as facade

    assert facade.export_hf is export_hf and issubclass(facade.Trainer, transformers.Trainer)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "6.1.0" if name == "transformers" else real(name))
    monkeypatch.delitem(sys.modules, "deltackpt.integrations.hf_trainer")
    with pytest.raises(IntegrationError, match=r"transformers 6\.1\.0 is installed; deltackpt is "
                                               r"tested with transformers 5\.17 up to"):
        importlib.import_module("deltackpt.integrations.hf_trainer")


@pytest.mark.slow
def test_ddp_saves_every_ranks_rng_and_resumes_exactly(tmp_path: Path) -> None:
    """Two CPU ranks (gloo): every rank saves, each rank's RNG states are kept, and a run resumed
    from a full step ends with the weights of the run that went through (the Trainer's own
    resume fails under DDP on CPUs: it maps its files to the device "cpu:0")."""
    script = Path(__file__).parent / "hf_trainer_ranks.py"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(script), str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed as went through" in result.stdout


def test_the_manuals_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = manual_examples("transformers-trainer.md")
    assert len(example) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(example[0], "docs/transformers-trainer.md", "exec"), {})
    assert CheckpointManager(tmp_path / "runs" / "tiny-gpt2" / "deltackpt",
                             read_only=True).steps() == [60, 80]
    assert (tmp_path / "runs" / "tiny-gpt2-hf" / "model.safetensors").is_file()
