"""Checkpoints on S3: saves and restores against moving the raw bytes with the same client.

Issue 17's targets, each reported beside its baseline measured in the same run,
against moto's S3 server on loopback (tests/s3_server.py) through s3fs:

* a full save at most 1.1x the time of uploading the state's ``torch.save``
  bytes in one ``pipe_file`` (the raw upload), since fewer bytes travel;
* a delta save at least 10x faster than that upload;
* a full restore against downloading those bytes (``cat_file``);
* read amplification of a sharded load at most 1.1: loading the first half
  of the rows of every matrix of a step (what rank 0 of 2 loads of a
  row-sharded model) fetches bytes / the stored bytes of the chunks holding
  those rows, counted by a proxy between client and server. (The step is
  saved by one process; a step saved by 4 ranks is not measured here.)

The state is the ``trained`` TinyGPT of bench/conftest.py (``large``: about
305 MB of weights and Adam moments), a delta the same model GAP training
steps later. ``pytest bench/bench_remote.py`` prints the table and the
ratios; loopback has no bandwidth limit, so the ratios measure the client
and server work per byte, not a network's.
"""

from __future__ import annotations

import copy
import io
import math
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import note, record

from deltackpt import CheckpointManager
from deltackpt.chain import restore_chain
from deltackpt.dtypes import spec_named
from deltackpt.training import load_corpus, make_optimizer, make_scheduler, split_corpus, train_step

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from s3_server import FaultProxy, moto_server

ROUNDS = 3
GAP = 20  # training steps between the full step and the delta
_best: dict[str, float] = {}  # best round of each measurement, for the ratios


@pytest.fixture(scope="module")
def s3() -> tuple[str, FaultProxy, dict]:
    """A loopback S3 server, a byte-counting proxy in front of it, and its client options."""
    with moto_server() as endpoint:
        proxy = FaultProxy(endpoint)
        opts = {"key": "bench", "secret": "bench", "endpoint_url": proxy.url}
        fsspec.filesystem("s3", **opts).mkdir("bench")
        yield endpoint, proxy, opts
        proxy.close()


@pytest.fixture(scope="module")
def states(trained) -> tuple[dict, dict, bytes]:
    """The trained state, the state GAP steps later, and the first's ``torch.save`` bytes."""
    model, optimizer = trained
    first = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    later_model = copy.deepcopy(model)
    later_optimizer = make_optimizer(later_model)
    later_optimizer.load_state_dict(optimizer.state_dict())
    scheduler = make_scheduler(later_optimizer, warmup=1, total=10 * GAP)
    train, _ = split_corpus(load_corpus())
    for _ in range(GAP):
        train_step(later_model, later_optimizer, scheduler, train, batch_size=8)
    later = {"model": later_model.state_dict(), "optimizer": later_optimizer.state_dict()}
    buffer = io.BytesIO()
    torch.save(first, buffer)
    return first, later, buffer.getvalue()


def _load(trained, state: dict) -> None:
    model, optimizer = trained
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _fresh_url() -> str:
    return f"s3://bench/{uuid.uuid4().hex}"


def _best_of(benchmark, name: str) -> None:
    _best[name] = benchmark.stats.stats.min


def test_raw_upload(benchmark, trained, s3, states) -> None:
    _, _, opts = s3
    data = states[2]
    fs = fsspec.filesystem("s3", **opts)
    benchmark.pedantic(lambda: fs.pipe_file(f"bench/raw/{uuid.uuid4().hex}.pt", data),
                       rounds=ROUNDS)
    record(benchmark, "raw upload (torch.save bytes, s3fs)", len(data), len(data))
    _best_of(benchmark, "raw upload")


def test_raw_download(benchmark, trained, s3, states) -> None:
    _, _, opts = s3
    data = states[2]
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe_file("bench/raw/download.pt", data)
    benchmark.pedantic(lambda: fs.cat_file("bench/raw/download.pt"), rounds=ROUNDS)
    record(benchmark, "raw download (s3fs)", len(data), len(data))
    _best_of(benchmark, "raw download")


def test_full_save(benchmark, trained, s3, states) -> None:
    _, _, opts = s3
    model, optimizer = trained
    _load(trained, states[0])
    managers = []

    def setup() -> tuple[tuple, dict]:
        managers.append(CheckpointManager(_fresh_url(), storage_options=opts))
        managers[-1].acquire()
        return (), {}

    infos = []
    benchmark.pedantic(lambda: infos.append(managers[-1].save(0, model, optimizer)), setup=setup,
                       rounds=ROUNDS)
    for mgr in managers:
        mgr.close()
    record(benchmark, "full save (deltackpt, s3)", infos[-1].raw_bytes, infos[-1].stored_bytes)
    _best_of(benchmark, "full save")


def test_delta_save(benchmark, trained, s3, states) -> None:
    _, _, opts = s3
    model, optimizer = trained
    managers = []

    def setup() -> tuple[tuple, dict]:
        _load(trained, states[0])
        managers.append(CheckpointManager(_fresh_url(), storage_options=opts))
        managers[-1].save(0, model, optimizer)
        _load(trained, states[1])
        return (), {}

    infos = []
    benchmark.pedantic(lambda: infos.append(managers[-1].save(GAP, model, optimizer)),
                       setup=setup, rounds=ROUNDS)
    for mgr in managers:
        mgr.close()
    assert infos[-1].kind == "delta"
    record(benchmark, "delta save (deltackpt, s3)", infos[-1].raw_bytes, infos[-1].stored_bytes)
    _best_of(benchmark, "delta save")


def test_full_restore(benchmark, trained, s3, states) -> None:
    _, _, opts = s3
    model, optimizer = trained
    _load(trained, states[0])
    url = _fresh_url()
    with CheckpointManager(url, storage_options=opts) as mgr:
        info = mgr.save(0, model, optimizer)
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    benchmark.pedantic(lambda: reader.restore(0), rounds=ROUNDS)
    record(benchmark, "full restore (deltackpt, s3)", info.raw_bytes, info.stored_bytes)
    _best_of(benchmark, "full restore")


def test_resharded_read_amplification(trained, s3, states) -> None:
    """Bytes a 2-way row-sharded load fetches over the stored bytes of the chunks it needs."""
    _, proxy, opts = s3
    model, optimizer = trained
    _load(trained, states[0])
    url = _fresh_url()
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(0, model, optimizer)
        meta = mgr.metadata(0)
    boxes, needed = {}, 0
    for record_ in meta.tensors:
        if len(record_.shape) < 2 or record_.alias_of is not None:
            continue
        rows = record_.shape[0] // 2
        boxes[record_.name] = ([0] * len(record_.shape), [rows, *record_.shape[1:]])
        row_bytes = spec_named(record_.dtype, record_.name).itemsize * math.prod(record_.shape[1:])
        needed += sum(c.length for f in record_.fragments for c in f.chunks
                      if c.raw_offset < rows * row_bytes)
    proxy.reset_counts()
    restore_chain(CheckpointManager(url, storage_options=opts, read_only=True).storage, meta,
                  boxes=boxes)
    fetched = sum(n for path, n in proxy.fetched.items() if "/d-" in path)
    amplification = fetched / needed
    note(f"resharded load (first half of the rows of {len(boxes)} tensors): fetched "
         f"{fetched / 1e6:.1f} MB for {needed / 1e6:.1f} MB of needed chunks = "
         f"{amplification:.3f}x (goal <= 1.1)")
    assert amplification <= 1.1


def test_ratios() -> None:
    """The targets, from the best rounds above."""
    if {"raw upload", "full save", "delta save"} <= _best.keys():
        note(f"full save / raw upload = {_best['full save'] / _best['raw upload']:.2f}x (goal <= 1.1); "
             f"raw upload / delta save = {_best['raw upload'] / _best['delta save']:.1f}x (goal >= 10)")
    if {"raw download", "full restore"} <= _best.keys():
        note(f"full restore / raw download = {_best['full restore'] / _best['raw download']:.2f}x")
