"""Seeded mutations of ``metadata.json`` files and what a reader makes of them.

Shared by ``tests/test_metadata_fuzz.py`` (a CI-sized run) and ``bench/metadata_audit.py`` (the
audit's figures). A small checkpoint (a full step and two deltas of a model with a tied weight,
AdamW state and an ``extra`` using every tag of FORMAT.md 2.5) is damaged one metadata file at a
time, in two ways:

* **damage** (``sealed=False``): the file's bytes change and its checksum does not, as a flipped
  bit on disk or a buggy copy would leave it. A reader must raise a ``DeltackptError`` or restore
  exactly what was saved;
* **re-sealed** (``sealed=True``): the JSON is mutated and its checksum recomputed, as an attacker
  or a buggy writer could. The checksum cannot tell, so validation must: a reader raises a
  ``DeltackptError`` or restores some checkpoint, never another exception, a hang or an
  allocation out of proportion to the files.

Mutations: bit flips, byte changes, insertions, deletions and truncations of the stored file;
JSON-aware changes of values (wrong types, huge and negative integers, other names), keys
(renamed, removed, added), lists (elements removed, repeated, swapped) and numbers (off by one,
scaled); text-level ones JSON libraries will not write (integers of thousands of digits,
``NaN``, nesting a hundred thousand levels deep); and zstd bombs (a small frame that inflates far
beyond the metadata bound, a frame whose stated size lies).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import resource
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from torch import nn

from deltackpt import CheckpointManager, DeltackptError
from deltackpt.format.metadata import CHECKSUM_KEY, METADATA_FILE, seal_json, step_dir_name
from deltackpt.io.reader import MAX_METADATA_BYTES, ZSTD_MAGIC
from deltackpt.save.capture import rng_state, set_rng_state

STEPS = (1, 2, 3)  # a full step and two deltas on it
_PLACEHOLDER = "\u0000fuzz"  # a string value that the text-level mutations replace

# -- the checkpoint ---------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 48), nn.LayerNorm(48), nn.Linear(48, 16),
                          nn.Linear(16, 32, bias=False))
    model[4].weight = model[0].weight  # tied: stored once, the second name an alias
    return model


def build_checkpoint(root: Path) -> None:
    """Write the fuzzed checkpoint: steps 1 (full), 2 and 3 (deltas) with model, AdamW, RNG and an
    ``extra`` holding a tuple, a dict with non-string keys, bytes, NaN, a numpy array and scalar, a
    nested list and tensors stored in chunks of every lossless codec (``raw``, ``byteplane``
    with raw, zstd and huffman planes, ``huffman``); between saves, numbers drawn from numpy (its
    keys twisted on: ``patch`` chunks with twists) and ``random`` (its position alone: ``patch``
    chunks of stored bytes)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, full_every=10, chunk_bytes=4096, workers=1) as mgr:
        for step in STEPS:
            for _ in range(3):
                loss = model(torch.randint(0, 32, (8,))).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            np.random.rand(700)
            random.random()
            extra = {"epoch": step, "schedule": (0.1, float("nan"), -math.inf),
                     "by_id": {1: "a", (2, "b"): [None, True]}, "blob": b"\x00\xffdata",
                     "array": np.arange(6, dtype=np.int32).reshape(2, 3), "scale": np.float32(0.5),
                     "seen": torch.arange(20), "nested": [[1, [2, [3, {"k": "v"}]]]],
                     "noise": torch.randn(4096), "zeros": torch.zeros(2048),
                     "labels": torch.randint(0, 4, (8192,), dtype=torch.int8)}
            mgr.save(step, model, optimizer, extra=extra)


def fresh_objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and optimizer of the checkpoint's layout, to load steps into."""
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fingerprint(value: Any) -> Any:
    """A comparable form of restored values: tensors and arrays by dtype, shape and bytes, floats
    by ``repr`` (NaN equals NaN), containers by type and order."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ("tensor", str(value.dtype), tuple(value.shape), xxhash.xxh3_64_hexdigest(data))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, xxhash.xxh3_64_hexdigest(value.tobytes()))
    if isinstance(value, np.generic):
        return ("numpy", value.dtype.str, repr(value.item()))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, dict):
        return ("dict", tuple((fingerprint(k), fingerprint(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(v) for v in value))
    return (type(value).__name__, value)


def restored(mgr: CheckpointManager, step: int) -> Any:
    """The fingerprint of everything ``step`` restores to."""
    ckpt = mgr.restore(step)
    return fingerprint({"model": ckpt.model, "optimizer": ckpt.optimizer, "extra": ckpt.extra,
                        "rng": ckpt.rng})


# -- mutations --------------------------------------------------------------------------------


@dataclass
class Case:
    """One mutated metadata file: ``data`` replaces step ``step``'s ``metadata.json``."""

    kind: str
    step: int
    data: bytes
    sealed: bool


def _json_text(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data) if data[:4] == ZSTD_MAGIC else data


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


# Replacement values: JSON ones, and text no JSON library writes (substituted for _PLACEHOLDER).
VALUES: list[Any] = [None, True, False, 0, -1, 1, 3, 255, 256, 2**31, 2**32, 2**53 + 1, 2**63, 2**64,
                     10**9, 10**12, 10**30, -(10**12), 0.5, -0.0, 1e308, "", "x", "float32", "bfloat16",
                     "nan", "../x", "d-00-r00000-000.bin", "quant", "zstd", "huffman", [], {}, [0],
                     [[0]], {"a": 1}, {"$float": "nan"}, {"$float": 1}, {"$tuple": 1}, {"$tuple": [1]},
                     {"$dict": [[1]]}, {"$dict": [[[1], 2]]}, {"$dict": [[{"$ndarray": "extra/array"}, 1]]},
                     {"$bytes": "!!"}, {"$bytes": 5}, {"$npscalar": ["<i4", "x"]},
                     {"$npscalar": ["O", 1]}, {"$npscalar": ["<i1", 10**6]}, {"$npscalar": ["zz", 1]},
                     {"$tensor": "extra/seen"}, {"$tensor": "missing"}, {"$ndarray": "model/0.weight"},
                     {"$zzz": 1}, {"$tensor": 1}, {"$ndarray": "rng/torch"}]
TEXT_VALUES = ["9" * 5000, "-" + "9" * 400, "1e999", "NaN", "Infinity", "-Infinity", _deep(100_000),
               _deep(70), _deep(40), '"' + "x" * 100_000 + '"']


class Mutator:
    """Seeded mutations of the metadata files ``originals`` (``step -> stored bytes``)."""

    def __init__(self, originals: dict[int, bytes], seed: int) -> None:
        self.originals = originals
        self.rng = random.Random(seed)
        self.texts = {s: _json_text(d) for s, d in originals.items()}
        self.objects = {s: json.loads(t) for s, t in self.texts.items()}

    # byte-level damage (the checksum is not recomputed)

    def damage(self, step: int) -> Case:
        data = bytearray(self.originals[step])
        r = self.rng
        i = r.randrange(len(data))
        how = r.choice(["flip", "flip", "flip", "byte", "insert", "delete", "truncate"])
        if how == "flip":
            data[i] ^= 1 << r.randrange(8)
        elif how == "byte":
            data[i] = (data[i] + r.randrange(1, 256)) % 256
        elif how == "insert":
            data[i:i] = bytes([r.randrange(256)])
        elif how == "delete":
            del data[i]
        else:
            del data[i:]
        return Case(f"damage:{how}", step, bytes(data), sealed=False)

    # JSON-aware mutations

    def _paths(self, obj: Any) -> list[tuple]:
        """Paths to every node under ``obj``, grouped so each region of the metadata gets its
        share: a region is drawn first, then a node in it."""
        regions: dict[str, list[tuple]] = {}

        def walk(node: Any, path: tuple, region: str) -> None:
            regions.setdefault(region, []).append(path)
            items = node.items() if isinstance(node, dict) else enumerate(node) \
                if isinstance(node, list) else ()
            for key, child in items:
                if path == () and key == CHECKSUM_KEY:
                    continue
                sub = region
                if len(path) == 0:
                    sub = key if key in ("tensors", "files", "state", "stats") else "top"
                elif path[0] == "state" and len(path) == 1:
                    sub = f"state/{key}"
                walk(child, (*path, key), sub)

        walk(obj, (), "top")
        region = self.rng.choice(sorted(regions))
        return regions[region]

    def _mutate(self, obj: Any) -> str:
        """Mutate a copy of ``obj`` in place at a random node; returns what was done."""
        r = self.rng
        path = r.choice(self._paths(obj))
        if not path:
            return "none"
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        value = parent[key]
        how = r.choice(["value", "value", "text", "number", "key", "string", "list", "name"])
        if how == "value":
            parent[key] = json.loads(json.dumps(r.choice(VALUES)))
        elif how == "text":
            parent[key] = _PLACEHOLDER
            self._text = r.choice(TEXT_VALUES)
        elif how == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = r.choice([value + 1, value - 1, value * 2, -value, value * 10**6,
                                    value + 2**63, value * 1.0001 if isinstance(value, float) else 2**40])
        elif how == "key" and isinstance(parent, dict):
            choice = r.choice(["rename", "drop", "add"])
            if choice == "rename":
                new = r.choice([key[:-1], key + "x", "$tensor", "$tuple", "state", "params", "name",
                                key.upper()]) if key else "x"
                parent[new] = parent.pop(key)
            elif choice == "drop":
                del parent[key]
            else:
                parent[key + "_future"] = value
            how = f"key:{choice}"
        elif how == "string" and isinstance(value, str) and value:
            i = r.randrange(len(value))
            parent[key] = value[:i] + chr(r.choice([ord(value[i]) ^ 1, 36, 47, 126, 0x263A])) + value[i + 1:]
        elif how == "list" and isinstance(value, list) and value:
            choice = r.choice(["drop", "repeat", "swap", "empty", "reverse"])
            i, j = r.randrange(len(value)), r.randrange(len(value))
            if choice == "drop":
                del value[i]
            elif choice == "repeat":
                value.insert(i, value[j])
            elif choice == "swap":
                value[i], value[j] = value[j], value[i]
            elif choice == "empty":
                value.clear()
            else:
                value.reverse()
            how = f"list:{choice}"
        elif how == "name":  # another name of the same step: a tensor, file or FQN
            names = [t["name"] for t in obj.get("tensors", []) if isinstance(t, dict) and "name" in t]
            parent[key] = r.choice(names or ["x"])
        else:
            parent[key] = json.loads(json.dumps(r.choice(VALUES)))
            how = "value"
        return how

    def _text_of(self, obj: Any) -> str:
        text = json.dumps(obj, separators=(",", ":"))
        if getattr(self, "_text", None) is not None:
            text = text.replace(json.dumps(_PLACEHOLDER), self._text)
            self._text = None
        return text

    def json_case(self, step: int, sealed: bool) -> Case:
        """A JSON-aware mutation of step ``step``'s metadata; ``sealed``: checksum recomputed."""
        obj = json.loads(self.texts[step])
        self._text = None
        how = self._mutate(obj)
        if sealed:
            obj.pop(CHECKSUM_KEY, None)
            text = seal_json(self._text_of(obj)).encode()
        else:  # the old checksum stays the last member, as a writer that forgot it would leave it
            checksum = obj.pop(CHECKSUM_KEY, None)
            if checksum is not None:
                obj[CHECKSUM_KEY] = checksum
            text = self._text_of(obj).encode()
        if self.originals[step][:4] == ZSTD_MAGIC and self.rng.random() < 0.8:
            text = zstandard.ZstdCompressor().compress(text)
        return Case(f"{'sealed' if sealed else 'damage'}:json:{how}", step, text, sealed)

    def bomb(self, step: int) -> Case:
        """A zstd frame far larger than the metadata bound once inflated, or one that lies."""
        how = self.rng.choice(["inflate", "lie", "no-size"])
        if how == "inflate":
            return Case("sealed:zstd-bomb", step, zstd_bomb(), sealed=True)
        text = self.texts[step]
        if how == "lie":  # a frame stating 16 bytes whose content is the whole text
            frame = zstandard.ZstdCompressor().compress(text)
            params = zstandard.get_frame_parameters(frame)
            assert params.content_size == len(text)
            small = zstandard.ZstdCompressor().compress(text[:16])
            header = zstandard.frame_header_size(small)
            frame = small[:header] + frame[zstandard.frame_header_size(frame):]
            return Case("sealed:zstd-lies", step, frame, sealed=True)
        stream = zstandard.ZstdCompressor(write_content_size=False).compress(text)
        return Case("sealed:zstd-no-size", step, stream, sealed=True)

    def _sealed(self, step: int, kind: str, edit: Callable[[dict], None], text: str = "") -> Case:
        """Step ``step``'s metadata as ``edit`` changes it, re-sealed (compressed as the step's
        was); ``text`` replaces a ``_PLACEHOLDER`` value that ``edit`` left."""
        obj = json.loads(self.texts[step])
        obj.pop(CHECKSUM_KEY, None)
        edit(obj)
        body = json.dumps(obj, separators=(",", ":")).replace(json.dumps(_PLACEHOLDER), text)
        data = seal_json(body).encode()
        if self.originals[step][:4] == ZSTD_MAGIC:
            data = zstandard.ZstdCompressor().compress(data)
        return Case(f"sealed:{kind}", step, data, sealed=True)

    def targeted(self) -> list[Case]:
        """The audit's cases of exhaustion and crashes, re-sealed, in a full and a delta step:
        a chunk of 10**12 bytes (also within a data file said to be that large), a tensor of
        10**9 elements (also with a chunk and file large enough to hold it, or in a chunk of an
        unknown codec), integers beyond
        int64, nesting a hundred thousand levels deep and just over the bound, and zstd frames
        that inflate far beyond the metadata or the bound."""
        def chunked(obj: dict) -> dict:
            """A float32 tensor with chunks that no other tensor aliases."""
            aliased = {t.get("alias_of") for t in obj["tensors"]}
            return next(t for t in obj["tensors"] if t["dtype"] == "float32" and t["fragments"]
                        and t["fragments"][0]["chunks"] and t["name"] not in aliased)

        def beyond(obj: dict, chunk: dict, length: int) -> None:
            """Move ``chunk`` past the end of its data file and say the file holds it."""
            file = obj["files"][chunk["file"]]
            chunk.update(offset=file["size"], length=length)
            file["size"] += length

        def long_chunk(file_too: bool) -> Callable[[dict], None]:
            def edit(obj: dict) -> None:
                chunk = chunked(obj)["fragments"][0]["chunks"][0]
                if file_too:
                    chunk.update(codec="zstd", params={})
                    beyond(obj, chunk, 10**12)
                else:
                    chunk["length"] = 10**12
            return edit

        def big_tensor(how: str) -> Callable[[dict], None]:
            def edit(obj: dict) -> None:
                record, n = chunked(obj), 10**9
                record["shape"], fragment = [n], record["fragments"][0]
                fragment.update(offsets=[0], sizes=[n], chunks=fragment["chunks"][:1])
                chunk = fragment["chunks"][0]
                chunk["raw_length"] = 4 * n
                if how == "consistent":  # a chunk and a data file that could hold it, by sizes
                    chunk.update(codec="zstd", params={})
                    beyond(obj, chunk, 4 * n // 2**15 + 1)
                elif how == "unknown codec":  # whose expansion no reader can bound
                    chunk.update(codec="hyperzip", params={})
            return edit

        def extra(value: Any) -> Callable[[dict], None]:
            return lambda obj: obj["state"].update(extra=value)

        cases = []
        for step in (1, 2):
            cases += [self._sealed(step, "chunk-length-1e12", long_chunk(False)),
                      self._sealed(step, "chunk-length-1e12-file-too", long_chunk(True)),
                      self._sealed(step, "shape-1e9", big_tensor("")),
                      self._sealed(step, "shape-1e9-chunk-and-file-too", big_tensor("consistent")),
                      self._sealed(step, "shape-1e9-unknown-codec", big_tensor("unknown codec")),
                      self._sealed(step, "shape-huge-int",
                                   lambda obj: chunked(obj).update(shape=[10**30])),
                      self._sealed(step, "nesting-100000", extra(_PLACEHOLDER), _deep(100_000)),
                      self._sealed(step, "nesting-70", extra(_PLACEHOLDER), _deep(70)),
                      self._sealed(step, "int-5000-digits", extra(_PLACEHOLDER), "9" * 5000),
                      self._sealed(step, "nan-seconds",
                                   lambda obj: obj["stats"].update(seconds=_PLACEHOLDER), "NaN")]
        whitespace = zstandard.ZstdCompressor().compress(b" " * (1 << 20))
        return [*cases, Case("sealed:zstd-bomb", 2, zstd_bomb(), sealed=True),
                Case("sealed:zstd-inflates-1MiB", 2, whitespace, sealed=True)]

    def cases(self, n: int) -> Iterator[Case]:
        """``n`` cases: a third byte damage, a sixth JSON-aware damage, the rest re-sealed JSON
        mutations and an occasional zstd bomb."""
        for i in range(n):
            step = self.rng.choice(sorted(self.originals))
            roll = self.rng.random()
            if i % 97 == 0:
                yield self.bomb(step)
            elif roll < 1 / 3:
                yield self.damage(step)
            elif roll < 1 / 2:
                yield self.json_case(step, sealed=False)
            else:
                yield self.json_case(step, sealed=True)


_BOMB: bytes | None = None


def zstd_bomb() -> bytes:
    """One zstd frame, with its content size, of twice ``MAX_METADATA_BYTES`` of JSON whitespace
    (a few tens of KB; compressed in pieces, so building it takes little memory)."""
    global _BOMB
    if _BOMB is None:
        size = 2 * MAX_METADATA_BYTES
        cobj = zstandard.ZstdCompressor(level=1).compressobj(size=size)
        piece = b" " * (1 << 20)
        parts = [cobj.compress(piece) for _ in range(size // len(piece))]
        _BOMB = b"".join(parts) + cobj.flush()
    return _BOMB


# -- outcomes ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a reader made of a case: ``"error"`` (a DeltackptError), ``"equal"`` (restored what
    was saved), ``"changed"`` (restored something else), or ``"crash"`` (any other exception,
    ``detail`` says which)."""

    result: str
    detail: str = ""


def run_case(root: Path, case: Case, expected: dict[int, Any],
             objects: tuple[nn.Module, torch.optim.Optimizer]) -> Outcome:
    """Put ``case`` in place of its step's metadata, then open the directory, verify every step,
    restore the case's step, read its optimizer, ``extra`` and RNG state, load it into
    ``objects`` and print ``deltackpt info`` of it; the original file is put back afterwards."""
    from deltackpt.app import cli

    path = root / step_dir_name(case.step) / METADATA_FILE
    original = path.read_bytes()
    path.write_bytes(case.data)
    rng = rng_state()
    try:
        with CheckpointManager(root, read_only=True) as mgr:
            problems = mgr.verify()
            got = restored(mgr, case.step)
            mgr.load(case.step, *objects)
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["info", str(root), "--step", str(case.step)])
    except DeltackptError as exc:
        return Outcome("error", f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:  # any other exception is what the fuzz looks for
        return Outcome("crash", f"{type(exc).__name__}: {exc}"[:300])
    finally:
        path.write_bytes(original)
        set_rng_state(rng)
    if any(problems.values()):
        return Outcome("error", f"verify: {problems}"[:300])
    return Outcome("equal" if got == expected[case.step] else "changed")


@contextlib.contextmanager
def memory_limit(extra_bytes: int) -> Iterator[None]:
    """Cap this process's address space at what it maps now plus ``extra_bytes``: an allocation
    beyond raises ``MemoryError`` (or torch's ``RuntimeError``) instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def prepared(root: Path) -> tuple[dict[int, bytes], dict[int, Any]]:
    """Build the checkpoint at ``root``; its metadata files and what each step restores to."""
    shutil.rmtree(root, ignore_errors=True)
    build_checkpoint(root)
    originals = {s: (root / step_dir_name(s) / METADATA_FILE).read_bytes() for s in STEPS}
    with CheckpointManager(root, read_only=True) as mgr:
        expected = {s: restored(mgr, s) for s in STEPS}
    return originals, expected


def audit(root: Path, n: int, seed: int,
          on_case: Callable[[Case, Outcome], None] | None = None) -> list[tuple[Case, Outcome]]:
    """Run ``n`` seeded cases against a fresh checkpoint at ``root`` under a 1 GiB memory cap."""
    originals, expected = prepared(root)
    objects = fresh_objects()
    results = []
    mutator = Mutator(originals, seed)
    with memory_limit(1 << 30):
        for case in mutator.cases(n):
            outcome = run_case(root, case, expected, objects)
            results.append((case, outcome))
            if on_case is not None:
                on_case(case, outcome)
    return results
