"""Checkpoints on object storage: ``memory://`` and ``s3://`` against a real S3-protocol server.

The S3 tests talk HTTP, through s3fs and botocore, to moto's standalone
server on loopback (tests/s3_server.py), most of them through a proxy that
can drop connections and answer 503 SlowDown, and counts the bytes that pass.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from helpers import assert_bitwise_equal
from s3_server import FaultProxy, moto_server

from deltackpt import CheckpointManager, NotACheckpointError, WriterLockedError
from deltackpt.app.cli import main as cli_main
from deltackpt.errors import ReadFailedError, StorageError, WriteFailedError
from deltackpt.io import objectstore
from deltackpt.io.objectstore import LEASE_OBJECT, ObjectStorage, is_transient
from deltackpt.io.storage import LocalStorage
from deltackpt.restore.chain import restore_chain

pytest.importorskip("s3fs")

SECRET = "wJalrXUtnFEMI-not-a-real-secret-7q2"
KEY_ID = "AKIATESTKEYID000"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def proxy(endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(endpoint)
    yield proxy
    proxy.close()


@pytest.fixture(autouse=True)
def no_ambient_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Credentials come from the test alone: none from the environment or config files, and no
    lookup of an instance metadata service."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back off for milliseconds, not the default tenths of seconds: the tests fail requests by
    the hundred."""
    monkeypatch.setattr(objectstore, "BACKOFF_SECONDS", 0.005)


def options(endpoint: str) -> dict:
    return {"key": KEY_ID, "secret": SECRET, "endpoint_url": endpoint, "skip_instance_cache": True}


def new_bucket(endpoint: str) -> str:
    bucket = f"b{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options(endpoint)).mkdir(bucket)
    return bucket


def every_object(url: str, opts: dict | None) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url, **(opts or {}))
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(root)}


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        optimizer.step()


# A test's writer lease: it lapses when two renewals' requests and a wake-up take more than two
# thirds of it, and 4 s leaves that margin to a loaded machine's S3 server (1.5 s once did not).
TEST_LEASE_SECONDS = 4.0


def stall(lease: objectstore._Lease) -> None:
    """The writer holding ``lease`` stalls: no more renewals, until its lease has expired."""
    lease._stop.set()
    lease._thread.join()
    time.sleep(max(0.0, lease.expires - time.time()) + 0.1)


@pytest.fixture(params=["memory", "s3"])
def remote(request: pytest.FixtureRequest) -> tuple[str, dict | None]:
    """A fresh checkpoint URL and its storage options, on each kind of object store."""
    if request.param == "memory":
        return f"memory://t{uuid.uuid4().hex[:12]}/run", None
    endpoint = request.getfixturevalue("endpoint")
    return f"s3://{new_bucket(endpoint)}/runs/run1", options(endpoint)


def test_save_restore_chain_gc_verify(remote: tuple[str, dict | None], tmp_path: Path) -> None:
    """Full and delta steps round-trip through an object store; its objects are the checkpoint
    directory of FORMAT.md, byte for byte (a copy restores the same tensors locally); gc
    and verify work there."""
    url, opts = remote
    model, optimizer = model_and_optimizer()
    with CheckpointManager(url, full_every=3, storage_options=opts, chunk_bytes=4096) as mgr:
        for step in range(5):
            train(model, optimizer)
            mgr.save(step, model, optimizer, extra={"step": step})
            if step == 0:
                saved = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.steps() == [0, 1, 2, 3, 4]
        assert [mgr.info(s).kind for s in range(5)] == ["full", "delta", "delta", "full", "delta"]
        assert mgr.verify(deep=True) == {s: [] for s in range(5)}
        restored = mgr.restore(0)
        for name, value in saved.items():
            assert_bitwise_equal(restored.model[name], value, name)
        remote_delta = mgr.restore(2)
        assert remote_delta.extra == {"step": 2}
    objects = every_object(url, opts)
    assert LEASE_OBJECT not in objects  # released at close
    local = tmp_path / "copy"
    for rel, data in objects.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    local_delta = CheckpointManager(local, read_only=True).restore(2)
    for name, value in local_delta.model.items():
        assert_bitwise_equal(remote_delta.model[name], value, name)
    with CheckpointManager(url, storage_options=opts, reader_grace=0) as mgr:
        report = mgr.gc("every=2")  # step 2 loses its base: re-coded, its metadata staged first
        assert report.removed == [1, 3] and mgr.steps() == [0, 2, 4]
        assert report.recoded or report.rewritten
        assert mgr.verify(deep=True) == {0: [], 2: [], 4: []}
        mgr.gc("last=1")
        assert mgr.steps() == [4]
    assert {rel.split("/")[0] for rel in every_object(url, opts)} == \
        {"deltackpt.json", "step-000000000004"}


def test_cli_takes_urls(endpoint: str, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """ls, info, verify, du, gc and restore take an s3:// URL, and convert writes to one; the
    endpoint and credentials come from the standard environment variables."""
    url = f"s3://{new_bucket(endpoint)}/run"
    model, optimizer = model_and_optimizer()
    with CheckpointManager(url, full_every=2, storage_options=options(endpoint)) as mgr:
        for step in (10, 20, 30):
            train(model, optimizer)
            mgr.save(step, model, optimizer)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    capsys.readouterr()
    assert cli_main(["ls", url, "--json"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [10, 20, 30]
    for command in (["info", url, "--step", "20"], ["verify", url], ["du", url]):
        assert cli_main(command) == 0, command
    assert cli_main(["restore", url, "--step", "30", "--out", str(tmp_path / "out")]) == 0
    assert CheckpointManager(tmp_path / "out", read_only=True).steps() == [30]
    assert cli_main(["gc", url, "--keep", "last=1"]) == 0
    assert CheckpointManager(url, read_only=True).steps() == [30]
    torch.save(model.state_dict(), tmp_path / "model.pt")
    converted = url + "-converted"
    assert cli_main(["convert", str(tmp_path / "model.pt"), "--out", converted, "--step", "7"]) == 0
    restored = CheckpointManager(converted, read_only=True).restore(7).model
    for name, value in model.state_dict().items():
        assert_bitwise_equal(restored[name], value, name)
    assert cli_main(["convert", str(tmp_path / "model.pt"), "--out", url + "-st", "--to",
                     "safetensors"]) == 2
    printed = capsys.readouterr()
    assert "only deltackpt output can be written to a URL" in printed.err
    assert SECRET not in printed.out + printed.err


def test_missing_bucket_and_credentials_fail_at_open(endpoint: str) -> None:
    """A missing bucket, missing credentials or an unreachable endpoint fail when the manager is
    made, naming the URL (and never the secret)."""
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-x/run: bucket 'no-such-bucket-x' "
                                           "does not exist"):
        CheckpointManager("s3://no-such-bucket-x/run", storage_options=options(endpoint))
    bucket = new_bucket(endpoint)
    with pytest.raises(StorageError, match=rf"cannot reach s3://{bucket}/run .*credentials") as info:
        CheckpointManager(f"s3://{bucket}/run", storage_options={"endpoint_url": endpoint,
                                                                 "skip_instance_cache": True})
    assert "NoCredentialsError" in str(info.value)
    with socket_closed_port() as port, pytest.raises(StorageError, match=f"s3://{bucket}/run") as info:
        CheckpointManager(f"s3://{bucket}/run",
                          storage_options={**options(f"http://127.0.0.1:{port}")})
    assert SECRET not in str(info.value)


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port nothing listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    yield port


def test_unknown_and_uninstalled_schemes() -> None:
    """An unknown scheme lists the schemes available; a known one whose package is missing names
    the package."""
    with pytest.raises(StorageError, match=r"unknown storage scheme 'nosuch'; available: local "
                                           r"paths, .*memory://.*s3://"):
        CheckpointManager("nosuch://bucket/run")
    from importlib.util import find_spec
    if find_spec("ocifs") is not None:
        pytest.skip("ocifs is installed")
    with pytest.raises(StorageError, match=r"oci:// needs a package that is not installed .*ocifs"):
        CheckpointManager("oci://bucket/run")


def test_credentials_never_in_errors_logs_or_objects(endpoint: str, proxy: FaultProxy,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The secret of storage_options (or of a URL) appears in no error, log record, stored object,
    repr or reported path, even when requests fail."""
    caplog.set_level(logging.DEBUG)
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(proxy.url)
    model, optimizer = model_and_optimizer()
    with CheckpointManager(url, storage_options=opts, workers=1) as mgr:
        mgr.save(0, model, optimizer)
        proxy.set_faults(error_rate=1.0, only="PUT")
        with pytest.raises(WriteFailedError) as failed:
            mgr.save(1, model, optimizer)
        proxy.set_faults()
        texts = [str(failed.value), repr(mgr), mgr.path]
    with pytest.raises(StorageError, match="credentials in the URL are not accepted") as refused:
        CheckpointManager(f"s3://user:{SECRET}@missing-bucket-q/run", storage_options=opts)
    texts.append(str(refused.value))
    everything = "\n".join([*texts, caplog.text]) + repr(every_object(url, options(endpoint)))
    assert SECRET not in everything
    assert "reduce your request rate" in texts[0]  # the 503 SlowDown, reported


def test_prefix_with_other_objects_refused(endpoint: str) -> None:
    """A prefix holding objects that are not a deltackpt checkpoint is refused, and left alone."""
    bucket = new_bucket(endpoint)
    fs = fsspec.filesystem("s3", **options(endpoint))
    fs.pipe_file(f"{bucket}/data/train.csv", b"a,b\n")
    with pytest.raises(NotACheckpointError, match=f"s3://{bucket}/data exists, is not empty"):
        CheckpointManager(f"s3://{bucket}/data", storage_options=options(endpoint))
    with pytest.raises(NotACheckpointError, match=r"has no deltackpt\.json"):
        CheckpointManager(f"s3://{bucket}/data", storage_options=options(endpoint), read_only=True)
    assert fs.find(f"{bucket}/data") == [f"{bucket}/data/train.csv"]


def test_second_writer_refused_then_served(remote: tuple[str, dict | None]) -> None:
    """The writer lease admits one writer: a second is refused with WriterLockedError while the
    first holds it, and served once it is released. Readers are never refused."""
    url, opts = remote
    first = CheckpointManager(url, storage_options=opts)
    first.save(0, extra={"a": 1}, rng=False)
    second = CheckpointManager(url, storage_options=opts)
    with pytest.raises(WriterLockedError, match="another CheckpointManager"):
        second.save(1, extra={"a": 2}, rng=False)
    assert CheckpointManager(url, storage_options=opts, read_only=True).steps() == [0]
    first.close()
    second.save(1, extra={"a": 2}, rng=False)
    second.close()
    assert CheckpointManager(url, storage_options=opts, read_only=True).steps() == [0, 1]


def test_lease_renewed_while_held_and_lost_lease_commits_nothing(
        remote: tuple[str, dict | None], monkeypatch: pytest.MonkeyPatch) -> None:
    """A live writer renews its lease past its duration; a writer whose lease was taken over
    (it stalled past expiry) commits nothing more."""
    url, opts = remote
    monkeypatch.setattr(ObjectStorage, "lease_seconds", TEST_LEASE_SECONDS)
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.acquire()
        lease = mgr.storage._lease
        first_expiry, deadline = lease.expires, time.monotonic() + 60
        while lease.expires < first_expiry + TEST_LEASE_SECONDS and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.expires >= first_expiry + TEST_LEASE_SECONDS, \
            "the lease was not renewed past its duration"
        mgr.save(0, extra={"a": 1}, rng=False)
        other = CheckpointManager(url, storage_options=opts)
        with pytest.raises(WriterLockedError):
            other.acquire()
        stall(lease)
        other.acquire()  # the stalled writer's lease has expired: taken over
        with pytest.raises(WriterLockedError, match="lost its lease"):
            mgr.save(1, extra={"a": 2}, rng=False)
        other.save(2, extra={"a": 3}, rng=False)
        other.close()
    assert CheckpointManager(url, storage_options=opts, read_only=True).steps() == [0, 2]


KILLED_WRITER = textwrap.dedent('''
    import json, os, signal, sys
    import torch
    from deltackpt import CheckpointManager
    from deltackpt.io.objectstore import ObjectStorage

    url, opts = sys.argv[1], json.loads(sys.argv[2])
    ObjectStorage.lease_seconds = 15.0  # the test's steps after the kill fit well inside it
    mgr = CheckpointManager(url, storage_options=opts, chunk_bytes=1 << 16, workers=2)
    gen = torch.Generator().manual_seed(0)
    mgr.save(0, extra={"w": torch.randn(300_000, generator=gen)}, rng=False)
    real = ObjectStorage.commit_file

    def die(self, rel, data):  # every data object of step 1 is uploaded: die before its metadata
        if rel.startswith("step-000000000001/"):
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, rel, data)

    ObjectStorage.commit_file = die
    mgr.save(1, extra={"w": torch.randn(300_000, generator=gen)}, rng=False)
''')


def test_killed_writer_leaves_no_step_and_its_lease_expires(endpoint: str, tmp_path: Path) -> None:
    """A writer SIGKILLed after uploading a step's data but before its metadata leaves no visible
    step; its lease refuses a second writer until it expires, then the next writer takes it
    over, deletes the dead writer's objects and aborts its unfinished uploads."""
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(endpoint)
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script), url, json.dumps(opts)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "dying" in done.stdout
    leftovers = [rel for rel in every_object(url, opts) if rel.startswith("step-000000000001/")]
    assert leftovers  # the data objects are there, without metadata
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert reader.steps() == [0]
    bucket = url[5:].split("/")[0]
    fs = fsspec.filesystem("s3", **opts)  # a multipart upload the writer left unfinished
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step-000000000001/d-0-r00000-009.bin")
    monkey = ObjectStorage.lease_seconds
    try:
        ObjectStorage.lease_seconds = 2.0
        mgr = CheckpointManager(url, storage_options=opts)
        with pytest.raises(WriterLockedError):
            mgr.acquire()
        deadline = time.time() + 30
        while True:
            try:
                mgr.acquire()
                break
            except WriterLockedError:
                assert time.time() < deadline, "the dead writer's lease never expired"
                time.sleep(0.3)
        assert not [rel for rel in every_object(url, opts) if rel.startswith("step-000000000001/")]
        assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
        assert mgr.restore(0).extra["w"].shape == (300_000,)
        mgr.close()
    finally:
        ObjectStorage.lease_seconds = monkey


def test_transient_faults_retried(endpoint: str, proxy: FaultProxy) -> None:
    """Dropped connections and 503 SlowDown answers to a fifth of all requests are retried:
    saves, restores, verify and gc all succeed, and the restored steps are exact."""
    url = f"s3://{new_bucket(endpoint)}/run"
    model, optimizer = model_and_optimizer()
    proxy.set_faults(drop_rate=0.1, error_rate=0.1)
    with CheckpointManager(url, full_every=2, compression="lossless", workers=2,
                           storage_options=options(proxy.url), chunk_bytes=4096) as mgr:
        states = {}
        for step in range(2):
            train(model, optimizer)
            mgr.save(step, model, optimizer)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        for step, state in states.items():
            for name, value in mgr.restore(step).model.items():
                assert_bitwise_equal(value, state[name], name)
        assert mgr.verify(deep=True) == {0: [], 1: []}
        mgr.gc("last=1")
    assert proxy.faults["drop"] > 0 and proxy.faults["503"] > 0


def test_a_request_failing_every_time_is_sent_retries_times(endpoint: str, proxy: FaultProxy) -> None:
    """The retries are deltackpt's (objectstore.RETRIES attempts of an operation): its client
    itself sends a request once, neither retrying nor sleeping before deltackpt's backoff."""
    storage = ObjectStorage(f"s3://{new_bucket(endpoint)}/run", options(proxy.url))
    storage.commit_file("probe", b"data")
    proxy.set_faults(error_rate=1.0, only=r"GET .*/probe")
    with pytest.raises(ReadFailedError, match="reduce your request rate") as failed:
        storage.read_bytes("probe")
    assert proxy.faults["503"] == objectstore.RETRIES
    assert str(failed.value).startswith(f"reading {storage.url}/probe: ")
    proxy.set_faults(error_rate=1.0, only=r"DELETE .*/probe")
    with pytest.raises(WriteFailedError, match=f"deleting {storage.url}/probe: .*reduce your"):
        storage.remove("probe")


def test_permanent_error_fails_the_save_cleanly(endpoint: str, proxy: FaultProxy) -> None:
    """Data uploads that keep failing fail the save with WriteFailedError naming the step: no step
    becomes visible, the earlier step is intact, nothing of the failed save stays stored
    (multipart uploads aborted), and the next save succeeds."""
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(proxy.url)
    with CheckpointManager(url, storage_options=opts, chunk_bytes=4096, workers=2) as mgr:
        mgr.save(0, extra={"w": torch.arange(10_000.0)}, rng=False)
        before = every_object(url, options(endpoint))
        proxy.set_faults(error_rate=1.0, only=r"PUT .*/step-000000000001/d-")
        with pytest.raises(WriteFailedError, match="writing step 1 failed"):
            mgr.save(1, extra={"w": torch.arange(10_000.0) + 1}, rng=False)
        proxy.set_faults()
        assert mgr.steps() == [0]
        fs = fsspec.filesystem("s3", **options(endpoint))
        bucket = url[5:].split("/")[0]
        assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
        after = every_object(url, options(endpoint))
        after.pop(LEASE_OBJECT)
        before.pop(LEASE_OBJECT)
        assert after == before
        mgr.save(1, extra={"w": torch.arange(10_000.0) + 1}, rng=False)
        assert torch.equal(mgr.restore(0).extra["w"], torch.arange(10_000.0))


def test_partial_load_fetches_only_its_chunks(endpoint: str, proxy: FaultProxy) -> None:
    """A load of a box of a tensor (a resharded load's shard) GETs only the chunks holding its rows:
    the data bytes fetched are at most 1.1x those chunks' stored bytes, about half the step's."""
    url = f"s3://{new_bucket(endpoint)}/run"
    weight = torch.randn(512, 256)
    with CheckpointManager(url, storage_options=options(proxy.url), chunk_bytes=32 << 10) as mgr:
        mgr.save(0, extra={"w": weight}, rng=False)
        meta = mgr.metadata(0)
        record = next(t for t in meta.tensors if t.name == "extra/w")
        row_bytes = 256 * 4
        needed = sum(c.length for c in record.fragments[0].chunks
                     if c.raw_offset < 128 * row_bytes and c.raw_offset + c.raw_length > 0)
        proxy.reset_counts()
        tensors, _ = restore_chain(mgr.storage, meta, boxes={"extra/w": ([0, 0], [128, 256])})
    assert torch.equal(tensors["extra/w"], weight[:128])
    fetched = sum(n for path, n in proxy.fetched.items() if "/d-" in path)
    assert 0 < fetched <= 1.1 * needed
    assert fetched < 0.3 * meta.stats.stored_bytes


def test_large_data_objects_upload_in_parts(endpoint: str, proxy: FaultProxy) -> None:
    """A data object larger than a part goes up as a multipart upload of several parts, restored
    exactly; when a part keeps failing, the save fails and the upload is aborted."""
    url = f"s3://{new_bucket(endpoint)}/run"
    values = torch.randint(0, 2**31 - 1, (5_000_000,), dtype=torch.int32)  # 20 MB, incompressible
    with CheckpointManager(url, storage_options=options(proxy.url), workers=1) as mgr:
        mgr.save(0, extra={"v": values}, rng=False)
        assert mgr.restore(0).extra["v"].equal(values)
        assert len([path for path in proxy.sent if "/d-" in path]) == 1  # one data object,
        assert proxy.part_puts >= 3  # sent in three parts of 8 MiB
        proxy.set_faults(error_rate=1.0, only=r"partNumber=2\b")
        with pytest.raises(WriteFailedError, match="writing step 1 failed"):
            mgr.save(1, extra={"v": values + 1}, rng=False)
        proxy.set_faults()
        assert mgr.steps() == [0]
    bucket = url[5:].split("/")[0]
    fs = fsspec.filesystem("s3", **options(endpoint))
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []  # aborted
    assert not fs.find(f"{bucket}/run/step-000000000001")


def test_is_transient() -> None:
    """What counts as transient: reset connections and timeouts, 5xx and SlowDown; not a missing
    object, a refused credential or a failed precondition."""
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as exc:
            raise OSError("wrapped") from exc
    except OSError as wrapped:
        assert is_transient(wrapped)
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(PermissionError("Access Denied"))
    assert not is_transient(OSError(22, "At least one of the pre-conditions you specified did not hold"))


def test_local_paths_take_no_storage_options(tmp_path: Path) -> None:
    """storage_options belong to object store URLs; a local path is still LocalStorage."""
    with pytest.raises(StorageError, match="storage_options"):
        CheckpointManager(tmp_path / "c", storage_options={"key": "x"})
    assert isinstance(CheckpointManager(tmp_path / "c").storage, LocalStorage)


def test_cache_tier(remote: tuple[str, dict | None], tmp_path: Path,
                    caplog: pytest.LogCaptureFixture) -> None:
    """With cache=, a save commits in the local cache and uploads in the background; the next
    operation sees it on the remote. Restores read the cache where it holds the same chain,
    the remote otherwise (a damaged cached chunk included). The cache keeps cache_keep steps and
    their chains, gc removes steps from both."""
    url, opts = remote
    cache = tmp_path / "cache"
    model, optimizer = model_and_optimizer()
    with CheckpointManager(url, full_every=3, storage_options=opts, cache=cache,
                           cache_keep=1) as mgr:
        for step in range(5):
            train(model, optimizer)
            mgr.save(step, model, optimizer)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        assert mgr.steps() == [0, 1, 2, 3, 4]
        cached = CheckpointManager(cache, read_only=True)
        assert cached.steps() == [3, 4]  # the newest and its chain
        remote_only = CheckpointManager(url, storage_options=opts, read_only=True)
        restored = remote_only.restore(4).model
        from_cache = mgr.restore(4).model
        for name in expected:
            assert_bitwise_equal(from_cache[name], restored[name], name)
        data = next(p for p in (cache / "step-000000000004").iterdir() if p.name.startswith("d-"))
        damaged = bytearray(data.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        data.write_bytes(bytes(damaged))
        for name, value in mgr.restore(4).model.items():  # from the remote
            assert_bitwise_equal(value, restored[name], name)
        assert "the cached copy of step 4 is damaged" in caplog.text  # it was read first
        mgr.gc("last=1")
        assert mgr.steps() == [4]
    assert CheckpointManager(url, storage_options=opts, read_only=True).steps() == [4]


def test_cache_tier_upload_failure_is_raised_and_retried(endpoint: str, proxy: FaultProxy,
                                                          tmp_path: Path) -> None:
    """A failed upload is raised by the next operation, naming the step; the step stays in the
    cache and is uploaded once the remote works again."""
    url = f"s3://{new_bucket(endpoint)}/run"
    with CheckpointManager(url, storage_options=options(proxy.url), cache=tmp_path / "cache",
                           cache_keep=0) as mgr:
        mgr.save(0, extra={"w": torch.arange(1000.0)}, rng=False)
        proxy.set_faults(error_rate=1.0, only=r"PUT .*/step-000000000001/")
        mgr.save(1, extra={"w": torch.arange(1000.0) + 1}, rng=False)  # returns: uploads later
        with pytest.raises(WriteFailedError, match=r"uploading step 1 .* failed"):
            mgr.steps()
        assert CheckpointManager(tmp_path / "cache", read_only=True).steps() == [1]
        proxy.set_faults()
        assert mgr.steps() == [0, 1]
        assert torch.equal(mgr.restore(1).extra["w"], torch.arange(1000.0) + 1)
    assert CheckpointManager(tmp_path / "cache", read_only=True).steps() == []


def _fsdp_mlp(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 MLP (the same weights on every rank) with AdamW state."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.ReLU(), torch.nn.Linear(384, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer)
    return model, optimizer


def test_4_to_2_resharded_load_fetches_only_its_chunks(endpoint: str, proxy: FaultProxy,
                                                       tmp_path: Path) -> None:
    """A step saved by 4 FSDP ranks and loaded on 2: the data bytes the 2 ranks GET are at most
    1.1x the stored bytes of the chunks they decode, and, each loading half the rows, together
    about the step's stored bytes once (not once per rank)."""
    from remote_ranks import save_on_4_load_on_2

    url = f"s3://{new_bucket(endpoint)}/run"
    fetched, needed, stored = save_on_4_load_on_2(url, options(proxy.url), proxy, _fsdp_mlp,
                                                  chunk_bytes=16 << 10, report=tmp_path / "needed")
    assert 0 < fetched <= 1.1 * needed
    assert fetched <= 1.1 * stored


RACER = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    from deltackpt import CheckpointManager, WriterLockedError
    from deltackpt.io.objectstore import _Lease

    url, opts, meeting = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    read = _Lease.storage_get

    def read_then_meet(self):  # both racers read the expired lease before either takes it over
        found = read(self)
        (meeting / str(os.getpid())).touch()
        deadline = time.time() + 30
        while len(list(meeting.iterdir())) < 2 and time.time() < deadline:
            time.sleep(0.01)
        return found

    _Lease.storage_get = read_then_meet
    mgr = CheckpointManager(url, storage_options=opts)
    try:
        mgr.acquire()
    except WriterLockedError as exc:
        print("refused", exc, flush=True)
    else:
        print("won", flush=True)
        sys.stdin.read()  # hold the lease until the test has seen both outcomes
        mgr.save(1, extra={"pid": os.getpid()}, rng=False)
        mgr.close()
''')


def test_two_processes_racing_for_an_expired_lease(endpoint: str, proxy: FaultProxy,
                                                   tmp_path: Path) -> None:
    """Two processes that both read a crashed writer's expired lease and take it over at once:
    exactly one wins (its conditional PUT's ETag matches; S3 applies it atomically); the other
    is refused with WriterLockedError naming the winner's process and host."""
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(proxy.url)
    CheckpointManager(url, storage_options=opts).close()
    fs, root = fsspec.core.url_to_fs(url, **options(endpoint))
    fs.pipe_file(f"{root}/{LEASE_OBJECT}", json.dumps(
        {"owner": "0" * 32, "host": "crashed-host", "pid": 1, "expires": time.time() - 1,
         "seconds": 60.0}).encode())
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    racers = [subprocess.Popen([sys.executable, str(script), url, json.dumps(opts), str(meeting)],
                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        first = [racer.stdout.readline().strip() for racer in racers]
        assert sorted(line.split()[0] for line in first) == ["refused", "won"], first
        winner = racers[[line.split()[0] for line in first].index("won")]
        refusal = next(line for line in first if line.startswith("refused"))
        assert f"held by process {winner.pid} on {socket.gethostname()}" in refusal
        assert len(list(meeting.iterdir())) == 2  # both had read the expired lease
        for racer in racers:
            _, err = racer.communicate("", timeout=120)
            assert racer.returncode == 0, err
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
    restored = CheckpointManager(url, storage_options=opts, read_only=True).restore(1)
    assert restored.extra == {"pid": winner.pid}


def test_steps_are_one_listing_and_kept_metadata_one_head(endpoint: str, proxy: FaultProxy) -> None:
    """On S3, listing the steps is one request however many steps there are; a manager keeps
    the metadata it wrote while the object's ETag stays the same (a HEAD, no GET), and reads it
    again once another writer replaced it; a step's "directory" costs no request."""
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(proxy.url)
    with CheckpointManager(url, storage_options=opts, full_every=100) as mgr:
        for step in range(6):
            mgr.save(step, extra={"w": torch.arange(100.0) + step}, rng=False)
        proxy.reset_counts()
        assert mgr.steps() == list(range(6))
        assert sum(proxy.requests.values()) == 1
        proxy.reset_counts()
        assert mgr.storage.makedirs("step-000000000009") is False
        assert sum(proxy.requests.values()) == 0
        kept = mgr.metadata(5)
        assert proxy.requests["GET"] == 0 and not any("metadata" in p for p in proxy.fetched)
        identity = mgr.storage.identity("step-000000000005/metadata.json")
        assert identity is not None and identity == mgr.storage.identity(
            "step-000000000005/metadata.json")
        assert mgr.storage.identity("step-000000000005/no-such-object") is None
    with CheckpointManager(url, storage_options=opts) as other:
        other.save(5, extra={"w": torch.zeros(100)}, rng=False, overwrite=True)
    assert mgr.storage.identity("step-000000000005/metadata.json") != identity
    assert mgr.metadata(5).save_id != kept.save_id  # read again


def test_restore_fetches_adjacent_chunks_in_few_gets(endpoint: str, proxy: FaultProxy) -> None:
    """A restore GETs adjacent chunks together (ranged GETs of up to RUN_BYTES, streamed), not
    one GET per chunk: a step of 250 chunks in one data object restores exactly, with one
    decoding thread, in one GET of its data (and at most three of metadata and RNG state);
    data fetched = data stored."""
    url = f"s3://{new_bucket(endpoint)}/run"
    values = torch.randn(250 * 1024)  # 1 MB in chunks of 4 KiB
    with CheckpointManager(url, storage_options=options(proxy.url), chunk_bytes=4096,
                           workers=1, compression="lossless") as mgr:
        mgr.save(0, extra={"v": values}, rng=False)
        meta = mgr.metadata(0)
        assert len(meta.files) == 1 and sum(len(f.chunks) for t in meta.tensors
                                            for f in t.fragments) >= 250
        proxy.reset_counts()
        assert torch.equal(mgr.restore(0).extra["v"], values)
    data = [path for path in proxy.fetched if "/d-" in path]
    assert len(data) == 1 and proxy.fetched[data[0]] == meta.files[0].size
    assert proxy.requests["GET"] <= 4


def _store_requests(proxy: FaultProxy) -> list[str]:
    """The requests the proxy forwarded, in order, but the lease's renewals (a background
    thread's, every third of its duration)."""
    return [r for r in proxy.log if LEASE_OBJECT not in r]


def test_delta_save_requests(endpoint: str, proxy: FaultProxy) -> None:
    """A delta save to S3 makes one listing of its step's prefix (it says whether the step exists,
    and what the commit leaves to delete), a PUT per data object and the PUT of its metadata:
    no HEAD (the metadata of its base and chain are objects this writer PUT under the lease it
    still holds, their ETags returned by those PUTs) and no listing after the commit."""
    url = f"s3://{new_bucket(endpoint)}/run"
    bucket = url[5:].split("/")[0]
    model, optimizer = model_and_optimizer()
    train(model, optimizer)  # the optimizer has its state: the next saves can be deltas
    with CheckpointManager(url, storage_options=options(proxy.url), workers=1) as mgr:
        mgr.save(0, model, optimizer)
        for step in (1, 2):
            train(model, optimizer)
            proxy.reset_counts()
            assert mgr.save(step, model, optimizer).kind == "delta"
            meta = mgr.metadata(step)
            step_dir = f"step-00000000000{step}"
            made = _store_requests(proxy)
            assert made[0].startswith(f"GET /{bucket}?list-type=2&prefix=run%2F{step_dir}%2F")
            assert sorted(made[1:-1]) == sorted(f"PUT /{bucket}/run/{step_dir}/{f.name}"
                                                for f in meta.files)
            assert made[-1] == f"PUT /{bucket}/run/{step_dir}/metadata.json"
    reader = CheckpointManager(url, storage_options=options(endpoint), read_only=True)
    assert reader.verify(deep=True) == {0: [], 1: [], 2: []}


def test_commit_deletes_what_its_listing_found(endpoint: str, proxy: FaultProxy) -> None:
    """The objects under a step's prefix that the save's listing found and the new metadata does
    not reference are deleted after the commit: those of a failed save of the step whose own
    clean-up failed too, and those of the version an overwrite replaced (kept until the new
    metadata's PUT, so a failed overwrite leaves the old version whole)."""
    url = f"s3://{new_bucket(endpoint)}/run"
    fs, root = fsspec.core.url_to_fs(url, **options(endpoint))

    def step_objects() -> set[str]:
        return {path.rsplit("/", 1)[1] for path in fs.find(f"{root}/step-000000000001")}

    def values(n: int) -> dict:
        return {"w": torch.arange(1000.0) + n}

    with CheckpointManager(url, storage_options=options(proxy.url), workers=1,
                           reader_grace=0) as mgr:
        mgr.save(1, extra=values(0), rng=False)
        first = step_objects()
        proxy.set_faults(error_rate=1.0, only=r"PUT .*/step-000000000001/metadata\.json|"
                                              r"DELETE .*/step-000000000001/")
        with pytest.raises(WriteFailedError, match="writing step 1 failed"):
            mgr.save(1, extra=values(1), rng=False, overwrite=True)
        proxy.set_faults()
        leftovers = step_objects() - first
        assert len(leftovers) == 1 and leftovers.pop().startswith("d-")  # its data object
        assert torch.equal(mgr.restore(1).extra["w"], values(0)["w"])  # the old version, whole
        mgr.save(1, extra=values(2), rng=False, overwrite=True)
        meta = mgr.metadata(1)
        assert step_objects() == {"metadata.json", *(f.name for f in meta.files)}
        assert not first & {f.name for f in meta.files}
    assert torch.equal(CheckpointManager(url, storage_options=options(endpoint), read_only=True)
                       .restore(1).extra["w"], values(2)["w"])


def test_own_metadata_identity_trusted_only_under_the_lease(
        endpoint: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity of a metadata object this writer PUT is, while it holds its lease, the one a
    HEAD reports, given without a request; once the lease expired unrenewed or was released, a
    HEAD asks the store again, and a save after another writer replaced its base step is a
    full step, not a delta against a version it never saw."""
    monkeypatch.setattr(ObjectStorage, "lease_seconds", TEST_LEASE_SECONDS)
    url = f"s3://{new_bucket(endpoint)}/run"
    opts = options(proxy.url)
    rel = "step-000000000000/metadata.json"
    mgr = CheckpointManager(url, storage_options=opts)
    mgr.save(0, extra={"w": torch.arange(1000.0)}, rng=False)
    proxy.reset_counts()
    own = mgr.storage.identity(rel)
    assert proxy.log == []
    assert own == ObjectStorage(url, opts).identity(rel)
    stall(mgr.storage._lease)
    proxy.reset_counts()
    assert mgr.storage.identity(rel) == own
    assert proxy.requests["HEAD"] == 1
    mgr.close()
    with CheckpointManager(url, storage_options=opts) as other:
        other.save(0, extra={"w": torch.zeros(1000)}, rng=False, overwrite=True)
    proxy.reset_counts()
    assert mgr.storage.identity(rel) not in (own, None)
    assert proxy.requests["HEAD"] == 1
    info = mgr.save(1, extra={"w": torch.arange(1000.0) + 1}, rng=False)
    assert info.kind == "full"
    mgr.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_steps_on_object_storage(remote: tuple[str, dict | None]) -> None:
    """deltackpt.dcp's Writer and Reader take URLs and storage options as everywhere else."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import deltackpt.dcp

    url, opts = remote
    model, optimizer = model_and_optimizer()
    saved = []
    for step in range(2):
        train(model, optimizer, 2)
        msd, osd = get_state_dict(model, optimizer)
        writer = deltackpt.dcp.Writer(url, step, full_every=2, storage_options=opts)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        saved.append((writer.info.kind, {k: v.clone() for k, v in msd.items()}))
    assert [kind for kind, _ in saved] == ["full", "delta"]
    fresh, fresh_optimizer = model_and_optimizer(seed=1)
    train(fresh, fresh_optimizer)
    msd, osd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=deltackpt.dcp.Reader(url, 0, storage_options=opts))
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for fqn, value in saved[0][1].items():
        assert_bitwise_equal(fresh.state_dict()[fqn], value, fqn)
