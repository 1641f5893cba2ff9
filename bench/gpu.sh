#!/usr/bin/env bash
# The GPU checks of deltackpt, in one run on a machine with an NVIDIA GPU (at most 9 minutes:
# the stages' timeouts, within one call of this workplace's device machine):
#
#  1. the environment: $PYTHON if it imports torch with CUDA, triton and this package; else one
#     over $PYTHON's packages with the wheels of .whl/ and this package (offline); else a
#     virtual environment (.venv-gpu) with torch==$TORCH_VERSION (PyPI's Linux wheels are CUDA
#     builds), triton==3.9.0 and this package with its dev extras;
#  2. tests/test_triton_kernels.py compiled on the GPU, not in the interpreter: the Triton
#     kernels against the Numba ones on the same data, bit for bit, on CUDA tensors;
#  3. the Triton encode and decode timed against a device-to-device copy of the same bytes
#     (goal: at least 0.5x the copy's bandwidth), medians of CUDA-event timings; xxh3-64 on the
#     device (a chunk's raw_xxh3) of the same bytes, as one digest and one per 8 MiB chunk,
#     beside the copy and the host's xxhash;
#  4. where CheckpointManager.save has a `blocking` parameter (asynchronous saves): the time the
#     caller is blocked by an async save of a >= 1B-parameter model with Adam on the GPU, a full
#     step (pinned copies) and delta steps (encoded on the device at the call, the running
#     reconstruction on the device, then with reconstruction="host"), beside the pinned
#     device-to-host copy of the same state alone and torch's dcp.async_save; the memory the
#     reconstruction takes where it lives.
#
# Figures go to stdout and, when $OUT is set, to $OUT/gpu.txt, with the date and the GPU.
# Usage: bench/gpu.sh   (env: PYTHON, TORCH_VERSION, GPU_BENCH_ELEMENTS, GPU_BENCH_PARAMS, OUT)
#        bench/gpu.sh --wheels   (here, before: the wheels an offline GPU machine lacks, into .whl/)
set -euo pipefail
cd "$(dirname "$0")/.."
report=${OUT:+$OUT/gpu.txt}
if [ -n "$report" ]; then mkdir -p "$OUT" && : > "$report"; fi
emit() { if [ -n "$report" ]; then tee -a "$report"; else cat; fi; }  # stdin to stdout and report
log() { echo "$@" | emit; }

log "deltackpt GPU bench, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not found')"

# -- 1. environment ------------------------------------------------------------------------
# A GPU machine without network access (this workplace's) has torch with CUDA, triton, numba,
# xxhash and pytest but not zstandard: fetch its wheel beforehand, where pip works, into .whl/
# (`bench/gpu.sh --wheels`; carry .whl), and this step installs it and this package, offline,
# into a virtual environment over the machine's packages. With network access and no usable
# torch, a virtual environment of its own is made as a fresh machine would (.venv-gpu).
if [ "${1:-}" = "--wheels" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl zstandard
    ls .whl; exit 0
fi
PYTHON=${PYTHON:-python3}
ready() {
    "$1" -c "import os, torch, triton, numba, zstandard, deltackpt.kernels
assert torch.cuda.is_available() or os.environ.get('GPU_BENCH_DRY_RUN')" 2>/dev/null
}
if ! ready "$PYTHON"; then
    offline=/tmp/deltackpt-gpu
    if [ ! -x "$offline/bin/python" ] && "$PYTHON" -c "import torch, triton, numba, pip" 2>/dev/null; then
        # $PYTHON may itself be a virtual environment's (this workplace's is): one made from it
        # with --system-site-packages would see its base interpreter's packages, not its own.
        # Its site directories go on the new one's path by a .pth file instead; pip is its too.
        "$PYTHON" -m venv --without-pip "$offline"
        site=$("$offline/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$PYTHON" -c 'import site; print(*site.getsitepackages(), sep="\n")' > "$site/machine.pth"
        if compgen -G ".whl/*.whl" >/dev/null; then
            "$offline/bin/python" -m pip install -q --no-index --no-deps .whl/*.whl
        fi
        "$offline/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    fi
    if [ -x "$offline/bin/python" ] && ready "$offline/bin/python"; then
        PYTHON=$offline/bin/python
    else
        if [ ! -x .venv-gpu/bin/python ]; then
            "$PYTHON" -m venv .venv-gpu
            .venv-gpu/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}" "triton==3.9.0"
            .venv-gpu/bin/pip install -q -e '.[dev]'
        fi
        PYTHON=.venv-gpu/bin/python
        ready "$PYTHON" || { log "no usable environment: torch with CUDA, triton, deltackpt"; exit 1; }
    fi
fi
log "python: $("$PYTHON" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)')"

# -- 2. bit identity on the GPU ---------------------------------------------------------------
log "== tests/test_triton_kernels.py, tests/test_device_encode.py and test_async's CUDA test on the GPU (compiled, no interpreter)"
set +e
env -u TRITON_INTERPRET -u DELTACKPT_KERNELS timeout 240 "$PYTHON" -m pytest tests/test_triton_kernels.py \
    tests/test_device_encode.py tests/test_async.py -k "not test_async or cuda" -q -x \
    -p no:cacheprovider --durations=10 2>&1 | tail -n 40 | emit
tests=${PIPESTATUS[0]}
log "tests: exit status $tests"

# -- 3 and 4. timings ----------------------------------------------------------------------------
# GPU_BENCH_DRY_RUN=1: the timings on the CPU, in the interpreter, on a few elements and a small
# model (DELTACKPT_KERNELS=triton: the device path of saves on CPU tensors), a check of this
# script on a machine without a GPU; its figures mean nothing.
if [ -n "${GPU_BENCH_DRY_RUN:-}" ]; then
    export TRITON_INTERPRET=1 DELTACKPT_KERNELS=triton
else
    unset TRITON_INTERPRET DELTACKPT_KERNELS
fi
PYTHONUNBUFFERED=1 timeout 300 "$PYTHON" - <<'EOF' 2>&1 | emit
import inspect
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
import xxhash
from torch import nn

from deltackpt.kernels import gpu_quant, gpu_xxh3
from deltackpt.kernels.quant import STAT_BAD

dry_run = bool(os.environ.get("GPU_BENCH_DRY_RUN"))
dev = torch.device("cpu" if dry_run else "cuda")
n = int(os.environ.get("GPU_BENCH_ELEMENTS", 5000 if dry_run else 1 << 28))  # 1 GiB of float32
block = 1024


def timed(fn, rounds=7):
    """Median seconds of ``fn()`` over ``rounds`` runs (after one warm-up), by CUDA events."""
    fn()
    if dry_run:
        return statistics.median(timed_on_host(fn) for _ in range(2))
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def timed_on_host(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


print(f"== kernels: {n:,} float32 elements ({n * 4 / 2**30:.2f} GiB), block {block}")
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(n, device=dev, generator=g) * 0.02
pred = x + torch.randn(n, device=dev, generator=g) * 2e-4  # the last save's reconstruction
v = (torch.rand(n, device=dev, generator=g) * 1e-3) ** 2  # Adam's exp_avg_sq
m = v.sqrt() * torch.randn(n, device=dev, generator=g) * 0.3  # and exp_avg
copy_dst = torch.empty_like(x)
t_copy = timed(lambda: copy_dst.copy_(x))
print(f"device-to-device copy of x: {t_copy * 1e3:.2f} ms, {2 * n * 4 / t_copy / 1e9:.0f} GB/s "
      "(read + write)")

cases = {  # as the writer codes weights, exp_avg_sq and exp_avg
    "weights (linear, pred, dither)": dict(x=x, pred=pred, ordinal=False, step=float(np.float32(1e-4)),
                                           dither=1, dither_signs=True, dither_groups=True),
    "exp_avg_sq (ordinal, pred)": dict(x=v, pred=v * 1.01, ordinal=True, step=1 << 16),
    "exp_avg (linear, scaled, dither)": dict(x=m, pred=None, ordinal=False,
                                             step=float(np.float32(0.05)), scale=v,
                                             eps=float(np.float32(1e-8)), dither=2,
                                             dither_signs=True, dither_groups=True),
}
for name, case in cases.items():
    case = dict(case)
    xx, pp = case.pop("x"), case.pop("pred")
    out = torch.empty_like(xx)
    work = None if pp is None else pp.clone()

    def encode():
        if work is not None:
            work.copy_(pp)  # the same prediction every round (timed apart, subtracted below)
        return gpu_quant.encode_on_device(xx, work, work if work is not None else out,
                                          block=block, **case)

    t_reset = timed(lambda: work.copy_(pp)) if work is not None else 0.0
    t_enc = timed(encode) - t_reset
    enc = encode()
    stream, stats = enc.to_host()
    enc_recon = (work if work is not None else out).clone()
    assert stats[:, STAT_BAD].sum() == 0
    t_host = timed(lambda: encode().to_host()) - t_reset
    recon = torch.empty_like(xx)
    uploaded = gpu_quant.upload_streams([stream], n, block, dev)
    decode = dict(ordinal=[case["ordinal"]], steps=[case["step"]], dithers=[case.get("dither")],
                  dither_signs=[case.get("dither_signs", False)],
                  dither_groups=[case.get("dither_groups", False)], zero_start=pp is None,
                  pred=pp, scale=case.get("scale"), eps=case.get("eps", 0.0))
    t_dec = timed(lambda: gpu_quant.apply_streams(uploaded, recon, **decode))
    t_dec_host = timed(lambda: gpu_quant.decode_block_stream(stream, pp, recon, block=block,
                                                             **case))
    assert torch.equal(recon.view(torch.int32), enc_recon.view(torch.int32)), "decode differs"
    print(f"{name}: stream {stream.nbytes / n:.2f} bytes/element; "
          f"encode {t_enc * 1e3:.2f} ms ({t_copy / t_enc:.2f}x copy), "
          f"+ stream to host {t_host * 1e3:.2f} ms ({t_copy / t_host:.2f}x); "
          f"decode {t_dec * 1e3:.2f} ms ({t_copy / t_dec:.2f}x), "
          f"from host bytes {t_dec_host * 1e3:.2f} ms ({t_copy / t_dec_host:.2f}x)")

# the end of a restore chain: 5 consecutive steps' streams applied in one pass
streams, running = [], pred.clone()
for i in range(5):
    target = running + torch.randn(n, device=dev, generator=g) * 2e-4
    streams.append(gpu_quant.encode_block_stream(target, running, running, ordinal=False,
                                                 step=float(np.float32(1e-4)), block=block)[0])
chain_out = torch.empty_like(x)
uploaded = gpu_quant.upload_streams(streams, n, block, dev)
t_chain = timed(lambda: gpu_quant.apply_streams(
    uploaded, chain_out, ordinal=[False] * 5, steps=[float(np.float32(1e-4))] * 5,
    zero_start=False, pred=pred), rounds=5)
print(f"chain decode of 5 uploaded steps: {t_chain * 1e3:.2f} ms ({t_copy / t_chain:.2f}x one copy)")
assert torch.equal(chain_out.view(torch.int32), running.view(torch.int32)), "chain decode differs"

# xxh3-64 of x's bytes (raw_xxh3 of a reconstruction): one digest (a serial scramble chain of
# 1024-byte blocks), and one a chunk of 8 MiB as the writer's chunks (their chains side by side)
data = x.view(torch.uint8)
chunk = 4096 if dry_run else 8 << 20
ranges = [(a, min(a + chunk, data.shape[0])) for a in range(0, data.shape[0], chunk)]
t_one = timed(lambda: gpu_xxh3.xxh3_64_on_device(data), rounds=3)
t_chunks = timed(lambda: gpu_xxh3.xxh3_64_ranges_on_device(data, ranges))
t_chunks_host = timed(lambda: [d.hexdigest() for d in gpu_xxh3.xxh3_64_ranges_on_device(data, ranges)])
host = data.cpu().numpy()
t_xxhash = statistics.median(timed_on_host(lambda: xxhash.xxh3_64_hexdigest(host)) for _ in range(3))
assert gpu_xxh3.xxh3_64_on_device(data).hexdigest() == xxhash.xxh3_64_hexdigest(host), "xxh3 differs"
assert [d.hexdigest() for d in gpu_xxh3.xxh3_64_ranges_on_device(data, ranges)] == \
    [xxhash.xxh3_64_hexdigest(host[a:b]) for a, b in ranges], "xxh3 of chunks differs"
print(f"xxh3-64 on the device of {data.shape[0] / 2**30:.2f} GiB: one digest {t_one * 1e3:.2f} ms "
      f"({data.shape[0] / t_one / 1e9:.1f} GB/s, {t_copy / t_one:.2f}x copy); {len(ranges)} chunks "
      f"of {chunk >> 10} KiB {t_chunks * 1e3:.2f} ms ({data.shape[0] / t_chunks / 1e9:.1f} GB/s, "
      f"{t_copy / t_chunks:.2f}x copy), + digests on the host {t_chunks_host * 1e3:.2f} ms; "
      f"host xxhash of the same bytes {t_xxhash * 1e3:.2f} ms ({data.shape[0] / t_xxhash / 1e9:.1f} GB/s)")
del data, host
del x, pred, v, m, copy_dst, streams, uploaded, running, chain_out
if not dry_run:
    torch.cuda.empty_cache()

# -- async save stall ------------------------------------------------------------------------
from deltackpt import CheckpointManager  # noqa: E402

if "blocking" not in inspect.signature(CheckpointManager.save).parameters:
    print("== async save: skipped, CheckpointManager.save has no `blocking` parameter here")
    raise SystemExit(0)
params = int(os.environ.get("GPU_BENCH_PARAMS", 20_000 if dry_run else 1_000_000_000))
width = 64 if dry_run else 8192
layers = -(-params // (width * (width + 1)))
print(f"== async save: {layers} x Linear({width}, {width}) = {layers * width * (width + 1):,} "
      f"fp32 parameters + Adam on the {'CPU (dry run)' if dry_run else 'GPU'}")
model = nn.Sequential(*(nn.Linear(width, width, device=dev) for _ in range(layers)))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step():
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()


def synchronize():
    if not dry_run:
        torch.cuda.synchronize()


def allocated():
    return 0 if dry_run else torch.cuda.memory_allocated()


train_step()
state = [t for t in [*model.parameters(), *(s for st in opt.state.values() for s in st.values()
                                           if torch.is_tensor(s) and s.numel() > 1)]]
nbytes = sum(t.numel() * t.element_size() for t in state)
pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=not dry_run) for t in state]
side = None if dry_run else torch.cuda.Stream()


def pinned_copy():
    if side is None:
        for dst, src in zip(pinned, state):
            dst.copy_(src)
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for dst, src in zip(pinned, state):
            dst.copy_(src, non_blocking=True)
    side.synchronize()


pinned_copy()
t0 = time.perf_counter()
pinned_copy()
t_pin = time.perf_counter() - t0
print(f"state {nbytes / 2**30:.2f} GiB; pinned device-to-host copy alone: {t_pin:.3f} s "
      f"({nbytes / t_pin / 1e9:.1f} GB/s)")
del pinned
root = tempfile.mkdtemp(prefix="deltackpt-gpu-")
try:
    for place in ("device", "host"):
        base = allocated()
        if not dry_run:
            torch.cuda.reset_peak_memory_stats()
        path = os.path.join(root, f"deltackpt-{place}")
        with CheckpointManager(path, full_every=10, reconstruction=place) as mgr:
            for step in range(3 if place == "device" else 2):  # the option: one delta
                train_step()
                synchronize()
                t0 = time.perf_counter()
                handle = mgr.save(step, model=model, optimizer=opt, blocking=False)
                stall = time.perf_counter() - t0
                t0 = time.perf_counter()
                info = handle.wait()
                print(f"deltackpt save(blocking=False, reconstruction={place!r}) step {step} "
                      f"({info.kind}): caller blocked {stall:.3f} s ({stall / t_pin:.2f}x the "
                      f"pinned copy; waiting for the save in flight {info.waited_seconds:.3f} s), "
                      f"then {time.perf_counter() - t0:.2f} s to commit; ratio "
                      f"{info.ratio:.1f}, host snapshot {info.snapshot_bytes / 2**30:.2f} GiB")
            print(f"reconstruction ({place}): "
                  + ", ".join(f"{kind} {size / 2**30:.2f} GiB"
                              for kind, size in mgr.reconstruction_bytes.items())
                  + f"; device memory the manager holds between saves "
                  f"{(allocated() - base) / 2**30:.2f} GiB"
                  + ("" if dry_run else f", peak during saves "
                     f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB")
                  + " above the training state")
        del mgr, handle  # its reconstruction freed before the next one is measured
        shutil.rmtree(path)  # a full step of the state: the disk holds few
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo" if dry_run else "cuda:nccl,cpu:gloo", rank=0,
                                world_size=1, init_method=f"file://{os.path.join(root, 'pg')}")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    for step in range(2):
        train_step()
        synchronize()
        t0 = time.perf_counter()
        future = dcp.async_save(sd, checkpoint_id=os.path.join(root, f"dcp-{step}"))
        stall = time.perf_counter() - t0
        future.result()
        print(f"dcp.async_save {step}: caller blocked {stall:.3f} s ({stall / t_pin:.2f}x the "
              "pinned copy)")
        shutil.rmtree(os.path.join(root, f"dcp-{step}"), ignore_errors=True)
    dist.destroy_process_group()
finally:
    shutil.rmtree(root, ignore_errors=True)
EOF
timings=${PIPESTATUS[0]}
set -e
log "timings: exit status $timings; done $(date -u '+%H:%M:%S UTC')"
[ "$tests" -eq 0 ] && [ "$timings" -eq 0 ]
