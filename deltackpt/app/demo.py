"""``deltackpt demo``: train a small GPT on real text, checkpoint it, resume from a checkpoint.

The main job of the README, well under a minute on two cores by default. It shows
the promises on a real run: checkpoints are much smaller than ``torch.save``'s
(a full lossless step, then delta steps), any saved step restores into freshly
built objects, training resumed from the full step continues bit for bit as the
uninterrupted run did, and training resumed from a delta step stays within a
fraction of a percent of it. The Numba kernels are compiled (on a first run;
later runs load them from Numba's cache) before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import torch

from deltackpt.app.training import (
    SIZES,
    TinyGPT,
    eval_loss,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)
from deltackpt.format.metadata import ROOT_MARKER
from deltackpt.manager import CheckpointManager
from deltackpt.save.queue import SaveHandle

DESCRIPTION = ("Train a small GPT on Python's own sources, checkpoint it with deltackpt beside "
               "torch.save, then resume from a full and from a delta step in freshly built objects. "
               "Well under a minute on two cores with the defaults; --steps, --size and --batch make "
               "it longer.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options on ``parser``."""
    parser.add_argument("--out", default="deltackpt-demo",
                        help="checkpoint directory (a previous demo's directory is replaced) "
                             "[%(default)s]")
    parser.add_argument("--compression", default="balanced",
                        choices=["balanced", "aggressive", "lossless"],
                        help="what delta steps keep [%(default)s]")
    parser.add_argument("--steps", type=int, default=40, help="training steps [%(default)s]")
    parser.add_argument("--every", type=int, default=5, help="save every N steps [%(default)s]")
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="model size: tiny (~0.1M params), small (~1.9M), medium (~4.8M), large (~25M), "
                             "xl (~50M) [%(default)s]")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch [%(default)s]")
    parser.add_argument("--resume-from", type=int, default=None,
                        help="the delta step to resume from, training to --steps again "
                             "[the saved step in the middle]")
    parser.add_argument("--seed", type=int, default=0, help="random seed [%(default)s]")


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def _torch_save_with_fsync(state: dict, path: Path) -> tuple[int, float]:
    """Bytes and seconds of ``torch.save`` of ``state`` made durable, as deltackpt's saves are."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size, time.perf_counter() - start


def _build(size: str, total_steps: int) -> tuple[TinyGPT, torch.optim.Optimizer,
                                                 torch.optim.lr_scheduler.LRScheduler]:
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, warmup=max(1, total_steps // 10), total=total_steps)
    return model, optimizer, scheduler


def _ready_kernels(compression: str, train: torch.Tensor) -> float:
    """Seconds to make the Numba kernels ready: a tiny model saved (a full step, a delta on it and
    a delta on that, which codes against a delta's reconstruction) and restored in a temporary
    directory, so that no timed save compiles them. Numba compiles them on a first run and
    caches them; later runs load them from that cache."""
    start = time.perf_counter()
    model, optimizer, scheduler = _build("tiny", 3)
    with tempfile.TemporaryDirectory() as tmp, CheckpointManager(Path(tmp) / "ckpt",
                                                                 compression=compression) as mgr:
        for step in (1, 2, 3):
            train_step(model, optimizer, scheduler, train, 2)
            mgr.save(step, model=model, optimizer=optimizer)
        mgr.restore(3)
    return time.perf_counter() - start


# Largest relative deviation of the mean resumed loss the demo accepts after a delta step.
DELTA_TOLERANCE = 0.02


def _resume(mgr: CheckpointManager, step: int, until: int, args: argparse.Namespace,
            train: torch.Tensor) -> tuple[list[float], TinyGPT]:
    """Load ``step`` into freshly built objects and train on to step ``until``: the losses of the
    resumed steps, and the model."""
    model, optimizer, scheduler = _build(args.size, args.steps)
    extra = mgr.load(step, model=model, optimizer=optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    return [train_step(model, optimizer, scheduler, train, args.batch)
            for _ in range(step + 1, until + 1)], model


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 if resuming from the full step matched the original run exactly
    and resuming from the other step stayed within tolerance."""
    if args.steps < 2 or args.every < 1 or args.every >= args.steps:
        raise ValueError("need --steps >= 2 and 1 <= --every < --steps")
    save_steps = list(range(args.every, args.steps + 1, args.every))
    resume_from = args.resume_from if args.resume_from is not None else save_steps[(len(save_steps) - 1) // 2]
    if resume_from not in save_steps:
        raise ValueError(f"--resume-from {resume_from} is not a saved step; saved steps: {save_steps}")
    full_step = save_steps[0]
    check_step = min(full_step + args.every, args.steps)  # resuming from the full step trains to it
    out = Path(args.out).absolute()

    train, held_out = split_corpus(load_corpus())
    kernel_seconds = _ready_kernels(args.compression, train)
    torch.manual_seed(args.seed)
    model, optimizer, scheduler = _build(args.size, args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyGPT '{args.size}': {n_params / 1e6:.2f}M parameters, trained on "
          f"{len(train) / 2**20:.1f} MiB of Python standard library source; "
          f"AdamW, {args.steps} steps, checkpoint every {args.every} into {out}")
    print(f"Numba kernels ready in {kernel_seconds:.1f} s before any timing (compiled on a first "
          "run, loaded from Numba's cache after)\n")
    print("deltackpt saves asynchronously: training waits for a copy of the state ('stall s'), "
          "and the step is encoded and written in the background ('save s'); torch.save "
          "stalls training for all of its time ('t.s. s')\n")
    print(f"{'step':>6} {'loss':>7} {'kind':>5} {'raw':>12} {'stored':>12} {'ratio':>6} "
          f"{'save s':>7} {'stall s':>7} {'torch.save':>12} {'t.s. s':>7}")

    if (out / ROOT_MARKER).is_file():  # a previous demo's directory
        shutil.rmtree(out)
    mgr = CheckpointManager(out, compression=args.compression)
    losses: dict[int, float] = {}
    saved: dict[str, dict[str, int | float]] = {"full": {"n": 0, "bytes": 0}, "delta": {"n": 0, "bytes": 0}}
    totals = {"stored": 0, "torch": 0, "seconds": 0.0, "stall": 0.0, "torch_seconds": 0.0}
    pending: list[tuple[SaveHandle, int, float]] = []  # saves in flight, with torch.save's figures

    def report(done: bool) -> None:
        """Print the rows of the saves that ended (all of them, waiting, if ``done``)."""
        while pending and (done or pending[0][0].done()):
            handle, torch_bytes, torch_seconds = pending.pop(0)
            info = handle.wait()
            saved[info.kind]["n"] += 1
            saved[info.kind]["bytes"] += info.stored_bytes
            totals["stored"] += info.stored_bytes
            totals["torch"] += torch_bytes
            totals["seconds"] += info.seconds
            totals["stall"] += info.blocked_seconds
            totals["torch_seconds"] += torch_seconds
            print(f"{info.step:>6} {losses[info.step]:>7.4f} {info.kind:>5} "
                  f"{_mib(info.raw_bytes):>12} {_mib(info.stored_bytes):>12} {info.ratio:>5.2f}x "
                  f"{info.seconds:>7.3f} {info.blocked_seconds:>7.3f} {_mib(torch_bytes):>12} "
                  f"{torch_seconds:>7.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.steps + 1):
            losses[step] = train_step(model, optimizer, scheduler, train, args.batch)
            if step == check_step:
                weights_at_check = {k: v.clone() for k, v in model.state_dict().items()}
            report(done=False)
            if step not in save_steps:
                continue
            handle = mgr.save(step, model=model, optimizer=optimizer, blocking=False,
                              extra={"scheduler": scheduler.state_dict(), "loss": losses[step]})
            torch_bytes, torch_seconds = _torch_save_with_fsync(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
                Path(tmp) / "ckpt.pt")
            pending.append((handle, torch_bytes, torch_seconds))
        report(done=True)
    final_eval = eval_loss(model, held_out)

    print(f"\nresuming in freshly built objects from step {full_step} ({mgr.info(full_step).kind}), "
          f"training to step {check_step}, and from step {resume_from} ({mgr.info(resume_from).kind}), "
          f"training to step {args.steps}")
    resumed, model2 = _resume(mgr, full_step, check_step, args, train)
    exact = (resumed == [losses[s] for s in range(full_step + 1, check_step + 1)]
             and _same_weights(model2.state_dict(), weights_at_check))
    resumed, model2 = _resume(mgr, resume_from, args.steps, args, train)
    original = [losses[s] for s in range(resume_from + 1, args.steps + 1)]
    deviation = abs(sum(resumed) / sum(original) - 1) if resumed else 0.0
    lossy = mgr.info(resume_from).kind == "delta"
    same = resumed == original and _same_weights(model2.state_dict(), model.state_dict())
    mgr.close()

    parts = ", ".join(f"{k['n']} {kind} {_mib(int(k['bytes'] / k['n'])).strip()} each"
                      for kind, k in saved.items() if k["n"])
    print(f"\nsummary: {len(save_steps)} checkpoints ({parts}): deltackpt "
          f"{_mib(totals['stored']).strip()} saved in {totals['seconds']:.2f} s in the background "
          f"(training stalled {totals['stall']:.2f} s), torch.save "
          f"{_mib(totals['torch']).strip()} in {totals['torch_seconds']:.2f} s (with fsync), "
          f"{totals['torch'] / totals['stored']:.1f}x smaller")
    print(f"final loss {losses[args.steps]:.4f}, held-out loss {final_eval:.4f}")
    print(f"resumed from step {full_step}: "
          f"{'training continued identically' if exact else 'MISMATCH'} to step {check_step}")
    ok = exact and (deviation <= DELTA_TOLERANCE if lossy else same)
    print(f"resumed from step {resume_from}: mean loss deviation {100 * deviation:.3f}% "
          f"({'within' if ok else 'OUTSIDE'} {100 * DELTA_TOLERANCE:.0f}% for a delta step; "
          f"a full step must match exactly)")
    print(f"\nthe checkpoints are in {out}: list them with `deltackpt ls {shlex.quote(args.out)}`, "
          f"remove them with `rm -r {shlex.quote(args.out)}`")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltackpt demo`` (and ``python -m deltackpt.app.demo``): parse ``argv``, run."""
    parser = argparse.ArgumentParser(
        prog="deltackpt demo", description=DESCRIPTION,
        epilog="examples:\n  deltackpt demo\n  deltackpt demo --size large --steps 200 --every 20\n"
               "  deltackpt demo --compression aggressive --out /tmp/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
