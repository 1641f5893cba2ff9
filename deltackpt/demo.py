"""``deltackpt demo``: train a small GPT on real text, checkpoint it, resume from a checkpoint.

The main job of the README. It shows the promises on a real run:
checkpoints are much smaller than ``torch.save``'s (a full lossless step,
then delta steps), any saved step restores into freshly built objects,
training resumed from the full step continues bit for bit as the
uninterrupted run did, and training resumed from a delta step stays within
a fraction of a percent of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from deltackpt.format import ROOT_MARKER
from deltackpt.manager import CheckpointManager
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options on ``parser``."""
    parser.add_argument("--out", default="deltackpt-demo",
                        help="checkpoint directory (a previous demo's directory is replaced) "
                             "[%(default)s]")
    parser.add_argument("--compression", default="balanced",
                        choices=["balanced", "aggressive", "lossless"],
                        help="what delta steps keep [%(default)s]")
    parser.add_argument("--steps", type=int, default=60, help="training steps [%(default)s]")
    parser.add_argument("--every", type=int, default=10, help="save every N steps [%(default)s]")
    parser.add_argument("--size", choices=sorted(SIZES), default="medium",
                        help="model size: tiny (~0.1M params), small (~1.9M), medium (~4.8M), large (~25M), "
                             "xl (~50M) "
                             "[%(default)s]")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch [%(default)s]")
    parser.add_argument("--resume-from", type=int, default=None,
                        help="a second saved step to resume from [a saved step near the middle]")
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


def _build(size: str, total_steps: int):
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, warmup=max(1, total_steps // 10), total=total_steps)
    return model, optimizer, scheduler


# Largest relative deviation of the mean resumed loss the demo accepts after a delta step.
DELTA_TOLERANCE = 0.02


def _resume(mgr: CheckpointManager, step: int, args: argparse.Namespace, train: torch.Tensor,
            losses: dict[int, float], model: torch.nn.Module) -> tuple[float, bool]:
    """Resume from ``step`` in fresh objects; relative deviation of the mean loss, same weights."""
    model2, optimizer2, scheduler2 = _build(args.size, args.steps)
    extra = mgr.load(step, model=model2, optimizer=optimizer2)
    scheduler2.load_state_dict(extra["scheduler"])
    resumed = [train_step(model2, optimizer2, scheduler2, train, args.batch)
               for _ in range(step + 1, args.steps + 1)]
    original = [losses[s] for s in range(step + 1, args.steps + 1)]
    deviation = abs(sum(resumed) / sum(original) - 1) if resumed else 0.0
    same = all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    return deviation, same and resumed == original


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 if resuming from the full step matched the original run exactly
    and resuming from the other step stayed within tolerance."""
    if args.steps < 2 or args.every < 1 or args.every >= args.steps:
        raise ValueError("need --steps >= 2 and 1 <= --every < --steps")
    save_steps = list(range(args.every, args.steps + 1, args.every))
    resume_from = args.resume_from if args.resume_from is not None else save_steps[(len(save_steps) - 1) // 2]
    if resume_from not in save_steps:
        raise ValueError(f"--resume-from {resume_from} is not a saved step; saved steps: {save_steps}")

    torch.manual_seed(args.seed)
    train, held_out = split_corpus(load_corpus())
    model, optimizer, scheduler = _build(args.size, args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"TinyGPT '{args.size}': {n_params / 1e6:.2f}M parameters, trained on "
          f"{len(train) / 2**20:.1f} MiB of Python standard library source; "
          f"AdamW, {args.steps} steps, checkpoint every {args.every} into {args.out}\n")
    print(f"{'step':>6} {'loss':>7} {'kind':>5} {'raw':>12} {'stored':>12} {'ratio':>6} "
          f"{'save s':>7} {'torch.save':>12} {'t.s. s':>7}")

    if (Path(args.out) / ROOT_MARKER).is_file():  # a previous demo's directory
        shutil.rmtree(args.out)
    mgr = CheckpointManager(args.out, compression=args.compression)
    losses: dict[int, float] = {}
    totals = {"stored": 0, "torch": 0, "seconds": 0.0, "torch_seconds": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.steps + 1):
            losses[step] = train_step(model, optimizer, scheduler, train, args.batch)
            if step not in save_steps:
                continue
            info = mgr.save(step, model=model, optimizer=optimizer,
                            extra={"scheduler": scheduler.state_dict(), "loss": losses[step]})
            torch_bytes, torch_seconds = _torch_save_with_fsync(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
                Path(tmp) / "ckpt.pt")
            totals["stored"] += info.stored_bytes
            totals["torch"] += torch_bytes
            totals["seconds"] += info.seconds
            totals["torch_seconds"] += torch_seconds
            print(f"{step:>6} {losses[step]:>7.4f} {info.kind:>5} {_mib(info.raw_bytes):>12} "
                  f"{_mib(info.stored_bytes):>12} {info.ratio:>5.2f}x {info.seconds:>7.3f} "
                  f"{_mib(torch_bytes):>12} {torch_seconds:>7.3f}")
    final_eval = eval_loss(model, held_out)

    full_step = save_steps[0]
    print(f"\nresuming in freshly built objects from step {full_step} ({mgr.info(full_step).kind}) "
          f"and from step {resume_from} ({mgr.info(resume_from).kind}), training to step "
          f"{args.steps} again")
    _, exact = _resume(mgr, full_step, args, train, losses, model)
    deviation, same = _resume(mgr, resume_from, args, train, losses, model)
    lossy = mgr.info(resume_from).kind == "delta"
    mgr.close()

    print(f"\nsummary: {len(save_steps)} checkpoints, deltackpt {_mib(totals['stored']).strip()} "
          f"in {totals['seconds']:.2f} s vs torch.save {_mib(totals['torch']).strip()} in "
          f"{totals['torch_seconds']:.2f} s ({totals['torch'] / totals['stored']:.2f}x smaller)")
    print(f"final loss {losses[args.steps]:.4f}, held-out loss {final_eval:.4f}")
    print(f"resumed from step {full_step}: "
          f"{'training continued identically' if exact else 'MISMATCH'}")
    ok = exact and (deviation <= DELTA_TOLERANCE if lossy else same)
    print(f"resumed from step {resume_from}: mean loss deviation {100 * deviation:.3f}% "
          f"({'within' if ok else 'OUTSIDE'} {100 * DELTA_TOLERANCE:.0f}% for a delta step; "
          f"a full step must match exactly)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m deltackpt.demo``."""
    parser = argparse.ArgumentParser(prog="deltackpt demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
