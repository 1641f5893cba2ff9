"""Step metadata: the data model of docs/FORMAT.md, its JSON form and its validation.

Everything read from disk passes through :func:`parse_step_metadata`, which
checks the metadata's checksum, then types, ranges and cross references
(byte ranges against the data files, the state tree against the tensors)
before any tensor is touched, so a damaged, foreign or hostile file fails
with a message naming the file and the field, and nothing is allocated on
the word of an unchecked number.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from deltackpt.errors import CorruptionError, FormatError, NotACheckpointError
from deltackpt.format.dtypes import spec_named
from deltackpt.format.tree import check_tree

FORMAT_NAME = "deltackpt"
FORMAT_VERSION = "2.9"
SCALED_16_BIT = (2, 1)  # since: scaled quant chunks of bfloat16 and float16 tensors (FORMAT.md 3.2)
# quant params a version before the one given has not: a reader of it would decode their chunks
# otherwise (FORMAT.md 3.2)
QUANT_PARAMS_SINCE = {"dither_signs": (2, 2),  # symbols' signs folded by the dither
                      "floor_log2": (2, 3),  # scaled steps shaped by the scale
                      "zeros": (2, 4),  # elements restored as exactly zero
                      "dither_groups": (2, 5),  # each block's symbols grouped by the dither
                      "bit_planes": (2, 8),  # the symbol stream stored as bit planes
                      "rans_bins": (2, 9)}  # the planes coded by rANS
UNCHANGED = "unchanged"  # the codec of a chunk of bytes its base step holds (FORMAT.md 3.5)
PATCH = "patch"  # the codec of a chunk of its base step's bytes, patched (FORMAT.md 3.6)
CODECS_SINCE = {UNCHANGED: (2, 6), PATCH: (2, 7)}  # codecs a version before the one given has not
MAX_PATCH_BYTES = 1 << 16  # of a patch chunk's raw bytes
MT19937_WORDS = 624  # of the state of a Mersenne Twister, which a patch chunk may twist
MAX_TWISTS = 4096  # of a patch chunk
PATCH_WORDS = (4, 8)  # the bytes a patch chunk's twisted words take each
ROOT_MARKER = "deltackpt.json"
METADATA_FILE = "metadata.json"
STEP_DIR_PATTERN = re.compile(r"step-(\d{12,})")
DATA_FILE_PATTERN = re.compile(r"d-[0-9a-f]+-r[0-9]+-[0-9]+\.bin")
MAX_FILE_NAME = 255  # NAME_MAX of POSIX file systems: a longer name can be no file
XXH3_PATTERN = re.compile(r"[0-9a-f]{16}")
ROLES = ("param", "buffer", "optimizer", "rng", "extra")  # minor versions may add more
KINDS = ("full", "delta")
CHECKSUM_KEY = "xxh3"  # the metadata's own checksum: its last member (FORMAT.md 2)
CHECKSUM_SINCE = (1, 7)
_SEAL = re.compile(rb',"xxh3":"([0-9a-f]{16})"\}')
MAX_INT = 2**63 - 1  # integer fields of the metadata are int64
MAX_ROOT_MARKER_BYTES = 4096
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a compressed metadata.json starts with it (FORMAT.md 2)
MAX_METADATA_BYTES = 1 << 28  # of a metadata.json's JSON text, compressed or not
MAX_METADATA_INFLATION = 64  # of a compressed one's text over its frame
LOSSLESS_CODECS = ("raw", "zstd", "huffman", "byteplane")
DELTA_CODECS = ("quant", "cast", "bnb8", UNCHANGED, PATCH)  # delta steps only (FORMAT.md 3)
# No chunk of a lossless codec decodes to more than this many bytes per stored byte: a zstd block
# of 128 KiB takes at least 4 bytes, a huffman block of 65536 symbols 2.
MAX_EXPANSION = 1 << 15
MAX_STATS_DEPTH = 16  # nesting of the informative stats' objects
MAX_STATE_DEPTH = 70  # nesting of ``state`` (itself level 1): tagged values of 64 levels fit


def step_dir_name(step: int) -> str:
    """Directory name of ``step``."""
    return f"step-{step:012d}"


def metadata_file(step: int) -> str:
    """The path of ``step``'s metadata file in its checkpoint directory."""
    return f"{step_dir_name(step)}/{METADATA_FILE}"


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
        """Serialize as the metadata file's text, checksum included."""
        fields = {k: v for k, v in vars(self).items() if k != "format_version"}
        body = {"format": FORMAT_NAME, "format_version": self.format_version, **fields}
        # Compact separators keep json on its C encoder: metadata of big models has many chunks.
        return seal_json(json.dumps(body, separators=(",", ":"), allow_nan=False, default=vars))


Layout = dict[str, tuple[str, str, tuple[int, ...]]]


def layout_of(meta: StepMetadata) -> Layout:
    """Role, dtype and shape of every stored (non-alias) tensor of a step."""
    return {r.name: (r.role, r.dtype, tuple(r.shape)) for r in meta.tensors if r.alias_of is None}


def seal_json(text: str) -> str:
    """``text``, the compact JSON of a non-empty object, with its checksum appended as the
    object's last member (FORMAT.md 2): ``"xxh3":"<xxh3-64 of every byte before it>"``."""
    head = text[:-1] + ","
    return f'{head}"{CHECKSUM_KEY}":"{xxhash.xxh3_64_hexdigest(head.encode())}"}}'


def check_seal(data: bytes, where: str) -> bool:
    """Whether the JSON text ``data`` ends with a checksum member (FORMAT.md 2); raises
    :class:`CorruptionError` when it does and the bytes before it do not match it."""
    match = _SEAL.match(data, max(0, len(data) - 27))
    if match is None or match.end() != len(data):
        return False
    if xxhash.xxh3_64_hexdigest(data[: match.start() + 1]) != match.group(1).decode():
        raise CorruptionError(f"{where}: checksum mismatch (the metadata file is damaged)")
    return True


def _not_json(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def load_json(data: bytes, where: str) -> Any:
    """Parse untrusted JSON: UTF-8 text, strict JSON (no ``NaN`` or ``Infinity``, no number
    that overflows a float), nested no deeper than the parser's recursion allows. Raises
    :class:`FormatError` naming ``where`` otherwise."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise FormatError(f"{where}: not valid JSON (nested too deep)") from None
    except ValueError as exc:  # malformed JSON or UTF-8, integers of over 4300 digits, the hooks'
        raise FormatError(f"{where}: not valid JSON ({exc})") from None


def check_format_version(version: Any, where: str) -> tuple[int, int]:
    """``(major, minor)`` of a ``format_version``; refuses a missing, malformed or unknown-major
    one (this deltackpt reads majors 1 and 2, FORMAT.md 4)."""
    ours = int(FORMAT_VERSION.split(".")[0])
    match = re.fullmatch(r"(\d{1,9})\.(\d{1,9})", version) if isinstance(version, str) else None
    if match is None:
        raise FormatError(f"{where}: format_version {version!r} is not 'MAJOR.MINOR'")
    if not 1 <= int(match.group(1)) <= ours:
        raise FormatError(f"{where}: written in format {version}, this deltackpt reads major "
                          f"versions 1 to {ours} (format {FORMAT_VERSION}); upgrade deltackpt to "
                          "read it")
    return int(match.group(1)), int(match.group(2))


def check_root_marker(data: bytes, where: str) -> None:
    """Check the text of a root marker ``deltackpt.json`` (FORMAT.md 1): a foreign or damaged
    one raises :class:`NotACheckpointError`, one of a newer major version :class:`FormatError`."""
    try:
        marker = load_json(data, where)
    except FormatError as exc:
        raise NotACheckpointError(str(exc)) from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_NAME:
        raise NotACheckpointError(f"{where}: not a deltackpt marker")
    check_format_version(marker.get("format_version"), where)


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
        raise FormatError(f"field {key!r} is {shown(value)}, expected {types}")

    def nonneg(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key, int, optional)
        if value is not None and not 0 <= value <= MAX_INT:
            raise FormatError(f"field {key!r} is {shown(value)}, not an integer in [0, 2**63)")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.get(key, list)
        for v in value:
            if v.__class__ is not int or not 0 <= v <= MAX_INT:
                raise FormatError(f"field {key!r} must hold integers in [0, 2**63), found "
                                  f"{shown(value)}")
        return value


def shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut short (metadata may be hostile)."""
    return reprlib.repr(value)


def check_plain(value: Any, depth: int, what: str) -> None:
    """Raise :class:`FormatError` unless JSON ``value`` nests at most ``depth`` levels of arrays
    and objects and its integers are int64: what the informative stats and codec params may
    hold (their readers format and convert them)."""
    cls = value.__class__
    if cls is not dict and cls is not list:
        if cls is int and not -MAX_INT - 1 <= value <= MAX_INT:
            raise FormatError(f"{what}: integer {shown(value)} is out of the int64 range")
        return
    if depth == 0:
        raise FormatError(f"{what}: nested too deep")
    for item in value.values() if cls is dict else value:
        cls = item.__class__
        if cls is dict or cls is list or (cls is int and not -MAX_INT - 1 <= item <= MAX_INT):
            check_plain(item, depth - 1, what)


def _located(parse: Callable[..., Any], items: list, what: str, *args: Any) -> list:
    """``parse(item, *args)`` for each item; an error is prefixed with the item's position
    (``what`` and its index, and its name if it has one)."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(parse(item, *args))
        except FormatError as exc:
            name = item.get("name") if isinstance(item, dict) else None
            label = f"{what} {i}" + (f" ({shown(name)})" if isinstance(name, str) else "")
            raise FormatError(f"{label}: {exc}") from None
    return out


def _nonneg_ints(values: tuple | list) -> bool:
    """Whether every value is an int in ``[0, 2**63)``, as :meth:`_Fields.nonneg` takes them."""
    for value in values:  # noqa: SIM110 (all() of a generator takes 10% of a parse more)
        if value.__class__ is not int or not 0 <= value <= MAX_INT:
            return False
    return True


def _chunk_fields(obj: Any) -> Chunk:
    """A chunk's fields, typed. Valid metadata takes one test of them all (a restore reads
    thousands of chunks a step); the checks field by field, which name the field, run only
    when it fails."""
    if obj.__class__ is dict:
        get = obj.get
        ints = get("file"), get("offset"), get("length"), get("raw_offset"), get("raw_length")
        codec, params, xxh3, raw_xxh3 = get("codec"), get("params"), get("xxh3"), get("raw_xxh3")
        if _nonneg_ints(ints) and codec.__class__ is str and params.__class__ is dict \
                and xxh3.__class__ is str and raw_xxh3.__class__ is str:
            return Chunk(*ints, codec, params, xxh3, raw_xxh3)
    f = _Fields(obj)
    return Chunk(
        file=f.nonneg("file"), offset=f.nonneg("offset"), length=f.nonneg("length"),
        raw_offset=f.nonneg("raw_offset"), raw_length=f.nonneg("raw_length"),
        codec=f.get("codec", str), params=f.get("params", dict),
        xxh3=f.get("xxh3", str), raw_xxh3=f.get("raw_xxh3", str))


def _parse_chunk(obj: Any, files: list[DataFile], kind: str) -> Chunk:
    chunk = _chunk_fields(obj)
    if chunk.file >= len(files):
        raise FormatError(f"file index {chunk.file} out of range ({len(files)} files)")
    for key in ("xxh3", "raw_xxh3"):
        if not XXH3_PATTERN.fullmatch(getattr(chunk, key)):
            raise FormatError(f"{key} {shown(getattr(chunk, key))} is not 16 hex digits")
    file = files[chunk.file]
    if chunk.offset + chunk.length > file.size:
        raise FormatError(f"bytes {chunk.offset}..{chunk.offset + chunk.length} lie beyond the "
                          f"end of data file {file.name} ({file.size} bytes)")
    if chunk.codec == "raw" and chunk.length != chunk.raw_length:
        raise FormatError(f"a raw chunk of {chunk.raw_length} bytes stores {chunk.length}")
    if chunk.codec in LOSSLESS_CODECS and chunk.raw_length > MAX_EXPANSION * chunk.length:
        raise FormatError(f"a {chunk.codec} chunk of {chunk.length} bytes cannot decode to "
                          f"{chunk.raw_length}")
    if kind == "full" and chunk.codec in DELTA_CODECS:
        raise FormatError(f"codec {chunk.codec!r} belongs to delta steps")
    if chunk.codec == UNCHANGED and (chunk.length or chunk.params):
        raise FormatError(f"an unchanged chunk stores no bytes and has no params, found "
                          f"{chunk.length} bytes and params {shown(chunk.params)}")
    if chunk.codec == PATCH:
        _check_patch(chunk)
    if chunk.params:
        check_plain(chunk.params, 3, "params")
    return chunk


def _check_patch(chunk: Chunk) -> None:
    """Raise :class:`FormatError` unless a patch chunk's params and lengths are those of
    FORMAT.md 3.6: its base's bytes XORed with stored ones, after twisting the Mersenne Twister
    state they may hold a bounded number of times."""
    params = chunk.params
    if chunk.raw_length > MAX_PATCH_BYTES:
        raise FormatError(f"a patch chunk of {chunk.raw_length} bytes: patch chunks hold at most "
                          f"{MAX_PATCH_BYTES}")
    if not params:
        if not chunk.length:
            raise FormatError("a patch chunk with no twists stores no bytes: it would be an "
                              "unchanged chunk")
        return
    twists, offset, word = (params.get(k) for k in ("twists", "offset", "word"))
    if params.keys() != {"twists", "offset", "word"} \
            or not all(v.__class__ is int for v in (twists, offset, word)):
        raise FormatError(f"patch params {shown(params)} are not {{}} or the integers twists, "
                          "offset and word")
    if not 1 <= twists <= MAX_TWISTS or word not in PATCH_WORDS or offset < 0 \
            or offset % word or offset + MT19937_WORDS * word > chunk.raw_length:
        raise FormatError(f"patch params {shown(params)}: twists must be 1 to {MAX_TWISTS}, word "
                          f"one of {PATCH_WORDS}, and the {MT19937_WORDS} words from offset (a "
                          f"multiple of word) lie in the chunk's {chunk.raw_length} bytes")


def _parse_fragment(obj: Any, record: TensorRecord, files: list[DataFile], kind: str,
                    itemsize: int) -> Fragment:
    if obj.__class__ is dict and _int_lists(offsets := obj.get("offsets"),
                                            sizes := obj.get("sizes")) \
            and (chunks := obj.get("chunks")).__class__ is list:
        frag = Fragment(offsets, sizes)
    else:  # the checks that name the field
        f = _Fields(obj)
        frag = Fragment(offsets=f.int_list("offsets"), sizes=f.int_list("sizes"))
        chunks = f.get("chunks", list)
    if len(frag.offsets) != len(record.shape) or len(frag.sizes) != len(record.shape):
        raise FormatError(f"offsets/sizes rank differs from shape {record.shape}")
    if any(o + s > d for o, s, d in zip(frag.offsets, frag.sizes, record.shape, strict=True)):
        raise FormatError(f"box {frag.offsets}+{frag.sizes} exceeds shape {record.shape}")
    frag.chunks = _located(_parse_chunk, chunks, "chunk", files, kind)
    expected = 0
    for chunk in frag.chunks:
        if chunk.raw_offset != expected or chunk.raw_length % itemsize:
            raise FormatError(f"chunks do not tile the fragment's bytes "
                              f"(chunk at {chunk.raw_offset}, expected {expected})")
        expected += chunk.raw_length
    if expected != frag.numel * itemsize:
        raise FormatError(f"chunks hold {expected} bytes, the box needs {frag.numel * itemsize}")
    return frag


def _int_lists(*values: Any) -> bool:
    """Whether every value is a list of ints in ``[0, 2**63)``, as :meth:`_Fields.int_list`
    takes them."""
    for value in values:  # noqa: SIM110 (as _nonneg_ints)
        if value.__class__ is not list or not _nonneg_ints(value):
            return False
    return True


def _optional_strs(*values: Any) -> bool:
    """Whether every value is a str or None."""
    for value in values:  # noqa: SIM110 (as _nonneg_ints)
        if value is not None and value.__class__ is not str:
            return False
    return True


def _tensor_fields(obj: Any) -> tuple[TensorRecord, list]:
    """A tensor's fields, typed, and its list of fragments (as :func:`_chunk_fields`)."""
    if obj.__class__ is dict:
        get = obj.get
        name, role, dtype, shape = get("name"), get("role"), get("dtype"), get("shape")
        fqn, state_key, alias_of = get("fqn"), get("state_key"), get("alias_of")
        fragments = get("fragments")
        if name.__class__ is str and role.__class__ is str and dtype.__class__ is str \
                and _int_lists(shape) and _optional_strs(fqn, state_key, alias_of) \
                and fragments.__class__ is list:
            return TensorRecord(name, role, dtype, shape, fqn, state_key, alias_of), fragments
    f = _Fields(obj)
    return TensorRecord(
        name=f.get("name", str), role=f.get("role", str), dtype=f.get("dtype", str),
        shape=f.int_list("shape"), fqn=f.get("fqn", str, optional=True),
        state_key=f.get("state_key", str, optional=True),
        alias_of=f.get("alias_of", str, optional=True)), f.get("fragments", list)


def _parse_tensor(obj: Any, files: list[DataFile], kind: str) -> TensorRecord:
    record, fragments = _tensor_fields(obj)
    itemsize = spec_named(record.dtype, "field 'dtype'").itemsize
    size = itemsize if 0 not in record.shape else 0
    for dim in record.shape:
        size *= dim
        if size > MAX_INT:
            raise FormatError(f"shape {shown(record.shape)} holds more than 2**63 bytes")
    if record.alias_of is not None:
        if fragments:
            raise FormatError("an alias must not have fragments")
        return record
    record.fragments = _located(_parse_fragment, fragments, "fragment", record, files, kind,
                                itemsize)
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
    if len(record.fragments) == 1:  # a tensor saved by one process: its box is checked
        covered = record.fragments[0].numel
        if covered != record.numel and record.numel > 0:
            raise FormatError(f"fragments cover {covered} of {record.numel} elements")
        return
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
    """Parse and validate the text of a ``metadata.json``; ``where`` names it in errors.

    Raises :class:`CorruptionError` when the checksum does not match, or is missing from
    metadata of a version that has one, and :class:`FormatError` for anything else that
    breaks FORMAT.md.
    """
    data = text.encode() if isinstance(text, str) else text
    sealed = check_seal(data, where)
    with _collector_paused():
        obj = load_json(data, where)
        if isinstance(obj, dict) and obj.get("format") == FORMAT_NAME:
            version = check_format_version(obj.get("format_version"), where)
            if not sealed and (version >= CHECKSUM_SINCE or CHECKSUM_KEY in obj):
                raise CorruptionError(f"{where}: the metadata's checksum is missing or "
                                      f"unreadable (format {obj['format_version']} ends it with "
                                      "one; the file is damaged)")
        try:
            return _parse_step(obj)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, if it runs, for the duration.

    Parsing a step makes tens of thousands of objects that all live on, so
    the collections their allocation triggers free nothing, and in a process
    with a large heap (torch, a model, a dataset) each full one walks all of
    it: they took 45% of a restore's metadata parsing (9 steps of 400
    tensors). The collector runs again at the next allocation after this.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _parse_step(obj: Any) -> StepMetadata:
    f = _Fields(obj)
    if obj.get("format") != FORMAT_NAME:
        raise FormatError(f"not deltackpt metadata (format={shown(obj.get('format'))})")
    kind = f.get("kind", str)
    files = _located(_parse_file, f.get("files", list), "file")
    meta = StepMetadata(
        step=f.nonneg("step"), kind=kind, base_step=f.nonneg("base_step", optional=True),
        save_id=f.get("save_id", str), created=f.get("created", str),
        library_version=f.get("library_version", str), world_size=f.nonneg("world_size"),
        files=files, tensors=_located(_parse_tensor, f.get("tensors", list), "tensor", files, kind),
        state=f.get("state", dict), stats=_parse_stats(f.get("stats", dict)),
        format_version=obj["format_version"])
    if meta.kind not in KINDS:
        raise FormatError(f"kind {shown(meta.kind)} is not one of {KINDS}")
    if (meta.kind == "full") != (meta.base_step is None):
        raise FormatError(f"a {meta.kind} step must {'not ' if meta.kind == 'full' else ''}"
                          f"have a base_step")
    if meta.world_size < 1:
        raise FormatError("world_size must be at least 1")
    _check_disjoint(meta)
    records = {t.name: t for t in meta.tensors}
    if len(records) != len(meta.tensors):
        raise FormatError("duplicate tensor names")
    for record in meta.tensors:
        if record.alias_of is None:
            continue
        target = records.get(record.alias_of)
        if target is None or target.alias_of is not None \
                or (target.dtype, target.shape) != (record.dtype, record.shape):
            raise FormatError(f"tensor {shown(record.name)} aliases {shown(record.alias_of)}, "
                              f"which is no stored tensor of its dtype and shape")
    _check_state(meta.state, records)
    version = check_format_version(meta.format_version, "")
    newer = [key for key, since in QUANT_PARAMS_SINCE.items() if version < since]
    if newer:
        _refuse_newer_params(meta, newer)
    if any(version < since for since in CODECS_SINCE.values()):
        _refuse_newer_codecs(meta, version)
    return meta


def _refuse_newer_codecs(meta: StepMetadata, version: tuple[int, int]) -> None:
    """Refuse a chunk of a codec of a version later than the metadata's (an ``unchanged``
    chunk in a 2.5 step): a writer of that version wrote none."""
    for record in meta.tensors:
        for chunk in (c for f in record.fragments for c in f.chunks):
            since = CODECS_SINCE.get(chunk.codec)
            if since is not None and version < since:
                raise FormatError(f"tensor {shown(record.name)}: a chunk of codec "
                                  f"{chunk.codec!r} is of format {'.'.join(map(str, since))}, "
                                  f"this step's format_version is {meta.format_version}")


def _refuse_newer_params(meta: StepMetadata, keys: list[str]) -> None:
    """Refuse a quant chunk (or the quant chunk inside a bnb8 one) with one of ``keys``, params
    of a version later than the metadata's: a reader of that version would decode it
    otherwise (with the wrong signs, or unshaped steps)."""
    for record in meta.tensors:
        for chunk in (c for f in record.fragments for c in f.chunks):
            inner = chunk.params.get("params")
            for key in keys:
                if key in chunk.params or (isinstance(inner, dict) and key in inner):
                    since = ".".join(map(str, QUANT_PARAMS_SINCE[key]))
                    raise FormatError(f"tensor {shown(record.name)}: a chunk's {key!r} is of "
                                      f"format {since}, this step's format_version is "
                                      f"{meta.format_version}")


def _check_disjoint(meta: StepMetadata) -> None:
    """Raise :class:`FormatError` if two chunks share stored bytes: each byte is written once,
    so the bytes a step decodes are bounded by those of its files."""
    ranges = sorted((c.file, c.offset, c.offset + c.length) for t in meta.tensors
                    for f in t.fragments for c in f.chunks if c.length)
    for (file, _, end), (other, start, _) in itertools.pairwise(ranges):
        if file == other and start < end:
            raise FormatError(f"two chunks share bytes from {start} of data file "
                              f"{meta.files[file].name}")


def _parse_file(obj: Any) -> DataFile:
    f = _Fields(obj)
    name = f.get("name", str)
    if not DATA_FILE_PATTERN.fullmatch(name):
        raise FormatError(f"data file name {shown(name)} is not allowed")
    if len(name) > MAX_FILE_NAME:
        raise FormatError(f"data file name {shown(name)} is {len(name)} characters long, more "
                          f"than a file name may have ({MAX_FILE_NAME})")
    return DataFile(name, f.nonneg("rank"), f.nonneg("size"))


def _parse_stats(obj: dict) -> StepStats:
    f = _Fields(obj)
    try:
        seconds = f.get("seconds", (int, float))
        if not 0 <= seconds <= MAX_INT:
            raise FormatError(f"field 'seconds' is {shown(seconds)}")
        stats = StepStats(raw_bytes=f.nonneg("raw_bytes"), stored_bytes=f.nonneg("stored_bytes"),
                          seconds=float(seconds), classes=f.get("classes", dict, optional=True),
                          compression=f.get("compression", dict, optional=True))
        for name, values in (stats.classes or {}).items():
            if not isinstance(values, dict) or not all(
                    v is None or v.__class__ is float or (v.__class__ is int and abs(v) <= MAX_INT)
                    for v in values.values()):
                raise FormatError(f"classes: {shown(name)} is not an object of numbers")
        check_plain(stats.compression, MAX_STATS_DEPTH, "compression")
        return stats
    except FormatError as exc:
        raise FormatError(f"stats: {exc}") from None


def _check_state(state: dict[str, Any], records: dict[str, TensorRecord]) -> None:
    """Raise :class:`FormatError` unless ``state`` is a State of FORMAT.md 2.2 whose tagged
    values (2.5) decode: an optimizer record whose param groups list each parameter once and
    whose state belongs to listed parameters, RNG states as the RNGs take them, tensor
    references to tensors of the step, and nesting within ``MAX_STATE_DEPTH``."""
    dtypes = {name: r.dtype for name, r in records.items()}
    for section in ("optimizer", "rng", "extra"):
        value = state.get(section)
        where = f"state: {section}"
        check_tree(value, dtypes, where, MAX_STATE_DEPTH - 1)
        try:
            if section == "optimizer" and value is not None:
                _check_optimizer(value)
            elif section == "rng" and value is not None:
                _check_rng(value, records)
        except FormatError as exc:
            raise FormatError(f"{where}: {exc}") from None


def _check_optimizer(optimizer: Any) -> None:
    f = _Fields(optimizer)
    f.get("class", str)
    listed: set[str] = set()
    for g, group in enumerate(f.get("param_groups", list)):
        params = _Fields(group).get("params", list)
        if not all(p.__class__ is str for p in params) or len(set(params)) != len(params) \
                or listed & set(params):
            raise FormatError(f"param group {g}: 'params' must list parameter names, each once "
                              "in all groups")
        listed.update(params)
    for fqn, values in f.get("state", dict).items():
        if fqn not in listed or not isinstance(values, dict):
            raise FormatError(f"the state of {shown(fqn)} is not an object for a parameter of "
                              "the param groups")


def _tagged(value: Any, tag: str) -> Any:
    """The body of ``value`` if it is the tagged value ``{tag: body}`` (FORMAT.md 2.5), else None."""
    return value[tag] if isinstance(value, dict) and len(value) == 1 and tag in value else None


def _check_rng(rng: Any, records: dict[str, TensorRecord]) -> None:
    """The RNG states as :func:`deltackpt.save.capture.rng_state` captures them: torch's (and CUDA's)
    byte tensors, numpy's legacy ``MT19937`` tuple and ``random``'s version 3 tuple."""
    def byte_tensor(value: Any) -> bool:
        record = records.get(_tagged(value, "$tensor"))
        return record is not None and record.dtype == "uint8" and len(record.shape) == 1

    cuda = _Fields(rng).get("cuda", list, optional=True) or []
    if not byte_tensor(rng.get("torch")) or not all(byte_tensor(t) for t in cuda):
        raise FormatError("torch's states must be uint8 tensors of one dimension")
    numpy_state = _tagged(rng.get("numpy"), "$tuple")
    if not (isinstance(numpy_state, list) and len(numpy_state) == 5
            and numpy_state[0] == "MT19937"
            and getattr(records.get(_tagged(numpy_state[1], "$ndarray")), "shape", None) == [624]
            and records[_tagged(numpy_state[1], "$ndarray")].dtype == "uint32"
            and numpy_state[2].__class__ is int and 0 <= numpy_state[2] <= 624
            and numpy_state[3].__class__ is int and numpy_state[3] in (0, 1)
            and numpy_state[4].__class__ in (int, float)):
        raise FormatError("numpy's state must be ('MT19937', 624 uint32 keys, position, "
                          "has_gauss, cached_gaussian)")
    python_state = _tagged(rng.get("python"), "$tuple")
    fields = isinstance(python_state, list) and len(python_state) == 3
    words = _tagged(python_state[1], "$tuple") if fields else None
    array = records.get(_tagged(python_state[1], "$ndarray")) if fields else None  # since 2.6
    if not (fields and python_state[0] == 3
            and ((isinstance(words, list) and len(words) == 625
                  and all(w.__class__ is int and 0 <= w < 2**32 for w in words)
                  and words[-1] <= 624)
                 or (array is not None and array.dtype == "uint32" and array.shape == [625]))
            and (python_state[2] is None or python_state[2].__class__ in (int, float))):
        raise FormatError("random's state must be (3, 625 words of 32 bits, gauss_next), its "
                          "words a list or a uint32 array")
