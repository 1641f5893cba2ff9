"""Lightning's own checkpointing (``TorchCheckpointIO``) beside ``deltackpt.lightning.CheckpointIO``
on the same run (issue 28, item 8).

``python bench/lightning_bench.py`` trains a TinyGPT (``--size``) with Lightning on the CPU, on
windows of Python's own sources, with AdamW in two param groups and a warm-up-cosine scheduler,
checkpointed by a ``ModelCheckpoint`` every ``--every`` steps (top 3 by training loss, and
``last.ckpt``), ``--saves`` times, with each plugin in a process of its own (the same seeded run
each time):

* ``lightning``: Lightning's default ``TorchCheckpointIO`` (a ``torch.save`` file per path);
* ``deltackpt``: ``deltackpt.lightning.CheckpointIO``, full every 10 saves.

It prints, per plugin, the bytes each checkpoint writes (every file Lightning asks for at that
step and, for deltackpt, the step's directory) and the seconds training waits in the plugin's
calls at each checkpoint (its saves and top-k removals; median of all but the first), each beside
Lightning's, the bytes on disk at the end and the run's wall time.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from children import compare_methods, dir_bytes

from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, make_scheduler, split_corpus

METHODS = ["lightning", "deltackpt"]
BATCH = 16


def measure(method: str, size: str, saves: int, every: int, out: Path) -> dict:
    """In this process: the training run, checkpointed ``saves`` times through ``method``'s
    plugin; per checkpoint the seconds spent in the plugin's calls and the bytes written."""
    import lightning as L
    from lightning.fabric.plugins.io import TorchCheckpointIO

    import deltackpt.lightning

    waited: dict[int, float] = defaultdict(float)
    written: dict[int, int] = defaultdict(int)
    kinds: dict[int, str] = {}
    ckpt = out / "ckpt"

    class Timed:
        """The plugin, timing its calls and counting what each save writes."""

        step = 0

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
                            ) -> None:
            self.step = step = checkpoint["global_step"]
            new = method == "deltackpt" and not (ckpt / f"step-{step:012d}").exists()
            started = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            waited[step] += time.perf_counter() - started
            written[step] += os.path.getsize(path)
            if new:  # the step this save wrote
                written[step] += dir_bytes(ckpt / f"step-{step:012d}")
                kinds[step] = self.manager.info(step).kind

        def remove_checkpoint(self, path: Any) -> None:
            started = time.perf_counter()
            super().remove_checkpoint(path)
            waited[self.step] += time.perf_counter() - started

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT(SIZES[size])

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            loss = self.model.loss(batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> dict:
            optimizer = make_optimizer(self.model)
            scheduler = make_scheduler(optimizer, warmup=saves * every // 10, total=saves * every)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(0)
    module = Module()
    train, _ = split_corpus(load_corpus())
    context = module.model.cfg.context + 1
    windows = train[: len(train) // context * context].view(-1, context).long()
    loader = torch.utils.data.DataLoader(windows, batch_size=BATCH, shuffle=True, drop_last=True)
    if method == "lightning":
        plugin = type("TimedTorch", (Timed, TorchCheckpointIO), {})()
    else:
        plugin = type("TimedDelta", (Timed, deltackpt.lightning.CheckpointIO), {})(ckpt, full_every=10)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "files", every_n_train_steps=every,
                                                save_top_k=3, monitor="train_loss", save_last=True)
    trainer = L.Trainer(max_steps=saves * every, accelerator="cpu", devices=1, plugins=[plugin],
                        callbacks=[saver], gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started
    state = sum(t.numel() * t.element_size() for t in module.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in trainer.optimizers[0].state.values()
        for v in s.values() if isinstance(v, torch.Tensor))
    steps = sorted(written)
    return {"waited": [waited[s] for s in steps], "written": [written[s] for s in steps],
            "kinds": [kinds.get(s, "") for s in steps], "seconds": seconds, "state": state,
            "disk": dir_bytes(out), "loss": float(trainer.callback_metrics["train_loss"])}


def main() -> None:
    compared = compare_methods(__file__, __doc__.split("\n\n")[0], METHODS, measure)
    if compared is None:
        return
    args, rows = compared
    base = rows["lightning"]
    print(f"TinyGPT {args.size} trained with Lightning on the CPU ({os.cpu_count()} CPUs), a "
          f"checkpoint every {args.every} steps (top 3 by loss and last.ckpt), {args.saves} "
          f"checkpoints; training state {base['state'] / 2**20:.1f} MiB (weights and AdamW "
          "moments), final loss " + ", ".join(f"{r['loss']:.4f}" for r in rows.values()) + "\n")
    print(f"{'plugin':<10} {'steps':<14} {'KiB/ckpt':>9} {'vs lightning':>13} {'wait ms/ckpt':>13} "
          f"{'vs lightning':>13} {'disk MiB':>9} {'run s':>7}")
    base_bytes = statistics.mean(base["written"])
    base_wait = statistics.median(base["waited"][1:])
    for method, r in rows.items():
        full = r["kinds"].count("full")
        kinds = f"{full} full, {len(r['kinds']) - full} delta" if method == "deltackpt" else "files"
        written = statistics.mean(r["written"])
        wait = statistics.median(r["waited"][1:])
        print(f"{method:<10} {kinds:<14} {written / 1024:>9.0f} {base_bytes / written:>12.1f}x "
              f"{1e3 * wait:>13.1f} {wait / base_wait:>12.2f}x {r['disk'] / 2**20:>9.1f} "
              f"{r['seconds']:>7.1f}")
    r = rows["deltackpt"]
    for kind in ("full", "delta"):
        sizes = [w for w, k in zip(r["written"], r["kinds"], strict=True) if k == kind]
        waits = [w for w, k in zip(r["waited"][1:], r["kinds"][1:], strict=True) if k == kind]
        if sizes:
            print(f"deltackpt, checkpoints with a {kind} step: {statistics.mean(sizes) / 1024:.0f} KiB "
                  f"({base_bytes / statistics.mean(sizes):.1f}x smaller than Lightning's)"
                  + (f", training waits {1e3 * statistics.median(waits):.0f} ms" if waits else ""))


if __name__ == "__main__":
    main()
