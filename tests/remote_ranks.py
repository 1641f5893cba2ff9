"""A step saved by 4 gloo ranks to an object store and loaded on 2: what the loading ranks fetch.

Used by tests/test_remote.py (a small FSDP2 model) and bench/bench_remote.py
(the large TinyGPT). The ranks are forked (tests/test_distributed.py's
``run_ranks``); each talks to the store through its own client, all of them
through one :class:`~s3_server.FaultProxy`, which counts the object bytes
they GET. A loading rank records the chunks it decodes: the chunks its
shards need, whose stored bytes the fetched bytes are compared with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from test_distributed import run_ranks

from deltackpt import CheckpointManager
from deltackpt.io.reader import ChunkSource

Build = Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer]]
"""Builds a rank's FSDP2 model and its optimizer, with optimizer state, given the rank."""


def _save(rank: int, world: int, url: str, options: dict, build: Build, chunk_bytes: int) -> None:
    model, optimizer = build(rank)
    with CheckpointManager(url, storage_options=options, chunk_bytes=chunk_bytes) as mgr:
        mgr.save(1, model, optimizer, rng=False)


def _load(rank: int, world: int, url: str, options: dict, build: Build, report: str) -> None:
    model, optimizer = build(rank)
    decoded: dict[tuple[int, int, int], int] = {}  # (step, file, offset) -> stored bytes
    stored = ChunkSource.stored

    def recording(self: ChunkSource, record, chunk):
        decoded[(self.meta.step, chunk.file, chunk.offset)] = chunk.length
        return stored(self, record, chunk)

    ChunkSource.stored = recording  # this forked rank's own copy of the class
    with CheckpointManager(url, storage_options=options, read_only=True) as mgr:
        mgr.load(1, model, optimizer, rng=False)
    Path(f"{report}.{rank}").write_text(json.dumps(sum(decoded.values())))


def save_on_4_load_on_2(url: str, options: dict, proxy, build: Build, *,
                        chunk_bytes: int, report: Path) -> tuple[int, int, int]:
    """Save step 1 of ``build``'s model on 4 ranks to ``url``, load it on 2 ranks (``options``
    reach the store through ``proxy``). Returns the data bytes the 2 ranks fetched, the stored
    bytes of the chunks they decoded, and the stored bytes of the step's data."""
    run_ranks(_save, 4, url, options, build, chunk_bytes)
    meta = CheckpointManager(url, storage_options=options, read_only=True).metadata(1)
    assert {f.rank for f in meta.files} == {0, 1, 2, 3}
    proxy.reset_counts()
    run_ranks(_load, 2, url, options, build, str(report))
    fetched = sum(n for path, n in proxy.fetched.items() if "/d-" in path)
    needed = sum(json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(2))
    return fetched, needed, sum(f.size for f in meta.files)
