"""Smoke test of an installed deltackpt: the API saves and restores a training state, and the
``deltackpt`` command of the environment compiles its kernels (``warm``), prints its version,
lists, verifies and exports it.

Run it with the python of an environment where the wheel is installed, from outside the source
tree (``.ci/run`` does, after building the wheel and installing it into a fresh venv)::

    cd /tmp && /path/to/venv/bin/python /path/to/repo/.ci/wheel_smoke.py

It refuses to run against the source tree: a deltackpt imported from the checkout would hide a
module missing from the wheel. Exits non-zero, saying what failed, on any failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import deltackpt

REPO = Path(__file__).resolve().parent.parent


def command(*args: object) -> str:
    """Run the environment's ``deltackpt`` console script; its stdout, after checking it exited 0."""
    script = Path(sys.executable).parent / "deltackpt"
    proc = subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"deltackpt {' '.join(map(str, args))} exited {proc.returncode}:\n"
                 f"{proc.stdout}{proc.stderr}")
    return proc.stdout


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on a random regression batch."""
    x = torch.randn(16, 32)
    nn.functional.mse_loss(model(x), torch.zeros(16, 8)).backward()
    optimizer.step()
    optimizer.zero_grad()


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def dcp_round_trip(path: Path, model: nn.Module) -> None:
    """A model saved with dcp.save through deltackpt.dcp.Writer loads back bit for bit."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import deltackpt.dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, storage_writer=deltackpt.dcp.Writer(path, step=0))
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load({"model": loaded}, storage_reader=deltackpt.dcp.Reader(path))
    if not all(torch.equal(loaded[k], v) for k, v in saved.items()):
        sys.exit("a step saved through deltackpt.dcp did not load back bit for bit")


def main() -> None:
    installed = Path(deltackpt.__file__).resolve()
    if REPO in installed.parents:
        sys.exit(f"deltackpt is imported from the source tree ({installed}), not from an installed wheel")
    command("warm")  # compiles the kernels into the cache beside the installed package
    if not any((installed.parent / "kernels" / "__pycache__").glob("*.nbi")):
        sys.exit("deltackpt warm left no Numba cache beside the installed package")
    torch.manual_seed(0)
    model, optimizer = build()
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        with deltackpt.CheckpointManager(path, full_every=2) as mgr:
            for step in (1, 2):  # a full step, then a delta step
                train(model, optimizer)
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
                mgr.save(step, model=model, optimizer=optimizer)

        reader = deltackpt.CheckpointManager(path, read_only=True)
        full = reader.restore(1).model
        if not all(torch.equal(full[k], v) for k, v in saved[1].items()):
            sys.exit("the full step 1 did not restore bit for bit")
        model2, optimizer2 = build()
        reader.load(2, model=model2, optimizer=optimizer2)
        for name, value in model2.state_dict().items():  # the delta's error is a fraction of the rms
            error = (value - saved[2][name]).norm() / saved[2][name].norm()
            if not error < 0.25:
                sys.exit(f"delta step 2 restored {name} with relative error {error:.3f}")

        version = command("--version")
        if version != f"deltackpt {deltackpt.__version__}\n":
            sys.exit(f"deltackpt --version printed {version!r}")
        listing = json.loads(command("ls", path, "--json"))
        kinds = [(row["step"], row["kind"]) for row in listing["steps"]]
        if kinds != [(1, "full"), (2, "delta")]:
            sys.exit(f"deltackpt ls listed {kinds}")
        if "2 steps checked: all intact" not in command("verify", path):
            sys.exit("deltackpt verify did not report both steps intact")
        command("info", path, "--step", "2")
        command("restore", path, "--format", "safetensors", "--out", Path(tmp) / "export")  # interop
        if not (Path(tmp) / "export" / "model.safetensors").is_file():
            sys.exit("deltackpt restore --format safetensors wrote no model.safetensors")
        dcp_round_trip(Path(tmp) / "dcp", model2)
    print(f"wheel smoke test passed: deltackpt {deltackpt.__version__} from {installed.parent}: "
          "warm, save and restore (full and delta), --version, ls, verify, info, restore --format "
          "safetensors, deltackpt.dcp")


if __name__ == "__main__":
    main()
