"""deltackpt.dcp and deltackpt.torchtitan beside DCP's own storage and torchtitan's own manager, on
the same training run (issue 28, item 8).

``python bench/dcp_bench.py`` (CPU; ``--size small --saves 10 --every 5`` by default) trains a
TinyGPT with AdamW on real text (the demo's corpus), seeded alike for every method, saving every
``--every`` training steps, each method in a process of its own:

* ``dcp.save`` (DCP's FileSystemWriter, a directory per save) and ``deltackpt.dcp``
  (``Writer``, one checkpoint directory, ``full_every=10``: a full step, then deltas);
* ``dcp.async_save`` of each (waiting for the save before it, as DCP asks);
* torchtitan's ``CheckpointManager`` and ``deltackpt.torchtitan.CheckpointManager`` (one gloo
  rank, ``async_mode="disabled"``, ``keep_latest_k=0``: every save kept).

It prints, per method: bytes written per save (mean; for deltackpt the full step and the
deltas apart) and the seconds the training loop waits per save (median, without the first
save), and each against its baseline in the same run.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from children import compare_methods, dir_bytes
from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

import deltackpt.dcp
from deltackpt import CheckpointManager
from deltackpt.app.training import (
    SIZES,
    TinyGPT,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)

METHODS = ["dcp.save", "deltackpt.dcp", "dcp.async_save", "deltackpt.dcp async",
           "torchtitan", "deltackpt.torchtitan"]
BASELINES = {"deltackpt.dcp": "dcp.save", "deltackpt.dcp async": "dcp.async_save",
             "deltackpt.torchtitan": "torchtitan"}
BATCH = 16


def _titan_manager(cls: type, folder: Path, model, optimizer, **options):
    """torchtitan's manager ``cls`` over the model and optimizer, wrapped in its containers'
    place: torchtitan saves what its states' ``state_dict`` give."""
    from torchtitan.components.checkpoint import ModelWrapper

    class Optimizers:
        def state_dict(self) -> dict:
            return get_state_dict(model, optimizer)[1]

        def load_state_dict(self, state: dict) -> None:
            set_optimizer_state_dict(model, optimizer, state)

    config = cls.Config(enable=True, folder=str(folder), interval=1, keep_latest_k=0, **options)
    manager = config.build(dataloader=None, model_parts=[model], optimizers=Optimizers(),
                           lr_schedulers=None, states={}, sd_adapter=None)
    manager.states["model"] = ModelWrapper([model])
    return manager


def measure(method: str, size: str, saves: int, steps: int, out: Path) -> dict:
    """``saves`` saves by ``method``, ``steps`` training steps before each; the seconds the
    loop waited at each and the bytes each wrote."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = TinyGPT(SIZES[size])
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, warmup=2, total=1000)
    train, _ = split_corpus(load_corpus())
    titan = None
    if method.endswith("torchtitan"):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torchtitan.components.checkpoint import CheckpointManager as TitanManager

        from deltackpt.torchtitan import CheckpointManager as DeltackptTitan

        cls = DeltackptTitan if method.startswith("deltackpt") else TitanManager
        titan = _titan_manager(cls, out / "titan", model, optimizer)
    waited, written, kinds, pending = [], [], [], None
    for i in range(saves):
        for _ in range(steps):
            train_step(model, optimizer, scheduler, train, BATCH)
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "step": i}
        started = time.perf_counter()
        if titan is not None:
            titan.save(i + 1)
        elif method == "dcp.save":
            dcp.save(state, checkpoint_id=out / f"dcp-{i}")
        elif method == "dcp.async_save":
            if pending is not None:
                pending.result()
            pending = dcp.async_save(state, checkpoint_id=out / f"dcp-{i}")
        else:
            if pending is not None:
                pending.result()
            writer = deltackpt.dcp.Writer(out / "ckpt", step=i, full_every=10)
            if method == "deltackpt.dcp":
                dcp.save(state, storage_writer=writer)
            else:
                pending = dcp.async_save(state, storage_writer=writer)
        waited.append(time.perf_counter() - started)
    if pending is not None:
        pending.result()
    if method.startswith("dcp"):
        written = [dir_bytes(out / f"dcp-{i}") for i in range(saves)]
    elif method == "torchtitan":
        written = [dir_bytes(out / "titan" / f"step-{i + 1}") for i in range(saves)]
    else:
        path = out / ("titan" if titan is not None else "ckpt")
        manager = CheckpointManager(path, read_only=True)
        infos = [manager.info(s) for s in manager.steps()]
        written, kinds = [i.stored_bytes for i in infos], [i.kind for i in infos]
    if titan is not None:
        titan.close()
        dist.destroy_process_group()
    return {"method": method, "waited": waited, "written": written, "kinds": kinds}


def main() -> None:
    compared = compare_methods(__file__, __doc__.splitlines()[0], METHODS, measure, every=5)
    if compared is None:
        return
    args, results = compared
    print(f"TinyGPT {args.size}, {args.saves} saves, {args.every} training steps apart")
    print(f"{'method':22} {'bytes/save':>12} {'full':>12} {'delta':>12} {'waits (s)':>10}"
          f" {'bytes vs':>9} {'waits vs':>9}")
    for method, r in results.items():
        mean = statistics.mean(r["written"])
        full = [b for b, k in zip(r["written"], r["kinds"], strict=False) if k == "full"]
        delta = [b for b, k in zip(r["written"], r["kinds"], strict=False) if k == "delta"]
        wait = statistics.median(r["waited"][1:])
        base = results.get(BASELINES.get(method, ""))
        vs = ("", "") if base is None else (
            f"{mean / statistics.mean(base['written']):.3f}x",
            f"{wait / statistics.median(base['waited'][1:]):.2f}x")
        print(f"{method:22} {mean:12,.0f} {statistics.mean(full) if full else 0:12,.0f} "
              f"{statistics.mean(delta) if delta else 0:12,.0f} {wait:10.3f} {vs[0]:>9} {vs[1]:>9}")


if __name__ == "__main__":
    main()
