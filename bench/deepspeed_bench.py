"""deltackpt's DeepSpeed checkpoint engine beside DeepSpeed's own ``save_checkpoint`` on the same
training run, and ``deltackpt convert`` beside ``ds_to_universal`` on the checkpoint DeepSpeed
wrote (issue 29, item 6).

``python bench/deepspeed_bench.py`` (CPU; ``--size xl --layers 8 --saves 6 --every 5`` by
default: a TinyGPT of 57.0M parameters) runs 2 gloo ranks of DeepSpeed ZeRO-2 (AdamW, fp32)
training on real text (the demo's corpus), each rank its own batches, and saves every
``--every`` steps: once with DeepSpeed's engine (a folder per save), once, on the same run
replayed from the same seeds, after ``deltackpt.deepspeed.install(engine, full_every=10)``. It
prints, per method, the bytes each save adds to disk (mean; for deltackpt the full step and the
deltas apart) and the seconds ``engine.save_checkpoint`` takes (median, without the first save),
with their ratios. Then it converts DeepSpeed's last checkpoint folder with
``deltackpt.interop.convert`` and with ``python -m deepspeed.checkpoint.ds_to_universal`` (2
extract and 2 merge workers: the machine's cores), and prints their seconds and throughput in MB
of training state per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from children import dir_bytes, print_saves, run_two_ranks

METHODS = ["deepspeed", "deltackpt.deepspeed"]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import deepspeed
    import deepspeed.comm.torch
    import torch.nn.functional as F

    import deltackpt.deepspeed
    from deltackpt.app.training import SIZES, TinyGPT, get_batch, load_corpus, split_corpus

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a compile gloo never uses
    train, _ = split_corpus(load_corpus())
    for method in METHODS:
        torch.manual_seed(0)
        model = TinyGPT(dataclasses.replace(SIZES[args.size], n_layer=args.layers))
        config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1,
                                                            "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          model_parameters=model.parameters())
        if rank == 0 and method == METHODS[0]:
            out["parameters"] = sum(p.numel() for p in model.parameters())
        ckpt = deltackpt.deepspeed.install(engine, full_every=10) if method != "deepspeed" else None
        save_dir = Path(root, method)
        data = torch.Generator().manual_seed(rank)
        seconds, sizes, kinds = [], [], []
        for _ in range(args.saves):
            for _ in range(args.every):
                batch = get_batch(train, 8, model.cfg.context, data)
                logits = engine(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()
            before = dir_bytes(save_dir) if save_dir.exists() else 0
            torch.distributed.barrier()
            started = time.perf_counter()
            engine.save_checkpoint(str(save_dir))
            seconds.append(time.perf_counter() - started)
            torch.distributed.barrier()
            if rank == 0:
                sizes.append(dir_bytes(save_dir) - before)
                kinds.append(ckpt.info.kind if ckpt is not None else "full")
        if rank == 0:
            out[method] = (seconds, sizes, kinds)
            if method == "deepspeed":
                out["last"] = str(save_dir / f"global_step{engine.global_steps}")
        engine.destroy()
    torch.distributed.destroy_process_group()


def _convert_seconds(folder: str, work: Path) -> dict[str, float]:
    """Seconds of deltackpt's convert and of ds_to_universal on DeepSpeed's checkpoint ``folder``."""
    from deltackpt.interop import convert

    started = time.perf_counter()
    convert(folder, work / "deltackpt")
    ours = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    folder, "--output_folder", str(work / "universal"), "--num_extract_workers", "2",
                    "--num_merge_workers", "2", "--inject_missing_state"], check=True,
                   capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return {"deltackpt convert": ours, "ds_to_universal": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="xl")
    parser.add_argument("--layers", type=int, default=8,
                        help="the model's blocks (8 of xl's width: 57.0M parameters) [%(default)s]")
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = run_two_ranks(_rank, args, root)
        state_mb = results["parameters"] * 12 / 1e6  # fp32 weights and two moments
        converts = _convert_seconds(results["last"], Path(root))
    print(f"TinyGPT {args.size}, {args.layers} blocks ({results['parameters'] / 1e6:.1f}M parameters), "
          "DeepSpeed ZeRO-2 "
          f"on 2 gloo ranks, {args.saves} saves, {args.every} steps apart")
    print_saves({m: results[m] for m in METHODS}, "deepspeed", width=22)
    print(f"converting DeepSpeed's last checkpoint ({state_mb:.0f} MB of training state):")
    for name, spent in converts.items():
        print(f"{name:<22} {spent:8.2f} s  {state_mb / spent:7.1f} MB/s"
              + (f"   {converts['ds_to_universal'] / spent:.2f}x faster than ds_to_universal"
                 if name != "ds_to_universal" else ""))


if __name__ == "__main__":
    main()
