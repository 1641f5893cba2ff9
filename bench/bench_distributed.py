"""Distributed saves and resharded loads against torch's DCP, side by side in one run.

Targets (issue 4), on an FSDP2 TinyGPT trained for real on 4 gloo CPU ranks:

* a full step saved by 4 ranks no slower than ``dcp.save`` of the same state (also
  measured in alternated pairs, since each save slows the one after it);
* a delta step saved by 4 ranks faster than ``dcp.save``, writing >= 10x fewer bytes;
* the 4-rank full step loaded on 2 ranks within 1.5x of ``dcp.load`` of the
  4-rank DCP checkpoint on 2 ranks; bytes read per rank show that each reads
  only the chunks of its shards.

The ranks are long-lived processes driven through queues: each benchmark
round sends one command to every rank and times it until the last rank
answers (the command runs between two barriers on the ranks).
``DELTACKPT_BENCH_DIST`` (default ``"large:10:20"``) is
size:steps_before_the_full_step:steps_between_the_full_and_the_delta.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from children import dir_bytes
from conftest import note, record

from deltackpt import CheckpointManager
from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, split_corpus, train_step
from deltackpt.io.reader import ChunkSource

SIZE, BEFORE, BETWEEN = os.environ.get("DELTACKPT_BENCH_DIST", "large:10:20").split(":")
ROUNDS = 3


def _rank(rank: int, world: int, port: int, commands, answers) -> None:
    """A rank: builds the FSDP2 model, then runs commands until told to stop."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    torch.manual_seed(0)
    model = TinyGPT(SIZES[SIZE])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = make_optimizer(model)
    train, _ = split_corpus(load_corpus())
    managers: dict[str, CheckpointManager] = {}
    read = []
    stored = ChunkSource.stored
    ChunkSource.stored = lambda self, r, c: read.append(c.length) or stored(self, r, c)

    def manager(path: str) -> CheckpointManager:
        if path not in managers:
            managers[path] = CheckpointManager(path, full_every=1000)
        return managers[path]

    while True:
        command, *args = commands.get()
        if command == "stop":
            break
        dist.barrier()
        started = time.perf_counter()
        result = None
        if command == "train":
            torch.manual_seed(1000 + rank)
            for _ in range(args[0]):
                train_step(model, optimizer, None, train, batch_size=8)
        elif command == "dcp_save":
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=args[0])
        elif command == "dcp_load":
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(state, checkpoint_id=args[0])
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        elif command == "save":
            path, step = args
            result = manager(path).save(step, model, optimizer, rng=False, overwrite=True).kind
        elif command == "load":
            path, step = args
            read.clear()
            manager(path).load(step, model, optimizer, rng=False)
            result = sum(read)
        dist.barrier()
        answers.put((rank, time.perf_counter() - started, result))
    for mgr in managers.values():
        mgr.close()
    dist.destroy_process_group()


class Ranks:
    """``world`` rank processes and the queues that drive them."""

    def __init__(self, world: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.answers = ctx.Queue()
        self.processes = [ctx.Process(target=_rank, args=(r, world, port, self.commands[r],
                                                          self.answers)) for r in range(world)]
        for p in self.processes:
            p.start()

    def run(self, *command) -> list:
        """Run ``command`` on every rank; each rank's result, by rank."""
        for q in self.commands:
            q.put(command)
        answers = []
        while len(answers) < self.world:
            try:
                answers.append(self.answers.get(timeout=5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died running {command}") from None
        return [result for _, _, result in sorted(answers)]

    def close(self) -> None:
        for q in self.commands:
            q.put(("stop",))
        for p in self.processes:
            p.join(timeout=120)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """4 ranks with a trained model, its full step and DCP checkpoint, then its delta."""
    ranks = Ranks(4)
    ranks.run("train", int(BEFORE))
    yield ranks, tmp_path_factory.mktemp("dist")
    ranks.close()


def _raw_bytes() -> int:
    model = TinyGPT(SIZES[SIZE])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params  # weights and two Adam moments


def test_dcp_save(benchmark, four) -> None:
    ranks, tmp = four
    benchmark.pedantic(lambda: ranks.run("dcp_save", str(tmp / "dcp")), rounds=ROUNDS,
                       setup=lambda: shutil.rmtree(tmp / "dcp", ignore_errors=True))
    record(benchmark, "dcp.save, 4 ranks", _raw_bytes(), dir_bytes(tmp / "dcp"))


def test_full_save(benchmark, four) -> None:
    ranks, tmp = four
    paths = [tmp / f"full-{i}" for i in range(ROUNDS)] + [tmp / "ckpt"]  # fresh, as dcp.save's
    written: list[Path] = []

    def delete_previous() -> None:  # as before each dcp.save: no earlier save's data to flush
        for path in written:
            shutil.rmtree(path, ignore_errors=True)

    def full() -> list:
        written.append(paths.pop(0))
        return ranks.run("save", str(written[-1]), 1)

    kinds = benchmark.pedantic(full, rounds=ROUNDS, setup=delete_previous)
    assert set(kinds) == {"full"}
    delete_previous()
    full()  # the step the loads read
    step_dir = tmp / "ckpt" / "step-000000000001"
    record(benchmark, "deltackpt full save, 4 ranks", _raw_bytes(), dir_bytes(step_dir))


def test_full_save_paired(four) -> None:
    """dcp.save and the full save alternated, in both orders (ABBA), so that neither always
    follows the other's writes: a full save writes about 250 MB, and the page cache and disk
    are still busy with the previous save's data when the next starts."""
    ranks, tmp = four
    seconds: dict[str, list[float]] = {"dcp": [], "full": []}
    for i, order in enumerate([("dcp", "full"), ("full", "dcp")] * 3):
        for kind in order:
            path = tmp / f"paired-{kind}-{i}"
            command = ("dcp_save", str(path)) if kind == "dcp" else ("save", str(path), 1)
            started = time.perf_counter()
            ranks.run(*command)
            seconds[kind].append(time.perf_counter() - started)
            shutil.rmtree(path)
    dcp_s, full_s = (sorted(seconds[k])[len(seconds[k]) // 2] for k in ("dcp", "full"))
    note(f"full save vs dcp.save, 6 alternated pairs: median {full_s:.2f} s vs {dcp_s:.2f} s "
         f"({dcp_s / full_s:.2f}x the speed of dcp.save); rounds: full "
         f"{', '.join(f'{t:.2f}' for t in seconds['full'])}, dcp "
         f"{', '.join(f'{t:.2f}' for t in seconds['dcp'])}")


def test_delta_save(benchmark, four) -> None:
    ranks, tmp = four
    # Each round (untimed) saves a full step into a fresh directory and trains BETWEEN steps,
    # then saves the delta on it.
    paths = [tmp / f"delta-{i}" for i in range(ROUNDS)]

    def fresh_base() -> None:
        ranks.run("save", str(paths[0]), 1)
        ranks.run("train", int(BETWEEN))

    def delta() -> list:
        return ranks.run("save", str(paths.pop(0)), 2)

    kinds = benchmark.pedantic(delta, rounds=ROUNDS, setup=fresh_base)
    assert set(kinds) == {"delta"}
    step_dir = tmp / f"delta-{ROUNDS - 1}" / "step-000000000002"
    assert paths == []
    record(benchmark, "deltackpt delta save, 4 ranks", _raw_bytes(), dir_bytes(step_dir))


@pytest.fixture(scope="module")
def two(four):
    ranks = Ranks(2)
    yield ranks, four[1]
    ranks.close()


def test_dcp_load_4_to_2(benchmark, two) -> None:
    ranks, tmp = two
    benchmark.pedantic(lambda: ranks.run("dcp_load", str(tmp / "dcp")), rounds=ROUNDS)
    record(benchmark, "dcp.load, saved by 4, on 2 ranks", _raw_bytes())


def test_load_4_to_2(benchmark, two) -> None:
    ranks, tmp = two
    read = benchmark.pedantic(lambda: ranks.run("load", str(tmp / "ckpt"), 1), rounds=ROUNDS)
    record(benchmark, "deltackpt load of the full step, 4 -> 2", _raw_bytes())
    stored = dir_bytes(tmp / "ckpt" / "step-000000000001")
    note(f"bytes read per rank loading the 4-rank full step on 2 ranks: "
         f"{', '.join(f'{b / 1e6:.1f} MB' for b in read)} of {stored / 1e6:.1f} MB stored")
