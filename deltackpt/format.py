"""Step metadata: the data model of docs/FORMAT.md, its JSON form and its validation.

Everything read from disk passes through :func:`parse_step_metadata`, which
checks types, ranges and cross references before any tensor is touched, so a
damaged or foreign file fails with a message naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltackpt.dtypes import spec_named
from deltackpt.errors import FormatError

FORMAT_NAME = "deltackpt"
FORMAT_VERSION = "1.6"
ROOT_MARKER = "deltackpt.json"
METADATA_FILE = "metadata.json"
STEP_DIR_PATTERN = re.compile(r"step-(\d{12,})")
DATA_FILE_PATTERN = re.compile(r"d-[0-9a-f]+-r[0-9]+-[0-9]+\.bin")
XXH3_PATTERN = re.compile(r"[0-9a-f]{16}")
ROLES = ("param", "buffer", "optimizer", "rng", "extra")  # minor versions may add more
KINDS = ("full", "delta")


def step_dir_name(step: int) -> str:
    """Directory name of ``step``."""
    return f"step-{step:012d}"


def data_file_name(save_id: str, rank: int, seq: int) -> str:
    """Name of the ``seq``-th data file that ``rank`` writes during save ``save_id``."""
    return f"d-{save_id}-r{rank:05d}-{seq:03d}.bin"


def escape_component(name: str) -> str:
    """Escape one tensor-name component as JSON Pointer does (``~``→``~0``, ``/``→``~1``)."""
    return name.replace("~", "~0").replace("/", "~1")


def tensor_name(*components: str) -> str:
    """The unique name of a tensor at this path of the state (FORMAT.md 2.3)."""
    return "/".join(escape_component(c) for c in components)


@dataclass
class Chunk:
    """A contiguous byte range of a fragment, coded on its own."""

    file: int
    offset: int
    length: int
    raw_offset: int
    raw_length: int
    codec: str
    params: dict[str, Any]
    xxh3: str
    raw_xxh3: str


@dataclass
class Fragment:
    """A dense box of a global tensor and the chunks that hold its bytes."""

    offsets: list[int]
    sizes: list[int]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.sizes)


@dataclass
class TensorRecord:
    """One tensor of a step, in global coordinates."""

    name: str
    role: str
    dtype: str
    shape: list[int]
    fqn: str | None = None
    state_key: str | None = None
    alias_of: str | None = None
    fragments: list[Fragment] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Raw size of the global tensor."""
        return self.numel * spec_named(self.dtype, self.name).itemsize

    @property
    def stored_bytes(self) -> int:
        """Bytes its chunks take on disk."""
        return sum(c.length for f in self.fragments for c in f.chunks)

    @property
    def codecs(self) -> list[str]:
        """Distinct codecs of its chunks, in order of first use."""
        return list(dict.fromkeys(c.codec for f in self.fragments for c in f.chunks))


@dataclass
class DataFile:
    """A data file of the step, relative to the step directory."""

    name: str
    rank: int
    size: int


@dataclass
class StepStats:
    """Sizes and timing of a save."""

    raw_bytes: int
    stored_bytes: int
    seconds: float
    classes: dict[str, dict[str, Any]] | None = None  # per tensor class of a delta (FORMAT.md 2.4)
    compression: dict[str, Any] | None = None  # the config, scale and target of a delta


@dataclass
class StepMetadata:
    """Everything ``step-N/metadata.json`` holds."""

    step: int
    kind: str
    base_step: int | None
    save_id: str
    created: str
    library_version: str
    world_size: int
    files: list[DataFile]
    tensors: list[TensorRecord]
    state: dict[str, Any]
    stats: StepStats
    format_version: str = FORMAT_VERSION

    def tensor(self, name: str) -> TensorRecord:
        """The record named ``name``."""
        for record in self.tensors:
            if record.name == name:
                return record
        raise KeyError(f"step {self.step} has no tensor {name!r}")

    def to_json(self) -> str:
        """Serialize as the metadata file's text."""
        fields = {k: v for k, v in vars(self).items() if k != "format_version"}
        body = {"format": FORMAT_NAME, "format_version": self.format_version, **fields}
        # Compact separators keep json on its C encoder: metadata of big models has many chunks.
        return json.dumps(body, separators=(",", ":"), allow_nan=False, default=vars)


def check_format_version(version: Any, where: str) -> None:
    """Refuse a missing, malformed or newer-major ``format_version``."""
    ours = int(FORMAT_VERSION.split(".")[0])
    match = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if match is None:
        raise FormatError(f"{where}: format_version {version!r} is not 'MAJOR.MINOR'")
    if int(match.group(1)) != ours:
        raise FormatError(f"{where}: written in format {version}, this deltackpt reads major "
                          f"version {ours} (format {FORMAT_VERSION}); upgrade deltackpt to read it")


class _Fields:
    """Typed access to one JSON object. Errors name the field; the parser adds where the object
    is (:func:`_located`) only when one is raised, so valid metadata pays for no messages."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            raise FormatError(f"expected an object, found {type(obj).__name__}")
        self.obj = obj

    def get(self, key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
        value = self.obj.get(key)
        # JSON values are exactly these classes, so an identity test suffices (and keeps bools
        # out of int fields): the fast path of metadata with thousands of chunks.
        cls = value.__class__
        if cls is types or (types.__class__ is tuple and cls in types):
            return value
        if value is None and optional:
            return None
        raise FormatError(f"field {key!r} is {value!r}, expected {types}")

    def nonneg(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key, int, optional)
        if value is not None and value < 0:
            raise FormatError(f"field {key!r} is negative ({value})")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.get(key, list)
        for v in value:
            if v.__class__ is not int or v < 0:
                raise FormatError(f"field {key!r} must hold non-negative integers, found {value!r}")
        return value


def _located(parse: Callable[..., Any], items: list, what: str, *args: Any) -> list:
    """``parse(item, *args)`` for each item; an error is prefixed with the item's position
    (``what`` and its index, and its name if it has one)."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(parse(item, *args))
        except FormatError as exc:
            name = item.get("name") if isinstance(item, dict) else None
            label = f"{what} {i}" + (f" ({name!r})" if isinstance(name, str) else "")
            raise FormatError(f"{label}: {exc}") from None
    return out


def _parse_chunk(obj: Any, n_files: int) -> Chunk:
    f = _Fields(obj)
    chunk = Chunk(
        file=f.nonneg("file"), offset=f.nonneg("offset"), length=f.nonneg("length"),
        raw_offset=f.nonneg("raw_offset"), raw_length=f.nonneg("raw_length"),
        codec=f.get("codec", str), params=f.get("params", dict),
        xxh3=f.get("xxh3", str), raw_xxh3=f.get("raw_xxh3", str))
    if chunk.file >= n_files:
        raise FormatError(f"file index {chunk.file} out of range ({n_files} files)")
    for key in ("xxh3", "raw_xxh3"):
        if not XXH3_PATTERN.fullmatch(getattr(chunk, key)):
            raise FormatError(f"{key} {getattr(chunk, key)!r} is not 16 hex digits")
    return chunk


def _parse_fragment(obj: Any, record: TensorRecord, n_files: int) -> Fragment:
    f = _Fields(obj)
    frag = Fragment(offsets=f.int_list("offsets"), sizes=f.int_list("sizes"))
    if len(frag.offsets) != len(record.shape) or len(frag.sizes) != len(record.shape):
        raise FormatError(f"offsets/sizes rank differs from shape {record.shape}")
    if any(o + s > d for o, s, d in zip(frag.offsets, frag.sizes, record.shape, strict=True)):
        raise FormatError(f"box {frag.offsets}+{frag.sizes} exceeds shape {record.shape}")
    frag.chunks = _located(_parse_chunk, f.get("chunks", list), "chunk", n_files)
    itemsize = spec_named(record.dtype, record.name).itemsize
    expected = 0
    for chunk in frag.chunks:
        if chunk.raw_offset != expected or chunk.raw_length % itemsize:
            raise FormatError(f"chunks do not tile the fragment's bytes "
                              f"(chunk at {chunk.raw_offset}, expected {expected})")
        expected += chunk.raw_length
    if expected != frag.numel * itemsize:
        raise FormatError(f"chunks hold {expected} bytes, the box needs {frag.numel * itemsize}")
    return frag


def _parse_tensor(obj: Any, n_files: int) -> TensorRecord:
    f = _Fields(obj)
    record = TensorRecord(
        name=f.get("name", str), role=f.get("role", str), dtype=f.get("dtype", str),
        shape=f.int_list("shape"), fqn=f.get("fqn", str, optional=True),
        state_key=f.get("state_key", str, optional=True),
        alias_of=f.get("alias_of", str, optional=True))
    spec_named(record.dtype, "field 'dtype'")
    fragments = f.get("fragments", list)
    if record.alias_of is not None:
        if fragments:
            raise FormatError("an alias must not have fragments")
        return record
    record.fragments = _located(_parse_fragment, fragments, "fragment", record, n_files)
    check_tiling(record)
    return record


Box = tuple[list[int], list[int]]
"""A dense box of a tensor: offsets and sizes, one each per dimension."""


def box_index(offsets: list[int], sizes: list[int], origin: list[int] | None = None) -> tuple:
    """The index (slices) of box ``offsets``/``sizes`` in a tensor whose own box starts at
    ``origin`` (default: the whole tensor, at zero)."""
    origin = origin or [0] * len(offsets)
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(offsets, sizes, origin, strict=True))


def box_intersection(a: Box, b: Box) -> Box | None:
    """The box where boxes ``a`` and ``b`` overlap, or None if they do not."""
    lo = [max(x, y) for x, y in zip(a[0], b[0], strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, [h - low for low, h in zip(lo, hi, strict=True)]


def check_tiling(record: TensorRecord) -> None:
    """Raise :class:`FormatError` unless the record's fragments (boxes within its shape) tile
    it: no two overlap, and together they cover every element (FORMAT.md 2)."""
    boxes = [f for f in record.fragments if f.numel]
    covered = sum(frag.numel for frag in boxes)
    if len(boxes) > 1:
        lo = np.array([f.offsets for f in boxes], np.int64)
        hi = lo + np.array([f.sizes for f in boxes], np.int64)
        overlap = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(axis=2)
        np.fill_diagonal(overlap, False)
        if overlap.any():
            i, j = (int(k) for k in np.argwhere(overlap)[0])
            raise FormatError(f"fragments {boxes[i].offsets}+{boxes[i].sizes} and "
                              f"{boxes[j].offsets}+{boxes[j].sizes} overlap")
    if covered != record.numel and record.numel > 0:
        raise FormatError(f"fragments cover {covered} of {record.numel} elements")


def parse_step_metadata(text: str | bytes, where: str) -> StepMetadata:
    """Parse and validate the text of a ``metadata.json``; ``where`` names it in errors."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    if isinstance(obj, dict) and obj.get("format") == FORMAT_NAME:
        check_format_version(obj.get("format_version"), where)
    try:
        return _parse_step(obj)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None


def _parse_step(obj: Any) -> StepMetadata:
    f = _Fields(obj)
    if obj.get("format") != FORMAT_NAME:
        raise FormatError(f"not deltackpt metadata (format={obj.get('format')!r})")
    files = _located(_parse_file, f.get("files", list), "file")
    meta = StepMetadata(
        step=f.nonneg("step"), kind=f.get("kind", str), base_step=f.nonneg("base_step", optional=True),
        save_id=f.get("save_id", str), created=f.get("created", str),
        library_version=f.get("library_version", str), world_size=f.nonneg("world_size"),
        files=files, tensors=_located(_parse_tensor, f.get("tensors", list), "tensor", len(files)),
        state=f.get("state", dict), stats=_parse_stats(f.get("stats", dict)),
        format_version=obj["format_version"])
    if meta.kind not in KINDS:
        raise FormatError(f"kind {meta.kind!r} is not one of {KINDS}")
    if (meta.kind == "full") != (meta.base_step is None):
        raise FormatError(f"a {meta.kind} step must {'not ' if meta.kind == 'full' else ''}"
                          f"have a base_step")
    names = [t.name for t in meta.tensors]
    if len(set(names)) != len(names):
        raise FormatError("duplicate tensor names")
    known = set(names)
    for record in meta.tensors:
        if record.alias_of is not None and record.alias_of not in known:
            raise FormatError(f"tensor {record.name!r} aliases unknown {record.alias_of!r}")
    return meta


def _parse_file(obj: Any) -> DataFile:
    f = _Fields(obj)
    name = f.get("name", str)
    if not DATA_FILE_PATTERN.fullmatch(name):
        raise FormatError(f"data file name {name!r} is not allowed")
    return DataFile(name, f.nonneg("rank"), f.nonneg("size"))


def _parse_stats(obj: dict) -> StepStats:
    f = _Fields(obj)
    try:
        return StepStats(raw_bytes=f.nonneg("raw_bytes"), stored_bytes=f.nonneg("stored_bytes"),
                         seconds=float(f.get("seconds", (int, float))),
                         classes=f.get("classes", dict, optional=True),
                         compression=f.get("compression", dict, optional=True))
    except FormatError as exc:
        raise FormatError(f"stats: {exc}") from None
