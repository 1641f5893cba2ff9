"""Lightning's checkpoints through deltackpt.lightning.CheckpointIO, driven by the real Trainer and
ModelCheckpoint on tiny models and synthetic data: a full step loads back exactly what Lightning
handed over (model, optimizers by meaning, schedulers, loops, callbacks); top-k rotation never
breaks a kept checkpoint; resuming continues as from Lightning's own checkpoint (exactly from a
full step, within the preset's fidelity from a delta), under DDP on 2 CPU processes too; another
run's directory, an ambiguous optimizer, an untested Lightning and a failed save are refused
clearly, leaving nothing behind."""

from __future__ import annotations

import copy
import errno
import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")

from helpers import assert_same_value, chain_depths, manual_examples  # noqa: E402
from lightning_ddp import Regression, data  # noqa: E402

import deltackpt.lightning  # noqa: E402
from deltackpt import (  # noqa: E402
    CheckpointManager,
    ConfigError,
    IntegrationError,
    OtherRunError,
    WriteFailedError,
)
from deltackpt.app.cli import main  # noqa: E402
from deltackpt.app.demo import DELTA_TOLERANCE  # noqa: E402
from deltackpt.lightning import CheckpointIO, CheckpointSaveError  # noqa: E402

ModelCheckpoint = L.pytorch.callbacks.ModelCheckpoint


class Recording(CheckpointIO):
    """The plugin, keeping a copy of every checkpoint Lightning hands it, by path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.handed[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two optimizers of different classes over disjoint parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.head(self.encoder(x)), y))
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.encoder.parameters(), lr=1e-2),
                torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, index: int) -> None:
        self.losses.append(float(outputs["loss"]))


def trainer(plugin: Any, steps: int, *callbacks: L.Callback, **kwargs: Any) -> L.Trainer:
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1,
                     plugins=[plugin] if plugin is not None else None, callbacks=list(callbacks),
                     enable_checkpointing=checkpointing, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def fit(module: L.LightningModule, plugin: Any, steps: int, *callbacks: L.Callback,
        ckpt_path: str | None = None, **kwargs: Any) -> L.Trainer:
    """Train ``module`` (built after ``torch.manual_seed(0)``) on :func:`data`."""
    t = trainer(plugin, steps, *callbacks, **kwargs)
    t.fit(module, data(), ckpt_path=ckpt_path)
    return t


def seeded(build: Any, *args: Any, **kwargs: Any) -> L.LightningModule:
    torch.manual_seed(0)
    return build(*args, **kwargs)


def saver(path: Path, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=path, every_n_train_steps=kwargs.pop("every", 4),
                           save_top_k=kwargs.pop("save_top_k", -1), **kwargs)


def files(path: Path) -> list[Path]:
    return sorted(path.glob("*.ckpt"))


def chain_closure(mgr: CheckpointManager, steps: set[int]) -> set[int]:
    """``steps`` and every step their chains need."""
    needed = set()
    for step in steps:
        meta = mgr.metadata(step)
        needed.add(step)
        while meta.kind == "delta":
            needed.add(meta.base_step)
            meta = mgr.metadata(meta.base_step)
    return needed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["groups", "named", "two"])
def test_a_full_step_loads_back_what_lightning_handed_over(tmp_path: Path, kind: str) -> None:
    """Two param groups (named after the module from an optimizer that lists its parameters by
    index, out of the module's order), the names torch records, two optimizers of two classes;
    each with a scheduler or manual steps, ModelCheckpoint's callback state and the loops."""
    plugin = Recording(tmp_path / "ckpt", full_every=1)
    module = seeded(TwoOptimizers) if kind == "two" else seeded(Regression, named=kind == "named")
    fit(module, plugin, 8, saver(tmp_path / "files", save_last=True))
    present = {os.fspath(p) for p in files(tmp_path / "files")}
    assert len(present) == 3 and set(plugin.handed) == present  # steps 4 and 8, and last
    reader = CheckpointIO(tmp_path / "ckpt")
    for path, handed in plugin.handed.items():
        assert_same_value(reader.load_checkpoint(path), handed, path)
    mgr = CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert mgr.steps() == [4, 8]
    meta = mgr.metadata(mgr.steps()[-1])
    moments = {(r.fqn, r.state_key) for r in meta.tensors if r.role == "optimizer"}
    first = "encoder.0.weight" if kind == "two" else "net.0.weight"
    assert {(first, "exp_avg"), (first, "exp_avg_sq")} <= moments
    if kind == "two":
        assert ("head.weight", "momentum_buffer") in moments
        assert mgr.restore(8).optimizer["class"] == "Adam+SGD"
    else:
        assert mgr.restore(8).optimizer["class"] == "AdamW"  # the scheduler's initial_lr aside


@pytest.mark.slow
def test_rotation_never_breaks_a_kept_checkpoint(tmp_path: Path) -> None:
    """Top-2 by loss and last, every 2 steps, a full step every 3 saves: before every step each
    file Lightning keeps loads, the directory verifies, and it holds no step but those the files
    name and the steps their chains need."""
    ckpt, kept = tmp_path / "ckpt", tmp_path / "files"
    plugin = CheckpointIO(ckpt, full_every=3, reader_grace=0)
    seen: set[int] = set()

    def check() -> None:
        mgr = CheckpointManager(ckpt, read_only=True)
        named = set()
        for path in files(kept):
            loaded = CheckpointIO(ckpt).load_checkpoint(path)
            named.add(loaded["global_step"])
        assert all(problems == [] for problems in mgr.verify().values())
        assert set(mgr.steps()) == chain_closure(mgr, named)
        seen.update(mgr.steps())

    class Check(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if ckpt.exists():
                check()

    fit(seeded(Regression), plugin, 30,
        saver(kept, every=2, save_top_k=2, monitor="loss", save_last=True), Check())
    check()
    mgr = CheckpointManager(ckpt, read_only=True)
    assert seen - set(mgr.steps())  # rotation deleted steps
    assert any(mgr.info(s).kind == "delta" for s in mgr.steps())
    assert len(files(kept)) == 3 and main(["verify", str(ckpt)]) == 0


@pytest.mark.slow
def test_resume_continues_as_from_lightnings_own_checkpoint(tmp_path: Path) -> None:
    """The same run saved through the plugin (step 4 full, 8 a delta) and through Lightning's own
    TorchCheckpointIO: resumed from step 4 both end bitwise equal 8 steps later, as does a run of
    the plugin resumed from Lightning's own file; resumed from the delta step 8 the losses stay
    within the preset's fidelity of those resumed from Lightning's file."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    fit(seeded(Regression), CheckpointIO(ours / "ckpt", full_every=2), 8, saver(ours / "files"))
    fit(seeded(Regression), None, 8, saver(theirs))
    mgr = CheckpointManager(ours / "ckpt", read_only=True)
    assert [mgr.info(s).kind for s in mgr.steps()] == ["full", "delta"]
    [our4, our8], [their4, their8] = files(ours / "files"), files(theirs)
    own = torch.load(their4, weights_only=True)
    loaded = CheckpointIO(ours / "ckpt").load_checkpoint(our4)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch", "global_step"):
        assert_same_value(loaded[key], own[key], key)

    def resumed(path: Path, plugin: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
        module, losses = seeded(Regression), Losses()
        fit(module, plugin, 16, losses, ckpt_path=str(path))
        return module.state_dict(), losses.losses

    from_ours, _ = resumed(our4, CheckpointIO(ours / "ckpt"))
    from_theirs, _ = resumed(their4, None)
    into_ours, _ = resumed(their4, CheckpointIO(tmp_path / "new"))  # Lightning's own file
    assert_same_value(from_ours, from_theirs)
    assert_same_value(into_ours, from_theirs)
    _, delta_losses = resumed(our8, CheckpointIO(ours / "ckpt"))
    _, exact_losses = resumed(their8, None)
    deviation = abs(sum(delta_losses) / sum(exact_losses) - 1)
    assert 0 < deviation < DELTA_TOLERANCE  # what the demo accepts of a resume from a delta
    restored = CheckpointIO(ours / "ckpt").load_checkpoint(our8)["state_dict"]
    own = torch.load(their8, weights_only=True)["state_dict"]
    for name, value in own.items():  # balanced: a weight within 12% of its root mean square
        assert (restored[name] - value).float().norm() <= 0.12 * value.float().norm(), name


@pytest.mark.slow
def test_saves_of_one_global_step_share_its_step(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                 ) -> None:
    """A second save of the global step just saved writes only its file; one after the state
    changed without an optimizer step (batch norm statistics) saves the step again, full, and
    every file of the step loads the new state with its own trainer state."""
    ckpt = tmp_path / "ckpt"
    plugin = Recording(ckpt, full_every=4)
    module = seeded(Regression)
    t = fit(module, plugin, 6)
    t.save_checkpoint(tmp_path / "a.ckpt")
    t.save_checkpoint(tmp_path / "b.ckpt")
    mgr = CheckpointManager(ckpt, read_only=True)
    first = mgr.metadata(6).save_id
    assert mgr.steps() == [6] and plugin.handed.keys() == {str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")}
    module.train()
    module.net(torch.randn(8, 4))  # new running statistics
    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        t.save_checkpoint(tmp_path / "c.ckpt")
    assert "global step 6 was saved again with another model or optimizer state" in caplog.text
    assert mgr.steps() == [6] and mgr.metadata(6).save_id != first and mgr.info(6).kind == "full"
    t.save_checkpoint(tmp_path / "d.ckpt", weights_only=True)  # the step holds its weights
    assert mgr.info(6).kind == "full" and len(plugin.handed) == 4
    new = plugin.handed[str(tmp_path / "c.ckpt")]["state_dict"]
    reader = CheckpointIO(ckpt)
    for name in ("a", "b", "c", "d"):
        loaded = reader.load_checkpoint(tmp_path / f"{name}.ckpt")
        assert_same_value(loaded["state_dict"], new, name)
        handed = plugin.handed[str(tmp_path / f"{name}.ckpt")]
        assert loaded.keys() == handed.keys() and loaded["loops"] == handed["loops"]
    assert "optimizer_states" not in loaded
    plugin.teardown()  # outside fit, the caller's to call: the managers' threads stop
    reader.teardown()


def test_validating_from_a_checkpoint_changes_nothing(tmp_path: Path) -> None:
    """A load by validate (not fit) is no resume: later saves drop no step another file names.
    Each delta is coded on the full step (``depth=1``)."""
    ckpt, kept = tmp_path / "ckpt", tmp_path / "files"
    plugin = CheckpointIO(ckpt, full_every=4, depth=1, reader_grace=0)
    module = seeded(Regression)
    t = fit(module, plugin, 12, saver(kept, save_last=True))
    assert chain_depths(ckpt) == {4: 0, 8: 1, 12: 1}  # depth 8: step 12 on step 8
    t.validate(module, data(), ckpt_path=str(kept / "epoch=0-step=4.ckpt"), verbose=False)
    t.save_checkpoint(kept / "after.ckpt")
    assert CheckpointManager(ckpt, read_only=True).steps() == [4, 8, 12]
    reader = CheckpointIO(ckpt)
    for path in files(kept):
        assert reader.load_checkpoint(path)["global_step"] in (4, 8, 12)
    plugin.teardown()
    reader.teardown()


def _index_keyed(named: bool) -> dict[str, Any]:
    """A Lightning-like checkpoint whose optimizer covers one of two same-shaped layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    params = [(n, p) for n, p in model.named_parameters() if n.startswith("1.")]
    params = params if named else [p for _, p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
            "global_step": 1, "epoch": 0}


def test_an_ambiguous_optimizer_mapping_is_refused(tmp_path: Path) -> None:
    """Handed over by other code than a Lightning strategy, an optimizer that lists its parameters
    by index is named after the state dict, and refused where the shapes leave two ways."""
    plugin = CheckpointIO(tmp_path / "ckpt")
    with pytest.raises(IntegrationError, match=r"optimizer_states\[0\]: the optimizer lists its 2 "
                       r"parameters by index, without names, and the model's state dict matches "
                       r"them in more than one way: parameter 0 is '1\.weight' or '0\.weight'.*"
                       r"build the optimizer from self\.named_parameters\(\)"):
        plugin.save_checkpoint(_index_keyed(named=False), tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists() and plugin.manager.steps() == []
    plugin.save_checkpoint(_index_keyed(named=True), tmp_path / "x.ckpt")
    meta = plugin.manager.metadata(1)
    assert {r.fqn for r in meta.tensors if r.role == "optimizer"} == {"1.weight", "1.bias"}
    plugin.teardown()


def test_another_runs_directory_is_refused_unless_continued(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with CheckpointManager(ckpt) as mgr:
        for step in (1, 2):
            mgr.save(step, extra={"step": step})
    with pytest.raises(OtherRunError, match=r"already holds 2 steps \(1 to 2\) of another run"):
        fit(seeded(Regression), CheckpointIO(ckpt), 4, saver(tmp_path / "files"))
    assert files(tmp_path / "files") == []
    fit(seeded(Regression), CheckpointIO(ckpt, continue_run=True, reader_grace=0), 8,
        saver(tmp_path / "files", save_top_k=1, monitor="loss"))
    assert CheckpointManager(ckpt, read_only=True).steps()[:2] == [1, 2]  # never dropped
    with pytest.raises(IntegrationError, match=r"global step 4 is a step of .* already, of the run "
                                               r"this one continues .* the latest \d+\)"):
        fit(seeded(Regression), CheckpointIO(ckpt, continue_run=True), 4, saver(tmp_path / "more"))


@pytest.mark.slow
def test_a_failed_save_raises_an_oserror_and_leaves_nothing(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the step, and a file Lightning's path cannot take after the step was
    written: CheckpointSaveError (an OSError with the errno) with deltackpt's error chained, no
    step, no file."""
    ckpt = tmp_path / "ckpt"
    plugin = CheckpointIO(ckpt, reader_grace=0)

    def full(rel: str) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plugin.manager.storage, "create", full)
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    with pytest.raises(CheckpointSaveError, match=r"saving the checkpoint of global step 4 to "
                       r".*epoch=0-step=4\.ckpt failed: writing step 4 failed") as failure:
        fit(seeded(Regression), plugin, 4, saver(tmp_path / "files"))
    assert isinstance(failure.value, OSError) and failure.value.errno == errno.ENOSPC
    assert isinstance(failure.value.__cause__, WriteFailedError)
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*") if p.name != ".writer.lock") == before
    assert files(tmp_path / "files") == []
    monkeypatch.undo()

    t = fit(seeded(Regression), plugin, 4)
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(CheckpointSaveError, match="global step 4") as failure:
        t.save_checkpoint(tmp_path / "a-file" / "x.ckpt")
    assert isinstance(failure.value.__cause__, OSError)
    assert plugin.manager.steps() == []
    plugin.teardown()


def test_an_untested_lightning_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "2.5.3" if name == "lightning" else real(name))
    for name in ("deltackpt.lightning", "deltackpt.integrations.lightning"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(IntegrationError, match=r"lightning 2\.5\.3 is installed; deltackpt is tested "
                                               r"with lightning 2\.6 up to \(not including\) 2\.7"):
        importlib.import_module("deltackpt.lightning")


def test_other_files_and_devices(tmp_path: Path) -> None:
    """A dict that is no training checkpoint (ddp_spawn's weights) is written as Lightning writes
    it; map_location moves a restored checkpoint; storage_options are Lightning's TypeError."""
    plugin = CheckpointIO(tmp_path / "ckpt")
    weights = {"w": torch.arange(4.0)}
    plugin.save_checkpoint(weights, tmp_path / "w.pt")
    assert_same_value(plugin.load_checkpoint(tmp_path / "w.pt"), weights)
    assert torch.load(tmp_path / "w.pt", weights_only=True)["w"].equal(weights["w"])
    plugin.save_checkpoint(_index_keyed(named=True), tmp_path / "x.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "x.ckpt", map_location="meta")
    assert all(t.is_meta for t in loaded["state_dict"].values())
    with pytest.raises(IntegrationError, match="map_location"):
        plugin.load_checkpoint(tmp_path / "x.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(ConfigError, match="full_every"):
        CheckpointIO(tmp_path / "other", full_every=0)
    for bad in (0, True):
        with pytest.raises(ConfigError, match="depth"):
            CheckpointIO(tmp_path / "other", depth=bad)
    assert not (tmp_path / "other").exists()
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint(_index_keyed(named=True), tmp_path / "y.ckpt", storage_options={})
    plugin.remove_checkpoint(tmp_path / "w.pt")
    assert not (tmp_path / "w.pt").exists()
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "w.pt")


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_saves_and_resumes(tmp_path: Path) -> None:
    """tests/lightning_ddp.py: rank 0 alone saves, every rank loads; resumed from the full step 4,
    the run ends bitwise where the run it resumed ended; the first run's step 8 was dropped by
    the resumed run and saved again, so its file says so."""
    script = Path(__file__).parent / "lightning_ddp.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["first_did"]["saved"] for r in ranks] == [True, False]
    params = [name for name, _ in Regression().named_parameters()]
    for rank in ranks:
        for name in params:
            assert torch.equal(rank["resumed"][name], rank["first"][name]), name
            assert torch.equal(rank["from_delta"][name], ranks[0]["from_delta"][name]), name
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [4, 8, 12]
    with pytest.raises(IntegrationError, match=r"names step 8 of .*, which was saved again since"):
        CheckpointIO(tmp_path / "ckpt").load_checkpoint(tmp_path / "files" / "epoch=3-step=8.ckpt")


def test_the_manuals_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = manual_examples("lightning.md")
    assert len(example) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(example[0], "docs/lightning.md", "exec"), {"__name__": "__main__"})
    assert CheckpointManager(tmp_path / "runs" / "ckpt", read_only=True).steps()
    assert deltackpt.lightning.CheckpointIO is CheckpointIO
