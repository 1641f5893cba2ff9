"""Start-up of the ``deltackpt`` command: the commands that only read metadata import neither
torch nor numba, so they start in a fraction of the time ``import torch`` takes
(``bench/bench_startup.py`` measures it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import deltackpt
from deltackpt import CheckpointManager
from deltackpt.interop import OUT_FORMATS, SOURCE_FORMATS

HEAVY = ("torch", "numba", "deltackpt.kernels")

# Runs every command line in one interpreter, in order, and reports after each whether a heavy
# module has been imported so far (the first command that imports one is the culprit).
_DRIVER = """
import contextlib, io, json, sys
from deltackpt.app.cli import main
results = []
heavy = json.loads(sys.argv[2])
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help and --version
            code = exc.code or 0
    results.append({"code": code, "out": out.getvalue(),
                    "imported": [m for m in heavy if m in sys.modules]})
print(json.dumps(results))
"""


def run_in_one_process(*argvs: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A full step and a delta step of a small trained model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path_factory.mktemp("startup") / "ckpt"
    with CheckpointManager(path, full_every=2) as mgr:
        for step in (1, 2):
            nn.functional.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.save(step, model=model, optimizer=optimizer)
    assert [mgr.info(s).kind for s in (1, 2)] == ["full", "delta"]
    return str(path)


def test_metadata_commands_import_neither_torch_nor_numba(ckpt: str) -> None:
    light = [["--version"], ["--help"], *([c, "--help"] for c in ("ls", "restore", "convert", "gc")),
             ["ls", ckpt], ["ls", ckpt, "--json"], ["info", ckpt], ["info", ckpt, "--step", "1", "--json"],
             ["du", ckpt], ["du", ckpt, "--json"], ["verify", ckpt],
             ["verify", ckpt, "--step", "2", "--json"]]
    results = run_in_one_process(*light, ["verify", ckpt, "--deep"])
    for argv, result in zip(light, results, strict=False):
        assert (result["code"], result["imported"]) == (0, []), (argv, result)
    assert json.loads(results[light.index(["ls", ckpt, "--json"])]["out"])["total"]["steps"] == 2
    assert "2 steps checked: all intact" in results[light.index(["verify", ckpt])]["out"]
    deep = results[-1]  # decoding does need them: the check above can see an import
    assert deep["code"] == 0 and set(deep["imported"]) == set(HEAVY), deep


def test_package_attributes_import_on_first_use() -> None:
    """``import deltackpt`` is light; every public name still resolves, to the object of its
    module, and names the package does not have raise AttributeError."""
    for name in deltackpt.__all__:
        assert getattr(deltackpt, name) is not None, name
    assert deltackpt.CheckpointManager is CheckpointManager
    assert set(deltackpt.__all__) <= set(dir(deltackpt))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        deltackpt.Nope  # noqa: B018
    from deltackpt.interop import exporters, sources

    assert tuple(sources.READERS) == SOURCE_FORMATS  # the names the command line offers
    assert exporters.OUT_FORMATS == OUT_FORMATS


def test_import_deltackpt_is_light() -> None:
    code = f"import sys, deltackpt, deltackpt.app.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr
