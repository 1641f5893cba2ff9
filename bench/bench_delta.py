"""Delta steps: kernel speed against memcpy, save speed against ``torch.save``, chain restores.

Targets, each reported beside a baseline measured in the same run (``-k accounting``: where
the CPU time of a delta save and of a chain restore goes, by phase, see the end of this file):

* (issue 3) fused encode kernel >= 0.3x memcpy into a preallocated buffer,
  decode >= 0.4x; restoring the step at the end of a 9-delta chain >= 1
  GB/s of state; a delta save of a ~600 MB training state (TinyGPT ``xl``:
  fp32 weights + Adam moments) >= 3x faster than ``torch.save`` + fsync of
  the same state, and a full lossless save no slower than it;
* (issue 15) at 40 MB of state (``40mb``) and 300 MB (``large``): a delta
  save in at most 0.5x and 0.3x the time of ``torch.save`` + fsync, and
  restoring the end of a 5-delta chain in at most 2x and 3x the time of
  ``torch.load`` (each timed in the same rounds: ``conftest.paired``).

The states are real: a TinyGPT trained on text with AdamW, checkpointed
GAP training steps apart. ``DELTACKPT_BENCH_DELTA_MODELS`` (default
``"40mb:30,large:30,xl:4"``) picks the models as size:training_steps;
``pytest bench/bench_delta.py`` prints the table.
"""

from __future__ import annotations

import copy
import os
import resource
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import CACHE, durable_torch_save, note, paired, record
from cpu_accounting import CpuAccounting

from deltackpt import CheckpointManager
from deltackpt.app.training import (
    SIZES,
    GPTConfig,
    TinyGPT,
    load_corpus,
    make_optimizer,
    make_scheduler,
    split_corpus,
    train_step,
)
from deltackpt.codecs.quant import (
    decode_quant,
    encode_quant,
    quant_params,
    quant_stream,
    stored_stream,
)
from deltackpt.encode.policy import tensor_class
from deltackpt.format.dtypes import spec_named
from deltackpt.io.pool import default_workers
from deltackpt.io.reader import ChunkSource, read_tensors
from deltackpt.io.writer import DEFAULT_CHUNK_BYTES
from deltackpt.kernels.quant import decode_block_stream, decode_step_streams, encode_block_stream
from deltackpt.restore.chain import restore_chain

ROUNDS = 3
# Rounds of the benchmarks timed against a baseline: small states take little time, so more of
# them, about this many bytes of state per benchmark (at most MAX_ROUNDS).
ROUND_BYTES = 2 << 30
MAX_ROUNDS = 25
# Training steps between the states a delta is measured on: the fidelity bench's shorter save
# interval. (The balanced preset's weight step is 16 learning rates: saves a few steps apart would
# code almost nothing and time an empty delta.)
GAP = 20
CHAIN = 9  # deltas in the restored chain
SHORT_CHAIN = 5  # and in the one restored against torch.load
# TinyGPT sizes by name; "40mb": 3.3M parameters, 40 MB of weights and AdamW moments.
BENCH_SIZES = {**SIZES, "40mb": GPTConfig(d_model=256, n_layer=4, n_head=4)}
MODELS = [(size, int(steps)) for size, steps in
          (item.split(":") for item in os.environ.get("DELTACKPT_BENCH_DELTA_MODELS",
                                                       "40mb:30,large:30,xl:4").split(","))]


def _rounds(raw_bytes: int) -> int:
    """Rounds of a benchmark of a state of ``raw_bytes`` timed against a baseline."""
    return max(ROUNDS, min(MAX_ROUNDS, ROUND_BYTES // raw_bytes))


def _train(size: str, steps: int, extra: int) -> tuple[TinyGPT, torch.optim.Optimizer, list[dict]]:
    """A TinyGPT trained ``steps`` steps, then ``extra`` more, keeping every GAP-th state."""
    torch.manual_seed(0)
    model = TinyGPT(BENCH_SIZES[size])
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, warmup=max(1, steps // 10), total=10 * steps)
    train, _ = split_corpus(load_corpus())
    path = CACHE / f"delta-{size}-{steps}-{extra}.pt"
    if path.exists():
        states = torch.load(path, weights_only=True)
    else:
        for _ in range(steps):
            train_step(model, optimizer, scheduler, train, batch_size=8)
        states = []
        for i in range(extra + 1):
            if i % GAP == 0:
                states.append({"model": copy.deepcopy(model.state_dict()),
                               "optimizer": copy.deepcopy(optimizer.state_dict())})
            if i < extra:
                train_step(model, optimizer, scheduler, train, batch_size=8)
        CACHE.mkdir(exist_ok=True)
        torch.save(states, path)
    model.load_state_dict(states[-1]["model"])
    optimizer.load_state_dict(states[-1]["optimizer"])
    return model, optimizer, states


@pytest.fixture(scope="module", params=MODELS, ids=[f"{s}-{n}" for s, n in MODELS])
def run(request) -> tuple[TinyGPT, torch.optim.Optimizer, list[dict]]:
    """Model and optimizer at the last of CHAIN + 1 states GAP training steps apart (fewer for xl)."""
    size, steps = request.param
    chain = CHAIN if size != "xl" else 1
    return _train(size, steps, GAP * chain)


def _load(model, optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _tensors(state: dict) -> list[tuple[str, np.ndarray]]:
    """Weights and Adam moments of a state dict as named float32 arrays."""
    out = [(f"w/{k}", v.numpy().reshape(-1)) for k, v in state["model"].items()
           if v.dtype == torch.float32 and k != "head.weight"]
    for i, s in state["optimizer"]["state"].items():
        out += [(f"{key}/{i}", s[key].numpy().reshape(-1)) for key in ("exp_avg", "exp_avg_sq")]
    return out


def test_memcpy(benchmark, run) -> None:
    """Baseline: copy weights and moments into a preallocated buffer."""
    arrays = [a for _, a in _tensors(run[2][-1])]
    dest = [np.empty_like(a) for a in arrays]
    benchmark.pedantic(lambda: [np.copyto(d, a) for d, a in zip(dest, arrays, strict=True)],
                       rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "memcpy", sum(a.nbytes for a in arrays))


EPS = float(np.float32(1e-8))  # AdamW's default eps, as a float32 value


def _coding(run) -> list[tuple[np.ndarray, np.ndarray | None, bool, float | int, np.ndarray | None]]:
    """(x, prediction, ordinal, step, scale) per chunk of a save, about as the balanced preset
    codes a delta: weights against the previous state (at 4 RMS of the change, where a save
    uses the learning rate), exp_avg_sq at 16 binades, exp_avg from zero scaled by the square
    root of exp_avg_sq's reconstruction.

    Tensors are cut into the chunks a save codes (``DEFAULT_CHUNK_BYTES``).
    """
    new, old = dict(_tensors(run[2][-1])), dict(_tensors(run[2][-2]))
    jobs = {}
    for name, x in sorted(new.items(), key=lambda item: item[0].startswith("exp_avg/")):
        if name.startswith("w/"):
            r = x - old[name]
            step = float(np.float32(4 * np.sqrt(np.mean(r.astype(np.float64) ** 2)) or 1.0))
            jobs[name] = (x, old[name].copy(), False, step, None)
        elif name.startswith("exp_avg_sq"):
            jobs[name] = (x, old[name].copy(), True, 16 << 23, None)
        else:  # after its exp_avg_sq, whose reconstruction scales it
            v, v_pred, _, v_step, _ = jobs[name.replace("exp_avg", "exp_avg_sq")]
            v_recon = np.empty_like(v)
            encode_block_stream(v, v_pred, v_recon, ordinal=True, step=v_step, block=1024)
            jobs[name] = (x, None, False, 2.0, v_recon)
    n = DEFAULT_CHUNK_BYTES // 4
    return [(x[i : i + n], None if p is None else p[i : i + n], ordinal, step,
             None if scale is None else scale[i : i + n])
            for x, p, ordinal, step, scale in jobs.values() for i in range(0, x.size, n)]


def test_encode_kernel(benchmark, run) -> None:
    """The fused kernel alone: residual, quantize, pack, update of the reconstruction in place;
    one chunk per task on a thread pool, as a save runs it."""
    jobs = _coding(run)
    recons = [np.empty_like(x) for x, *_ in jobs]

    def setup() -> None:  # untimed: the reconstructions back to the previous state
        for recon, (_, p, *_) in zip(recons, jobs, strict=True):
            recon[:] = 0 if p is None else p

    def encode_one(i: int) -> int:
        x, p, ordinal, step, scale = jobs[i]
        return encode_block_stream(x, None if p is None else recons[i], recons[i],
                                   ordinal=ordinal, step=step, block=1024, scale=scale,
                                   eps=EPS)[0].size

    with ThreadPoolExecutor(default_workers()) as pool:
        packed = benchmark.pedantic(lambda: sum(pool.map(encode_one, range(len(jobs)))),
                                    setup=setup, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "fused encode kernel (packed)", sum(x.nbytes for x, *_ in jobs), packed)


def test_decode_kernel(benchmark, run) -> None:
    """Unpack, dequantize and add into the running reconstruction, in place; one chunk per task."""
    jobs = _coding(run)
    streams = [encode_block_stream(x, p, np.empty_like(x), ordinal=o, step=s, block=1024,
                                   scale=scale, eps=EPS)[0] for x, p, o, s, scale in jobs]
    outs = [np.empty_like(x) if p is None else p.copy() for x, p, *_ in jobs]

    def decode_one(i: int) -> None:
        _, p, ordinal, step, scale = jobs[i]
        decode_block_stream(streams[i], None if p is None else outs[i], outs[i], ordinal=ordinal,
                            step=step, block=1024, scale=scale, eps=EPS)

    with ThreadPoolExecutor(default_workers()) as pool:
        benchmark.pedantic(lambda: list(pool.map(decode_one, range(len(jobs)))),
                           rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "decode kernel (in place)", sum(x.nbytes for x, *_ in jobs))


@pytest.fixture(scope="module")
def saved_delta(run, tmp_path_factory) -> list[tuple[str, dict, np.ndarray, np.ndarray | None,
                                                       np.ndarray | None, int]]:
    """What a real delta save (``balanced``, the last state against the one GAP steps before)
    codes, chunk by chunk: ``(class, params, x, prediction, scale, first)``, with the params
    its metadata records (steps, dither seeds, scales), checked to give the streams it stored."""
    model, optimizer, states = run
    root = tmp_path_factory.mktemp("by-class")
    with CheckpointManager(root / "delta") as mgr, \
            CheckpointManager(root / "truth", full_every=1) as truth:
        for step, state in ((1, states[-2]), (2, states[-1])):
            _load(model, optimizer, state)
            mgr.save(step, model, optimizer, rng=False)
            truth.save(step, model, optimizer, rng=False)
        meta = mgr.metadata(2)
        base = read_tensors(mgr.storage, mgr.metadata(1))
        now = read_tensors(truth.storage, truth.metadata(2))
        restored, _ = restore_chain(mgr.storage, meta)
        source = ChunkSource(mgr.storage, meta)
        jobs = []
        for rec in meta.tensors:
            kind = tensor_class(rec.role, rec.state_key, spec_named(rec.dtype, rec.name), rec.numel)
            for chunk in (c for f in rec.fragments for c in f.chunks if c.codec == "quant"):
                first, n = chunk.raw_offset // 4, chunk.raw_length // 4
                part = slice(first, first + n)
                params = chunk.params
                scale = params.get("scale")
                jobs.append((kind, params, now[rec.name].reshape(-1)[part].numpy(),
                             base[rec.name].reshape(-1)[part].numpy().copy()
                             if params["pred"] == "base" else None,
                             None if scale is None else restored[scale].reshape(-1)[part].numpy(),
                             first))
                stream = quant_stream(source.stored(rec, chunk), params, n).data
                assert np.array_equal(_encode_job(jobs[-1])[0], stream), rec.name
        source.close()
    return jobs


def _kernel_args(params: dict, first: int) -> dict:
    ordinal, _, step, block, dither, dither_signs, dither_groups = quant_params(params)
    return {"ordinal": ordinal, "step": step, "block": block, "dither": dither,
            "dither_signs": dither_signs, "dither_groups": dither_groups, "first": first}


def _scaling(params: dict) -> dict:
    """A scaled chunk's eps and the floor that shapes its steps (0: none), as its params say."""
    return {"eps": params.get("eps", 0.0),
            "floor": 2.0 ** params["floor_log2"] if "floor_log2" in params else 0.0}


def _encode_job(job, recon: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    _, params, x, pred, scale, first = job
    return encode_block_stream(x, pred, np.empty_like(x) if recon is None else recon,
                               **_kernel_args(params, first), scale=scale, **_scaling(params),
                               bit_planes=True)


def _decode_job(job, stream: np.ndarray, out: np.ndarray) -> None:
    """As a restore applies the chunk from the bit planes ``stream``: a chain pass from its
    base, a scaled chunk from zero."""
    _, params, _, pred, scale, first = job
    args = _kernel_args(params, first)
    if scale is not None:
        decode_block_stream(stream, None, out, **args, scale=scale, **_scaling(params),
                            bit_planes=True)
        return
    out[:] = 0 if pred is None else pred
    decode_step_streams([stream], out, ordinal=[args["ordinal"]], steps=[args["step"]],
                        block=args["block"], zero_start=pred is None, dithers=[args["dither"]],
                        dither_signs=[args["dither_signs"]],
                        dither_groups=[args["dither_groups"]], first=first, bit_planes=[True])


def test_kernel_cost_by_class(saved_delta) -> None:
    """Each class's encode and decode kernel, the entropy coding of its streams as the writer
    stores them (zstd, or rANS for streams grouped by their dither) and back, and memcpy of the
    same elements, on one thread, in ns an element: what a save and a restore pay a class,
    whatever the core count. Medians of ROUNDS rounds of every class."""
    classes = sorted({job[0] for job in saved_delta})
    outs = [np.empty_like(job[2]) for job in saved_delta]
    streams = [_encode_job(job, recon)[0] for job, recon in zip(saved_delta, outs, strict=True)]
    for i, job in enumerate(saved_delta):  # what is timed decodes to what was encoded
        recon = outs[i].copy()
        _decode_job(job, streams[i], outs[i])
        assert np.array_equal(outs[i].view(np.uint32), recon.view(np.uint32)), job[0]
    def stored(i: int) -> bytes:
        params, n = saved_delta[i][1], outs[i].size
        return stored_stream(streams[i], n, params["block"], "dither_groups" in params)[0]

    coded = [stored(i) for i in range(len(saved_delta))]
    unzeroed = [{k: v for k, v in job[1].items() if k != "zeros"} for job in saved_delta]
    work = {
        "memcpy": lambda i: np.copyto(outs[i], saved_delta[i][2]),
        "encode kernel": lambda i: _encode_job(saved_delta[i]),
        "entropy code": stored,
        "decode kernel": lambda i: _decode_job(saved_delta[i], streams[i], outs[i]),
        "entropy decode": lambda i: quant_stream(memoryview(coded[i]), unzeroed[i], outs[i].size),
    }
    times = {(kind, what): [] for kind in classes for what in work}
    for _ in range(ROUNDS + 1):  # the first warms up
        for kind in classes:
            mine = [i for i, job in enumerate(saved_delta) if job[0] == kind]
            for what, fn in work.items():
                started = time.perf_counter()
                for i in mine:
                    fn(i)
                times[kind, what].append(time.perf_counter() - started)
    note("")
    note("kernel cost by class, ns an element on one thread (medians of "
         f"{ROUNDS} rounds; memcpy of the same elements beside it)")
    for kind in classes:
        n = sum(job[2].size for job in saved_delta if job[0] == kind)
        ns = {what: statistics.median(times[kind, what][1:]) / n * 1e9 for what in work}
        bits = {name: 8 * sum(len(b) for b, job in zip(data, saved_delta, strict=True)
                              if job[0] == kind) / n
                for name, data in (("planes", streams), ("stored", coded))}
        note(f"  {kind:<14} {n / 1e6:6.2f}M elements, {bits['planes']:.2f} bits each in planes, "
             f"{bits['stored']:.2f} stored: " + ", ".join(
            f"{what} {ns[what]:.2f} ({ns[what] / ns['memcpy']:.0f}x)" for what in work
            if what != "memcpy") + f"; memcpy {ns['memcpy']:.2f}")


def test_codec_roundtrip_is_exact(run) -> None:
    """What the benchmarks time decodes to what the encoder kept (a guard, not a timing)."""
    x, p, ordinal, step, _ = _coding(run)[0]
    recon = np.empty_like(x)
    chunk, _ = encode_quant(x, p, recon, ordinal=ordinal, step=step, block=1024)
    out = p.copy()
    decode_quant(memoryview(chunk.parts[0]), chunk.params, out, out, first=0)
    assert np.array_equal(out.view(np.uint32), recon.view(np.uint32))


def test_torch_save_fsync(benchmark, run, tmp_path) -> None:
    """Baseline: ``torch.save`` + fsync of model and optimizer state dicts."""
    model, optimizer, _ = run
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    path = tmp_path / "ckpt.pt"
    raw = sum(a.nbytes for _, a in _tensors(run[2][-1]))
    benchmark.pedantic(durable_torch_save, args=(payload, path), rounds=_rounds(raw),
                       warmup_rounds=1)
    record(benchmark, "torch.save + fsync", raw, path.stat().st_size)


def test_torch_load(benchmark, run, tmp_path) -> None:
    """Baseline of restores: ``torch.load`` of that file (in the page cache)."""
    model, optimizer, _ = run
    path = tmp_path / "ckpt.pt"
    durable_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    raw = sum(a.nbytes for _, a in _tensors(run[2][-1]))
    benchmark.pedantic(torch.load, args=(path,), kwargs={"weights_only": True},
                       rounds=_rounds(raw), warmup_rounds=1)
    record(benchmark, "torch.load", raw, path.stat().st_size)


def test_full_save_fsync(benchmark, run, tmp_path) -> None:
    """A full lossless step, fsynced and committed."""
    model, optimizer, _ = run
    directory = tmp_path / "full"
    infos = []

    def setup() -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def save() -> None:
        with CheckpointManager(directory) as mgr:
            infos.append(mgr.save(1, model, optimizer, rng=False))

    benchmark.pedantic(save, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, "full save + fsync", infos[-1].raw_bytes, infos[-1].stored_bytes)


class _DeltaSaves:
    """Rounds of a delta step (balanced preset) on the state GAP training steps earlier: each
    round's untimed :meth:`setup` makes a fresh directory holding the earlier state as a full
    step, :meth:`save` saves the later one as a delta, :meth:`torch_save` the baseline.
    ``full_every``: the managers' (default theirs: the full step is the base of later deltas
    too, and the delta writes running values of its own; 2: the delta is its base's last use,
    and codes in place, as most deltas of a run do)."""

    def __init__(self, run, tmp_path, full_every: int | None = None) -> None:
        self.model, self.optimizer, self.states = run
        self.tmp_path = tmp_path
        self.options = {} if full_every is None else {"full_every": full_every}
        self.manager: CheckpointManager | None = None
        self.infos = []

    def setup(self) -> None:
        self.close()
        shutil.rmtree(self.tmp_path / "delta", ignore_errors=True)
        _load(self.model, self.optimizer, self.states[-2])
        self.manager = CheckpointManager(self.tmp_path / "delta", **self.options)
        self.manager.save(1, self.model, self.optimizer, rng=False)
        _load(self.model, self.optimizer, self.states[-1])

    def save(self) -> None:
        self.infos.append(self.manager.save(2, self.model, self.optimizer, rng=False))

    def torch_save(self) -> None:
        durable_torch_save({"model": self.model.state_dict(),
                            "optimizer": self.optimizer.state_dict()}, self.tmp_path / "ckpt.pt")

    def close(self) -> None:
        # Dropped once closed, as a training process holds one manager: a closed manager keeps
        # its reconstruction for a later save, and holding every round's (300 MB each on the
        # large state) made each save slower than the one before, up to 1.4x torch.save.
        if self.manager is not None:
            self.manager.close()
            self.manager = None


@pytest.mark.parametrize("full_every", [None, 2], ids=["base-kept", "in-place"])
def test_delta_save_fsync(benchmark, run, tmp_path, full_every) -> None:
    """A delta step on the state GAP training steps earlier (balanced preset), fsynced, against
    ``torch.save`` + fsync of the same state in the same rounds: on a base later deltas use
    too, and on its base's last use (:class:`_DeltaSaves`)."""
    saves = _DeltaSaves(run, tmp_path, full_every)
    raw = sum(a.nbytes for _, a in _tensors(run[2][-1]))
    baseline = paired(benchmark, saves.save, saves.torch_save, setup=saves.setup,
                      rounds=_rounds(raw))
    saves.close()
    assert saves.infos[-1].kind == "delta"
    record(benchmark, "delta save + fsync (balanced)" + (", in place" if full_every else ""),
           saves.infos[-1].raw_bytes,
           saves.infos[-1].stored_bytes, baseline=("torch.save + fsync", baseline))


@pytest.fixture(scope="module")
def chain(run, tmp_path_factory) -> CheckpointManager:
    """A manager of a full step and CHAIN deltas, one for each state of the run, in order."""
    model, optimizer, states = run
    if len(states) < CHAIN + 1:
        pytest.skip("this model is trained for the save benchmarks only")
    with CheckpointManager(tmp_path_factory.mktemp("chain"), full_every=CHAIN + 1) as mgr:
        for i, state in enumerate(states):
            _load(model, optimizer, state)
            mgr.save(i, model, optimizer, rng=False)
        yield mgr


def _delta_at_end_of_chain(mgr: CheckpointManager, step: int) -> int:
    """The raw bytes of ``step``, checked to be the end of a chain of ``step`` deltas."""
    info = mgr.info(step)
    assert info.kind == "delta" and mgr.metadata(step).base_step == step - 1
    return info.raw_bytes


def test_restore_end_of_chain(benchmark, chain) -> None:
    """Restore the last step of a full step + CHAIN deltas (files in the page cache)."""
    raw = _delta_at_end_of_chain(chain, CHAIN)
    benchmark.pedantic(chain.restore, args=(CHAIN,), rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, f"restore end of {CHAIN}-delta chain", raw)


def _restore_against_torch_load(benchmark, run, chain, tmp_path, restore, name: str) -> None:
    """Benchmark ``restore()`` of the last step of a full step + SHORT_CHAIN deltas against
    ``torch.load`` of that state's ``torch.save`` file in the same rounds (files in the page
    cache)."""
    raw = _delta_at_end_of_chain(chain, SHORT_CHAIN)
    path = tmp_path / "ckpt.pt"
    durable_torch_save(run[2][SHORT_CHAIN], path)
    baseline = paired(benchmark, restore, lambda: torch.load(path, weights_only=True),
                      rounds=_rounds(raw))
    record(benchmark, name, raw, baseline=("torch.load", baseline))


def test_restore_end_of_short_chain(benchmark, run, chain, tmp_path) -> None:
    """By the manager that saved the chain (as a training run's evaluation does)."""
    _restore_against_torch_load(benchmark, run, chain, tmp_path,
                                lambda: chain.restore(SHORT_CHAIN),
                                f"restore end of {SHORT_CHAIN}-delta chain")


def test_restore_end_of_short_chain_new_manager(benchmark, run, chain, tmp_path) -> None:
    """By a manager opened for it (as a resumed run does): it reads every step's metadata."""
    def restore() -> None:
        with CheckpointManager(chain.path, read_only=True) as mgr:
            mgr.restore(SHORT_CHAIN)

    _restore_against_torch_load(benchmark, run, chain, tmp_path, restore,
                                f"restore end of {SHORT_CHAIN}-delta chain (new mgr)")


# -- CPU accounting -------------------------------------------------------------------------
#
# Where the CPU time of a delta save and of a chain restore goes, phase by phase, summed over
# every thread: what bounds the ratios above from below. ``pytest bench/bench_delta.py -k
# accounting`` prints it for each model, beside torch.save + fsync and torch.load measured in
# the same rounds, and the floor a perfectly parallel run on this machine's cores would reach.

ACCOUNTING_ROUNDS = 5


def _cpu() -> tuple[float, float]:
    """This process's CPU time (user + system) and system time, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime


def _account(name: str, target, baseline, baseline_name: str, setup=None) -> None:
    """Run ``target`` ACCOUNTING_ROUNDS times (after a warm-up) under :class:`CpuAccounting`,
    ``baseline`` just before each, and note the mean CPU time by phase."""
    phases: dict[str, list[float]] = {}
    faults: dict[str, int] = {}
    rows = {"wall": [], "cpu": [], "system": [], "main": [], "base wall": [], "base cpu": []}
    for round_ in range(ACCOUNTING_ROUNDS + 1):
        if setup is not None:
            setup()
        wall, (cpu, system) = time.perf_counter(), _cpu()
        baseline()
        base_wall, (base_cpu, _) = time.perf_counter() - wall, _cpu()
        base_cpu -= cpu
        with CpuAccounting() as accounting:
            wall, (cpu, system), main = time.perf_counter(), _cpu(), time.thread_time()
            target()
            wall, main = time.perf_counter() - wall, time.thread_time() - main
            cpu, system = (now - before for now, before in zip(_cpu(), (cpu, system), strict=True))
        if round_ == 0:  # warm-up
            continue
        for key, value in zip(rows, (wall, cpu, system, main, base_wall, base_cpu), strict=True):
            rows[key].append(value)
        for phase, seconds in accounting.cpu.items():
            phases.setdefault(phase, []).append(seconds)
        for phase, count in accounting.faults.items():
            faults[phase] = faults.get(phase, 0) + count
    med = {key: statistics.median(values) for key, values in rows.items()}
    # Medians: on a loaded machine one round in several is stalled, and a mean would charge it
    # to whatever phase it hit.
    phase_med = {phase: statistics.median(values + [0.0] * (ACCOUNTING_ROUNDS - len(values)))
                 for phase, values in phases.items()}
    cores = default_workers()
    note("")
    note(f"CPU accounting: {name} (medians of {ACCOUNTING_ROUNDS} rounds; phases: thread CPU "
         "time, exclusive of the phases they call; faults: minor page faults a round)")
    note(f"  wall {med['wall'] * 1e3:.1f} ms, CPU {med['cpu'] * 1e3:.1f} ms (system "
         f"{med['system'] * 1e3:.1f}), main thread {med['main'] * 1e3:.1f} ms; {baseline_name}: "
         f"wall {med['base wall'] * 1e3:.1f} ms, CPU {med['base cpu'] * 1e3:.1f} ms")
    note(f"  wall / {baseline_name} {med['wall'] / med['base wall']:.2f}x, CPU / its CPU "
         f"{med['cpu'] / med['base cpu']:.2f}x; floor on {cores} idle cores (max of main thread "
         f"and CPU / cores, over {baseline_name}'s wall): "
         f"{max(med['main'], med['cpu'] / cores) / med['base wall']:.2f}x")
    for phase, seconds in sorted(phase_med.items(), key=lambda item: -item[1]):
        note(f"  {phase:<40} {seconds * 1e3:8.2f} ms {faults.get(phase, 0) / ACCOUNTING_ROUNDS:9.0f} faults")
    note(f"  {'(not in a phase: pool, GIL, the rest)':<40} "
         f"{(med['cpu'] - sum(phase_med.values())) * 1e3:8.2f} ms (medians: about)")
    if accounting.missing:
        note(f"  not timed (renamed?): {', '.join(accounting.missing)}")


def test_cpu_accounting_delta_save(run, tmp_path) -> None:
    """CPU by phase of a delta save (as test_delta_save_fsync), torch.save + fsync beside it."""
    saves = _DeltaSaves(run, tmp_path)
    try:
        _account(f"delta save, {_model_name(run)}", saves.save, saves.torch_save,
                 "torch.save + fsync", setup=saves.setup)
    finally:
        saves.close()
    assert saves.infos[-1].kind == "delta"


def test_cpu_accounting_restore(run, chain, tmp_path) -> None:
    """CPU by phase of restoring the end of a SHORT_CHAIN-delta chain (as
    test_restore_end_of_short_chain), torch.load of the state beside it."""
    _delta_at_end_of_chain(chain, SHORT_CHAIN)
    path = tmp_path / "ckpt.pt"
    durable_torch_save(run[2][SHORT_CHAIN], path)
    _account(f"restore end of {SHORT_CHAIN}-delta chain, {_model_name(run)}",
             lambda: chain.restore(SHORT_CHAIN), lambda: torch.load(path, weights_only=True),
             "torch.load")


def _model_name(run) -> str:
    """The size of a run's model, in MB of weights and Adam moments."""
    return f"{sum(a.nbytes for _, a in _tensors(run[2][-1])) / 1e6:.0f} MB state"
