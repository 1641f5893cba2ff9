"""deltackpt.megatron's save strategy beside Megatron-core's own ``torch_dist`` strategy, on the
same training run and the same sharded state dict (issue 29, item 4).

``python bench/megatron_bench.py`` (CPU; ``--size small --saves 10 --every 5`` by default) runs 2
gloo ranks that train the same TinyGPT with AdamW on real text (the demo's corpus), seeded alike
(data-parallel replicas), and every ``--every`` steps save a sharded state dict: each parameter and
its ``exp_avg``/``exp_avg_sq`` as a ShardedTensor split along its first dimension between the
ranks (tensor-parallel-like boxes), the step as a ShardedObject. Once through
``dist_checkpointing.save`` with Megatron's default strategy (a directory per save), once with
``deltackpt.megatron.SaveStrategy`` (``full_every=10``). It prints, per method, the bytes each
save adds to disk (mean; for deltackpt the full step and the deltas apart) and the seconds
``dist_checkpointing.save`` takes (median, without the first save), and their ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch
from children import dir_bytes, print_saves, run_two_ranks

METHODS = ["torch_dist", "deltackpt.megatron"]


def _sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int,
             step: int) -> dict:
    """The state as Megatron shards it: every tensor's rows split between the ranks."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def sharded(key: str, tensor: torch.Tensor) -> ShardedTensor:
        if tensor.dim() == 0 or tensor.shape[0] % world:
            return ShardedTensor.from_rank_offsets(key, tensor.detach(), replica_id=rank)
        return ShardedTensor.from_rank_offsets(key, tensor.detach().chunk(world)[rank],
                                               (0, rank, world))

    state = {}
    for name, param in model.named_parameters():
        state[name] = sharded(name, param)
        for moment in ("exp_avg", "exp_avg_sq"):
            if param in optimizer.state:
                state[f"optimizer.{moment}.{name}"] = sharded(f"optimizer.{moment}.{name}",
                                                              optimizer.state[param][moment])
    state["iteration"] = ShardedObject("iteration", {"step": step}, (1,), (0,), replica_id=rank)
    return state


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str,
          out: dict) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core calls these unconditionally
    torch.cuda.current_device = lambda: "cpu"
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing

    import deltackpt.megatron
    from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, split_corpus, train_step

    train, _ = split_corpus(load_corpus())
    for method in METHODS:
        torch.manual_seed(0)
        model = TinyGPT(SIZES[args.size])
        optimizer = make_optimizer(model)
        seconds, sizes, kinds = [], [], []
        for save in range(1, args.saves + 1):
            for _ in range(args.every):
                train_step(model, optimizer, None, train, 16)
            step = save * args.every
            folder = Path(root, method, f"iter_{step:07d}")
            folder.mkdir(parents=True, exist_ok=True)
            before = dir_bytes(Path(root, method + ".run")) if Path(root, method + ".run").exists() \
                else 0
            strategy = deltackpt.megatron.SaveStrategy(Path(root, method + ".run"), full_every=10) \
                if method != "torch_dist" else None
            torch.distributed.barrier()
            started = time.perf_counter()
            dist_checkpointing.save(_sharded(model, optimizer, rank, world, step), str(folder),
                                    sharded_strategy=strategy)
            seconds.append(time.perf_counter() - started)
            torch.distributed.barrier()
            if rank == 0:
                run = Path(root, method + ".run")
                sizes.append(dir_bytes(folder) + (dir_bytes(run) - before if run.exists() else 0))
                kinds.append(strategy.info.kind if strategy is not None else "full")
        if rank == 0:
            out[method] = (seconds, sizes, kinds)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = run_two_ranks(_rank, args, root)
    print(f"TinyGPT {args.size}, 2 gloo ranks, {args.saves} saves, {args.every} steps apart")
    print_saves({m: results[m] for m in METHODS}, "torch_dist")


if __name__ == "__main__":
    main()
