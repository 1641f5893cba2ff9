"""Asynchronous saves: how long training waits per save, beside the other ways to save the same
state, and what saving in the background costs a training run (issue 16, item 8).

``python bench/bench_async.py`` (CPU) runs each method in a process of its own, on the same
state (a TinyGPT trained with AdamW, seeded), and prints one table (the README's figures:
``--saves 5 --train-steps 30 --train-rounds 2``, 9 to 13 minutes on a shared 2-core machine,
and ``--methods none --train-rounds 4`` for the training run):

* the time the caller is blocked per save (median over ``--saves`` saves, one training step
  between them): a blocking deltackpt save, an asynchronous one (``blocking=False``: waiting
  for the save before it at ``max_in_flight=1``, capturing and copying the state), ``torch.save``
  with fsync, ``dcp.save``, ``dcp.async_save`` (waiting for the one before, as DCP asks), and the
  snapshot copy alone (capture and copy into the reused host buffers); goal: the asynchronous
  stall at most 1.2x the snapshot copy;
* bytes written per save, and the process's peak RSS and its growth over the RSS before the
  first save;
* the demo model (``--train-size``) trained with an asynchronous save every 10 steps against
  the same training without saves, alternated ``--train-rounds`` times: steps per second of each
  and their ratio (goal: at least 0.9x; the background encode competes with training for the
  same cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from pathlib import Path

import torch
from children import dir_bytes, run_child

from deltackpt import CheckpointManager
from deltackpt.app.training import (
    SIZES,
    TinyGPT,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)
from deltackpt.save.capture import capture
from deltackpt.save.snapshot import HostBuffers

METHODS = ["snapshot", "async", "blocking", "torch.save", "dcp.save", "dcp.async_save"]
BATCH = 16
SAVE_EVERY = 10  # training steps between the saves of the training run


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _setup(size: str, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, warmup=2, total=1000)
    train, _ = split_corpus(load_corpus())
    train_step(model, optimizer, scheduler, train, BATCH)  # the moments exist
    return model, optimizer, scheduler, train


def _durable_torch_save(obj: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def measure_method(method: str, size: str, saves: int, out: Path) -> dict:
    """In this process: ``saves`` saves by ``method``, one training step before each; the
    caller's blocked seconds of each, bytes written, RSS."""
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, optimizer, scheduler, train = _setup(size)
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor))
    rss_before = _rss_bytes()
    blocked, written = [], []
    mgr = CheckpointManager(out / "ckpt", full_every=10) \
        if method in ("async", "blocking") else None
    buffers = HostBuffers()
    pending = None
    for i in range(saves):
        train_step(model, optimizer, scheduler, train, BATCH)
        started = time.perf_counter()
        if method == "snapshot":
            buffers.take(capture(model, optimizer, None, True))
        elif method == "async":
            pending = mgr.save(i, model, optimizer, blocking=False)
        elif method == "blocking":
            written.append(mgr.save(i, model, optimizer).stored_bytes)
        elif method == "torch.save":
            _durable_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                                out / f"{i}.pt")
        elif method == "dcp.save":
            dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                     checkpoint_id=out / f"dcp-{i}")
        elif method == "dcp.async_save":
            if pending is not None:
                pending.result()
            pending = dcp.async_save({"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict()},
                                     checkpoint_id=out / f"dcp-{i}")
        blocked.append(time.perf_counter() - started)
    if method == "async":  # (each save waited for the one before: max_in_flight=1)
        mgr.wait()
        written = [mgr.info(i).stored_bytes for i in range(saves)]
    if method == "dcp.async_save":
        pending.result()
    if mgr is not None:
        mgr.close()
    if method == "torch.save":
        written = [(out / f"{i}.pt").stat().st_size for i in range(saves)]
    elif method.startswith("dcp"):
        written = [dir_bytes(out / f"dcp-{i}") for i in range(saves)]
    return {"method": method, "raw_bytes": raw, "blocked": blocked[1:],  # without the first
            "first_blocked": blocked[0], "written": written,
            "peak_rss": _peak_rss_bytes(), "rss_growth": _peak_rss_bytes() - rss_before}


def measure_training(size: str, steps: int, async_saves: bool, out: Path) -> dict:
    """Steps per second of ``steps`` training steps, with an asynchronous save every
    ``SAVE_EVERY`` steps or none (after a first save, which readies the kernels and buffers)."""
    model, optimizer, scheduler, train = _setup(size)
    with CheckpointManager(out / "ckpt", full_every=10, blocking=False) as mgr:
        mgr.save(0, model, optimizer).wait()
        stall = 0.0
        started = time.perf_counter()
        for step in range(1, steps + 1):
            train_step(model, optimizer, scheduler, train, BATCH)
            if async_saves and step % SAVE_EVERY == 0:
                t = time.perf_counter()
                mgr.save(step, model, optimizer)
                stall += time.perf_counter() - t
        seconds = time.perf_counter() - started
        mgr.wait()  # the last save ends after the timed steps, as in a run that goes on
    return {"steps_per_s": steps / seconds, "stall": stall}


def _print_methods(args: argparse.Namespace, methods: list[str]) -> None:
    """Time the save ``methods`` (the snapshot copy first: the others are given against it)."""
    print(f"TinyGPT {args.size}, one training step before each save, {args.saves} saves "
          f"(median of all but the first); {os.cpu_count()} CPUs")
    rows = {m: run_child(__file__, ["method", m, args.size, str(args.saves)]) for m in methods}
    raw = rows["snapshot"]["raw_bytes"]
    snapshot = statistics.median(rows["snapshot"]["blocked"])
    print(f"state: {raw / 2**20:.1f} MiB (weights and AdamW moments)\n")
    print(f"{'method':<16} {'blocked ms':>11} {'vs snapshot':>12} {'first ms':>9} "
          f"{'MiB written/save':>17} {'peak RSS MiB':>13} {'RSS growth MiB':>15}")
    for method in methods:
        r = rows[method]
        median = statistics.median(r["blocked"])
        written = statistics.mean(r["written"]) / 2**20 if r["written"] else 0.0
        print(f"{method:<16} {1e3 * median:>11.1f} {median / snapshot:>11.2f}x "
              f"{1e3 * r['first_blocked']:>9.1f} {written:>17.2f} {r['peak_rss'] / 2**20:>13.0f} "
              f"{r['rss_growth'] / 2**20:>15.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="medium", choices=sorted(SIZES),
                        help="the TinyGPT whose state the saves are timed on [%(default)s]")
    parser.add_argument("--saves", type=int, default=7, help="saves per method [%(default)s]")
    parser.add_argument("--train-size", default="small", choices=sorted(SIZES),
                        help="the model of the training run (the demo's) [%(default)s]")
    parser.add_argument("--train-steps", type=int, default=40, help="[%(default)s]")
    parser.add_argument("--train-rounds", type=int, default=3,
                        help="alternated runs with and without saves [%(default)s]")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="the save methods timed, comma-separated; none: only the training "
                             "run [%(default)s]")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "method":
            result = measure_method(rest[0], rest[1], int(rest[2]), Path(args.tmp))
        else:
            result = measure_training(rest[0], int(rest[1]), rest[2] == "async", Path(args.tmp))
        print(json.dumps(result))
        return

    methods = [m for m in args.methods.split(",") if m in METHODS]
    if methods:
        _print_methods(args, ["snapshot", *(m for m in methods if m != "snapshot")])
    print(f"\ntraining TinyGPT {args.train_size}, {args.train_steps} steps, an asynchronous "
          f"save every {SAVE_EVERY} steps against none, {args.train_rounds} alternated rounds:")
    with_saves, without = [], []
    for _ in range(args.train_rounds):
        without.append(run_child(__file__, ["train", args.train_size, str(args.train_steps), "none"]))
        with_saves.append(run_child(__file__, ["train", args.train_size, str(args.train_steps), "async"]))
    a = statistics.median(r["steps_per_s"] for r in with_saves)
    b = statistics.median(r["steps_per_s"] for r in without)
    stall = statistics.median(r["stall"] for r in with_saves)
    rounds = [", ".join(f"{r['steps_per_s']:.2f}" for r in runs) for runs in (without, with_saves)]
    print(f"  without saves {b:.2f} steps/s, with saves {a:.2f} steps/s: {a / b:.3f}x "
          f"(training stalled {stall:.3f} s in all by a run's saves, median; steps/s of the "
          f"rounds: {rounds[0]} without, {rounds[1]} with)")


if __name__ == "__main__":
    main()
