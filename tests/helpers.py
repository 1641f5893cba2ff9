"""Shared helpers of the core library's tests (a plain module, imported by the test files)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zstandard
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.format.dtypes import BY_NAME
from deltackpt.format.metadata import CHECKSUM_KEY, ZSTD_MAGIC, seal_json


def raw_bytes_of(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order as bytes (exact bit pattern, NaN payloads included)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Same dtype, same shape and the very same bytes."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, not a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert raw_bytes_of(actual) == raw_bytes_of(expected), f"{what}: bytes differ"


def assert_state_dicts_equal(actual: dict, expected: dict, what: str = "state") -> None:
    """Two name -> tensor mappings with the same names and bitwise equal tensors."""
    assert sorted(actual) == sorted(expected), f"{what}: names {sorted(actual)} != {sorted(expected)}"
    for name, tensor in expected.items():
        assert_bitwise_equal(actual[name], tensor, f"{what}[{name!r}]")


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (``bool``: 0 or 1 only)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).bool().reshape(shape)
    itemsize = dtype.itemsize
    data = torch.randint(0, 256, (n * itemsize,), generator=gen, dtype=torch.uint8)
    return data.view(dtype).reshape(shape)


ALL_DTYPES: list[torch.dtype] = [spec.torch_dtype for spec in BY_NAME.values()]


def files_under(root: str | os.PathLike[str]) -> set[str]:
    """Every file and directory below ``root``, as paths relative to it."""
    root = Path(root)
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of ``step`` under the checkpoint root."""
    return Path(root) / f"step-{step:012d}"


def data_files(root: str | os.PathLike[str], step: int) -> list[Path]:
    """The data files present in the directory of ``step``, sorted."""
    return sorted(step_dir(root, step).glob("*.bin"))


def chain_depths(root: str | os.PathLike[str]) -> dict[int, int]:
    """Each committed step of the checkpoint at ``root``: how many deltas restoring it decodes
    (its ``base_step`` links back to its full step)."""
    mgr = CheckpointManager(root, read_only=True)
    depths = {}
    for step in mgr.steps():
        meta, deltas = mgr.metadata(step), 0
        while meta.kind == "delta":
            meta, deltas = mgr.metadata(meta.base_step), deltas + 1
        depths[step] = deltas
    return depths


def assert_same_value(actual: object, expected: object, path: str = "value") -> None:
    """Deep equality that also requires identical types; floats, arrays and tensors compare bitwise."""
    assert type(actual) is type(expected), \
        f"{path}: type {type(actual).__name__} != {type(expected).__name__} ({actual!r} vs {expected!r})"
    if isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, path)
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, (np.generic, float)):
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), \
            f"{path}: {actual!r} != {expected!r} bitwise"
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_value(a, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            assert_same_value(actual[key], value, f"{path}[{key!r}]")
            assert type(next(k for k in actual if k == key)) is type(key), f"{path}: key type of {key!r}"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def edit_metadata(path: str | os.PathLike[str], edit: Callable[[dict[str, Any]], None]) -> Path:
    """Rewrite a ``metadata.json`` (compressed or not) as ``edit`` changes its JSON object, sealed
    with a new checksum as a writer would: the checksum no longer tells, validation must."""
    path = Path(path)
    data = path.read_bytes()
    if data[:4] == ZSTD_MAGIC:
        data = zstandard.ZstdDecompressor().decompress(data)
    obj = json.loads(data)
    edit(obj)
    obj.pop(CHECKSUM_KEY, None)
    path.write_text(seal_json(json.dumps(obj, separators=(",", ":"))))
    return path


# Ranks fork from a clean single-threaded server, never from pytest's process: a fork taken
# while another thread holds a lock (an earlier test's writer, a framework's pool) can hang.
# The server imports the frameworks the ranks import (once, not per rank); not megatron.core,
# which imports triton, whose TRITON_INTERPRET a rank takes from its test's environment.
START_METHOD = "forkserver"
mp.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "deltackpt", "helpers", "accelerate", "deepspeed", "torchtitan"])


def free_port() -> int:
    """A TCP port free on loopback now, for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, scenario, world: int, port: int, args: tuple,
              env: dict[str, str] | None = None) -> None:
    """One gloo rank of :func:`run_ranks`: ``scenario(rank, world, *args)`` in its group, with
    the environment ``env`` (the test's, when it started the ranks: the forkserver's is that of
    the first test that started any)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        scenario(rank, world, *args)
    finally:
        dist.destroy_process_group()


RENDEZVOUS_TRIES = 3


def run_ranks(scenario, world: int, *args) -> None:
    """Run ``scenario(rank, world, *args)`` on ``world`` gloo ranks; a rank's exception fails the
    test with its traceback. Where another test took the rendezvous port between
    :func:`free_port` and rank 0's listen (EADDRINUSE, before any scenario ran: tests run in
    parallel), the ranks start again on another port."""
    for attempt in range(RENDEZVOUS_TRIES):
        try:
            mp.start_processes(rank_main, nprocs=world, start_method=START_METHOD,
                               args=(scenario, world, free_port(), args, dict(os.environ)))
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == RENDEZVOUS_TRIES - 1:
                raise


def manual_examples(page: str, after: str = "") -> list[str]:
    """The Python examples of the manual's ``docs/<page>`` (those after the line ``after``, if
    given), as the tests that run them take them."""
    text = (Path(__file__).parent.parent / "docs" / page).read_text()
    if after:
        text = text.split(f"\n{after}\n", 1)[1]
    return re.findall(r"```python\n(.*?)```", text, re.S)


class Positions(nn.Module):
    """Position embeddings for 64 positions, of which training (:func:`train_positions`) uses
    the first 32: the other rows get no gradient, and Adam's moments keep them exactly zero."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.position.weight[:x.shape[1]])


def train_positions(model: Positions, optimizer: torch.optim.Optimizer, steps: int,
                    seed: int) -> None:
    """``steps`` training steps of ``model`` on sequences of 32 positions (from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, 32, generator=generator)
        loss = (model(x) - x[..., :8].roll(1, 1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@contextlib.contextmanager
def unclosed_managers() -> Iterator[Callable[[], list[CheckpointManager]]]:
    """Within the block, a function listing the CheckpointManagers created in it and not closed
    since (each keeps its worker threads until it is closed or collected)."""
    opened: dict[int, CheckpointManager] = {}
    init, close = CheckpointManager.__init__, CheckpointManager.close

    def tracked_init(self: CheckpointManager, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened[id(self)] = self

    def tracked_close(self: CheckpointManager) -> None:
        opened.pop(id(self), None)
        close(self)

    CheckpointManager.__init__, CheckpointManager.close = tracked_init, tracked_close
    try:
        yield lambda: list(opened.values())
    finally:
        CheckpointManager.__init__, CheckpointManager.close = init, close
