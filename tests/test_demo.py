"""``deltackpt demo`` (the README's main command), shortened: it readies the kernels before
timing anything and says so, resumes exactly from its full step and within tolerance from a
delta step, and says where it wrote and how to remove it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from deltackpt.app.cli import main


def test_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    out = "demo out"  # a path the removal command must quote
    assert main(["demo", "--size", "tiny", "--steps", "6", "--every", "2", "--batch", "4", "--out", out]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    kinds = [line.split()[2] for line in lines if line.split()[:1] in (["2"], ["4"], ["6"])]
    assert kinds == ["full", "delta", "delta"], text
    assert any(line.startswith("Numba kernels ready in ") and "before any timing" in line for line in lines)
    assert "resumed from step 2: training continued identically to step 4" in text
    assert "resumed from step 4: mean loss deviation" in text and "(within 2%" in text
    assert lines[-1] == (f"the checkpoints are in {tmp_path / out}: list them with "
                         f"`deltackpt ls {shlex.quote(out)}`, remove them with `rm -r {shlex.quote(out)}`")
    assert (tmp_path / out / "deltackpt.json").is_file()


def test_demo_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: deltackpt demo")
    assert all(option in text for option in ("--steps", "--every", "--size", "--out", "--resume-from"))
