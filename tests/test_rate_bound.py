"""The rate bench (bench/rate_bound.py) measures against the quantizer the codec runs.

Its figures come from real runs in the bench; this checks that the per-element steps it
divides each class by are the codec's: a restored weight, first moment and second moment (in
ordinal keys) lies within half its step of the saved one, and reaches nearly that far (a step
twice too large or too small fails).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.format.metadata import StepMetadata
from deltackpt.kernels.quant import numpy_keys

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
rate_bound = importlib.import_module("rate_bound")


def _saved_delta(mgr: CheckpointManager, model: nn.Linear, optimizer: torch.optim.Optimizer
                 ) -> StepMetadata:
    """Steps 5 (full) and 10 (a delta) of ``model`` trained in its own dtype; step 10's
    metadata."""
    for step in (5, 10):
        for _ in range(5):
            loss = model(torch.randn(32, 64, dtype=model.weight.dtype)).float().square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mgr.save(step, model, optimizer, rng=False)
    meta = mgr.metadata(10)
    assert meta.kind == "delta"
    return meta


def _reach(restored: torch.Tensor, saved: torch.Tensor, steps: torch.Tensor) -> float:
    return float(((restored.double().flatten() - saved.double().flatten()).abs() / steps).max())


def test_every_class_restores_within_half_the_steps_it_reads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path, full_every=10) as mgr:
        meta = _saved_delta(mgr, model, optimizer)
        chunk = next(r for r in meta.tensors if r.name == "optimizer/state/weight/exp_avg"
                     ).fragments[0].chunks[0]
        assert "floor_log2" in chunk.params  # shaped steps: what the bench once left out
        saved = {"weight": model.weight.detach().clone(),
                 **{k: t.clone() for k, t in optimizer.state[model.weight].items()}}
        restored_model = nn.Linear(64, 64, bias=False)
        restored = torch.optim.AdamW(restored_model.parameters(), lr=1e-3)
        mgr.load(10, restored_model, restored)
    state = restored.state[restored_model.weight]

    def keys(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(numpy_keys(t.flatten().numpy()).astype(np.float64))

    reaches = {
        "weights": _reach(restored_model.weight.detach(), saved["weight"],
                          rate_bound.element_steps(meta, "model/weight", None)),
        "first_moment": _reach(state["exp_avg"], saved["exp_avg"], rate_bound.element_steps(
            meta, "optimizer/state/weight/exp_avg", state["exp_avg_sq"].flatten())),
        "second_moment": _reach(keys(state["exp_avg_sq"]), keys(saved["exp_avg_sq"]),
                                rate_bound.element_steps(meta, "optimizer/state/weight/exp_avg_sq",
                                                         None)),
    }
    assert all(0.45 < r <= 0.5 + 1e-6 for r in reaches.values()), reaches


def test_steps_cover_every_element_of_a_bfloat16_tensor(tmp_path: Path) -> None:
    """Chunks count bytes: a bfloat16 tensor's 2-byte elements all get their chunk's step."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path, full_every=10, chunk_bytes=4096) as mgr:
        meta = _saved_delta(mgr, model, optimizer)
    chunks = next(r for r in meta.tensors if r.name == "model/weight").fragments[0].chunks
    assert len(chunks) == 2  # 8 KiB of bfloat16 in 4 KiB chunks
    steps = rate_bound.element_steps(meta, "model/weight", None)
    assert steps.shape == (4096,) and torch.equal(
        steps, torch.tensor([c.params["step"] for c in chunks], dtype=torch.float64
                            ).repeat_interleave(2048))
