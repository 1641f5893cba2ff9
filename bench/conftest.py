"""Shared fixtures of the benchmarks: a really trained model, and a summary table of rates.

Run with ``pytest bench`` (see README). Every benchmark records the bytes it
processed and its output size in ``benchmark.extra_info``; the table printed
at the end gives GB/s and compression ratios side by side with the
baselines of the same run (memcpy, ``torch.save``, plain zstd). A benchmark
measured against a baseline (:func:`paired`) times the baseline in the same
rounds, just before each of its own, and the table gives the ratio of their
median times: on a machine whose load changes from minute to minute, only
times taken side by side compare.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deltackpt.app.training import (
    SIZES,
    TinyGPT,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)

CACHE = Path(__file__).parent / ".cache"
# Models to measure, as size:training_steps. The medium model is trained long enough for its
# moments to settle; the large one (25M parameters, 300 MB of state) measures speed at scale.
MODELS = [(size, int(steps)) for size, steps in
          (item.split(":") for item in os.environ.get("DELTACKPT_BENCH_MODELS",
                                                       "medium:200,large:40").split(","))]

_rows: list[dict] = []
_notes: list[str] = []


@pytest.fixture(scope="session", params=MODELS, ids=[f"{size}-{steps}" for size, steps in MODELS])
def trained(request) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A TinyGPT trained with AdamW on real text, cached across runs in bench/.cache."""
    size, steps = request.param
    torch.manual_seed(0)
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    path = CACHE / f"{size}-{steps}.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return model, optimizer
    train, _ = split_corpus(load_corpus())
    scheduler = make_scheduler(optimizer, warmup=steps // 10, total=steps)
    for _ in range(steps):
        train_step(model, optimizer, scheduler, train, batch_size=16)
    CACHE.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return model, optimizer


def durable_torch_save(obj: dict, path: Path) -> None:
    """The baseline every save is compared with: ``torch.save``, flushed and fsynced."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def paired(benchmark, target: Callable[[], object], baseline: Callable[[], object], *,
           setup: Callable[[], None] | None = None, rounds: int) -> list[float]:
    """Benchmark ``target`` with ``baseline`` timed in the same rounds: in each round's untimed
    setup (after ``setup``), just before ``target``. Returns the baseline's times (seconds) of
    the measured rounds, for :func:`record`."""
    times: list[float] = []

    def before() -> None:
        if setup is not None:
            setup()
        started = time.perf_counter()
        baseline()
        times.append(time.perf_counter() - started)

    benchmark.pedantic(target, setup=before, rounds=rounds, warmup_rounds=1)
    return times[1:]  # without the warm-up round's


def record(benchmark, name: str, raw_bytes: int, out_bytes: int | None = None, *,
           baseline: tuple[str, list[float]] | None = None) -> None:
    """Attach sizes to a finished benchmark and queue a row for the summary table.

    Rows are grouped by the model the benchmark ran on (its ``trained`` parameter).
    ``baseline``: the name and times of the baseline :func:`paired` timed beside it.
    """
    model = benchmark.name.split("[", 1)[-1].rstrip("]") if "[" in benchmark.name else ""
    benchmark.extra_info.update({"raw_bytes": raw_bytes, "out_bytes": out_bytes})
    against = None
    if baseline is not None:
        against = (baseline[0], benchmark.stats.stats.median / statistics.median(baseline[1]))
        benchmark.extra_info["vs_baseline"] = {"baseline": baseline[0], "median_ratio": against[1]}
    _rows.append({"model": model, "name": name, "raw": raw_bytes, "out": out_bytes,
                  "stats": benchmark.stats, "against": against})


def note(text: str) -> None:
    """A line for the summary that is not a timing (e.g. a bound the ratios are compared with)."""
    _notes.append(text)


def pytest_terminal_summary(terminalreporter) -> None:
    """Print GB/s (from the fastest round), compression ratios and, against a baseline timed in
    the same rounds, the ratio of median times of every benchmark of the run."""
    rows = [r for r in _rows if r["stats"] is not None]
    write = terminalreporter.write_line
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        rate = {r["name"]: r["raw"] / r["stats"].stats.min for r in group}
        write("")
        write(f"deltackpt benchmarks, TinyGPT {model} (size-training steps); GB/s of raw state, best round")
        write(f"{'benchmark':<40} {'raw MB':>9} {'GB/s':>7} {'vs memcpy':>10} {'ratio':>7}  "
              "median time vs a baseline in the same rounds")
        for r in group:
            rel = f"{rate[r['name']] / rate['memcpy']:.3f}x" if "memcpy" in rate else "-"
            ratio = f"{r['raw'] / r['out']:.3f}x" if r["out"] else "-"
            against = f"{r['against'][1]:.2f}x {r['against'][0]}" if r["against"] else ""
            write(f"{r['name']:<40} {r['raw'] / 1e6:>9.1f} {rate[r['name']] / 1e9:>7.3f} {rel:>10} "
                  f"{ratio:>7}  {against}")
    for text in _notes:
        write(text)
