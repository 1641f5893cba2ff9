"""How few bits a delta could take at the precision the presets keep: measured against the
entropy bounds of scalar dithered quantization and of any coder at all.

For an AdamW or SGD-momentum cell of the fidelity matrix (:mod:`fidelity`) saved every 20
steps, this trains
the run for real, saves it through the public API with the ``balanced`` and ``aggressive``
presets, and for the delta at the restore point compares, per element and class:

* ``measured``: the bits the step's chunks take (its metadata's statistics);
* ``scalar``: the entropy of the keys an ideal memoryless entropy coder would need for the
  preset's scalar quantizer: ``H(round(x / s + u))`` for classes coded against the base on a
  fixed dithered grid (weights, ``exp_avg_sq``; ``u`` is the previous save's error), and
  ``I(x; x + u)`` for the first moment (``exp_avg``, ``momentum_buffer``), dithered anew each
  save, which a coder conditioned on the dither reaches (Zamir and Feder);
* ``bound``: what any coder needs at the same mean square error: the Shannon lower bound for
  the weights (their error does not accumulate, closed loop), and for the moments, whose error
  must be unbiased (``E[error | value] = 0``), ``0.5 log2(1 + var / D)`` less the source's
  distance from a Gaussian: the information any unbiased error of variance ``D`` lets through.

``x`` is each value in units of its element's step as the delta's own chunks state it
(FORMAT.md 3.2: the codec's steps, whatever chose them): the weight's change since the previous
save; ``exp_avg`` and SGD's momentum less their decayed previous values, Adam's steps
``step * (sqrt(v) + eps)`` shaped by ``sqrt(sqrt(v) + floor)`` with ``v`` the save's
``exp_avg_sq`` (its reconstruction is within a step of it); the change of ``exp_avg_sq``'s
ordinal keys since the previous save. ``D`` is the error variance, ``1 / 12`` in those units.
Each tensor of at least 4096 elements counts by its size. ``scalar`` is a memoryless coder's
figure, not a bound on every coder: the codec stores fewer bits than it on some tensors (the
MLP's input layer: 1.16 against 1.33 bits an element, which the entropy of each block's
symbols alone does not explain, 1.32).

    python bench/rate_bound.py [--tasks gpt-small,gpt-tiny,mlp,cnn-bn] [--optimizers adamw-0.95,sgd]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity

from deltackpt import CheckpointManager
from deltackpt.format.metadata import StepMetadata
from deltackpt.kernels.quant import numpy_element_steps, numpy_keys

INTERVAL = 20
MIN_ELEMENTS = 4096


def _entropy(keys: torch.Tensor) -> float:
    """Order-0 entropy of integer ``keys`` in bits a key."""
    _, counts = torch.unique(keys, return_counts=True)
    p = counts.double() / counts.sum()
    return float(-(p * p.log2()).sum())


def differential_entropy(x: torch.Tensor, width: float) -> float:
    """Differential entropy of ``x`` in bits, from a histogram of bins of ``width``."""
    return _entropy(torch.round(x / width)) + math.log2(width)


def fixed_grid_bits(x: torch.Tensor, step: float, gen: torch.Generator) -> float:
    """Bits a key of ``x`` quantized on a grid shifted by a uniform error of the previous save."""
    return _entropy(torch.round(x / step + torch.rand(x.shape, generator=gen, dtype=x.dtype) - 0.5))


def fresh_dither_bits(x: torch.Tensor, step: float, gen: torch.Generator) -> float:
    """``I(x; x + u)`` for ``u`` uniform over one ``step``: the bits a key dithered anew takes
    when coded given its dither."""
    y = x / step + torch.rand(x.shape, generator=gen, dtype=x.dtype) - 0.5
    return differential_entropy(y, 1 / 64)


def shannon_bound(x: torch.Tensor, mse: float) -> float:
    """Least bits of any coder of ``x`` within mean square error ``mse``."""
    h = differential_entropy(x, math.sqrt(mse) / 32)
    return max(0.0, h - 0.5 * math.log2(2 * math.pi * math.e * mse))


def unbiased_bound(x: torch.Tensor, mse: float) -> float:
    """Least bits of any coder of ``x`` whose error is unbiased with variance ``mse``: its
    restored value tells at least what a Gaussian channel of that noise does, less how far
    ``x`` is from a Gaussian of its variance."""
    var = float(x.var())
    h = differential_entropy(x, math.sqrt(min(var, mse)) / 32)
    return max(0.0, 0.5 * math.log2(1 + var / mse) - (0.5 * math.log2(2 * math.pi * math.e * var) - h))


def element_steps(meta: StepMetadata, name: str, scale: torch.Tensor | None) -> torch.Tensor:
    """Each element's step in the quant chunks of tensor ``name`` of step ``meta``, as FORMAT.md
    3.2 has the reader compute it (``numpy_element_steps``), float64; ``scale``: the values of
    the tensor that scales them (the save's, which its reconstruction is within a step of)."""
    record = next(r for r in meta.tensors if r.name == name)
    steps = torch.full((record.numel,), math.nan, dtype=torch.float64)  # NaN: in no chunk
    size = getattr(torch, record.dtype).itemsize
    for chunk in record.fragments[0].chunks:
        if chunk.codec != "quant":
            raise ValueError(f"step {meta.step}: {name} holds a {chunk.codec} chunk")
        params = chunk.params
        lo, hi = chunk.raw_offset // size, (chunk.raw_offset + chunk.raw_length) // size
        floor = 2.0 ** params["floor_log2"] if "floor_log2" in params else 0.0
        values = scale[lo:hi].float().numpy() if "scale" in params else None
        steps[lo:hi] = torch.from_numpy(np.asarray(numpy_element_steps(
            params["step"], values, params.get("eps", 0.0), floor), dtype=np.float64))
    return steps


def _residuals(prev: dict, cur: dict, order: list[str], group: dict, meta: StepMetadata):
    """``(class, x)`` for every tensor of at least MIN_ELEMENTS elements, in the units above
    (``meta``: the step measured, whose chunks give every element's step)."""
    adam = "betas" in group
    for i, name in enumerate(order):
        s, s0 = cur["optimizer"]["state"][i], prev["optimizer"]["state"][i]
        w, w0 = cur["model"][name].double(), prev["model"][name].double()
        if w.numel() < MIN_ELEMENTS:
            continue
        state = f"optimizer/state/{name}"
        if adam:
            m, v = s["exp_avg"].double().flatten(), s["exp_avg_sq"].flatten()
            m0, v0 = s0["exp_avg"].double().flatten(), s0["exp_avg_sq"].flatten()
            yield "first_moment", (m - group["betas"][0] ** INTERVAL * m0) / element_steps(
                meta, f"{state}/exp_avg", v)
            keys = torch.from_numpy(numpy_keys(v.float().numpy()) - numpy_keys(v0.float().numpy()))
            yield "second_moment", keys.double() / element_steps(meta, f"{state}/exp_avg_sq", None)
        else:
            buf, buf0 = s["momentum_buffer"].double().flatten(), s0["momentum_buffer"].double().flatten()
            yield "first_moment", (buf - group["momentum"] ** INTERVAL * buf0) / element_steps(
                meta, f"{state}/momentum_buffer", None)
        yield "weights", (w - w0).flatten() / element_steps(meta, f"model/{name}", None)


def measure(task_name: str, stop: int, presets: tuple[str, ...] = ("balanced", "aggressive"),
            optimizer: str = "adamw-0.95") -> dict:
    """Train ``task_name`` with ``optimizer`` to step ``stop`` saving every 20 steps, and compare
    the delta at ``stop`` with the bounds (module doc), per preset."""
    task, spec = fidelity.TASKS[task_name], fidelity.OPTIMIZERS[optimizer]
    if spec.family not in ("adam", "sgd-momentum"):
        raise ValueError(f"{optimizer}: the bounds here read Adam's moments or SGD's momentum")
    run = fidelity.Run.fresh(task, spec, 0)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        managers = {p: CheckpointManager(f"{root}/{p}", full_every=fidelity.FULL_EVERY, compression=p)
                    for p in presets}
        prev = None
        while run.step < stop:
            if run.step == stop - INTERVAL:
                prev = run.snapshot()
            run.train(INTERVAL)
            for mgr in managers.values():
                run.save(mgr)
        cur = run.snapshot()
        names = {id(p): n for n, p in run.model.named_parameters()}
        group = run.optimizer.param_groups[0]
        order = [names[id(p)] for g in run.optimizer.param_groups for p in g["params"]]
        report = {}
        for preset in presets:
            meta = managers[preset].metadata(stop)
            if meta.kind != "delta":
                raise ValueError(f"step {stop} of {task_name} is a {meta.kind} step")
            sums: dict[str, list[float]] = {}
            for cls, x in _residuals(prev, cur, order, group, meta):
                mse = 1 / 12
                scalar = (fresh_dither_bits if cls == "first_moment" else fixed_grid_bits)(x, 1.0, gen)
                bound = (shannon_bound if cls == "weights" else unbiased_bound)(x, mse)
                acc = sums.setdefault(cls, [0.0, 0.0, 0.0])
                acc[0] += x.numel() * scalar
                acc[1] += x.numel() * bound
                acc[2] += x.numel()
            classes = meta.stats.classes
            coded = sum(c["stored_bytes"] for k, c in classes.items() if k != "exact")
            other = meta.stats.stored_bytes - coded  # exact tensors, RNG states, extra
            row: dict = {"stored_bytes": meta.stats.stored_bytes, "raw_bytes": meta.stats.raw_bytes,
                         "other_bytes": other, "classes": {}}
            for cls, (scalar, bound, n) in sums.items():
                row["classes"][cls] = {
                    "measured": 8 * classes[cls]["stored_bytes"] / classes[cls]["elements"],
                    "scalar": scalar / n, "bound": bound / n, "elements": classes[cls]["elements"]}
            for what in ("measured", "scalar", "bound"):
                coded_bytes = sum(c[what] * c["elements"] / 8 for c in row["classes"].values())
                row[f"ratio_{what}"] = meta.stats.raw_bytes / (coded_bytes + other)
            report[preset] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="gpt-small,gpt-tiny,mlp,cnn-bn")
    parser.add_argument("--optimizers", default="adamw-0.95,sgd", help="fidelity.OPTIMIZERS names")
    parser.add_argument("--step", type=int, default=400, help="the delta step measured (mid-run)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = {}
    print(f"{'cell':<20} {'preset':<11} {'class':<14} {'measured':>8} {'scalar':>7} {'bound':>7}  "
          "(bits an element)")
    for task_name, optimizer in itertools.product(args.tasks.split(","), args.optimizers.split(",")):
        cell = f"{task_name}/{optimizer}"
        figures[cell] = measure(task_name, args.step, optimizer=optimizer)
        for preset, row in figures[cell].items():
            for cls, c in row["classes"].items():
                print(f"{cell:<20} {preset:<11} {cls:<14} {c['measured']:>8.3f} {c['scalar']:>7.3f} "
                      f"{c['bound']:>7.3f}")
            print(f"{cell:<20} {preset:<11} {'ratio':<14} {row['ratio_measured']:>7.1f}x "
                  f"{row['ratio_scalar']:>6.1f}x {row['ratio_bound']:>6.1f}x  "
                  f"(other bytes {row['other_bytes']})")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
