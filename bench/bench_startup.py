"""Start-up of the ``deltackpt`` command against ``python -c "import torch"``, in the same run.

The commands that only read metadata import neither torch nor numba
(``tests/test_startup.py``); the goal is ``deltackpt --version`` and
``deltackpt ls`` in under 0.3x the time of importing torch. Each command is a
fresh ``python -m deltackpt`` process (what the console script runs); the
summary gives the best round of each and its ratio to the baseline.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import note
from torch import nn

from deltackpt import CheckpointManager

ROUNDS = 7
BASELINE = "python -c 'import torch'"
_best: dict[str, float] = {}


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A full and a delta step of a small model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path_factory.mktemp("startup") / "ckpt"
    with CheckpointManager(path, full_every=2) as mgr:
        for step in (1, 2):
            model(torch.randn(4, 256)).sum().backward()
            optimizer.step()
            mgr.save(step, model=model, optimizer=optimizer)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def ratios() -> Iterator[None]:
    """After the module's benchmarks: each command's best round against the baseline's."""
    yield
    base = _best.get(BASELINE)
    for name, seconds in _best.items():
        if base and name != BASELINE:
            note(f"start-up: {name} {seconds:.3f} s = {seconds / base:.2f}x {BASELINE} ({base:.3f} s), "
                 f"best of {ROUNDS} (goal: under 0.3x)")


@pytest.mark.parametrize("name, args", [
    (BASELINE, ["-c", "import torch"]),
    ("deltackpt --version", ["-m", "deltackpt", "--version"]),
    ("deltackpt ls", ["-m", "deltackpt", "ls", None]),
], ids=["import-torch", "version", "ls"])
def test_startup(benchmark, ckpt: str, name: str, args: list[str | None]) -> None:
    argv = [sys.executable, *(ckpt if a is None else a for a in args)]
    benchmark.pedantic(_run, args=(argv,), rounds=ROUNDS, warmup_rounds=1)
    _best[name] = benchmark.stats.stats.min
