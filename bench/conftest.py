"""Shared fixtures of the benchmarks: a really trained model, and a summary table of rates.

Run with ``pytest bench`` (see README). Every benchmark records the bytes it
processed and its output size in ``benchmark.extra_info``; the table printed
at the end gives GB/s and compression ratios side by side with the
baselines of the same run (memcpy, ``torch.save``, plain zstd).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deltackpt.training import (
    SIZES,
    TinyGPT,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)

CACHE = Path(__file__).parent / ".cache"
TRAIN_STEPS = int(os.environ.get("DELTACKPT_BENCH_TRAIN_STEPS", "200"))
MODEL_SIZE = os.environ.get("DELTACKPT_BENCH_SIZE", "medium")

_rows: list[dict] = []


@pytest.fixture(scope="session")
def trained() -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A TinyGPT trained with AdamW on real text, cached across runs in bench/.cache."""
    torch.manual_seed(0)
    model = TinyGPT(SIZES[MODEL_SIZE])
    optimizer = make_optimizer(model)
    path = CACHE / f"{MODEL_SIZE}-{TRAIN_STEPS}.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return model, optimizer
    train, _ = split_corpus(load_corpus())
    scheduler = make_scheduler(optimizer, warmup=TRAIN_STEPS // 10, total=TRAIN_STEPS)
    for _ in range(TRAIN_STEPS):
        train_step(model, optimizer, scheduler, train, batch_size=16)
    CACHE.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return model, optimizer


def record(benchmark, name: str, raw_bytes: int, out_bytes: int | None = None) -> None:
    """Attach sizes to a finished benchmark and queue a row for the summary table."""
    benchmark.extra_info.update({"raw_bytes": raw_bytes, "out_bytes": out_bytes})
    _rows.append({"name": name, "raw": raw_bytes, "out": out_bytes, "stats": benchmark.stats})


def pytest_terminal_summary(terminalreporter) -> None:
    """Print GB/s (from the fastest round) and ratios of every benchmark of the run."""
    rows = [r for r in _rows if r["stats"] is not None]
    if not rows:
        return
    base = {r["name"]: r["raw"] / r["stats"].stats.min for r in rows}
    write = terminalreporter.write_line
    write("")
    write(f"deltackpt benchmarks ({MODEL_SIZE} TinyGPT trained {TRAIN_STEPS} steps; GB/s of raw state, "
          "best round)")
    write(f"{'benchmark':<40} {'raw MB':>9} {'GB/s':>7} {'vs memcpy':>10} {'ratio':>7}")
    for r in rows:
        rate = base[r["name"]]
        rel = rate / base["memcpy"] if "memcpy" in base else float("nan")
        ratio = f"{r['raw'] / r['out']:.3f}x" if r["out"] else "-"
        write(f"{r['name']:<40} {r['raw'] / 1e6:>9.1f} {rate / 1e9:>7.3f} {rel:>9.3f}x {ratio:>7}")
