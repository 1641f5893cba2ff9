"""The whole-run storage bench (bench/long_run.py) accounts for what it reports.

A few saves of a small run through every setting: the directory's bytes and
their parts, the ratio to ``torch.save`` at every save, the restore depths,
and the bound on ``aggressive`` over the classes it codes more coarsely. The
figures themselves are measured by the bench on 300 saves, not asserted here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
long_run = importlib.import_module("long_run")


def test_long_run_accounts_for_every_byte(tmp_path: Path) -> None:
    report = long_run.long_run("mlp-adamw", saves=4, interval=2, repeats=1, root=tmp_path)
    assert report["saves"] == 4 and report["torch_save_bytes"] > 0
    for i, (label, s) in enumerate(report["settings"].items()):
        assert s["bytes"] == long_run.directory_bytes(tmp_path / "mlp-adamw" / f"s{i}"), label
        assert s["ratio"] == pytest.approx(report["torch_save_bytes"] / s["bytes"])
        assert s["full_steps"] >= 1 and s["max_depth"] <= 8
        parts = sum(s["parts"].values())
        assert 0.95 * s["bytes"] < parts <= s["bytes"], label  # the root marker is the rest
    assert set(report["restore"]) == set(range(report["settings"]["balanced"]["max_depth"] + 1))
    text = long_run.table(report)
    assert "aggressive stores" in text and "deepest restore" in text


def test_coarser_classes_are_those_aggressive_codes_otherwise() -> None:
    """aggressive codes every lossy class more coarsely than balanced; buffers stay exact."""
    assert long_run.coarser_classes() == ["weights", "first_moment", "second_moment"]
