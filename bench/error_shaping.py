"""What shaping a class's error by Adam's second moment would buy: steps lost against bits.

The presets bound a weight's error per tensor, in units of how far the optimizer moves it a
step, and a first moment's per element in units of the update it drives: within a tensor every
element gets the same error. Where the loss is more sensitive to some elements than others,
the same bits spent unevenly cost less. Adam's bias-corrected second moment ``v`` is the
run's own per-element sensitivity estimate (its square root is the scale of the element's
recent gradients), so this bench gives element ``i`` the step ``c * unit * s_i`` with ``s_i =
(sqrt(v_i) + floor) ** (-2 * alpha)``, normalized to a geometric mean of 1 over the tensor (as
many bits in the fine-step limit), ``floor`` being ``--kappa`` (1/16) times the tensor's root mean
square of ``sqrt(v)`` (so that elements whose gradients were all zero do not take unbounded
errors). ``alpha = 0`` is the presets' uniform error.

For a cell (a :mod:`fidelity` task and optimizer, restored at ``--at`` after saves every
``--interval`` steps) it trains the run once, then for each step multiple ``c`` and ``alpha``
adds the error a dithered quantizer would leave (uniform within half a step, independent per
element) to one class, resumes 100 steps with ``--seeds`` draws and reports the steps of
progress lost against the exact run (:func:`fidelity.steps_lost`) beside the bits an element
that the codec's kernel, packing and zstd store of the symbols such a quantizer would code,
and their order-0 entropy (weights: the residual over the last interval; first moments: the
values). Comparing ``alpha`` at equal bits is the measure: an ``alpha`` whose
frontier lies below uniform's loses fewer steps for the same bytes.

Run ``python bench/error_shaping.py --task gpt-tiny --optimizer adamw-0.95 --cls weights``
(about a minute a multiple on 2 cores for gpt-tiny); ``--json FILE`` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import OPTIMIZERS, TASKS, Run, steps_lost

from deltackpt.codecs.lossless import zstd_compress
from deltackpt.encode.optimizers import movement_units
from deltackpt.encode.policy import CompressionConfig
from deltackpt.kernels.quant import encode_block_stream
from deltackpt.save.capture import capture, parameter_names

RESUME = 100
KAPPA = 1 / 16


def _adam_states(run: Run) -> list[tuple[torch.Tensor, dict, float, float]]:
    """Per parameter with Adam state: the parameter, its state, eps and the bias corrections'
    step count."""
    out = []
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            state = run.optimizer.state[p]
            if "exp_avg_sq" in state:
                out.append((p, state, group["eps"], float(state["step"])))
    return out


def _shape(v_hat: torch.Tensor, eps: float, alpha: float, kappa: float = KAPPA,
           group: str = "element") -> torch.Tensor:
    """Per-element step multipliers ``(sqrt(v_hat) + floor) ** (-2 alpha)``, geometric mean 1,
    ``floor`` being ``kappa`` times the root mean square of ``sqrt(v_hat)``; with ``group``
    ``row`` (a tensor's first dimension) or a number of consecutive elements, each group's
    elements share their geometric mean (what a step stored a group would give); ``rowcol``
    gives a matrix's element the product of a factor of its row and one of its column (the
    least-squares fit of the logarithms: what a step stored per row and per column would
    give)."""
    root = v_hat.sqrt()
    floor = kappa * float(v_hat.mean().sqrt()) + eps
    logs = (root + floor).log().mul(-2 * alpha).flatten()
    if group == "tensor":  # one factor a tensor, normalized over the class by class_steps
        return logs.mean().exp().expand(v_hat.shape)
    if group == "rowcol" and v_hat.dim() > 1:  # log s_ij fitted by a_i + b_j
        table = logs.reshape(v_hat.shape[0], -1)
        logs = (table.mean(1, keepdim=True) + table.mean(0, keepdim=True) - table.mean()).flatten()
    elif group not in ("element", "rowcol"):
        size = logs.numel() // v_hat.shape[0] if group == "row" else int(group)
        index = torch.arange(logs.numel()) // size
        sums = torch.zeros(int(index[-1]) + 1).index_add_(0, index, logs)
        logs = (sums / torch.bincount(index))[index]
    return (logs - logs.mean()).exp().reshape(v_hat.shape)


def class_steps(run: Run, cls: str, alpha: float, c: float, kappa: float = KAPPA,
                group: str = "element") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tensor, per-element step)`` for every tensor of class ``cls`` (``weights`` or
    ``first_moment``) of an Adam-family run, at ``c`` times the class's unit."""
    betas = run.optimizer.param_groups[0]["betas"]
    if cls == "weights":  # the codec's unit: how far a training step moves the parameter
        movement = movement_units(capture(run.model, run.optimizer, None, False))
        names = parameter_names(run.model)
    shaped = []  # (tensor, unit, shape)
    for p, state, eps, t in _adam_states(run):
        v_hat = state["exp_avg_sq"].float() / (1 - betas[1] ** t)
        shape = _shape(v_hat, eps, alpha, kappa, group)
        if cls == "weights":
            shaped.append((p, movement[names[id(p)]], shape))
        else:  # the exp_avg that moves the update m_hat / (sqrt(v_hat) + eps) by one
            shaped.append((state["exp_avg"], (v_hat.sqrt() + eps) * (1 - betas[0] ** t), shape))
    if group == "tensor":  # the tensors' factors held at a geometric mean of 1 over the class
        mean = sum(s.log().sum() for _, _, s in shaped) / sum(s.numel() for _, _, s in shaped)
        shaped = [(x, unit, s / mean.exp()) for x, unit, s in shaped]
    return [(x, c * unit * s) for x, unit, s in shaped]


def _entropy(x: torch.Tensor, steps: torch.Tensor, seed: int) -> float:
    """Order-0 entropy, in bits an element, of the dithered symbols coding ``x`` at ``steps``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.round(x / steps + torch.rand(x.shape, generator=gen) - 0.5).to(torch.int64)
    _, counts = torch.unique(q, return_counts=True)
    p = counts.double() / q.numel()
    return float(-(p * p.log2()).sum())


def _residuals(pairs: list[tuple[torch.Tensor, torch.Tensor]],
               references: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """What each tensor's symbols code: its residual against ``references``, else its values."""
    return [t.detach().float() - (references[i] if references else 0)
            for i, (t, _) in enumerate(pairs)]


def equal_bits(shaped: list[tuple[torch.Tensor, torch.Tensor]], uniform: list[torch.Tensor],
               references: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Each tensor's ``shaped`` steps times the power of two (bisected to 1/64 octave) at which
    its symbols' entropy is that of its ``uniform`` steps: shaping at the bits of the moving
    elements, where a geometric mean of 1 holds the bits of all (elements that do not move
    cost none at any step)."""
    out = []
    for i, (x, (_, steps), flat) in enumerate(zip(_residuals(shaped, references), shaped, uniform,
                                                  strict=True)):
        target, lo, hi = _entropy(x, flat, i), -8.0, 8.0
        while hi - lo > 1 / 64:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _entropy(x, steps * 2 ** mid, i) > target else (lo, mid)
        out.append(steps * 2 ** hi)
    return out


def equal_class_bits(shaped: list[tuple[torch.Tensor, torch.Tensor]], uniform: list[torch.Tensor],
                     references: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Every tensor's ``shaped`` steps times one power of two (bisected to 1/64 octave) at which
    the class's symbols take the entropy of its ``uniform`` steps' in all: the bits moved
    between tensors (``--group tensor``), where :func:`equal_bits` holds each tensor's."""
    xs = _residuals(shaped, references)

    def bits(steps: list[torch.Tensor]) -> float:
        return sum(_entropy(x, s, i) * x.numel() for i, (x, s) in enumerate(zip(xs, steps,
                                                                                strict=True)))

    target, lo, hi = bits(uniform), -8.0, 8.0
    while hi - lo > 1 / 64:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bits([s * 2 ** mid for _, s in shaped]) > target else (lo, mid)
    return [s * 2 ** hi for _, s in shaped]


def equal_symbols(shaped: list[tuple[torch.Tensor, torch.Tensor]], uniform: list[torch.Tensor],
                  references: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Each tensor's ``shaped`` steps scaled so that its symbols' mean magnitude is the
    ``uniform`` steps' (``sum |x| / steps`` held): at low rates, where most symbols are 0 and a
    dithered quantizer codes ``x`` as nonzero about ``|x| / step`` of the time, the count of
    nonzero symbols and with it the bits, in one pass (what an encoder can afford)."""
    out = []
    for x, (_, steps), flat in zip(_residuals(shaped, references), shaped, uniform, strict=True):
        held = float((x.abs() / flat).sum())
        out.append(steps * (float((x.abs() / steps).sum()) / held) if held > 0 else steps)
    return out


def coded_bits(pairs: list[tuple[torch.Tensor, torch.Tensor]],
               references: list[torch.Tensor] | None) -> tuple[float, float]:
    """Bits an element of the dithered symbols coding each tensor (its residual against
    ``references`` where given, else its values) at its steps: their order-0 entropy, and what
    the codec's packing, bit planes and zstd store of them (a tensor a chunk). Shaped steps ``g * s_i``
    give the symbols of the values ``x_i / s_i`` at the uniform step ``g``, which the codec's
    own kernel then codes."""
    entropy = stored = elements = 0.0
    for i, (x, (_, steps)) in enumerate(zip(_residuals(pairs, references), pairs, strict=True)):
        entropy += _entropy(x, steps, i) * x.numel()
        g = float(np.float32(steps.log().mean().exp()))
        values = (x * (g / steps)).flatten().numpy().astype(np.float32)
        stream, _ = encode_block_stream(values, None, np.empty_like(values), ordinal=False,
                                        step=g, block=CompressionConfig().block, dither=i,
                                        dither_signs=True, bit_planes=True)
        stored += 8 * len(zstd_compress(stream, "packed"))
        elements += x.numel()
    return entropy / elements, stored / elements


def measure(task: str, optimizer: str, at: int, interval: int, cls: str, multiples: list[float],
            alphas: list[float], seeds: int, kappa: float = KAPPA, group: str = "element",
            normalize: str = "mean") -> list[dict]:
    """Train the cell, then one row a step multiple and ``alpha`` (see the module doc)."""
    base = Run.fresh(TASKS[task], OPTIMIZERS[optimizer], 0)
    base.train(at - interval)
    previous = [p.detach().float().clone() for p, *_ in _adam_states(base)]
    base.train(interval)
    snap = base.snapshot()
    exact = base.rebuilt(snap)
    exact.train(RESUME)
    references = previous if cls == "weights" else None

    def steps_of(run: Run, alpha: float, c: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = class_steps(run, cls, alpha, c, kappa, group)
        if normalize != "mean" and alpha:
            flat = [s for _, s in class_steps(run, cls, 0.0, c)]
            held = {"bits": equal_bits, "symbols": equal_symbols,
                    "class": equal_class_bits}[normalize](pairs, flat, references)
            pairs = list(zip([t for t, _ in pairs], held, strict=True))
        return pairs

    rows = []
    for c in multiples:
        for alpha in alphas:
            entropy, bits = coded_bits(steps_of(base.rebuilt(snap), alpha, c), references)
            lost = []
            for seed in range(seeds):
                run = base.rebuilt(snap)
                gen = torch.Generator().manual_seed(1000 + seed)
                with torch.no_grad():
                    for tensor, steps in steps_of(run, alpha, c):
                        tensor.add_(steps * (torch.rand(tensor.shape, generator=gen) - 0.5))
                run.train(RESUME)
                lost.append(steps_lost(run.losses[-RESUME:], exact.losses[-RESUME:]))
            row = {"c": c, "alpha": alpha, "entropy": entropy, "bits": bits,
                   "steps_lost": statistics.mean(lost),
                   "se": statistics.stdev(lost) / len(lost) ** 0.5 if len(lost) > 1 else 0.0}
            rows.append(row)
            print(f"  c={c:7.1f} alpha={alpha:5.3f} bits/element {bits:6.3f} "
                  f"(entropy {entropy:6.3f}) "
                  f"steps lost {row['steps_lost']:7.2f} (se {row['se']:.2f})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="gpt-tiny")
    parser.add_argument("--optimizer", default="adamw-0.95")
    parser.add_argument("--at", type=int, default=400)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--cls", choices=("weights", "first_moment"), default="weights")
    parser.add_argument("--multiples", default=None,
                        help="step multiples, comma-separated (default: 96,192,384 for "
                             "weights, 3, 6 and 12 times balanced's; 2.8,5.6,11.2 for first "
                             "moments, 2, 4 and 8 times)")
    parser.add_argument("--alphas", default="0,0.125,0.25")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--kappa", type=float, default=KAPPA,
                        help="the floor under sqrt(v), as a multiple of its root mean square")
    parser.add_argument("--group", default="element",
                        help="shape by element, by 'row', by 'rowcol' (a factor a row times one a "
                             "column), by a number of consecutive elements or by 'tensor' (one "
                             "factor a tensor, normalized over the class)")
    parser.add_argument("--normalize", choices=("mean", "bits", "symbols", "class"),
                        default="mean",
                        help="hold each tensor's geometric-mean step (mean), its symbols' "
                             "entropy (bits) or their mean magnitude (symbols), or the class's "
                             "entropy in all (class), at the uniform step's")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    default = "96,192,384" if args.cls == "weights" else "2.8,5.6,11.2"
    multiples = [float(x) for x in (args.multiples or default).split(",")]
    alphas = [float(x) for x in args.alphas.split(",")]
    print(f"{args.task} {args.optimizer}, restored at {args.at} (saves every {args.interval}), "
          f"{args.cls}:")
    rows = measure(args.task, args.optimizer, args.at, args.interval, args.cls, multiples, alphas,
                   args.seeds, args.kappa, args.group, args.normalize)
    if args.json:
        Path(args.json).write_text(json.dumps({**vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
