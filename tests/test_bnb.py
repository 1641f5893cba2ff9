"""bitsandbytes' 8-bit optimizers: their moments coded by meaning in delta steps (FORMAT.md 3.4).

Every delta restores to a valid 8-bit state (the running values requantized by bitsandbytes),
whose running values are within the coded bounds of what the optimizer held, and loads into a
fresh optimizer that trains on. A real run measures the ratio and the resumed loss.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import multiprocessing
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from deltackpt import CheckpointManager, CompressionConfig, DeltackptError, Quantizer
from deltackpt.app.training import SIZES, TinyGPT, eval_loss, load_corpus, split_corpus, train_step
from deltackpt.codecs import bnb8
from deltackpt.restore.chain import restore_chain

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed "
                          "(pip install 'deltackpt[bnb]')")

OPTIMIZERS = ["AdamW8bit", "PagedAdamW8bit", "Lion8bit"]
F32_EPS = 2.0**-23
WRAP = "__bnb_optimizer_quant_state__"


def _keys(x: np.ndarray) -> np.ndarray:
    """Ordinal keys of float32 values (FORMAT.md 3.2)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(bits < 0x80000000, bits, -(bits & 0x7FFFFFFF))


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """bitsandbytes' optimizer ``name``, or torch's ``AdamW`` (the float reference)."""
    lr = 3e-4 if name.startswith("Lion") else 3e-3
    cls = torch.optim.AdamW if name == "AdamW" else getattr(bnb.optim, name)
    return cls(model.parameters(), lr=lr, betas=(0.9, 0.95))


def _model(seed: int = 0, hidden: int = 1200) -> nn.Module:
    torch.manual_seed(seed)  # two matrices of 64 * hidden elements: 8-bit states; biases: float32
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 64))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(32, 64)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def _moments(state: dict) -> dict[str, np.ndarray]:
    """``state1``/``state2`` of a bitsandbytes parameter state, dequantized."""
    quant = state[WRAP]
    return {k: bnb8.dequantize(quant[k].numpy(), quant[f"absmax{k[-1]}"].numpy(),
                               quant[f"qmap{k[-1]}"].numpy(), 256)
            for k in ("state1", "state2") if k in quant}


def _check_bounds(meta, name: str, running: np.ndarray, saved: np.ndarray,
                  values: dict[str, np.ndarray]) -> None:
    """Each element of a bnb8 chunk's running values is within half its step of the saved
    (dequantized) moment: linear in value (a scaled chunk's steps from the running values it
    names), ordinal in keys (one and a half steps within a step of zero)."""
    for chunk in meta.tensor(name).fragments[0].chunks:
        assert chunk.codec == "bnb8", f"{name}: {chunk.codec} chunk in a delta"
        codec, params, *_ = bnb8.state_params(chunk.params)
        lo, hi = chunk.raw_offset, chunk.raw_offset + chunk.raw_length
        r, x = running[lo:hi].astype(np.float64), saved[lo:hi].astype(np.float64)
        if codec != "quant":
            assert np.array_equal(running[lo:hi], saved[lo:hi]), f"{name}: lossless chunk differs"
        elif params["domain"] == "linear":
            step = params["step"]
            if "scale" in params:
                step = step * (np.sqrt(values[params["scale"]][lo:hi].astype(np.float64))
                               + params["eps"])
            slack = 4 * F32_EPS * (np.abs(r) + np.abs(x) + step)
            assert np.all(np.abs(r - x) <= step / 2 + slack), f"step {meta.step} {name}"
        else:
            kx, step = _keys(saved[lo:hi]), params["step"]
            bound = np.where(np.abs(kx) < step, step + step // 2, step // 2)
            assert np.all(np.abs(_keys(running[lo:hi]) - kx) <= bound), f"step {meta.step} {name}"


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize(("name", "chunk_bytes"), list(zip(OPTIMIZERS, (8 << 20, 1100, 5000),
                                                                  strict=True)))
def test_deltas_restore_valid_8bit_states_within_their_bounds(tmp_path: Path, name: str,
                                                              chunk_bytes: int,
                                                              one_torch_thread: None) -> None:
    """Chunks of any size (1100 bytes: several absmax chunks too; neither 1100 nor 5000 bytes
    on a block boundary)."""
    model = _model()
    optimizer = _optimizer(name, model)
    saved = {}
    with CheckpointManager(tmp_path / "ckpt", full_every=5, chunk_bytes=chunk_bytes) as mgr:
        for step in range(1, 31):
            _train(model, optimizer, 1)
            if step % 5 == 0:
                info = mgr.save(step, model=model, optimizer=optimizer)
                assert info.kind == ("full" if step in (5, 30) else "delta")
                saved[step] = copy.deepcopy(optimizer.state_dict()["state"])
        assert not any(mgr.verify(deep=True).values())
        for step, state in saved.items():
            meta = mgr.metadata(step)
            tensors, recon = restore_chain(mgr.storage, meta)
            for fqn, index in (("0.weight", 0), ("2.weight", 2)):
                truth = _moments(state[index])
                prefix = f"optimizer/state/{fqn}/{WRAP}"
                for key, x in truth.items():
                    s = f"{prefix}/{key}"
                    codes, absmax = tensors[s], tensors[f"{prefix}/absmax{key[-1]}"]
                    qmap = tensors[f"{prefix}/qmap{key[-1]}"].numpy()
                    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32
                    running = recon.values[s]
                    if meta.kind == "full":  # stored exactly: the very codes and scales
                        assert torch.equal(codes, state[index][WRAP][key])
                        assert torch.equal(absmax, state[index][WRAP][f"absmax{key[-1]}"])
                        assert np.array_equal(running, x)
                        continue
                    # A valid 8-bit state: the running values requantized
                    bnb8.check_requantized(running, codes.reshape(-1).numpy(), absmax.numpy(),
                                           qmap, 256)
                    _check_bounds(meta, s, running, x, recon.values)
                    restored = bnb8.dequantize(codes.numpy(), absmax.numpy(), qmap, 256)
                    live = np.abs(x) > 1e-3 * np.abs(x).max()
                    ratio = float(np.median(restored[live] / x[live]))
                    assert 0.9 <= ratio <= 1.1, f"step {step} {s}: median ratio {ratio}"
        fresh_model = _model(seed=1)
        fresh = _optimizer(name, fresh_model)
        mgr.load(15, fresh_model, fresh)
        assert np.isfinite(_train(fresh_model, fresh, 3))
        assert mgr.save(33, model=fresh_model, optimizer=fresh).kind == "delta"
        assert not mgr.verify(33, deep=True)[33]


def test_missing_bitsandbytes_names_what_to_install(tmp_path: Path, monkeypatch,
                                                    one_torch_thread: None) -> None:
    model = _model()
    optimizer = _optimizer("AdamW8bit", model)
    with CheckpointManager(tmp_path / "ckpt", full_every=5) as mgr:
        for step in (1, 2):
            _train(model, optimizer, 1)
            mgr.save(step, model=model, optimizer=optimizer)
        real_import = builtins.__import__

        def no_bnb(name: str, *args, **kwargs):
            if name.startswith("bitsandbytes"):
                raise ImportError(f"No module named {name!r}")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_bnb)
        mgr.restore(1)  # a full step needs no bitsandbytes
        with pytest.raises(DeltackptError, match=r"bnb8.*deltackpt\[bnb\]"):
            mgr.restore(2)


def test_an_older_reader_fails_naming_the_codec() -> None:
    from deltackpt.codecs.base import decode_into
    with pytest.raises(DeltackptError, match="unknown codec 'bnb8'"):
        decode_into("bnb8", {}, memoryview(b""), np.empty(0, np.uint8))


BALANCED = CompressionConfig.preset("balanced")
SETTINGS = {
    "balanced": BALANCED,
    "20x": replace(BALANCED, target_ratio=21, max_error=128),  # aimed above 20: met within 5%
    # weights within 32 steps' movement, second moments within a factor 16 (their square root 4)
    "coarse": replace(BALANCED, weights=Quantizer(step=1.0, move_step=64.0),
                      second_moment=Quantizer(step=8.0, domain="ordinal")),
}
MIN_RATIO = {"balanced": 8, "20x": 20, "coarse": 14}


RESTORED = (80, 120, 160)  # the third, fifth and seventh delta of the chain
RESUME = 100  # steps a resumed run trains
# The cells of the real run: (optimizer, setting). Each optimizer's run is trained once, saved
# under all of its settings.
REAL_RUNS = [("AdamW8bit", "balanced"), ("AdamW8bit", "20x"), ("AdamW8bit", "coarse"),
             ("Lion8bit", "balanced"), ("AdamW", "balanced")]


@functools.cache
def _text() -> tuple[torch.Tensor, torch.Tensor]:
    """Train and evaluation parts of the real text (read once; forked workers inherit them)."""
    return split_corpus(load_corpus(1 << 20))


def _tiny_gpt(name: str) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """TinyGPT "tiny" as initialized at step 0 (seed 0), with optimizer ``name``."""
    torch.manual_seed(0)
    model = TinyGPT(SIZES["tiny"])
    return model, _optimizer(name, model)


def _figures(losses: list[float], model: TinyGPT) -> tuple[float, float]:
    """What a resumed run is compared by: the mean of its last 20 training losses, and its eval
    loss."""
    return statistics.mean(losses[-20:]), eval_loss(model, _text()[1], batches=8)


def _resumed(name: str, path: Path, step: int) -> tuple[float, float]:
    """The figures of the run restored from ``step`` of the checkpoint at ``path`` into fresh
    objects, then resumed RESUME steps (in a worker process, forked from the test's)."""
    torch.set_num_threads(1)
    model, optimizer = _tiny_gpt(name)
    with CheckpointManager(path, read_only=True) as mgr:
        mgr.load(step, model, optimizer)
    losses = [train_step(model, optimizer, None, _text()[0], 16) for _ in range(RESUME)]
    return _figures(losses, model)


@dataclass
class RealRun:
    """One optimizer's run of TinyGPT "tiny" on its real text, saved every 20 steps (a full step
    then deltas) under each setting it is tested with. ``ratios``: the deltas' ratios per
    setting; ``exact`` (per step of RESTORED) and ``restored`` (per setting and step): the
    figures of the exact resume from the step and of the resume restored from its delta."""

    ratios: dict[str, list[float]]
    exact: dict[int, tuple[float, float]]
    restored: dict[tuple[str, int], tuple[float, float]]

    @classmethod
    def trained(cls, name: str, root: Path) -> RealRun:
        """The run of optimizer ``name``, trained once for all of its cells (saving does not
        change training, so the one run saves into a manager per setting). It trains on,
        uninterrupted, RESUME steps past the last restored step: an exact resume from a step (a
        deep copy of model, optimizer and RNG state loaded into fresh objects) replays the run
        bit for bit, so the run's figures RESUME steps after a restored step are the exact
        resume's. The restored runs resume meanwhile, in two worker processes (as many as the
        CI machine's cores), each as soon as its step is saved."""
        settings = [s for n, s in REAL_RUNS if n == name]
        ratios: dict[str, list[float]] = {s: [] for s in settings}
        exact, pending = {}, {}
        model, optimizer = _tiny_gpt(name)
        losses = []
        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(2, mp_context=fork) as workers, contextlib.ExitStack() as stack:
            managers = {s: stack.enter_context(CheckpointManager(
                root / s, full_every=10, compression=SETTINGS[s])) for s in settings}
            for step in range(1, max(RESTORED) + RESUME + 1):
                losses.append(train_step(model, optimizer, None, _text()[0], 16))
                if step % 20 == 0 and step <= max(RESTORED):
                    for setting, mgr in managers.items():
                        info = mgr.save(step, model=model, optimizer=optimizer)
                        if info.kind == "delta":
                            ratios[setting].append(info.ratio)
                        if step in RESTORED:
                            pending[setting, step] = workers.submit(_resumed, name, root / setting,
                                                                     step)
                if step - RESUME in RESTORED:
                    exact[step - RESUME] = _figures(losses, model)
            return cls(ratios, exact, {key: done.result() for key, done in pending.items()})


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory,
              one_torch_thread: None) -> Callable[[str], RealRun]:
    """The run of an optimizer, trained by the first cell that asks for it and kept for the
    others."""
    runs: dict[str, RealRun] = {}

    def run(name: str) -> RealRun:
        if name not in runs:
            runs[name] = RealRun.trained(name, tmp_path_factory.mktemp(name))
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(("name", "setting"), REAL_RUNS)
def test_real_run_ratio_and_resumed_loss(real_runs: Callable[[str], RealRun], name: str,
                                         setting: str) -> None:
    """TinyGPT "tiny" on its real text, saved every 20 steps (a full step then deltas) with
    each of ``SETTINGS``, restored from deltas deep in the chain and resumed 100 steps beside
    the exact resume. Prints the figures: the deltas' ratios, and the deviation of the resumed
    run's training loss (its last 20 steps) and eval loss from the exact one's. torch's float
    ``AdamW`` is the reference: how far its runs drift apart at ``balanced``."""
    real_run = real_runs(name)
    ratios = real_run.ratios[setting]
    devs = {step: tuple(r / b - 1 for r, b in zip(real_run.restored[setting, step], base, strict=True))
            for step, base in real_run.exact.items()}
    print(f"\n{name} tiny {setting}, every 20 steps: delta ratios "
          f"{[round(r, 1) for r in ratios]}; resumed loss, eval loss deviation from step " + ", ".join(
              f"{s}: {d[0]:+.2%} {d[1]:+.2%}" for s, d in devs.items()))
    assert statistics.median(ratios) >= MIN_RATIO[setting]
    assert all(abs(d) < 0.05 for pair in devs.values() for d in pair)


def test_gc_keeps_what_kept_steps_restore_to(tmp_path: Path, one_torch_thread: None) -> None:
    """A kept delta whose base is rewritten as a full step (its 8-bit moments stored requantized,
    no longer their running values) is rewritten too, and restores to what it did."""
    model = _model(hidden=128)
    optimizer = _optimizer("AdamW8bit", model)
    # deltas enough against a full step for the gc to rewrite rather than hold their chain (no
    # RNG states: full steps store them whole, deltas as patches of tens of bytes)
    with CheckpointManager(tmp_path / "ckpt", full_every=20) as mgr:
        for step in range(1, 17):
            _train(model, optimizer, 1)
            mgr.save(step, model=model, optimizer=optimizer, rng=False)
        before = {s: mgr.restore(s).optimizer["state"] for s in (15, 16)}
        assert mgr.gc("last=2").rewritten == [15, 16]
        assert mgr.steps() == [15, 16]
        assert not any(mgr.verify(deep=True).values())
        for step, state in before.items():
            after = mgr.restore(step).optimizer["state"]
            for fqn, entries in state.items():
                for key, value in entries[WRAP].items():
                    assert torch.equal(after[fqn][WRAP][key], value), f"step {step} {fqn} {key}"
