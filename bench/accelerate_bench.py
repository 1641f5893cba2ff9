"""Accelerate's own ``save_state`` beside ``deltackpt.accelerate.Checkpointer`` on the same run
(issue 28, item 8).

``python bench/accelerate_bench.py`` trains a TinyGPT (``--size``) with accelerate on the CPU,
on windows of Python's own sources in a shuffled, prepared dataloader, with AdamW and a
warm-up-cosine scheduler, and saves every ``--every`` steps ``--saves`` times, by each method
in a process of its own (the same seeded run each time):

* ``accelerate``: ``accelerator.save_state(folder)``, a folder per save;
* ``deltackpt``: ``Checkpointer.save_state(step)``, blocking, full every 10 saves;
* ``deltackpt-async``: the same with ``blocking=False`` (each save waits for the one before).

It prints, per method, the bytes each save writes (the save's folder; a deltackpt step's
directory, once written) and the seconds training waits in each save call (median of all but
the first), each beside accelerate's, and the run's wall time.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from children import compare_methods, dir_bytes

from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, make_scheduler, split_corpus

METHODS = ["accelerate", "deltackpt", "deltackpt-async"]
BATCH = 16


def measure(method: str, size: str, saves: int, every: int, out: Path) -> dict:
    """In this process: the training run with ``saves`` saves by ``method``, one every
    ``every`` steps; the seconds each save call took and the bytes each save wrote."""
    from accelerate import Accelerator

    from deltackpt.accelerate import Checkpointer

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    steps = saves * every
    scheduler = make_scheduler(optimizer, warmup=steps // 10, total=steps)
    train, _ = split_corpus(load_corpus())
    context = model.cfg.context + 1
    windows = train[: len(train) // context * context].view(-1, context).long()
    loader = torch.utils.data.DataLoader(windows, batch_size=BATCH, shuffle=True, drop_last=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    ckpt = Checkpointer(accelerator, out / "ckpt", full_every=10,
                        blocking=method != "deltackpt-async") if method != "accelerate" else None
    waited, kinds = [], []
    started = time.perf_counter()
    batches = iter(loader)
    for step in range(1, steps + 1):
        loss = accelerator.unwrap_model(model).loss(next(batches))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % every == 0:
            t = time.perf_counter()
            if ckpt is None:
                accelerator.save_state(out / f"checkpoint_{step}")
            else:
                ckpt.save_state(step)
            waited.append(time.perf_counter() - t)
    if ckpt is not None:
        ckpt.close()
    seconds = time.perf_counter() - started
    save_steps = range(every, steps + 1, every)
    if ckpt is None:
        written = [dir_bytes(out / f"checkpoint_{s}") for s in save_steps]
    else:
        written = [dir_bytes(out / "ckpt" / f"step-{s:012d}") for s in save_steps]
        kinds = [ckpt.manager.info(s).kind for s in save_steps]
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.optimizer.state.values()
        for v in s.values() if isinstance(v, torch.Tensor))
    return {"waited": waited, "written": written, "kinds": kinds, "seconds": seconds,
            "state": state, "loss": loss.item()}


def main() -> None:
    compared = compare_methods(__file__, __doc__.split("\n\n")[0], METHODS, measure)
    if compared is None:
        return
    args, rows = compared
    base = rows["accelerate"]
    print(f"TinyGPT {args.size} trained with accelerate on the CPU ({os.cpu_count()} CPUs), "
          f"a save every {args.every} steps, {args.saves} saves; training state "
          f"{base['state'] / 2**20:.1f} MiB (weights and AdamW moments), final loss "
          + ", ".join(f"{r['loss']:.4f}" for r in rows.values()) + "\n")
    print(f"{'method':<16} {'kinds':<14} {'KiB/save':>9} {'vs accelerate':>14} "
          f"{'wait ms/save':>13} {'vs accelerate':>14} {'run s':>7}")
    base_bytes = statistics.mean(base["written"])
    base_wait = statistics.median(base["waited"][1:])
    for method, r in rows.items():
        full = r["kinds"].count("full")
        kinds = f"{full} full, {len(r['kinds']) - full} delta" if r["kinds"] else "folders"
        written = statistics.mean(r["written"])
        wait = statistics.median(r["waited"][1:])
        print(f"{method:<16} {kinds:<14} {written / 1024:>9.0f} {base_bytes / written:>13.1f}x "
              f"{1e3 * wait:>13.1f} {wait / base_wait:>13.2f}x {r['seconds']:>7.1f}")
    for method, r in rows.items():
        if r["kinds"]:
            delta = [w for w, k in zip(r["written"], r["kinds"], strict=True) if k == "delta"]
            full = [w for w, k in zip(r["written"], r["kinds"], strict=True) if k == "full"]
            print(f"{method}: full steps {statistics.mean(full) / 1024:.0f} KiB, deltas "
                  f"{statistics.mean(delta) / 1024:.0f} KiB ({base_bytes / statistics.mean(delta):.1f}x "
                  "smaller than accelerate's save)")


if __name__ == "__main__":
    main()
