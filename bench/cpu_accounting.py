"""Where a save's or a restore's CPU time goes: thread CPU time and minor page faults by phase,
summed over every thread, each phase exclusive of the timed phases it calls. ``bench_delta.py
-k accounting`` prints it for a delta save and a chain restore, ``restore_depth.py`` for its
deepest step beside its full step."""

from __future__ import annotations

import functools
import importlib
import resource
import threading
import time
import types

import xxhash

CHAIN_KERNEL = "decode kernel: chain of steps"  # the phase of a restore chain's decode kernel

# (module, attribute, phase) of the functions timed. Each phase's time is exclusive: a timed
# function's time leaves out that of the timed functions it calls. Encode and decode kernel
# variants are timed one by one (``_ENCODERS``/``_DECODERS``, by variant).
PHASES = [
    ("deltackpt.manager", "capture", "capture (main)"),
    ("deltackpt.save.driver", "delta_base", "base check (main)"),
    ("deltackpt.encode.encoder.StepEncoder", "_plan", "plan: steps from samples (main)"),
    ("deltackpt.encode.encoder.StepEncoder", "__call__", "chunk coding, Python"),
    ("deltackpt.encode.encoder.StepEncoder", "_count", "statistics"),
    ("deltackpt.encode.encoder", "_error_stats", "statistics"),
    ("deltackpt.encode.encoder", "encode_lossless", "lossless encode (exact chunks)"),
    ("deltackpt.kernels.quant", "_compact", "stream compaction"),
    ("deltackpt.kernels.quant", "compact_planes", "stream compaction"),
    ("deltackpt.codecs.quant", "zstd_compress", "zstd, quant streams"),
    ("deltackpt.codecs.quant", "encode_planes", "rANS, grouped streams"),
    ("deltackpt.io.writer", "_encode_and_write", "writer task, Python"),
    ("deltackpt.io.writer._DataFiles", "append", "file writes"),
    ("deltackpt.io.storage.LocalStorage", "finish", "fsync"),
    ("deltackpt.io.storage.LocalStorage", "sync_dir", "fsync"),
    ("deltackpt.encode.encoder.StepEncoder", "summary", "metadata: build"),
    ("deltackpt.io.writer", "step_metadata", "metadata: build"),
    ("deltackpt.format.metadata.StepMetadata", "to_json", "metadata: serialize + seal"),
    ("deltackpt.io.writer", "metadata_bytes", "metadata: zstd"),
    ("deltackpt.io.writer", "commit_step", "commit"),
    ("deltackpt.restore.cached", "restore_chain", "restore planning (main)"),
    ("deltackpt.io.reader", "parse_step_metadata", "metadata: parse + validate"),
    ("deltackpt.io.reader", "check_chunks_readable", "chunk checks"),
    ("deltackpt.io.reader.ChunkSource", "stored", "chunk reads"),
    ("deltackpt.io.reader.ChunkSource", "decode", "lossless decode, Python"),
    ("deltackpt.codecs.lossless", "huffman_decode", "lossless decode: huffman"),
    ("deltackpt.codecs.lossless", "merge_planes", "lossless decode: merge planes"),
    ("deltackpt.codecs.lossless", "zstd_decompress", "lossless decode: zstd"),
    ("deltackpt.restore.chain", "_restore_range", "range task, Python"),
    ("deltackpt.restore.chain", "_restore_derived", "derived task, Python"),
    ("deltackpt.codecs.quant", "zstd_decompress_bounded", "zstd, quant streams"),
    ("deltackpt.codecs.quant", "decode_planes", "rANS, grouped streams"),
    ("deltackpt.codecs.quant", "check_stream", "stream check"),
    ("deltackpt.kernels.quant", "decode_step_streams", CHAIN_KERNEL),
]


class CpuAccounting:
    """Thread CPU time and minor page faults by phase (see PHASES), while installed."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.faults: dict[str, int] = {}
        self.missing: list[str] = []
        self._local = threading.local()
        self._undo: list = []

    def _account(self, phase: str, fn):
        local, cpu, faults = self._local, self.cpu, self.faults

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack = local.__dict__.setdefault("stack", [])
            stack.append([0.0, 0])
            started, faulted = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.thread_time() - started
                fell = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faulted
                inner = stack.pop()
                cpu[phase] = cpu.get(phase, 0.0) + took - inner[0]
                faults[phase] = faults.get(phase, 0) + fell - inner[1]
                if stack:
                    stack[-1][0] += took
                    stack[-1][1] += fell

        return timed

    def _replace(self, owner, key, value) -> None:
        if isinstance(owner, dict):
            old = owner[key]
            owner[key] = value
            self._undo.append(lambda: owner.__setitem__(key, old))
        else:
            old = owner.__dict__[key]  # a class's own attribute, not an inherited one
            setattr(owner, key, value)
            self._undo.append(lambda: setattr(owner, key, old))

    def __enter__(self) -> CpuAccounting:
        import deltackpt.kernels.quant as kernels

        for path, attr, phase in PHASES:
            owner = _resolve(path)
            if owner is None or attr not in vars(owner):
                self.missing.append(f"{path}.{attr}")
                continue
            self._replace(owner, attr, self._account(phase, getattr(owner, attr)))
        for table, what in ((kernels._ENCODERS, "encode"), (kernels._DECODERS, "decode")):
            for variant, kernel in list(table.items()):
                ordinal, pred, dithered, scaled = variant
                name = "/".join(["ordinal" if ordinal else "linear"]
                                + ["pred"] * pred + ["dither"] * dithered + ["scaled"] * scaled)
                self._replace(table, variant, self._account(f"{what} kernel: {name}", kernel))
        checksums = self._account("checksums", lambda hasher, data: hasher.update(data))
        account = self._account

        class Hasher:  # xxh3 of a chunk's parts, as the writer feeds them
            def __init__(self) -> None:
                self.hasher = xxhash.xxh3_64()

            def update(self, data) -> None:
                checksums(self.hasher, data)

            def hexdigest(self) -> str:
                return self.hasher.hexdigest()

        timed_xxhash = types.SimpleNamespace(
            xxh3_64=Hasher, xxh3_64_hexdigest=account("checksums", xxhash.xxh3_64_hexdigest))
        for module in ("deltackpt.io.writer", "deltackpt.io.reader"):
            self._replace(_resolve(module), "xxhash", timed_xxhash)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()


def _resolve(path: str):
    """The module or class ``path`` names (a module, then attributes), or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            owner = getattr(owner, attr, None)
        return owner
    return None
