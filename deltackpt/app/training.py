"""A small GPT trained for real on real text, for the demo, benchmarks and tests.

The text is Python's own standard library source, which exists on every
machine that runs deltackpt, so nothing is downloaded. Tokens are bytes
(vocabulary 256). Batches are drawn with torch's global RNG, so restoring a
checkpoint's RNG state replays the same data order.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of :class:`TinyGPT`. ``n_params`` grows about as ``12 * n_layer * d_model**2``."""

    vocab: int = 256
    context: int = 128
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(context=64, d_model=64, n_layer=2, n_head=2),
    "small": GPTConfig(d_model=192, n_layer=4, n_head=4),
    "medium": GPTConfig(d_model=256, n_layer=6, n_head=8),
    "large": GPTConfig(d_model=512, n_layer=8, n_head=8),
    "xl": GPTConfig(d_model=768, n_layer=7, n_head=12),  # ~50M parameters, 600 MB of training state
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2 style language model with the output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaled init of residual projections
            for proj in (block.proj, block.out):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-byte cross entropy of a ``(B, context + 1)`` batch of tokens."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def load_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Concatenated Python standard library sources as a uint8 tensor, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of Python sources under {stdlib}")
    return torch.frombuffer(bytearray(b"".join(parts)[:max_bytes]), dtype=torch.uint8)


def split_corpus(corpus: torch.Tensor, eval_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and evaluation parts of ``corpus`` (the evaluation part is its tail)."""
    cut = int(len(corpus) * (1 - eval_fraction))
    return corpus[:cut], corpus[cut:]


def get_batch(data: torch.Tensor, batch_size: int, context: int,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """``batch_size`` random windows of ``context + 1`` tokens, as int64."""
    starts = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def eval_loss(model: TinyGPT, data: torch.Tensor, batch_size: int = 16, batches: int = 4) -> float:
    """Mean loss over fixed windows of ``data``; uses its own RNG, not the global one."""
    gen = torch.Generator().manual_seed(1234)
    was_training = model.training
    model.eval()
    losses = [model.loss(get_batch(data, batch_size, model.cfg.context, gen)).item()
              for _ in range(batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with the usual two groups: decay on matrices, none on biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup: int,
                   total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10% of the peak learning rate."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(model: TinyGPT, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None,
               data: torch.Tensor, batch_size: int) -> float:
    """One optimizer step on a batch drawn with the global RNG; returns the loss."""
    loss = model.loss(get_batch(data, batch_size, model.cfg.context))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss.item()
