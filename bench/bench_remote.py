"""Checkpoints on S3: saves and restores against moving the raw bytes with the same client.

Issue 17's targets, each timed beside its baseline in the same rounds
(``conftest.paired``), against moto's S3 server on loopback
(tests/s3_server.py, in a process of its own, as an S3 endpoint would be),
through s3fs:

* a full save at most 1.1x the time of uploading the state's ``torch.save``
  bytes with ``pipe_file`` (the raw upload), since fewer bytes travel;
* a delta save at least 10x faster than that upload;
* a full restore against downloading those bytes with ``cat_file``;
* read amplification of a 4-to-2 resharded load at most 1.1: the large
  TinyGPT under FSDP2 saved by 4 gloo ranks, loaded on 2; the data bytes
  they GET (counted by a proxy between client and server) over the stored
  bytes of the chunks they decode (tests/remote_ranks.py).

Each timed operation and its baseline run in the same rounds, the baseline
just before (``ROUNDS`` of them, ``DELTACKPT_BENCH_REMOTE_ROUNDS`` to
change, after one warm-up round): the ratios are of their median times, and
the spread of the ratio of each round's pair (median, least and most over
the rounds) is printed beside them, since the upload baseline alone swings
2-3x from run to run on a shared machine.

The state is bench_delta's ``large`` TinyGPT (about 305 MB of weights and
AdamW moments) trained 30 steps, and the delta the same model GAP training
steps later (``bench_delta._train``, cached in bench/.cache). With obstore
installed, ``test_client_obstore`` moves the same bytes through it for the
comparison of the clients. ``pytest bench/bench_remote.py`` prints the table
and the ratios; loopback has no bandwidth limit, so the ratios measure the
client's and the server's work per byte, not a network's.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from bench_delta import GAP, _train
from conftest import note, paired, record

from deltackpt import CheckpointManager
from deltackpt.app.training import SIZES, TinyGPT, load_corpus, make_optimizer, split_corpus, train_step

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from remote_ranks import save_on_4_load_on_2
from s3_server import FaultProxy, moto_server

ROUNDS = int(os.environ.get("DELTACKPT_BENCH_REMOTE_ROUNDS", "7"))
SIZE, STEPS = "large", 30
BUCKET = "bench"
_ratios: dict[str, float] = {}  # median time / the baseline's median time in the same rounds
_rounds: dict[str, list[float]] = {}  # each round's time / its baseline's, ascending


@pytest.fixture(scope="module")
def s3() -> dict:
    """Client options of a loopback S3 server running in a process of its own."""
    with moto_server(own_process=True) as endpoint:
        opts = {"key": "bench", "secret": "bench", "endpoint_url": endpoint,
                "skip_instance_cache": True}
        fsspec.filesystem("s3", **opts).mkdir(BUCKET)
        yield opts


@pytest.fixture(scope="module")
def run() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[dict], bytes]:
    """The large TinyGPT and its optimizer, its states GAP training steps apart, and the first
    state's ``torch.save`` bytes."""
    model, optimizer, states = _train(SIZE, STEPS, GAP)
    buffer = io.BytesIO()
    torch.save(states[0], buffer)
    return model, optimizer, states, buffer.getvalue()


def _load(run, state: dict) -> None:
    model, optimizer, *_ = run
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _fresh_url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def _ratio(benchmark, name: str, baseline: list[float]) -> None:
    """Keep the ratio of the medians for ``test_ratios``, and note the spread of the rounds:
    each round's time over its baseline's, and both times' range."""
    times = benchmark.stats.stats.data
    _ratios[name] = statistics.median(times) / statistics.median(baseline)
    per_round = _rounds[name] = sorted(t / b for t, b in zip(times, baseline, strict=True))
    note(f"{name}, each of {len(times)} rounds: median {statistics.median(per_round):.3f}x, "
         f"{per_round[0]:.3f}x to {per_round[-1]:.3f}x (times {min(times):.3f} to "
         f"{max(times):.3f} s, baseline {min(baseline):.3f} to {max(baseline):.3f} s)")


def test_full_save(benchmark, run, s3) -> None:
    model, optimizer, states, data = run
    fs = fsspec.filesystem("s3", **s3)
    _load(run, states[0])
    managers: list[CheckpointManager] = []

    def setup() -> None:
        if managers:  # its lease renewals and threads stay out of the next rounds
            managers[-1].close()
        managers.append(CheckpointManager(_fresh_url(), storage_options=s3))
        managers[-1].acquire()

    infos = []
    upload = paired(benchmark, lambda: infos.append(managers[-1].save(0, model, optimizer)),
                    lambda: fs.pipe_file(f"{BUCKET}/raw/{uuid.uuid4().hex}.pt", data),
                    setup=setup, rounds=ROUNDS)
    for mgr in managers:
        mgr.close()
    record(benchmark, "full save (deltackpt, s3)", infos[-1].raw_bytes, infos[-1].stored_bytes,
           baseline=("raw upload (pipe_file)", upload))
    _ratio(benchmark, "full save / raw upload", upload)
    note(f"raw upload of the torch.save bytes ({len(data) / 1e6:.1f} MB), s3fs pipe_file: "
         f"median {statistics.median(upload):.2f} s")


def test_delta_save(benchmark, run, s3) -> None:
    model, optimizer, states, data = run
    fs = fsspec.filesystem("s3", **s3)
    managers: list[CheckpointManager] = []

    def setup() -> None:
        if managers:
            managers[-1].close()
        _load(run, states[0])
        managers.append(CheckpointManager(_fresh_url(), storage_options=s3))
        managers[-1].save(0, model, optimizer)
        _load(run, states[1])

    infos = []
    upload = paired(benchmark, lambda: infos.append(managers[-1].save(GAP, model, optimizer)),
                    lambda: fs.pipe_file(f"{BUCKET}/raw/{uuid.uuid4().hex}.pt", data),
                    setup=setup, rounds=ROUNDS)
    for mgr in managers:
        mgr.close()
    assert infos[-1].kind == "delta"
    record(benchmark, "delta save (deltackpt, s3)", infos[-1].raw_bytes, infos[-1].stored_bytes,
           baseline=("raw upload (pipe_file)", upload))
    _ratio(benchmark, "delta save / raw upload", upload)


def test_full_restore(benchmark, run, s3) -> None:
    model, optimizer, states, data = run
    fs = fsspec.filesystem("s3", **s3)
    fs.pipe_file(f"{BUCKET}/raw/download.pt", data)
    _load(run, states[0])
    url = _fresh_url()
    with CheckpointManager(url, storage_options=s3) as mgr:
        info = mgr.save(0, model, optimizer)
    reader = CheckpointManager(url, storage_options=s3, read_only=True)
    download = paired(benchmark, lambda: reader.restore(0),
                      lambda: fs.cat_file(f"{BUCKET}/raw/download.pt"), rounds=ROUNDS)
    reader.close()
    record(benchmark, "full restore (deltackpt, s3)", info.raw_bytes, info.stored_bytes,
           baseline=("raw download (cat_file)", download))
    _ratio(benchmark, "full restore / raw download", download)
    note(f"raw download of the torch.save bytes, s3fs cat_file: median "
         f"{statistics.median(download):.2f} s")


def test_client_obstore(run, s3) -> None:
    """The raw upload and download of the same bytes through obstore (Rust) beside s3fs, in
    alternating rounds: what choosing the other client would change. Each client's defaults
    (s3fs: 50 MiB parts and ranges, 10 at a time; obstore's ``put``: 5 MiB parts, 12 at a
    time; its ``get``: one GET), and one request each way through both."""
    obstore = pytest.importorskip("obstore")
    from obstore.store import S3Store

    data = run[3]
    fs = fsspec.filesystem("s3", **s3)
    store = S3Store(BUCKET, endpoint=s3["endpoint_url"], access_key_id=s3["key"],
                    secret_access_key=s3["secret"], region="us-east-1",
                    virtual_hosted_style_request=False, client_options={"allow_http": True})
    fs.pipe_file(f"{BUCKET}/raw/client.pt", data)
    moves = {
        "s3fs pipe_file": lambda: fs.pipe_file(f"{BUCKET}/raw/client-s3fs.pt", data),
        "obstore put": lambda: obstore.put(store, "raw/client-obstore.pt", data),
        "s3fs one PUT": lambda: fs.call_s3("put_object", Bucket=BUCKET, Key="raw/one-s3fs.pt",
                                           Body=data),
        "obstore one PUT": lambda: obstore.put(store, "raw/one-obstore.pt", data,
                                               use_multipart=False),
        "s3fs cat_file": lambda: fs.cat_file(f"{BUCKET}/raw/client.pt"),
        "s3fs one GET": lambda: fs.cat_file(f"{BUCKET}/raw/client.pt", max_concurrency=1),
        "obstore get (one GET)": lambda: obstore.get(store, "raw/client.pt").bytes(),
    }
    times: dict[str, list[float]] = {name: [] for name in moves}
    for _ in range(ROUNDS):
        for name, move in moves.items():
            started = time.perf_counter()
            move()
            times[name].append(time.perf_counter() - started)
    note(f"clients, {len(data) / 1e6:.1f} MB, median of {ROUNDS}: " + ", ".join(
        f"{name} {statistics.median(t):.2f} s" for name, t in times.items()))


def _fsdp_large(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The large TinyGPT under FSDP2 (one unit per block), after one training step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT(SIZES[SIZE])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = make_optimizer(model)
    torch.manual_seed(1000 + rank)
    train_step(model, optimizer, None, split_corpus(load_corpus())[0], batch_size=2)
    return model, optimizer


def test_resharded_read_amplification(s3, tmp_path) -> None:
    """Bytes the 2 ranks of a 4-to-2 resharded load fetch over the stored bytes of the chunks
    they decode."""
    proxy = FaultProxy(s3["endpoint_url"])
    try:
        fetched, needed, stored = save_on_4_load_on_2(
            _fresh_url(), {**s3, "endpoint_url": proxy.url}, proxy, _fsdp_large,
            chunk_bytes=8 << 20, report=tmp_path / "needed")
    finally:
        proxy.close()
    amplification = fetched / needed
    note(f"4-to-2 resharded load (TinyGPT {SIZE}, FSDP2): the 2 ranks fetched "
         f"{fetched / 1e6:.1f} MB for {needed / 1e6:.1f} MB of chunks they decode = "
         f"{amplification:.3f}x (goal <= 1.1); the step stores {stored / 1e6:.1f} MB")
    assert amplification <= 1.1


def test_ratios() -> None:
    """The targets, from the medians above."""
    for name, ratio in _ratios.items():
        fastest, slowest = _rounds[name][0], _rounds[name][-1]
        goal = {"full save / raw upload": " (goal <= 1.1)",
                "delta save / raw upload": f" = {1 / ratio:.1f}x faster (goal >= 10x; rounds "
                                           f"{1 / slowest:.1f}x to {1 / fastest:.1f}x)"}.get(name, "")
        note(f"{name}: {ratio:.3f}x{goal}")
