"""Fidelity of delta checkpoints on a real training run: ratio against resumed-training loss.

A small GPT (deltackpt.training.TinyGPT, pure torch, AdamW) trains on real
text (Python's standard library sources). Every ``interval`` steps the same
trajectory is saved into one checkpoint directory per compression setting
(``full_every=10``: a full step, then deltas). At a step several deltas into
the chain, training is resumed twice for ``resume`` steps with the same data
order: once from the exact in-memory state, once from each checkpoint. The
report gives, per setting:

* ``ratio``: raw fp32 bytes of weights + Adam moments over the bytes the
  delta steps occupy on disk (data files and metadata), averaged over the
  delta steps of the run, and ``bits_per_param`` (all three tensors);
* ``loss_dev``: relative deviation of the mean of the last 20 training
  losses after resuming, and ``eval_dev``: of the evaluation loss at the end;
* ``max_err``: the largest ``rms_rel_error`` of any class in those steps;
* ``bits_per_element``: per tensor class, in the step training resumed from.

``repeated_restores`` interrupts a run five times, each time resuming from
the latest (delta) checkpoint in fresh objects, and compares the end with
the uninterrupted run, beside the same run restored near-losslessly (the
deviation any perturbation grows to in training).

Run ``python bench/fidelity.py`` (about 20 minutes on 2 cores) or import
:func:`measure` (the fidelity notebook does, with shorter settings).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltackpt import CheckpointManager
from deltackpt.compression import CompressionConfig, Quantizer, as_config
from deltackpt.training import (
    SIZES,
    TinyGPT,
    eval_loss,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)

BATCH = 16
EVAL_BATCHES = 8
# Learning-rate schedule of every run: long enough that the rate is still high where we resume.
WARMUP, TOTAL = 20, 2000


@dataclass
class Run:
    """One training trajectory: the objects, the data and the losses so far."""

    model: TinyGPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train: torch.Tensor
    evaluation: torch.Tensor
    losses: list[float] = field(default_factory=list)

    @classmethod
    def fresh(cls, size: str, seed: int) -> Run:
        torch.manual_seed(seed)
        model = TinyGPT(SIZES[size])
        optimizer = make_optimizer(model)
        train, evaluation = split_corpus(load_corpus())
        return cls(model, optimizer, make_scheduler(optimizer, WARMUP, TOTAL), train, evaluation)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.losses.append(train_step(self.model, self.optimizer, self.scheduler, self.train,
                                          BATCH))

    def extra(self) -> dict:
        return {"scheduler": self.scheduler.state_dict()}

    def snapshot(self) -> dict:
        """Exact copy of the whole training state, RNG included."""
        return {"model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}

    def from_snapshot(self, snap: dict, size: str) -> Run:
        run = Run.fresh(size, 0)
        run.model.load_state_dict(snap["model"])
        run.optimizer.load_state_dict(snap["optimizer"])
        run.scheduler.load_state_dict(snap["scheduler"])
        torch.set_rng_state(snap["rng"])
        return run

    def from_checkpoint(self, mgr: CheckpointManager, step: int, size: str) -> Run:
        run = Run.fresh(size, 0)
        extra = mgr.load(step, run.model, run.optimizer)
        run.scheduler.load_state_dict(extra["scheduler"])
        return run

    def eval(self) -> float:
        return eval_loss(self.model, self.evaluation, batches=EVAL_BATCHES)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Raw fp32 bytes of weights plus Adam moments, and the number of parameters."""
    params = sum(p.numel() for p in model.parameters())
    moments = sum(s[k].numel() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    return 4 * (params + moments), params


def step_disk_bytes(mgr: CheckpointManager, step: int) -> int:
    """Bytes of a step directory on disk: data files and metadata."""
    directory = Path(mgr.path.removeprefix("file://")) / f"step-{step:012d}"
    return sum(p.stat().st_size for p in directory.iterdir())


def _mean_last(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / min(n, len(losses))


def measure(settings: dict[str, str | CompressionConfig], *, interval: int = 20, saves: int = 10,
            resume: int = 100, size: str = "small", seed: int = 0,
            workdir: str | None = None) -> dict:
    """Train, checkpoint under every setting, resume from the last save; see the module doc.

    ``saves`` checkpoints are taken every ``interval`` steps (the first is the
    full step) and training resumes from the last one, ``saves - 1`` deltas
    into its chain.
    """
    root = Path(workdir or tempfile.mkdtemp(prefix="deltackpt-fidelity-"))
    run = Run.fresh(size, seed)
    managers = {name: CheckpointManager(root / name, full_every=10, compression=as_config(cfg))
                for name, cfg in settings.items()}
    sizes: dict[str, list[int]] = {name: [] for name in settings}
    errors: dict[str, float] = {name: 0.0 for name in settings}
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    try:
        for i in range(1, saves + 1):
            run.steps(interval)
            step = i * interval
            for name, mgr in managers.items():
                info = mgr.save(step, run.model, run.optimizer, extra=run.extra())
                if info.kind == "delta":
                    sizes[name].append(step_disk_bytes(mgr, step))
                    seconds[name].append(info.seconds)
                    classes = mgr.metadata(step).stats.classes or {}
                    errors[name] = max([errors[name]] + [c["rms_rel_error"]
                                                         for c in classes.values()])
        raw, n_params = state_bytes(run.model, run.optimizer)
        resume_step = saves * interval
        snap = run.snapshot()
        exact = run.from_snapshot(snap, size)
        exact.steps(resume)
        base_loss, base_eval = _mean_last(exact.losses), exact.eval()
        report = {"interval": interval, "resume_step": resume_step, "resume_steps": resume,
                  "deltas_in_chain": saves - 1, "params": n_params, "raw_bytes": raw,
                  "exact": {"loss": base_loss, "eval": base_eval}, "settings": {}}
        for name, mgr in managers.items():
            restored = run.from_checkpoint(mgr, resume_step, size)
            restored.steps(resume)
            loss, ev = _mean_last(restored.losses), restored.eval()
            stored = sum(sizes[name]) / len(sizes[name]) if sizes[name] else float("nan")
            classes = mgr.metadata(resume_step).stats.classes or {}
            report["settings"][name] = {
                "bits_per_element": {c: 8 * v["stored_bytes"] / max(1, v["elements"])
                                     for c, v in classes.items()},
                "ratio": raw / stored, "bits_per_param": 8 * stored / n_params,
                "loss": loss, "eval": ev,
                "loss_dev": abs(loss / base_loss - 1), "eval_dev": abs(ev / base_eval - 1),
                "max_err": errors[name], "save_seconds": sum(seconds[name]) / max(1, len(seconds[name])),
                "losses": restored.losses}
        report["exact"]["losses"] = exact.losses
        return report
    finally:
        for mgr in managers.values():
            mgr.close()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


# Errors about 1000x below balanced's (a weight within 0.005 learning rates of its saved value,
# moments within 0.5% of theirs): what restoring at all costs a chaotic training run, for scale.
NEAR_LOSSLESS = CompressionConfig(weights=Quantizer(step=1e-3, move_step=0.01),
                                  first_moment=Quantizer(step=0.01, pred="zero"),
                                  second_moment=Quantizer(step=2.0**-10, domain="ordinal"),
                                  name="near-lossless")


def repeated_restores(setting: str | CompressionConfig = "balanced", *, interval: int = 20,
                      restores: int = 5, first: int | None = None, tail: int = 100,
                      size: str = "small", seed: int = 0,
                      reference: str | CompressionConfig | None = NEAR_LOSSLESS) -> dict:
    """Interrupt training ``restores`` times, resuming each time from the latest checkpoint.

    Saves every ``interval`` steps. The run is dropped and rebuilt from its
    latest (delta) step at step ``first`` (default ``10 * interval``, where
    :func:`measure` resumes, so one restore costs what it reports) and after
    every second save from then on; ``tail`` steps follow the last restore
    (100: as long as :func:`measure` resumes).
    Compares the final losses with an uninterrupted run of the same length
    and data order, and does the same with the ``reference`` setting:
    training amplifies any perturbation, so even near-lossless restores
    leave some deviation, the floor to read the setting's against.
    """
    first = 10 * interval if first is None else first
    if first % interval or first <= interval:
        raise ValueError(f"first restore at step {first}: must be a later save than the first "
                         f"(a multiple of interval={interval})")
    restore_at = [first + 2 * interval * k for k in range(restores)]
    straight = Run.fresh(size, seed)
    straight.steps(restore_at[-1] + tail)
    base, base_ev = _mean_last(straight.losses), straight.eval()
    report: dict = {"restores": restore_at, "tail": tail, "exact_loss": base}
    for key, cfg in (("", setting), ("reference_", reference)):
        if cfg is None:
            continue
        run, kinds = _interrupted(cfg, interval, restore_at, tail, size, seed)
        loss, ev = _mean_last(run.losses), run.eval()
        report.update({f"{key}loss_dev": abs(loss / base - 1), f"{key}eval_dev": abs(ev / base_ev - 1),
                       f"{key}loss": loss, f"{key}kinds": kinds})
    return report


def _interrupted(setting: str | CompressionConfig, interval: int, restore_at: list[int],
                 tail: int, size: str, seed: int) -> tuple[Run, list[str]]:
    """A run saved under ``setting`` every ``interval`` steps and rebuilt from its latest step
    at each step of ``restore_at``; the kinds of the steps it restored from."""
    root = Path(tempfile.mkdtemp(prefix="deltackpt-restores-"))
    try:
        run = Run.fresh(size, seed)
        kinds = []
        with CheckpointManager(root, full_every=10, compression=as_config(setting)) as mgr:
            while len(run.losses) < restore_at[-1]:
                run.steps(interval)
                step = len(run.losses)
                info = mgr.save(step, run.model, run.optimizer, extra=run.extra())
                if step in restore_at:
                    kinds.append(info.kind)
                    losses = run.losses
                    run = run.from_checkpoint(mgr, step, size)
                    run.losses = losses
            run.steps(tail)
        return run, kinds
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(report: dict) -> str:
    lines = [f"interval {report['interval']} steps, resume from step {report['resume_step']} "
             f"({report['deltas_in_chain']} deltas into its chain) for {report['resume_steps']} "
             f"steps; {report['params'] / 1e6:.2f}M parameters, "
             f"{report['raw_bytes'] / 2**20:.1f} MiB of fp32 weights + moments",
             f"{'setting':<22} {'ratio':>8} {'bits/param':>10} {'loss dev':>9} {'eval dev':>9} "
             f"{'max rms err':>11} {'save s':>7}"]
    for name, r in report["settings"].items():
        lines.append(f"{name:<22} {r['ratio']:>7.1f}x {r['bits_per_param']:>10.2f} "
                     f"{100 * r['loss_dev']:>8.2f}% {100 * r['eval_dev']:>8.2f}% "
                     f"{r['max_err']:>11.4f} {r['save_seconds']:>7.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--intervals", default="20,100")
    parser.add_argument("--resume", type=int, default=100)
    parser.add_argument("--json", help="also write the full report to this file")
    args = parser.parse_args()
    settings = {"balanced": "balanced", "aggressive": "aggressive"}
    reports = []
    for interval in map(int, args.intervals.split(",")):
        started = time.perf_counter()
        saves = 10 if interval <= 20 else 4
        report = measure(settings, interval=interval, saves=saves, resume=args.resume,
                         size=args.size)
        reports.append(report)
        print(_table(report), f"\n({time.perf_counter() - started:.0f} s)\n", flush=True)
    restores = repeated_restores("balanced", size=args.size)
    print(f"5 interruptions (at steps {restores['restores']}, resumed from "
          f"{restores['kinds']} steps), {restores['tail']} steps after the last: loss deviation "
          f"{100 * restores['loss_dev']:.2f}%, eval deviation {100 * restores['eval_dev']:.2f}% "
          f"(near-lossless restores: {100 * restores['reference_loss_dev']:.2f}%, "
          f"{100 * restores['reference_eval_dev']:.2f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"intervals": reports, "repeated": restores},
                                              indent=1))


if __name__ == "__main__":
    main()
