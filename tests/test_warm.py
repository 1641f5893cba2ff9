"""``deltackpt warm`` compiles what other runs' saves and restores call (deltackpt.app.warm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# In a fresh process: ``deltackpt warm``, then other runs than its own (other models, shapes,
# settings, asynchronous saves, loads into new models), which must find every kernel they call
# compiled or loaded by it: no Numba dispatcher of the package gains an overload. It leaves
# torch's RNG as it found it.
SCRIPT = """
import gc, json, sys
import torch
from numba.core.dispatcher import Dispatcher
from torch import nn
from deltackpt import CheckpointManager
from deltackpt.app.cli import main

def overloads():
    return {id(d): (d.py_func.__qualname__, len(d.overloads)) for d in gc.get_objects()
            if isinstance(d, Dispatcher) and d.py_func.__module__.startswith("deltackpt")}

def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10))

def run(path, make_model, make_optimizer, shape, dtype=torch.float32, **options):
    torch.manual_seed(1)
    model = make_model().to(dtype)
    optimizer = make_optimizer(model.parameters())
    with CheckpointManager(path, blocking=False, **options) as mgr:
        for step in range(7):
            out = model(torch.randn(*shape).to(dtype))
            (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.save(step, model, optimizer).wait()
        for step in mgr.steps():
            fresh = make_model().to(dtype)
            mgr.load(step, fresh, make_optimizer(fresh.parameters()))

state = torch.get_rng_state()
assert main(["warm"]) == 0
assert torch.equal(torch.get_rng_state(), state), "warm moved torch's RNG"
before = overloads()
root = sys.argv[1]
run(root + "/cnn", cnn, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1), (4, 3, 8, 8))
run(root + "/gru", lambda: nn.GRU(12, 24), lambda p: torch.optim.RMSprop(
    p, lr=1e-3, momentum=0.5, centered=True), (5, 2, 12), full_every=6)
run(root + "/bf16", lambda: nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3)),
    lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.95)), (8, 40), torch.bfloat16,
    compression="aggressive")
run(root + "/sgd", lambda: nn.Linear(100, 30), lambda p: torch.optim.SGD(
    p, lr=1e-2, momentum=0.9, nesterov=True), (8, 100), depth=2)
after = overloads()
print(json.dumps(sorted(name for key, (name, n) in after.items()
                        if n > before.get(key, (name, 0))[1])))
"""


def test_other_runs_find_every_kernel_compiled(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("AdamW: ") and lines[-2].startswith("compiled and cached in ")
    assert json.loads(lines[-1]) == [], "kernels warm left to compile"
