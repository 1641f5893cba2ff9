"""Whole-run storage of long runs: a directory of hundreds of saves against torch.save at each.

Each run trains a real model on real data (:mod:`fidelity`'s tasks: Python's own sources, nothing
downloaded) and saves it every ``interval`` training steps, ``saves`` times, through the public
API into one directory per setting: the presets ``balanced`` and ``aggressive`` and
``target_ratio=100`` with errors up to four times ``balanced``'s (``max_error=64``) with the
default schedule, ``balanced`` with ``full_every=10`` and a chain
of single steps (``depth=9``: the schedule before hierarchical references), and ``balanced``
under other schedules (:data:`SCHEDULES`). Every setting sees the same trajectory: the saves
never change the training.

Per run and setting it reports the directory's bytes (every file), the bytes ``torch.save``
writes for the same state at every save (model, optimizer and scheduler, measured at each
save), their ratio, the full steps, the deepest restore and the bytes by part
(:func:`bytes_by_part`: with them, how much less ``aggressive`` could store at most if the
classes it codes more coarsely took none), and for ``balanced`` under each schedule the time to
restore steps by their depth, each in a fresh read-only manager as a
resuming process does (median of ``--repeats``, after one restore untimed), against restoring
its full step; then a gc keeping every tenth save: its dry run's estimate against what it did.

Run ``python bench/long_run.py`` (about 15 minutes on 2 cores) or with ``--runs``, ``--saves``,
``--interval``; ``--json FILE`` keeps the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import OPTIMIZERS, TASKS, Run

from deltackpt import CheckpointManager
from deltackpt.encode.policy import CLASSES, CompressionConfig
from deltackpt.format.metadata import METADATA_FILE

RUNS = {"gpt-adamw": ("gpt-tiny", "adamw-0.95"), "cnn-sgd": ("cnn-bn", "sgd"),
        "mlp-adamw": ("mlp", "adamw-0.999")}
SETTINGS = {
    "balanced": {"compression": "balanced"},
    "aggressive": {"compression": "aggressive"},
    "target_ratio=100, max_error=64": {"compression": dataclasses.replace(
        CompressionConfig.preset("balanced"), target_ratio=100, max_error=64)},
    "balanced, full_every=10 chain": {"compression": "balanced", "full_every": 10, "depth": 9},
}
# balanced under other schedules: (full_every, depth)
SCHEDULES = [(128, 8), (256, 5), (64, 4)]


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def torch_save_bytes(run: Run) -> int:
    """Bytes ``torch.save`` writes for the state a save stores."""
    buffer = io.BytesIO()
    torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict()}, buffer)
    return buffer.tell()


def depth_of(mgr: CheckpointManager) -> dict[int, int]:
    """The deltas restoring each step of ``mgr`` decodes, by step."""
    out: dict[int, int] = {}
    for step in mgr.steps():
        meta = mgr.metadata(step)
        out[step] = 0 if meta.kind == "full" else out[meta.base_step] + 1
    return out


def bytes_by_part(mgr: CheckpointManager, path: Path) -> dict[str, int]:
    """The directory's bytes by what they hold: every step's metadata file, the full steps'
    stored bytes, and the delta steps' by class (their statistics: ``exact`` is what they store
    losslessly, RNG states and Adam's step counts among it)."""
    parts = {"metadata": sum(p.stat().st_size for p in path.rglob(METADATA_FILE)), "full": 0}
    for step in mgr.steps():
        meta = mgr.metadata(step)
        if meta.kind == "full":
            parts["full"] += meta.stats.stored_bytes
            continue
        for cls, stats in meta.stats.classes.items():
            parts[cls] = parts.get(cls, 0) + stats["stored_bytes"]
    return parts


def restore_times(path: Path, repeats: int) -> dict[int, dict]:
    """Median seconds to restore steps of each depth (two per depth: the first and the last)
    in a fresh read-only manager, by depth. Each round restores every step once, so a change
    in the machine's speed (they are noisy) weighs on all depths alike."""
    by_depth: dict[int, list[int]] = {}
    with CheckpointManager(path, read_only=True) as mgr:
        for step, depth in depth_of(mgr).items():
            by_depth.setdefault(depth, []).append(step)
        mgr.restore(by_depth[max(by_depth)][-1])  # warm
    picked = {depth: sorted({steps[0], steps[-1]}) for depth, steps in sorted(by_depth.items())}
    seconds: dict[int, list[float]] = {depth: [] for depth in picked}
    for _ in range(repeats):
        for depth, steps in picked.items():
            for step in steps:
                with CheckpointManager(path, read_only=True) as mgr:
                    started = time.perf_counter()
                    mgr.restore(step)
                    seconds[depth].append(time.perf_counter() - started)
    return {depth: {"steps": picked[depth], "seconds": statistics.median(seconds[depth])}
            for depth in picked}


def long_run(name: str, saves: int, interval: int, repeats: int, root: Path) -> dict:
    """Train run ``name`` for ``saves`` saves ``interval`` steps apart into every setting."""
    task, optimizer = RUNS[name]
    run = Run.fresh(TASKS[task], OPTIMIZERS[optimizer])
    settings = {**SETTINGS, **{f"balanced, full_every={f}, depth={d}": {
        "compression": "balanced", "full_every": f, "depth": d} for f, d in SCHEDULES}}
    managers = {label: CheckpointManager(root / name / f"s{i}", **options)
                for i, (label, options) in enumerate(settings.items())}
    baseline, kinds, started = 0, {label: [] for label in settings}, time.perf_counter()
    for _ in range(saves):
        run.train(interval)
        baseline += torch_save_bytes(run)
        for label, mgr in managers.items():
            kinds[label].append(run.save(mgr))
    report = {"run": name, "task": task, "optimizer": optimizer, "saves": saves,
              "interval": interval, "raw_bytes": run.raw_bytes(), "torch_save_bytes": baseline,
              "train_and_save_seconds": time.perf_counter() - started, "settings": {}}
    for i, (label, mgr) in enumerate(managers.items()):
        mgr.close()
        path = root / name / f"s{i}"
        size = directory_bytes(path)
        depths = list(depth_of(mgr).values())
        report["settings"][label] = {
            "bytes": size, "ratio": baseline / size, "full_steps": kinds[label].count("full"),
            "max_depth": max(depths), "mean_depth": statistics.fmean(depths),
            "parts": bytes_by_part(mgr, path),
            "restore": restore_times(path, repeats) if label not in SETTINGS or i == 0 else None}
    report["restore"] = report["settings"]["balanced"]["restore"]
    report["gc"] = gc_estimate(root / name / "s0", keep=f"every={10 * interval}")
    return report


def gc_estimate(path: Path, keep: str) -> dict:
    """A gc of ``keep`` on a copy of ``path``: what its dry run estimated, and what it then
    did."""
    copy = path.with_name(f"{path.name}-gc")
    shutil.copytree(path, copy)
    with CheckpointManager(copy, reader_grace=0) as mgr:
        dry = mgr.gc(keep, dry_run=True)
        done = mgr.gc(keep)
    return {"keep": keep, "bytes_before": done.bytes_before, "estimated_after": dry.bytes_after,
            "bytes_after": done.bytes_after, "recoded": len(done.recoded),
            "rewritten": len(done.rewritten), "removed": len(done.removed),
            "held": len(done.held)}


def coarser_classes() -> list[str]:
    """The classes ``aggressive`` codes otherwise than ``balanced``."""
    balanced, aggressive = (CompressionConfig.preset(name) for name in ("balanced", "aggressive"))
    return [cls for cls in CLASSES if getattr(balanced, cls) != getattr(aggressive, cls)]


def table(report: dict) -> str:
    """The report as text."""
    lines = [f"{report['run']} ({report['task']}, {report['optimizer']}): {report['saves']} saves "
             f"every {report['interval']} steps, state {report['raw_bytes'] / 1e6:.2f} MB, "
             f"torch.save at every save {report['torch_save_bytes'] / 1e6:.1f} MB"]
    for label, s in report["settings"].items():
        restore = s["restore"]
        worst = "" if restore is None else ", deepest restore {:.2f}x its full step's".format(
            max(r["seconds"] for r in restore.values()) / restore[0]["seconds"])
        lines.append(f"  {label:40s} {s['bytes'] / 1e6:8.2f} MB  {s['ratio']:6.1f}x  "
                     f"{s['full_steps']:3d} full  depth max {s['max_depth']} "
                     f"mean {s['mean_depth']:.1f}{worst}")
    for label in ("balanced", "aggressive"):
        parts = report["settings"][label]["parts"]
        lines.append(f"  {label} by part: " + ", ".join(
            f"{part} {size / 1e6:.2f} MB" for part, size in parts.items()))
    balanced, aggressive = (report["settings"][label]["bytes"] for label in ("balanced",
                                                                              "aggressive"))
    parts = report["settings"]["balanced"]["parts"]
    classes = coarser_classes()
    coarser = sum(parts.get(cls, 0) for cls in classes)
    lines.append(f"  aggressive stores {balanced / aggressive:.2f}x less than balanced; with no "
                 f"bytes at all for the classes it codes more coarsely ({', '.join(classes)}), "
                 f"at most {balanced / (balanced - coarser):.2f}x")
    full = report["restore"][0]["seconds"]
    lines.append("  restore (balanced, defaults), by depth: " + ", ".join(
        f"{d}: {r['seconds'] * 1e3:.0f} ms ({r['seconds'] / full:.2f}x)"
        for d, r in report["restore"].items()))
    gc = report["gc"]
    lines.append(f"  gc {gc['keep']} (balanced, defaults): {gc['bytes_before'] / 1e6:.2f} MB -> "
                 f"{gc['bytes_after'] / 1e6:.2f} MB, dry run estimated "
                 f"{gc['estimated_after'] / 1e6:.2f} MB ({gc['estimated_after'] / gc['bytes_after']:.2f}x); "
                 f"removed {gc['removed']}, re-coded {gc['recoded']}, rewrote {gc['rewritten']}, "
                 f"held {gc['held']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="gpt-adamw,cnn-sgd")
    parser.add_argument("--saves", type=int, default=300)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reports = []
    with tempfile.TemporaryDirectory(prefix="deltackpt-long-") as tmp:
        for name in args.runs.split(","):
            reports.append(long_run(name, args.saves, args.interval, args.repeats, Path(tmp)))
            print(table(reports[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
