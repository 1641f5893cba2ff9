"""Restore time by depth, by the size of the state: what a step costs to restore through the
deltas under it, against its full step.

For each model (:mod:`fidelity`'s tasks, AdamW with betas (0.9, 0.95), real training on
Python's sources) it saves ``--saves`` times (default 9: the default schedule puts them at
depths 0 to 8), ``--interval`` steps apart, with the default settings, then restores each step
in a fresh read-only manager as a resuming process does (:func:`long_run.restore_times`), in
``--rounds`` rounds, each also timing what the deepest restore spends reading and validating
the metadata of its chain. The state's size decides what dominates: on a small one, fixed
costs a step (its metadata, a task a chunk); on a large one, the decode of each delta. Then
it splits the CPU time of the full step's restore and of the deepest's by phase
(:mod:`cpu_accounting`, medians of the rounds), and gives the deepest's CPU without its decode
kernel over the full step's: what no faster kernel can take below.

Run ``python bench/restore_depth.py`` (about 4 minutes on 2 cores) or with ``--models``;
``--json FILE`` keeps the report."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_accounting import CHAIN_KERNEL, CpuAccounting
from fidelity import OPTIMIZERS, TASKS, Run
from long_run import depth_of, restore_times

from deltackpt import CheckpointManager
from deltackpt.io.reader import chain_of, read_metadata
from deltackpt.io.storage import open_storage


def metadata_seconds(path: Path, step: int) -> float:
    """Seconds to read and validate the metadata of ``step``'s chain."""
    storage = open_storage(str(path))
    started = time.perf_counter()
    chain_of(storage, read_metadata(storage, step))
    return time.perf_counter() - started


def cpu_by_phase(path: Path, step: int) -> dict[str, float]:
    """CPU seconds by phase (``total``: the process's) of restoring ``step`` in a fresh
    read-only manager."""
    with CheckpointManager(path, read_only=True) as mgr, CpuAccounting() as accounting:
        started = time.process_time()
        mgr.restore(step)
        total = time.process_time() - started
    return {"total": total, **accounting.cpu}


def restore_by_depth(task: str, saves: int, interval: int, rounds: int, root: Path) -> dict:
    """Train ``task`` for ``saves`` saves and time the restore of each depth, in ``rounds``
    rounds of every depth and the deepest's metadata: each ratio is the median of the rounds'
    (the machines are noisy, and their speed changes between rounds, not within one)."""
    run = Run.fresh(TASKS[task], OPTIMIZERS["adamw-0.95"])
    path = root / task
    with CheckpointManager(path) as mgr:
        for _ in range(saves):
            run.train(interval)
            run.save(mgr)
    depths = depth_of(CheckpointManager(path, read_only=True))
    deepest = max(depths, key=lambda step: (depths[step], step))
    measured = [(restore_times(path, 1), metadata_seconds(path, deepest)) for _ in range(rounds)]
    by_depth = sorted(measured[0][0])
    full = min(depths, key=lambda step: (depths[step], step))
    cpu = {label: [cpu_by_phase(path, step) for _ in range(rounds)]
           for label, step in (("full", full), ("deepest", deepest))}
    cpu = {label: {phase: statistics.median(r.get(phase, 0.0) for r in runs)
                   for phase in set().union(*runs)} for label, runs in cpu.items()}
    return {"task": task, "raw_bytes": run.raw_bytes(), "saves": saves, "interval": interval,
            "full_seconds": statistics.median(t[0]["seconds"] for t, _ in measured),
            "ratio_by_depth": {d: statistics.median(t[d]["seconds"] / t[0]["seconds"]
                                                    for t, _ in measured) for d in by_depth},
            "deepest_metadata_share": statistics.median(
                m / t[max(by_depth)]["seconds"] for t, m in measured),
            "cpu_by_phase": cpu}


def table(report: dict) -> str:
    """One line a model: restore time by depth against its full step's."""
    return (f"{report['task']} (state {report['raw_bytes'] / 1e6:.1f} MB): full step "
            f"{report['full_seconds'] * 1e3:.0f} ms; by depth " + ", ".join(
                f"{d}: {r:.2f}x" for d, r in report["ratio_by_depth"].items())
            + f"; the deepest's metadata {report['deepest_metadata_share']:.0%} of its restore"
            + "\n" + cpu_table(report["cpu_by_phase"]))


def cpu_table(cpu: dict[str, dict[str, float]]) -> str:
    """The full step's and the deepest step's restore CPU by phase, and the deepest's without
    its decode kernel over the full step's."""
    full, deep = cpu["full"], cpu["deepest"]
    phases = sorted((set(full) | set(deep)) - {"total"}, key=lambda p: -deep.get(p, 0.0))
    lines = [f"  CPU ms, full step / deepest: total {full['total'] * 1e3:.0f} / "
             f"{deep['total'] * 1e3:.0f} ({deep['total'] / full['total']:.2f}x); without the "
             f"decode kernel {(deep['total'] - deep.get(CHAIN_KERNEL, 0.0)) / full['total']:.2f}x"]
    lines += [f"    {phase:<44} {full.get(phase, 0.0) * 1e3:8.1f} {deep.get(phase, 0.0) * 1e3:8.1f}"
              for phase in phases]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt-tiny,gpt-small,gpt-large")
    parser.add_argument("--saves", type=int, default=9)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reports = []
    with tempfile.TemporaryDirectory(prefix="deltackpt-restore-") as tmp:
        for task in args.models.split(","):
            reports.append(restore_by_depth(task, args.saves, args.interval, args.rounds,
                                            Path(tmp)))
            print(table(reports[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
