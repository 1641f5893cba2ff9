"""A Lightning run under DDP on 2 CPU processes (gloo) saving through deltackpt.lightning, and the
runs resumed from its steps, for tests/test_lightning.py.

``python tests/lightning_ddp.py ROOT`` starts rank 0; Lightning's launcher starts rank 1 by running
the same command. In the same processes: a run of 8 steps saving every 4 (step 4 full, step 8 a
delta), then a run resumed from step 4's file to step 8, then one resumed from its step 8 to step 12.
Each rank writes ``ROOT/rank<r>.pt``: the weights each run ended with and what the plugin did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import deltackpt.lightning


class Regression(L.LightningModule):
    """A small regressor with a batch norm (buffers), AdamW in two param groups and a scheduler."""

    def __init__(self, named: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> dict:
        params = list(self.named_parameters())
        groups = [[(n, p) for n, p in params if p.dim() >= 2], [(n, p) for n, p in params if p.dim() < 2]]
        if not self.hparams.named:
            groups = [[p for _, p in g] for g in groups]
        optimizer = torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1},
                                       {"params": groups[1], "weight_decay": 0.0}], lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3)}


def data(batches: int = 8) -> DataLoader:
    """The same ``batches`` batches of 8 synthetic samples in every run."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8 * batches, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def fit(root: Path, steps: int, resume: str | None = None) -> tuple[Regression, dict]:
    torch.manual_seed(0)
    plugin = deltackpt.lightning.CheckpointIO(root / "ckpt", full_every=2, reader_grace=0)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "files", every_n_train_steps=4,
                                                save_top_k=-1)
    trainer = L.Trainer(max_steps=steps, strategy="ddp", accelerator="cpu", devices=2,
                        plugins=[plugin], callbacks=[saver], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Regression()
    trainer.fit(model, data(4), ckpt_path=resume)  # 2 batches a rank: an epoch is 2 steps
    return model, {"saved": plugin._manager is not None, "files": dict(plugin._files)}


def main(root: Path) -> None:
    first, did = fit(root, 8)
    rank = first.global_rank
    resumed, did_resumed = fit(root, 8, str(root / "files" / "epoch=1-step=4.ckpt"))
    # its step 8, a delta, saved again over the first run's (whose file now says so)
    from_delta, _ = fit(root, 12, str(root / "files" / "epoch=3-step=8-v1.ckpt"))
    torch.save({"first": first.state_dict(), "resumed": resumed.state_dict(),
                "from_delta": from_delta.state_dict(), "first_did": did, "resumed_did": did_resumed},
               root / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
