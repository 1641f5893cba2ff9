"""``deltackpt warm``: compile the kernels that saves and restores call into Numba's cache.

Numba compiles a kernel at its first call in an environment whose cache lacks it: a fresh
install, or a container started from an image that installed deltackpt but never ran it. There
the first saves and the first restore take tens of seconds more (65-70 s for an AdamW MLP's
first three saves and restore on 2 cores, 0.8 s once cached). :func:`warm` trains, saves and
restores a small model with each optimizer whose state is coded by meaning, in a temporary
directory, so that every kernel those saves and restores call is compiled and cached: next to
the package where that is writable, else in Numba's user-wide cache directory (or
``NUMBA_CACHE_DIR``). Run it once in an image's build step. It covers the host (Numba) path;
the Triton kernels of a delta coded on a GPU are compiled and cached by Triton.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from deltackpt.manager import CheckpointManager

# The optimizers whose runs warm() saves and restores: their names, and the optimizer and dtype
# of the model each trains.
RUNS: dict[str, tuple[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], torch.dtype]] = {
    "AdamW": (lambda params: torch.optim.AdamW(params, lr=1e-3), torch.float32),
    "SGD with momentum": (lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
                          torch.float32),
    "RMSprop, centered, with momentum": (lambda params: torch.optim.RMSprop(
        params, lr=1e-3, momentum=0.9, centered=True), torch.float32),
    "Adagrad": (lambda params: torch.optim.Adagrad(params, lr=1e-2), torch.float32),
    "Adam in bfloat16": (lambda params: torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.95)),
                         torch.bfloat16),
}
SAVES = 5  # a full step, and deltas at every depth of full_every=4, depth=3


def warm(log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Save and restore a small model trained with each optimizer of :data:`RUNS` (a BatchNorm
    MLP; RNG states drawn from between saves), every step restored; returns the seconds each
    run took (the first includes the kernels most runs share). ``log`` gets a line a run.
    torch's random number generator is left in the state it had."""
    seconds = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, (make_optimizer, dtype) in RUNS.items():
            started = time.perf_counter()
            _save_and_restore(make_optimizer, dtype)
            seconds[name] = time.perf_counter() - started
            if log is not None:
                log(f"{name}: {seconds[name]:.1f} s")
    return seconds


def _save_and_restore(make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                      dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))
    model = model.to(dtype)
    optimizer = make_optimizer(model.parameters())
    with tempfile.TemporaryDirectory(prefix="deltackpt-warm-") as path, \
            CheckpointManager(path, full_every=4, depth=3) as mgr:
        for step in range(SAVES):
            model(torch.randn(16, 64).to(dtype)).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.rand(1024)  # past 624 words: deltas store torch's RNG state as a twisted patch
            mgr.save(step, model, optimizer, blocking=True)
        for step in mgr.steps():
            mgr.restore(step)
