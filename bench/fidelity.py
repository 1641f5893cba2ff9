"""Fidelity matrix of delta checkpoints: ratio against what resumed training loses.

Every **cell** of the matrix trains a real model on real data (bytes of
Python's standard library sources, which exist on every machine: nothing is
downloaded), saves the trajectory every ``interval`` steps through the public
API (``CheckpointManager(path, full_every=10, compression=preset)``: a full
step, then nine deltas) under every compression preset, and at each of its
restore steps (a delta step) rebuilds the run in *fresh* model, optimizer and
scheduler objects from a freshly opened manager, as a restarted process
would. After the last restore it trains ``resume`` more steps (as many as the
interval, at least 100) and is compared with the *exact* run: the same
trajectory rebuilt at the same steps from an in-memory deep copy of the
state, RNG included, so both see the same data order.

Models (:data:`TASKS`):

* ``gpt-tiny``, ``gpt-small``: :class:`deltackpt.app.training.TinyGPT`, next-byte
  language model on the sources (``gpt-large``, 25M parameters, is not in the matrix:
  ``restore_depth.py`` times restores on it);
* ``mlp``: next byte from the 8 bytes before it (one-hot, two hidden layers);
* ``gru``: next byte from the bytes before it, a two-layer GRU (a recurrent model);
* ``cnn-bn``: the sources laid out as a page (one line a row, 64 columns);
  a CNN with BatchNorm fills in the masked centre byte of a 16x16 patch
  from the lines above and below it.

Optimizers (:data:`OPTIMIZERS`): AdamW with betas (0.9, 0.95) (the project's
own run) and (0.9, 0.999); Adam with 100 warm-up steps and a cosine decay
(the others warm up for 20 steps and decay slowly, over :data:`HORIZON`
steps); SGD with momentum 0.9, plain and Nesterov; Adagrad; RMSprop, plain
and with momentum 0.9 and ``centered=True``; Lion (written here: torch has
none; its momentum is stored as ``exp_avg``, as lion-pytorch does); AdamW on
float32 master weights of a bfloat16 model (the master kept as
``master_param`` in the optimizer state, which the codec recognizes, see
``deltackpt/codecs/cast.py``); and AdamW on a model entirely in bfloat16,
its moments included (``adamw-pure-bf16``).

Restore points: ``early`` (step 50: the ninth delta of a chain saved every 5
steps), ``warmup`` (the first delta after warm-up), ``mid`` (step 400 of the
1000-step schedule), ``late`` (step 900, the learning rate near its floor),
and ``5x``: five interruptions two saves apart from ``mid``, each resumed from
the latest delta step, the loss compared with the uninterrupted exact run.

The full matrix (:data:`MATRIX`: about 30 minutes on 2 cores before each cell
had the noise floor's three more resumes) runs every
restore point and every interval (5, 20, 100 steps) on AdamW and on SGD
momentum with the tiny GPT; every optimizer on the tiny GPT at ``mid``;
AdamW (0.9, 0.999), Adam-cosine and bf16 master weights also early; the
small GPT (the project's original run) at 5, 20 and 100 steps; the MLP with
AdamW, SGD, Adagrad and RMSprop; the BatchNorm CNN with SGD momentum and
AdamW, early, mid and 5x; the GRU with RMSprop, plain and centered with
momentum, early at 10 steps; the bfloat16 GPT early and mid. :data:`QUICK`
(``--quick``, 82 s on 2 cores) keeps the axes that matter most: AdamW early
and mid, SGD momentum, the BatchNorm CNN.

Training is chaotic and amplifies any perturbation, so every cell has its
own **noise floor**: :data:`FLOOR_SEEDS` resumes from the exact state with
every weight perturbed by a seeded relative :data:`FLOOR_SCALE` (about the
near-lossless preset's weight error; stochastically rounded in bfloat16),
at each restore. A preset's deviation reads against their spread. Every
cell is also run under :data:`NEAR_LOSSLESS` beside the presets.

Per cell and preset the report gives:

* ``ratio``: raw bytes of the state (model parameters and buffers, every
  optimizer state tensor) over the mean bytes of its delta steps on disk
  (data files and metadata, :func:`step_disk_bytes`);
* ``loss_dev``: relative deviation of the mean of the last 20 resumed
  training losses from the exact run's (``loss_rel``: the same, signed);
  ``steps_lost``: the steps of progress that deviation is worth
  (:func:`steps_lost`: negative when ahead); ``excess_dev`` and
  ``excess_steps``: the same less the noise floor's mean, and
  ``within_floor``: ``loss_dev`` at most the largest of the floor's (the
  cell's ``floor`` has each seed's and their mean and spread); ``eval_dev``: of the evaluation
  loss at the end; ``logit_diff``: the largest absolute difference of the
  evaluation logits (in eval mode, so it sees BatchNorm's running stats);
* ``max_err``: the largest ``rms_rel_error`` (root of the summed squared
  errors over the summed squared values) of any tensor class recorded in
  the metadata of its delta steps; ``max_err_by_class``: per class;
* ``moments``: per optimizer state key holding a float tensor of its
  parameter's shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
  ``sum``, ``square_avg``, ``master_param``...), per float buffer
  (``running_mean``, ``running_var``) and for all parameters (``weights``):
  quantiles (5%, median, 95%) of the element ratio restored / true, on each
  restored step against the exact state at that step, pooled over the
  cell's tensors and restores (up to :data:`SAMPLE` elements). For signed quantities only elements with
  ``|true|`` at least their tensor's median ``|true|`` count (the ratio of
  near-zero values means nothing); ``slope`` is the least-squares
  ``sum(r*t) / sum(t*t)`` over all elements, which shrinkage toward zero
  lowers (a moment restored as zeros has slope 0).

:func:`check` lists the cells that miss targets (:data:`ISSUE_TARGETS` by
default: those of issue 14; :data:`FLOOR_TARGETS`: issue 31's, in steps of
progress and against the noise floor).

``--by-class K`` runs, instead of the near-lossless reference, ``balanced``
and ``aggressive`` beside ``balanced`` with one class's errors K times
larger, and with every class's (:func:`class_variants`): what each class's
precision costs a resumed run, and what it saves.

``--seeds N`` runs each cell with training seeds 0 to N - 1 and reports each preset's steps
lost over them (:func:`over_seeds`): the floor perturbs the restores of one trajectory, while
what a preset's errors cost changes with the trajectory, by several steps on the GPT's cells.

Run ``python bench/fidelity.py --quick`` or ``python bench/fidelity.py
[--json FILE] [--cells NAME,...] [--by-class K] [--seeds N]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.app.training import SIZES, TinyGPT, get_batch, load_corpus, make_scheduler, split_corpus
from deltackpt.codecs.cast import MASTER_KEYS
from deltackpt.encode.cost import CostModel
from deltackpt.encode.policy import CLASSES, ERROR_BOUNDS, CompressionConfig, Quantizer, as_config

FULL_EVERY = 10
HORIZON = 1000  # steps of the cosine schedule every run follows
EVAL_BATCHES = 8
LAST = 20  # resumed training losses averaged for loss_dev
SAMPLE = 100_000  # elements pooled per state key for the moment statistics

# Errors about 1000x below balanced's (a weight within 0.005 steps' worth of its movement,
# moments within 0.5% of theirs): what restoring at all costs a chaotic training run, for scale.
NEAR_LOSSLESS = CompressionConfig(weights=Quantizer(step=1e-3, move_step=0.01),
                                  first_moment=Quantizer(step=0.01, update_step=0.01, pred="zero"),
                                  second_moment=Quantizer(step=2.0**-10, domain="ordinal"),
                                  name="near-lossless")
PRESETS: dict[str, str | CompressionConfig] = {"near-lossless": NEAR_LOSSLESS,
                                               "balanced": "balanced", "aggressive": "aggressive"}
REFERENCE = "near-lossless"


def coarser(quantizer: Quantizer, factor: float) -> Quantizer:
    """``quantizer`` with every error bound (its step and the step's units) ``factor`` times
    larger: what ``target_ratio``'s scale does to it."""
    return replace(quantizer, **{f: getattr(quantizer, f) * factor for f in ERROR_BOUNDS
                                 if getattr(quantizer, f) is not None})


def class_variants(factor: float) -> dict[str, CompressionConfig]:
    """``balanced`` and ``aggressive``, per lossy class ``balanced`` with that class's errors
    ``factor`` times larger, and with every class's (``all``: what ``target_ratio`` at that
    scale codes) (``--by-class``): what each class's precision costs a resumed run and saves."""
    balanced = CompressionConfig.preset("balanced")
    lossy = [cls for cls in CLASSES if not getattr(balanced, cls).exact]
    out = {"balanced": balanced, "aggressive": CompressionConfig.preset("aggressive")}
    for name, classes in [*((cls, [cls]) for cls in lossy), ("all", lossy)]:
        name = f"{name} x{factor:g}"
        out[name] = replace(balanced, name=name, **{
            cls: coarser(getattr(balanced, cls), factor) for cls in classes})
    return out
# The cell's noise floor: resumes whose only error is a seeded relative perturbation of every
# weight by about the near-lossless preset's weight error (FLOOR_SCALE times a standard normal
# draw). Training is chaotic: their spread is what any restore costs this run, and a preset's
# deviation reads against it.
FLOOR_SEEDS = 3
FLOOR_SCALE = 1e-4


# --- data and models -------------------------------------------------------------------------

MLP_CONTEXT = 8  # bytes the MLP sees
GRU_CONTEXT = 64  # bytes of the GRU's sequences
PAGE_WIDTH, PATCH = 64, 16  # columns of the CNN's page, side of its patches
MASK = 256  # the token of the byte the CNN fills in


@functools.cache
def _text() -> tuple[torch.Tensor, torch.Tensor]:
    """Train and evaluation bytes of the standard library sources."""
    return split_corpus(load_corpus())


@functools.cache
def _pages() -> tuple[torch.Tensor, torch.Tensor]:
    """The sources as a page: one line a row, cut or padded with spaces to PAGE_WIDTH bytes;
    train and evaluation rows."""
    lines = bytes(torch.cat(_text()).numpy()).split(b"\n")
    rows = b"".join(line[:PAGE_WIDTH].ljust(PAGE_WIDTH) for line in lines)
    return split_corpus(torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(-1, PAGE_WIDTH))


def _text_windows(context: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Batches of the GPT: ``context`` bytes and the same shifted by one."""
    def batch(data: torch.Tensor, size: int, gen: torch.Generator | None):
        b = get_batch(data, size, context, gen)
        return b[:, :-1], b[:, 1:]
    return batch


def _next_byte(data: torch.Tensor, size: int, gen: torch.Generator | None):
    """Batches of the MLP: ``MLP_CONTEXT`` bytes and the byte after them."""
    b = get_batch(data, size, MLP_CONTEXT, gen)
    return b[:, :-1], b[:, -1]


def _patches(grid: torch.Tensor, size: int, gen: torch.Generator | None):
    """Batches of the CNN: PATCH x PATCH patches of the page with the centre byte masked, and
    that byte."""
    rows = torch.randint(len(grid) - PATCH, (size,), generator=gen)
    cols = torch.randint(PAGE_WIDTH - PATCH + 1, (size,), generator=gen)
    x = torch.stack([grid[r:r + PATCH, c:c + PATCH] for r, c in zip(rows.tolist(), cols.tolist(),
                                                                       strict=True)]).long()
    y = x[:, PATCH // 2, PATCH // 2].clone()
    x[:, PATCH // 2, PATCH // 2] = MASK
    return x, y


class ByteMLP(nn.Module):
    """Next byte from the ``MLP_CONTEXT`` bytes before it, one-hot coded."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256 * MLP_CONTEXT, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(F.one_hot(x, 256).flatten(1).to(self.net[0].weight.dtype))


class PatchCNN(nn.Module):
    """Masked centre byte of a text patch: embedding, four conv-BatchNorm-ReLU layers, and a
    head on the centre's features and the patch's mean features."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(MASK + 1, 16)
        layers: list[nn.Module] = []
        for c_in in (16, width, width, width):
            layers += [nn.Conv2d(c_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.ReLU()]
        self.convs = nn.Sequential(*layers)
        self.head = nn.Linear(2 * width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.convs(self.embed(x).permute(0, 3, 1, 2))
        centre = h[:, :, PATCH // 2, PATCH // 2]
        return self.head(torch.cat([centre, h.mean(dim=(2, 3))], dim=1))


class ByteGRU(nn.Module):
    """Next byte from the bytes before it: an embedding, a two-layer GRU and a linear head."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.rnn = nn.GRU(64, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


@dataclass(frozen=True)
class Task:
    """A model and its real data: ``batch(data, size, generator)`` gives inputs and targets."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    batch_size: int


TASKS = {t.name: t for t in (
    Task("gpt-tiny", lambda: TinyGPT(SIZES["tiny"]), _text, _text_windows(SIZES["tiny"].context), 16),
    Task("gpt-small", lambda: TinyGPT(SIZES["small"]), _text, _text_windows(SIZES["small"].context),
         16),
    Task("gpt-large", lambda: TinyGPT(SIZES["large"]), _text, _text_windows(SIZES["large"].context),
         8),
    Task("mlp", ByteMLP, _text, _next_byte, 64),
    Task("gru", ByteGRU, _text, _text_windows(GRU_CONTEXT), 16),
    Task("cnn-bn", PatchCNN, _pages, _patches, 32),
)}


# --- optimizers --------------------------------------------------------------------------------

class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay.
    Its momentum is stored as ``exp_avg``, as lion-pytorch names it."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on float32 master copies of 16-bit parameters, as mixed-precision optimizers
    (TransformerEngine's ``FusedAdam(master_weights=True)``) keep them: the state holds
    ``master_param``, and each parameter is set to its master rounded after every step."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), master_param=p.to(torch.float32, copy=True),
                                 exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
                state["step"] += 1
                t, grad, master = state["step"].item(), p.grad.float(), state["master_param"]
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
                master.mul_(1 - group["lr"] * group["weight_decay"])
                master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))
                p.copy_(master)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load keeping the state float32: torch's loader casts it to the (16-bit) parameters'
        dtype."""
        kept = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params, strict=True):
            self.state[p].update(kept.get(i, {}))


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on biases, norms and embeddings of one dimension."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer of the matrix: how to build it, its warm-up, and the model's dtype."""

    name: str
    family: str  # "adam", "sgd-momentum" or "other": which ratio targets apply
    make: Callable[[nn.Module], torch.optim.Optimizer]
    warmup: int = 20
    dtype: torch.dtype = torch.float32


OPTIMIZERS = {o.name: o for o in (
    OptimizerSpec("adamw-0.95", "adam", lambda m: torch.optim.AdamW(
        _decay_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.95))),
    OptimizerSpec("adamw-0.999", "adam", lambda m: torch.optim.AdamW(
        _decay_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.999))),
    OptimizerSpec("adam-cosine", "adam", lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
                  warmup=100),
    OptimizerSpec("adamw-bf16", "adam", lambda m: MasterAdamW(
        _decay_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.95)), dtype=torch.bfloat16),
    OptimizerSpec("sgd", "sgd-momentum", lambda m: torch.optim.SGD(
        _decay_groups(m, 1e-4), lr=0.1, momentum=0.9)),
    OptimizerSpec("sgd-nesterov", "sgd-momentum", lambda m: torch.optim.SGD(
        _decay_groups(m, 1e-4), lr=0.1, momentum=0.9, nesterov=True)),
    OptimizerSpec("adagrad", "other", lambda m: torch.optim.Adagrad(m.parameters(), lr=0.03)),
    OptimizerSpec("rmsprop", "other", lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3)),
    OptimizerSpec("rmsprop-centered", "other", lambda m: torch.optim.RMSprop(
        m.parameters(), lr=1e-3, momentum=0.9, centered=True)),
    OptimizerSpec("adamw-pure-bf16", "adam", lambda m: torch.optim.AdamW(
        _decay_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.95)), dtype=torch.bfloat16),
    OptimizerSpec("lion", "other", lambda m: Lion(_decay_groups(m, 0.1), lr=3e-4)),
)}


# --- one training run --------------------------------------------------------------------------

@dataclass
class Run:
    """One training trajectory: model, optimizer, scheduler, and the losses so far."""

    task: Task
    spec: OptimizerSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    losses: list[float] = field(default_factory=list)

    @classmethod
    def fresh(cls, task: Task, spec: OptimizerSpec, seed: int = 0) -> Run:
        """New objects; the seed draws the initial weights and then the data order."""
        torch.manual_seed(seed)
        model = task.build().to(spec.dtype)
        optimizer = spec.make(model)
        return cls(task, spec, model, optimizer, make_scheduler(optimizer, spec.warmup, HORIZON))

    @property
    def step(self) -> int:
        return len(self.losses)

    def train(self, n: int) -> None:
        """``n`` optimizer steps on batches drawn with the global RNG."""
        train_data = self.task.data()[0]
        self.model.train()
        for _ in range(n):
            x, y = self.task.batch(train_data, self.task.batch_size, None)
            loss = F.cross_entropy(self.model(x).flatten(0, -2).float(), y.flatten())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.losses.append(loss.item())

    @torch.no_grad()
    def evaluate(self) -> tuple[float, torch.Tensor]:
        """Mean loss and the logits on fixed evaluation batches (eval mode, own RNG)."""
        gen = torch.Generator().manual_seed(1234)
        eval_data = self.task.data()[1]
        self.model.eval()
        logits, losses = [], []
        for _ in range(EVAL_BATCHES):
            x, y = self.task.batch(eval_data, self.task.batch_size, gen)
            out = self.model(x).flatten(0, -2).float()
            losses.append(F.cross_entropy(out, y.flatten()).item())
            logits.append(out)
        self.model.train()
        return sum(losses) / len(losses), torch.cat(logits)

    def snapshot(self) -> dict:
        """Exact deep copy of the whole training state, RNG included."""
        return {"model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}

    def rebuilt(self, snap: dict) -> Run:
        """The run rebuilt in fresh objects from :meth:`snapshot` (which stays intact: torch's
        optimizer adopts the state tensors it loads, it does not copy them)."""
        run = Run.fresh(self.task, self.spec)
        run.model.load_state_dict(snap["model"])
        run.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        run.scheduler.load_state_dict(snap["scheduler"])
        torch.set_rng_state(snap["rng"])
        run.losses = list(self.losses)
        return run

    @torch.no_grad()
    def perturb(self, seed: int) -> None:
        """Multiply every weight (and float32 master copy of one) by ``1 + FLOOR_SCALE * g``,
        ``g`` standard normal drawn from ``seed``: a restore of the noise floor. bfloat16
        weights are rounded stochastically, so that they change by as much on average."""
        gen = torch.Generator().manual_seed(seed)
        masters = [s[key] for s in self.optimizer.state.values() for key in MASTER_KEYS if key in s]
        for t in [*self.model.parameters(), *masters]:
            x = t.float() * (1 + FLOOR_SCALE * torch.randn(t.shape, generator=gen))
            if t.dtype == torch.bfloat16:  # add 16 random low bits, then cut them
                noise = torch.randint(0, 1 << 16, t.shape, generator=gen, dtype=torch.int32)
                x = ((x.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
            t.copy_(x)

    def restored(self, mgr: CheckpointManager, step: int) -> Run:
        """The run rebuilt in fresh objects from checkpoint ``step``."""
        run = Run.fresh(self.task, self.spec)
        extra = mgr.load(step, run.model, run.optimizer)
        run.scheduler.load_state_dict(extra["scheduler"])
        run.losses = list(self.losses)
        return run

    def save(self, mgr: CheckpointManager) -> str:
        """Save the current step; returns its kind."""
        return mgr.save(self.step, self.model, self.optimizer,
                        extra={"scheduler": self.scheduler.state_dict()}).kind

    def raw_bytes(self) -> int:
        """Bytes of the state: model parameters and buffers (tied ones once), optimizer state."""
        tensors = {t.data_ptr(): t for t in self.model.state_dict().values()}
        tensors.update((t.data_ptr(), t) for s in self.optimizer.state.values()
                       for t in s.values() if torch.is_tensor(t))
        return sum(t.numel() * t.element_size() for t in tensors.values())


def step_disk_bytes(mgr: CheckpointManager, step: int) -> int:
    """Bytes of a step directory on disk: data files and metadata."""
    directory = Path(mgr.path.removeprefix("file://")) / f"step-{step:012d}"
    return sum(p.stat().st_size for p in directory.iterdir())


# --- restored against true state ---------------------------------------------------------------

def _paired_state(run: Run, snap: dict) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, restored, true) of every optimizer state tensor of its parameter's shape and float
    dtype, of every float buffer (keyed by its last name), and of every parameter (``weights``);
    ``run`` holds the restored state, ``snap`` the true one."""
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    restored = run.optimizer.state_dict()["state"]
    for i, state in snap["optimizer"]["state"].items():
        for key, true in state.items():
            if torch.is_tensor(true) and true.is_floating_point() and true.shape == params[i].shape:
                yield key, restored[i][key], true
    for name, buf in run.model.named_buffers():
        if buf.is_floating_point():
            yield name.rsplit(".", 1)[-1], buf, snap["model"][name]
    for name, param in run.model.named_parameters():
        yield "weights", param, snap["model"][name]


@dataclass
class _Pool:
    """Elements of one state key pooled over tensors and restores."""

    ratios: list[torch.Tensor] = field(default_factory=list)  # restored / true, chosen elements
    restored: list[torch.Tensor] = field(default_factory=list)
    true: list[torch.Tensor] = field(default_factory=list)
    signed: bool = False

    def add(self, restored: torch.Tensor, true: torch.Tensor) -> None:
        """Sample a pair of tensors; the ratios are of non-zero elements, for signed tensors only
        of those with ``|true|`` at least its median (more than half may be zero: rows of an
        embedding no batch used)."""
        r, t = restored.detach().double().flatten(), true.detach().double().flatten()
        stride = max(1, t.numel() // SAMPLE)
        signed = bool((t < 0).any())
        chosen = (t.abs() >= t.abs().median() if signed else True) & (t != 0)
        self.ratios.append((r[chosen] / t[chosen])[::stride])
        self.restored.append(r[::stride])
        self.true.append(t[::stride])
        self.signed |= signed

    def stats(self) -> dict[str, Any]:
        """Quantiles of restored / true (up to SAMPLE of them) and the least-squares slope."""
        ratio = torch.cat(self.ratios)
        ratio = ratio[torch.linspace(0, len(ratio) - 1, min(len(ratio), SAMPLE)).long()]
        r, t = torch.cat(self.restored), torch.cat(self.true)
        q = (torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
             if len(ratio) else [math.nan] * 3)
        slope = float((r * t).sum() / (t * t).sum()) if bool((t != 0).any()) else math.nan
        return {"q05": q[0], "median": q[1], "q95": q[2], "slope": slope, "signed": self.signed,
                "elements": len(ratio)}


# --- a cell ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One training run of the matrix, restored at ``restores`` (delta steps, in order)."""

    task: str
    optimizer: str
    interval: int
    point: str  # early, warmup, mid, late, 5x
    restores: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.task}/{self.optimizer}/i{self.interval}/{self.point}"

    @property
    def resume(self) -> int:
        """Steps trained after the last restore: as many as the interval, at least 100."""
        return max(self.interval, 100)


def _delta_at(step: int, interval: int) -> int:
    """The first save at or after ``step`` that is a delta step (not the chain's full step)."""
    k = max(2, math.ceil(step / interval))
    while k % FULL_EVERY == 1:
        k += 1
    return k * interval


def cell(task: str, optimizer: str, interval: int, point: str) -> Cell:
    """The cell restoring ``task`` trained with ``optimizer`` at restore point ``point``."""
    spec = OPTIMIZERS[optimizer]
    first = {"early": 10 * 5, "warmup": spec.warmup + 1, "mid": 400, "late": 900, "5x": 400}[point]
    start = _delta_at(first, interval)
    if point == "early" and start > 100:
        raise ValueError(f"no delta step within the first 100 steps at interval {interval}")
    if point != "5x":
        return Cell(task, optimizer, interval, point, (start,))
    restores = [start]
    while len(restores) < 5:
        restores.append(_delta_at(restores[-1] + 2 * interval, interval))
    return Cell(task, optimizer, interval, point, tuple(restores))


QUICK = [cell("gpt-tiny", "adamw-0.95", 5, "early"), cell("gpt-tiny", "adamw-0.95", 20, "mid"),
         cell("mlp", "sgd", 20, "mid"), cell("cnn-bn", "sgd", 20, "mid")]
MATRIX = [
    *(cell("gpt-tiny", o, 5, p) for o in ("adamw-0.95", "sgd") for p in ("early", "warmup", "mid",
                                                                          "late")),
    *(cell("gpt-tiny", o, i, p) for o in ("adamw-0.95", "sgd") for i, p in ((20, "mid"), (20, "late"),
                                                                             (20, "5x"), (100, "mid"),
                                                                             (100, "late"))),
    *(cell("gpt-tiny", o, 20, "mid") for o in OPTIMIZERS if o not in ("adamw-0.95", "sgd")),
    cell("gpt-tiny", "adamw-0.999", 5, "early"), cell("gpt-tiny", "adam-cosine", 5, "warmup"),
    cell("gpt-tiny", "adamw-bf16", 5, "early"),
    *(cell("gpt-small", "adamw-0.95", i, "mid") for i in (5, 20, 100)),
    *(cell("mlp", o, 20, "mid") for o in ("adamw-0.95", "sgd", "adagrad", "rmsprop")),
    *(cell("cnn-bn", o, i, p) for o in ("sgd", "adamw-0.95") for i, p in ((5, "early"), (20, "mid"),
                                                                           (20, "5x"))),
    *(cell("gru", o, 10, "early") for o in ("rmsprop", "rmsprop-centered")),
    cell("gpt-tiny", "adamw-pure-bf16", 5, "early"),
]


def steps_lost(resumed: list[float], exact: list[float]) -> float:
    """Steps of progress a resumed run lost: how far behind the exact run it ends, in steps of
    the exact run's progress. Its mean loss over the last ``LAST`` steps less the exact run's,
    over how much the exact run's loss falls a step (the slope of a least-squares line through
    ``exact``, its losses since the resume); negative when ahead, NaN where the exact loss does
    not fall. Where progress is steady, that is the step at which the exact run reached the
    resumed run's loss, counted back from the end."""
    y = torch.tensor(exact, dtype=torch.float64)
    t = torch.arange(len(exact), dtype=torch.float64)
    slope = float(((t - t.mean()) * (y - y.mean())).sum() / (t - t.mean()).square().sum())
    if not slope < 0:
        return math.nan
    return (sum(resumed[-LAST:]) - sum(exact[-LAST:])) / LAST / -slope


def _floor(seeds: list[dict]) -> dict:
    """The noise floor of a cell from its perturbed resumes: their deviations and steps lost,
    each as a mean and a spread (standard deviation over the seeds), and the largest deviation
    (a preset below it is within the floor)."""
    devs = torch.tensor([abs(f["loss_rel"]) for f in seeds], dtype=torch.float64)
    lost = torch.tensor([f["steps_lost"] for f in seeds], dtype=torch.float64)
    return {"seeds": seeds, "loss_dev": float(devs.mean()), "loss_dev_spread": float(devs.std()),
            "loss_dev_max": float(devs.max()), "steps_lost": float(lost.mean()),
            "steps_lost_spread": float(lost.std())}


def run_cell(c: Cell, presets: dict[str, str | CompressionConfig] | None = None,
             seed: int = 0) -> dict:
    """Train, checkpoint, restore and resume one cell under every preset; see the module doc."""
    presets = PRESETS if presets is None else presets
    task, spec = TASKS[c.task], OPTIMIZERS[c.optimizer]
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="deltackpt-fidelity-"))
    configs = {name: as_config(cfg) for name, cfg in presets.items()}
    paths = {name: root / name.replace("/", "_") for name in presets}
    delta_steps: dict[str, list[int]] = {name: [] for name in presets}

    def saved(run: Run, name: str, mgr: CheckpointManager) -> None:
        if run.step % c.interval == 0 and run.save(mgr) == "delta":
            delta_steps[name].append(run.step)

    try:
        base = Run.fresh(task, spec, seed)
        managers = {name: CheckpointManager(paths[name], full_every=FULL_EVERY, compression=cfg)
                    for name, cfg in configs.items()}
        while base.step < c.restores[0]:
            base.train(c.interval)
            for name, mgr in managers.items():
                saved(base, name, mgr)
        for mgr in managers.values():
            mgr.close()
        raw = base.raw_bytes()
        snap = base.snapshot()

        def trajectory(name: str | None, perturb: int | None = None
                       ) -> tuple[Run, dict, list[str]]:
            """The run from the first restore on: exact (``name`` None; perturbed at every restore
            with seed ``perturb`` if given) or from ``name``'s steps; the moment statistics and
            the kinds of the steps it was restored from."""
            run, true, pools, kinds = base, snap, {}, []
            for i, step in enumerate(c.restores):
                if name is None:
                    run = run.rebuilt(true)
                    if perturb is not None:
                        run.perturb(perturb)
                else:
                    with CheckpointManager(paths[name], full_every=FULL_EVERY,
                                           compression=configs[name]) as mgr:
                        run = run.restored(mgr, step)
                        kinds.append(mgr.metadata(step).kind)
                        for key, restored, value in _paired_state(run, true):
                            pools.setdefault(key, _Pool()).add(restored, value)
                        if i + 1 < len(c.restores):
                            while run.step < c.restores[i + 1]:
                                run.train(c.interval)
                                saved(run, name, mgr)
                if i + 1 < len(c.restores):
                    if name is None:
                        run.train(c.restores[i + 1] - run.step)
                    true = run.snapshot()
            run.train(c.resume)
            return run, {key: pool.stats() for key, pool in pools.items()}, kinds

        exact, _, _ = trajectory(None)
        exact_loss = sum(exact.losses[-LAST:]) / LAST
        exact_eval, exact_logits = exact.evaluate()

        def deviation(run: Run) -> dict:
            loss = sum(run.losses[-LAST:]) / LAST
            return {"loss_rel": loss / exact_loss - 1,
                    "steps_lost": steps_lost(run.losses[-c.resume:], exact.losses[-c.resume:])}

        floor = _floor([deviation(trajectory(None, k)[0]) for k in range(FLOOR_SEEDS)])
        results = {}
        for name in presets:
            run, moments, kinds = trajectory(name)
            dev = deviation(run)
            ev, logits = run.evaluate()
            with CheckpointManager(paths[name], full_every=FULL_EVERY) as mgr:
                disk = [step_disk_bytes(mgr, s) for s in delta_steps[name]]
                errors: dict[str, float] = {}
                for s in delta_steps[name]:
                    for cls, stats in (mgr.metadata(s).stats.classes or {}).items():
                        errors[cls] = max(errors.get(cls, 0.0), stats["rms_rel_error"])
            results[name] = {
                "ratio": raw / (sum(disk) / len(disk)) if disk else math.nan,
                "loss_dev": abs(dev["loss_rel"]), **dev,
                "excess_dev": abs(dev["loss_rel"]) - floor["loss_dev"],
                "excess_steps": dev["steps_lost"] - floor["steps_lost"],
                "within_floor": abs(dev["loss_rel"]) <= floor["loss_dev_max"],
                "eval_dev": abs(ev / exact_eval - 1),
                "logit_diff": float((logits - exact_logits).abs().max()),
                "max_err": max(errors.values(), default=math.nan), "max_err_by_class": errors,
                "deltas": len(disk), "restored_kinds": kinds, "moments": moments,
                "losses": run.losses[c.restores[0]:]}
        return {**asdict(c), "name": c.name, "seed": seed, "family": spec.family,
                "resume": c.resume,
                "dtype": str(spec.dtype).removeprefix("torch."), "raw_bytes": raw,
                "params": sum(p.numel() for p in base.model.parameters()),
                "exact": {"loss": exact_loss, "eval": exact_eval,
                          "losses": exact.losses[c.restores[0]:]}, "floor": floor,
                "presets": results, "seconds": time.perf_counter() - started}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cached_cell(c: Cell, presets: dict[str, str | CompressionConfig] | None, cache: str | Path,
                seed: int = 0) -> dict:
    """:func:`run_cell`'s result, kept as JSON in the directory ``cache``: taken from there where
    the cell was run before (same seed, as many torch threads, the same noise floor) under every
    preset asked, each with the same configuration (a preset's result does not depend on the
    others run beside it); else run and kept there."""
    presets = PRESETS if presets is None else presets
    configs = json.loads(json.dumps({name: asdict(as_config(cfg)) for name, cfg in presets.items()}))
    floor = [FLOOR_SEEDS, FLOOR_SCALE]
    path = Path(cache) / f"{c.name.replace('/', '_')}-seed{seed}-threads{torch.get_num_threads()}.json"
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("floor") == floor and all(kept["configs"].get(name) == config
                                               for name, config in configs.items()):
            result = kept["result"]
            return {**result, "presets": {name: result["presets"][name] for name in presets}}
    result = run_cell(c, presets, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(".tmp")  # then renamed: a reader never sees half a file
    written.write_text(json.dumps({"configs": configs, "floor": floor, "result": result}))
    written.replace(path)
    return result


def run_matrix(cells: Iterable[Cell], presets: dict[str, str | CompressionConfig] | None = None,
               log: Callable[[str], None] | None = print, cache: str | Path | None = None,
               seeds: int = 1) -> dict:
    """Run every cell with training seeds ``0 .. seeds - 1``; ``log`` gets each run's table rows
    as it finishes. ``cache``: a directory where each run's results are kept and reused
    (:func:`cached_cell`)."""
    started = time.perf_counter()
    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "cells": []}
    for c in cells:
        for seed in range(seeds):
            report["cells"].append(run_cell(c, presets, seed) if cache is None
                                   else cached_cell(c, presets, cache, seed))
            if log is not None:
                log(table({"cells": report["cells"][-1:]}, header=not report["cells"][1:]))
    report["seconds"] = time.perf_counter() - started
    return report


def over_seeds(report: dict) -> str:
    """Each cell run with several training seeds: every preset's steps lost (or loss deviation,
    where the loss no longer falls) as the mean and standard deviation over the seeds, with
    their range, beside the noise floor's mean. The floor perturbs one trajectory's restores;
    the seed changes the trajectory, and with it what a preset's errors cost."""
    runs: dict[str, list[dict]] = {}
    for c in report["cells"]:
        runs.setdefault(c["name"], []).append(c)
    lines = []
    for name, cells in runs.items():
        if len(cells) < 2:
            continue
        seeds = ",".join(str(c.get("seed", 0)) for c in cells)
        floor = statistics.fmean(c["floor"]["steps_lost"] for c in cells)
        for preset in cells[0]["presets"]:
            steps = [c["presets"][preset]["steps_lost"] for c in cells]
            if all(math.isfinite(v) for v in steps):
                values, unit, floor_text = steps, "steps", f"{floor:.2f}"
            else:
                values = [100 * c["presets"][preset]["loss_dev"] for c in cells]
                unit = "% loss"
                floor_text = f"{100 * statistics.fmean(c['floor']['loss_dev'] for c in cells):.3f}"
            lines.append(f"{name:<36} seeds {seeds:<7} {preset:<13} "
                         f"{statistics.fmean(values):7.2f} +- {statistics.stdev(values):6.2f} {unit} "
                         f"[{min(values):.2f}, {max(values):.2f}]; floor {floor_text}")
    return "\n".join(lines)


# --- the expected cost of errors ----------------------------------------------------------------

def _cost_of(result: dict) -> float | None:
    """How many steps of progress a resume is off the exact run, either way (None: unknown)."""
    lost = result.get("steps_lost")
    return abs(lost) if isinstance(lost, (int, float)) and math.isfinite(lost) else None


def median(values: list[float]) -> float:
    """The median (the mean of the middle two of an even count); NaN for none."""
    return statistics.median(values) if values else math.nan


def _variant(name: str) -> tuple[str, float] | None:
    """``("weights", 4.0)`` for a :func:`class_variants` name ``"weights x4"``, else None."""
    cls, _, factor = name.rpartition(" x")
    try:
        return (cls, float(factor)) if cls in (*CLASSES, "all") else None
    except ValueError:
        return None


def fit_cost(cells: list[dict]) -> tuple[CostModel, list[str]]:
    """The cost model of ``deltackpt/encode/cost.py`` fitted to ``--by-class`` results, and a
    check of what it predicts for every config in them against what they measured.

    Each class's coefficient is the rise of the median cost (:func:`_cost_of`) from
    ``balanced`` to that class's variant, over the cells whose state holds the class, per unit
    of ``K**2 - 1`` (least squares over the factors run); the floor is ``balanced``'s median
    over every cell less their sum. A cell run in several reports counts once (its first result
    under each config).
    """
    merged: dict[str, dict] = {}
    for c in cells:
        kept = merged.setdefault(c["name"], {**c, "presets": {}})
        kept["presets"] = {**c["presets"], **kept["presets"]}

    def lossy(c: dict) -> list[str]:
        return [k for k in c["presets"]["balanced"]["max_err_by_class"] if k in CLASSES]

    def found(name: str, cls: str | None = None) -> list[tuple[dict, float, float]]:
        """(cell, balanced's cost, the config's) where both are known (and the state holds cls)."""
        return [(c, b, v) for c in merged.values()
                if name in c["presets"] and (cls is None or cls in lossy(c))
                for b, v in [(_cost_of(c["presets"]["balanced"]), _cost_of(c["presets"][name]))]
                if b is not None and v is not None]

    names = sorted({name for c in merged.values() for name in c["presets"]})
    rises: dict[str, list[tuple[float, float]]] = {}  # per class: (K**2 - 1, median rise)
    for name in names:
        cls, factor = _variant(name) or (None, 0.0)
        rows = found(name, cls) if cls in CLASSES else []
        if rows:
            rise = median([v for _, _, v in rows]) - median([b for _, b, _ in rows])
            rises.setdefault(cls, []).append((factor ** 2 - 1, rise))
    per_class = {cls: round(max(sum(x * y for x, y in xy) / sum(x * x for x, _ in xy), 0.0), 3)
                 for cls, xy in rises.items()}  # least squares through zero over the factors
    base = median([b for _, b, _ in found("balanced")])
    model = CostModel(round(max(base - sum(per_class.values()), 0.0), 3), per_class)
    check = []
    for name in names:
        variant = _variant(name)
        config = (class_variants(variant[1])[name] if variant else
                  as_config(name) if name in ("balanced", "aggressive") else None)
        rows = found(name, variant[0] if variant and variant[0] in CLASSES else None)
        if config is None or not rows:
            continue
        predicted = median([model.steps(config, classes=lossy(c)) for c, _, _ in rows])
        check.append(f"{name}: predicted {predicted:.2f}, measured median "
                     f"{median([v for _, _, v in rows]):.2f} steps over {len(rows)} cells")
    return model, check


# --- targets and the table ---------------------------------------------------------------------

@dataclass(frozen=True)
class Targets:
    """What a preset must achieve in every cell.

    ``max_loss_dev``: by save interval (the entry of the largest interval not
    above the cell's applies); ``min_ratio``: ``(family, interval or None for
    any, ratio)``; ``drift``: the range the median restored / true ratio of
    every key of ``moments`` (optimizer state, buffers, weights) must stay in;
    ``max_steps_lost`` and ``within_floor``: the steps of progress a resume may
    lose, and whether it must stay within the cell's noise floor.
    """

    max_loss_dev: dict[int, float]
    min_ratio: tuple[tuple[str, int | None, float], ...] = ()
    drift: tuple[float, float] = (0.9, 1.1)
    max_steps_lost: float | None = None  # where the exact loss falls (steps_lost is a number)
    within_floor: bool = False  # loss_dev at most the largest of the cell's noise floor

    def loss_limit(self, interval: int) -> float:
        keys = sorted(self.max_loss_dev)
        return self.max_loss_dev[max([k for k in keys if k <= interval], default=keys[0])]


ISSUE_TARGETS = {
    "balanced": Targets({5: 0.005, 20: 0.005, 100: 0.01},
                        (("adam", 20, 50.0), ("sgd-momentum", None, 20.0))),
    "aggressive": Targets({5: 0.01}, (("adam", 20, 150.0),)),
}
# Issue 31's, in the run's own units: balanced within the noise floor and at most a step of
# progress lost, aggressive at most three.
FLOOR_TARGETS = {
    "balanced": Targets({5: math.inf}, max_steps_lost=1.0, within_floor=True),
    "aggressive": Targets({5: math.inf}, max_steps_lost=3.0),
}


def check(report: dict, targets: dict[str, Targets] | None = None) -> list[str]:
    """The misses of ``targets`` (preset name -> :class:`Targets`, default the issue's) in the
    report, one line each; empty when every cell of every preset named meets them."""
    targets = ISSUE_TARGETS if targets is None else targets
    misses = []
    for c in report["cells"]:
        for name, want in targets.items():
            r = c["presets"].get(name)
            if r is None:
                continue
            where = f"{c['name']}" + (f" seed {c['seed']}" if c.get("seed") else "") + f" {name}:"
            limit = want.loss_limit(c["interval"])
            if not r["loss_dev"] <= limit:
                misses.append(f"{where} loss_dev {100 * r['loss_dev']:.2f}% > {100 * limit:.2f}%")
            for family, interval, ratio in want.min_ratio:
                if c["family"] == family and interval in (None, c["interval"]) \
                        and not r["ratio"] >= ratio:
                    misses.append(f"{where} ratio {r['ratio']:.1f}x < {ratio:g}x")
            if want.max_steps_lost is not None and r["steps_lost"] > want.max_steps_lost:
                misses.append(f"{where} {r['steps_lost']:.1f} steps of progress lost > "
                              f"{want.max_steps_lost:g}")
            if want.within_floor and not r["within_floor"]:
                floor = c["floor"]
                misses.append(f"{where} loss_dev {100 * r['loss_dev']:.3f}% above the noise floor "
                              f"({100 * floor['loss_dev']:.3f}% +- "
                              f"{100 * floor['loss_dev_spread']:.3f}%, at most "
                              f"{100 * floor['loss_dev_max']:.3f}%)")
            low, high = want.drift
            misses.extend(f"{where} {key} median restored/true {m['median']:.3g} outside "
                          f"[{low:g}, {high:g}]"
                          for key, m in r["moments"].items() if not low <= m["median"] <= high)
    return misses


def _moments_text(moments: dict[str, dict]) -> str:
    return "; ".join(f"{k} {m['median']:.3g} [{m['q05']:.3g},{m['q95']:.3g}] s{m['slope']:.3g}"
                     for k, m in moments.items())


def table(report: dict, header: bool = True) -> str:
    """One row per cell and preset: its loss deviation and steps of progress lost, beside the
    cell's noise floor (mean +- spread of its perturbed resumes); ``ref`` is the near-lossless
    loss_dev of the same cell."""
    lines = []
    if header:
        lines.append(f"{'cell':<36} {'seed':>4} {'restores':<19} {'preset':<13} {'ratio':>7} "
                     f"{'loss dev':>8} "
                     f"{'steps':>6} {'floor dev':>15} {'floor steps':>11} {'ref dev':>7} "
                     f"{'eval dev':>8} {'logit':>7} {'max err':>8}  "
                     f"moments: median restored/true [5%,95%] slope")
    for c in report["cells"]:
        ref = c["presets"].get(REFERENCE, {}).get("loss_dev", math.nan)
        restores = ",".join(map(str, c["restores"]))
        floor = c["floor"]
        floor_dev = f"{100 * floor['loss_dev']:.3f}+-{100 * floor['loss_dev_spread']:.3f}%"
        floor_steps = f"{floor['steps_lost']:.1f}+-{floor['steps_lost_spread']:.1f}"
        for name, r in c["presets"].items():
            lines.append(f"{c['name']:<36} {c.get('seed', 0):>4} {restores:<19} {name:<13} "
                         f"{r['ratio']:>6.1f}x "
                         f"{100 * r['loss_dev']:>7.3f}% {r['steps_lost']:>6.1f} "
                         f"{floor_dev:>15} {floor_steps:>11} {100 * ref:>6.3f}% "
                         f"{100 * r['eval_dev']:>7.3f}% {r['logit_diff']:>7.3f} {r['max_err']:>8.4f}  "
                         f"{_moments_text(r['moments'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick subset (82 s on 2 cores)")
    parser.add_argument("--cells", help="comma-separated cell names (see MATRIX) to run instead")
    parser.add_argument("--json", help="also write the full report to this file")
    parser.add_argument("--by-class", type=float, metavar="K",
                        help="run balanced and aggressive beside balanced with one class's errors "
                             "K times larger, and with every class's")
    parser.add_argument("--fit-cost", nargs="+", metavar="REPORT",
                        help="fit the expected cost model to --by-class reports (--json) and "
                             "print it with what it predicts for each config against them")
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="run each cell with training seeds 0 .. N-1 and report the spread")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: faster for these small models)")
    args = parser.parse_args()
    if args.fit_cost:
        model, predictions = fit_cost([c for path in args.fit_cost
                                       for c in json.loads(Path(path).read_text())["cells"]])
        print(model, *predictions, sep="\n")
        return
    torch.set_num_threads(args.threads)
    cells = QUICK if args.quick else MATRIX
    if args.cells:
        known = {c.name: c for c in MATRIX + QUICK}
        cells = [known[name] for name in args.cells.split(",")]
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    report = run_matrix(cells, class_variants(args.by_class) if args.by_class else None,
                        seeds=args.seeds)
    if args.seeds > 1:
        print(f"\nover {args.seeds} training seeds:\n{over_seeds(report)}")
    for what, targets in (("issue 14's targets", ISSUE_TARGETS),
                          ("the noise floor's targets", FLOOR_TARGETS)):
        misses = check(report, targets)
        print(f"\n{len(report['cells'])} cell runs in {report['seconds']:.0f} s; "
              f"{len(misses)} misses of {what}:")
        print("\n".join(misses))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
