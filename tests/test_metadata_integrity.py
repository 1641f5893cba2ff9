"""Metadata integrity (FORMAT.md 2, format 1.7): the checksum every metadata.json ends with, the
root marker, and the validation of untrusted metadata before anything is read or allocated.

Damage to a file leaves its checksum as it was; the validation cases re-seal the metadata with a
new checksum (as a buggy writer or an attacker could), so only validation can refuse them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from helpers import edit_metadata, files_under, step_dir
from torch import nn

from deltackpt import (
    CheckpointManager,
    CorruptionError,
    DeltackptError,
    FormatError,
    NotACheckpointError,
    StateMismatchError,
)
from deltackpt.codecs.lossless import METADATA_LEVEL, ZSTD_LEVEL
from deltackpt.format.metadata import CHECKSUM_KEY, FORMAT_VERSION, ZSTD_MAGIC, seal_json
from deltackpt.io import reader as reader_module
from deltackpt.io import storage as storage_module
from deltackpt.io.reader import read_metadata
from deltackpt.io.storage import open_storage

FULL, DELTA = 1, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 32), nn.Linear(32, 32), nn.Linear(32, 8, bias=False))
    model[2].weight = model[0].weight  # tied: the second name is an alias
    return model


def _extra(step: int) -> dict[str, Any]:
    return {"epoch": step, "pair": (1, 2.5), "by_int": {3: "x"}, "blob": b"ab", "np": np.int16(7),
            "array": np.arange(3, dtype=np.float32), "codes": torch.zeros(10, dtype=torch.uint8),
            "half": torch.zeros(4, dtype=torch.bfloat16), "big": torch.randn(4096), "nan": float("nan")}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 1 (full) and step 2 (a delta on it) of a model with a tied weight, AdamW state, RNG
    states and an ``extra`` of every tag."""
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, chunk_bytes=4096) as mgr:
        for step in (FULL, DELTA):
            model(torch.arange(8)).square().mean().backward()
            optimizer.step()
            mgr.save(step, model, optimizer, extra=_extra(step))
    return root


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _path(root: Path, step: int) -> Path:
    return step_dir(root, step) / "metadata.json"


def _text(root: Path, step: int) -> bytes:
    data = _path(root, step).read_bytes()
    return zstandard.ZstdDecompressor().decompress(data) if data[:4] == ZSTD_MAGIC else data


# -- the checksum (item 10) ---------------------------------------------------------------------

@pytest.mark.parametrize("step", [FULL, DELTA])
def test_checksum_is_the_xxh3_of_the_text_before_it(ckpt: Path, step: int) -> None:
    """FORMAT.md 2: the text ends with ``"xxh3":"<xxh3-64 of every byte before the member>"}``,
    in the decompressed text of a delta's zstd frame."""
    assert (_path(ckpt, step).read_bytes()[:4] == ZSTD_MAGIC) == (step == DELTA)
    text = _text(ckpt, step)
    head, tail = text[:-26], text[-26:]
    assert head.endswith(b",")
    assert tail == b'"xxh3":"' + xxhash.xxh3_64_hexdigest(head).encode() + b'"}'
    obj = json.loads(text)
    assert obj["format_version"] == FORMAT_VERSION == "2.9"
    assert list(obj)[-1] == CHECKSUM_KEY


@pytest.mark.parametrize("step", [FULL, DELTA])
def test_every_byte_flip_is_caught(ckpt: Path, step: int) -> None:
    """A bit flipped anywhere in a metadata file, its checksum included, fails the read with a
    DeltackptError; in a zstd frame a flip may also leave the decoded text as it was (the
    metadata read is then the same)."""
    storage, path = open_storage(ckpt), _path(ckpt, step)
    original = path.read_bytes()
    expected = read_metadata(storage, step)
    positions = sorted({*range(0, len(original), max(1, len(original) // 400)),
                        *range(max(0, len(original) - 40), len(original))})
    caught = same = 0
    for i in positions:
        data = bytearray(original)
        data[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(data))
        try:
            meta = read_metadata(storage, step)
        except DeltackptError:
            caught += 1
            continue
        assert step == DELTA and meta == expected, f"byte {i}: a changed read went unnoticed"
        same += 1
    path.write_bytes(original)
    assert caught + same == len(positions) and caught > 0.9 * len(positions)


@pytest.mark.parametrize("change", ["rng digit", "$tensor renamed", "optimizer state renamed"])
def test_changes_the_audit_missed_are_caught(ckpt: Path, change: str) -> None:
    """The single-byte changes an audit found restored as changed values with verify passing (a
    digit of the saved RNG state, ``"$tensor"`` renamed, the optimizer's ``"state"`` key renamed):
    restore and load raise CorruptionError naming the file, verify reports the step and the delta
    coded against it."""
    path = _path(ckpt, FULL)
    text = path.read_bytes()
    if change == "rng digit":
        start = text.index(b'"numpy":{"$tuple":["MT19937",{"$ndarray":"rng/numpy/1"},')
        digit = next(i for i in range(start, len(text)) if text[i:i + 1].isdigit())
        damaged = text[:digit] + bytes([b"0123456789"[(int(text[digit:digit + 1]) + 1) % 10]]) \
            + text[digit + 1:]
    else:
        old, new = {"$tensor renamed": (b'"$tensor"', b'"$tensoR"'),
                    "optimizer state renamed": (b'"state":{"0.weight"', b'"statf":{"0.weight"')}[change]
        assert old in text
        damaged = text.replace(old, new, 1)
    assert len(damaged) == len(text) and sum(a != b for a, b in zip(damaged, text, strict=True)) == 1
    path.write_bytes(damaged)
    mgr = CheckpointManager(ckpt, read_only=True)
    for call in (lambda: mgr.restore(FULL), lambda: mgr.load(FULL, *_live()),
                 lambda: mgr.restore(DELTA)):
        with pytest.raises(CorruptionError, match="checksum") as info:
            call()
        assert str(path) in str(info.value)
    report = mgr.verify()
    assert len(report[FULL]) == 1 and "checksum" in report[FULL][0] and report[DELTA]


def _live() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_checksum_member_itself_is_checked(ckpt: Path) -> None:
    """A changed digit of the checksum, a renamed checksum key and a 1.7+ metadata without one are
    damage; metadata that says 1.6 and has none is an old step and reads as it did."""
    path = _path(ckpt, FULL)
    text = path.read_bytes()
    mgr = CheckpointManager(ckpt, read_only=True)
    expected = mgr.restore(FULL).extra
    digit = len(text) - 3
    other = b"0" if text[digit:digit + 1] != b"0" else b"1"
    unsealed = json.dumps({k: v for k, v in json.loads(text).items() if k != CHECKSUM_KEY},
                          separators=(",", ":")).encode()
    for damaged, message in [(text[:digit] + other + text[digit + 1:], "checksum mismatch"),
                             (text.replace(b'"xxh3":', b'"xxh4":'), "checksum is missing"),
                             (unsealed, "checksum is missing")]:
        path.write_bytes(damaged)
        with pytest.raises(CorruptionError, match=message):
            mgr.restore(FULL)
    path.write_bytes(unsealed.replace(f'"format_version":"{FORMAT_VERSION}"'.encode(),
                                      b'"format_version":"1.6"'))
    restored = mgr.restore(FULL).extra
    assert restored.keys() == expected.keys() and restored["pair"] == expected["pair"]


MARKERS = {"not UTF-8": b'{"format": "deltackpt\xff", "format_version": "1.2"}',
           "version of 5000 digits": b'{"format": "deltackpt", "format_version": "1.'
           + b"9" * 5000 + b'"}',
           "larger than 4 KiB": b" " * 5000 + b'{"format": "deltackpt", "format_version": "1.2"}',
           "nested 100000 deep": b"[" * 100_000}


@pytest.mark.parametrize("marker", list(MARKERS))
def test_damaged_root_marker_names_the_file(ckpt: Path, marker: str) -> None:
    """A deltackpt.json that is not UTF-8, holds an absurd version, is larger than a marker can be
    or nests absurdly deep makes the directory no checkpoint (or an unreadable one), naming the
    file, for readers and writers alike; nothing in the directory changes."""
    (ckpt / "deltackpt.json").write_bytes(MARKERS[marker])
    before = files_under(ckpt)
    for read_only in (True, False):
        with pytest.raises((NotACheckpointError, FormatError), match=r"deltackpt\.json"):
            CheckpointManager(ckpt, read_only=read_only)
    assert files_under(ckpt) == before


# -- validation of untrusted metadata (item 11) ---------------------------------------------------

def _tensor(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in m["tensors"] if t["name"] == name)


def _chunks(m: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return _tensor(m, name)["fragments"][0]["chunks"]


def _coded(m: dict[str, Any]) -> dict[str, Any]:
    """The first chunk of a full step that is not stored raw."""
    return next(c for t in m["tensors"] for f in t["fragments"] for c in f["chunks"]
                if c["codec"] != "raw")


def _set(path: tuple, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


OPT, RNG, EXTRA = ("state", "optimizer"), ("state", "rng"), ("state", "extra")
INVALID: dict[str, Callable[[dict[str, Any]], None]] = {
    "alias of an alias": lambda m: _tensor(m, "model/1.weight").update(
        alias_of="model/2.weight", fragments=[]),
    "alias of another shape": lambda m: _tensor(m, "model/2.weight").update(shape=[32, 8]),
    "chunk beyond its file": lambda m: _chunks(m, "model/1.weight")[0].update(offset=10**6),
    "raw chunk of other length": lambda m: _chunks(m, "model/0.weight")[0].update(length=10),
    "chunk decoding beyond 32768x": lambda m: _coded(m).update(length=0),
    "chunks sharing bytes": lambda m: _chunks(m, "extra/big")[1].update(
        file=_chunks(m, "extra/big")[0]["file"], offset=_chunks(m, "extra/big")[0]["offset"]),
    "quant chunk in a full step": lambda m: _coded(m).update(codec="quant"),
    "unchanged chunk in a full step": lambda m: _coded(m).update(codec="unchanged", length=0,
                                                                  params={}),
    "patch chunk in a full step": lambda m: _coded(m).update(codec="patch", params={}),
    "tensor of 2**63 bytes": lambda m: _tensor(m, "extra/array").update(shape=[2**61]),
    "step beyond int64": _set(("step",), 2**64),
    "world size 0": _set(("world_size",), 0),
    "negative seconds": _set(("stats", "seconds"), -1.0),
    "class stats not numbers": _set(("stats", "classes"), {"weights": {"tensors": "x"}}),
    "compression holding a huge int": _set(("stats", "compression"), {"scale": 10**30}),
    "params nested deep": lambda m: _coded(m).update(params={"a": [[[[1]]]]}),
    "optimizer not an object": _set(OPT, [1]),
    "param group listing numbers": lambda m: m["state"]["optimizer"]["param_groups"][0].update(
        params=[0, 1]),
    "parameter in two groups": lambda m: m["state"]["optimizer"]["param_groups"].append(
        dict(m["state"]["optimizer"]["param_groups"][0])),
    "state of an unlisted parameter": lambda m: m["state"]["optimizer"]["state"].update(
        {"nothing.weight": {}}),
    "optimizer state a list": lambda m: m["state"]["optimizer"]["state"].update(
        {"1.weight": [1]}),
    "rng torch a list": _set((*RNG, "torch"), [1]),
    "rng torch another dtype": _set((*RNG, "torch"), {"$tensor": "extra/array"}),
    "rng numpy keys missing": lambda m: m["state"]["rng"]["numpy"]["$tuple"].__setitem__(1, 5),
    "rng python index beyond 624": _set((*RNG, "python"), {"$tuple": [3, {"$tuple": [0] * 624
                                                                          + [625]}, None]}),
    "rng python 624 words": _set((*RNG, "python"), {"$tuple": [3, {"$tuple": [0] * 624}, None]}),
    "rng python words of 624 keys": lambda m: m["state"]["rng"]["python"]["$tuple"].__setitem__(
        1, {"$ndarray": "rng/numpy/1"}),
    "unknown $tensor": _set((*EXTRA, "x"), {"$tensor": "extra/nothing"}),
    "$ndarray of bfloat16": _set((*EXTRA, "x"), {"$ndarray": "extra/half"}),
    "invalid $bytes": _set((*EXTRA, "blob"), {"$bytes": "YWJj="}),
    "$npscalar out of range": _set((*EXTRA, "np"), {"$npscalar": ["<i2", 40000]}),
    "$npscalar of objects": _set((*EXTRA, "np"), {"$npscalar": ["|O", 1]}),
    "$npscalar of a bad dtype": _set((*EXTRA, "np"), {"$npscalar": ["zz", 1]}),
    "unknown tag": _set((*EXTRA, "x"), {"$set": [1]}),
    "$dict key a list": _set((*EXTRA, "by_int"), {"$dict": [[[1], "x"]]}),
    "$dict key an array": _set((*EXTRA, "by_int"), {"$dict": [[{"$ndarray": "extra/array"}, 1]]}),
    "$dict key nested 500 deep": _set((*EXTRA, "by_int"), {"$dict": [[json.loads(
        '{"$tuple": [' * 250 + "1" + "]}" * 250), 1]]}),
    "$float of a number": _set((*EXTRA, "nan"), {"$float": 1}),
    "$tuple of a number": _set((*EXTRA, "pair"), {"$tuple": 1}),
    "state nested 71 deep": _set(EXTRA, json.loads("[" * 70 + "]" * 70)),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_metadata_is_refused_when_read(ckpt: Path, case: str) -> None:
    """Metadata that breaks FORMAT.md (re-sealed, so its checksum passes) is refused when it is
    read, before any tensor: FormatError naming the file, from restore, load and verify alike."""
    path = edit_metadata(_path(ckpt, FULL), INVALID[case])
    mgr = CheckpointManager(ckpt, read_only=True)
    with pytest.raises(FormatError) as info:
        mgr.restore(FULL)
    assert str(path) in str(info.value)
    with pytest.raises(FormatError):
        mgr.load(FULL, *_live())
    report = mgr.verify(FULL)
    assert len(report[FULL]) == 1 and str(path) in report[FULL][0]


# Each typed field of a tensor, fragment and chunk, given a value of another type: what the
# parser's one test of all fields must send on to the checks that name the field.
FIELDS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str, Any]] = {
    "chunk file a bool": (lambda m: _chunks(m, "model/0.weight")[0], "file", True),
    "chunk offset negative": (lambda m: _chunks(m, "model/0.weight")[0], "offset", -1),
    "chunk length a float": (lambda m: _chunks(m, "model/0.weight")[0], "length", 4.0),
    "chunk raw_offset 2**63": (lambda m: _chunks(m, "model/0.weight")[0], "raw_offset", 2**63),
    "chunk raw_length missing": (lambda m: _chunks(m, "model/0.weight")[0], "raw_length", None),
    "chunk codec a number": (lambda m: _chunks(m, "model/0.weight")[0], "codec", 1),
    "chunk params a list": (lambda m: _chunks(m, "model/0.weight")[0], "params", []),
    "chunk xxh3 a number": (lambda m: _chunks(m, "model/0.weight")[0], "xxh3", 7),
    "chunk raw_xxh3 missing": (lambda m: _chunks(m, "model/0.weight")[0], "raw_xxh3", None),
    "fragment offsets a number": (lambda m: _tensor(m, "model/0.weight")["fragments"][0],
                                  "offsets", 0),
    "fragment sizes holding a bool": (lambda m: _tensor(m, "model/0.weight")["fragments"][0],
                                      "sizes", [True, 8]),
    "fragment chunks an object": (lambda m: _tensor(m, "model/0.weight")["fragments"][0],
                                  "chunks", {}),
    "tensor name a number": (lambda m: _tensor(m, "model/0.weight"), "name", 0),
    "tensor role missing": (lambda m: _tensor(m, "model/0.weight"), "role", None),
    "tensor dtype a list": (lambda m: _tensor(m, "model/0.weight"), "dtype", ["float32"]),
    "tensor shape negative": (lambda m: _tensor(m, "model/0.weight"), "shape", [-1, 8]),
    "tensor fqn a number": (lambda m: _tensor(m, "model/0.weight"), "fqn", 3),
    "tensor state_key a list": (lambda m: _tensor(m, "model/0.weight"), "state_key", []),
    "tensor alias_of a bool": (lambda m: _tensor(m, "model/0.weight"), "alias_of", False),
    "tensor fragments missing": (lambda m: _tensor(m, "model/0.weight"), "fragments", None),
}


@pytest.mark.parametrize("case", list(FIELDS))
def test_a_field_of_another_type_is_refused_by_name(ckpt: Path, case: str) -> None:
    """A tensor's, fragment's or chunk's field of the wrong type (a bool for an int, a number
    out of range, missing) is a FormatError naming the file, the tensor and the field."""
    node_of, key, value = FIELDS[case]

    def edit(m: dict[str, Any]) -> None:
        node = node_of(m)
        if value is None:
            del node[key]
        else:
            node[key] = value

    path = edit_metadata(_path(ckpt, FULL), edit)
    with pytest.raises(FormatError) as info:
        read_metadata(open_storage(str(ckpt)), FULL)
    message = str(info.value)
    assert str(path) in message and f"field {key!r}" in message
    assert "'model/0.weight'" in message or key == "name"


UNCHANGED_EDITS: dict[str, dict[str, Any]] = {
    "storing bytes": {"offset": 0, "length": 1},
    "with params": {"params": {"step": 1.0}},
    "of other bytes": {"raw_xxh3": "0" * 16},
}


@pytest.mark.parametrize("case", list(UNCHANGED_EDITS))
def test_damaged_unchanged_chunks_are_refused(ckpt: Path, case: str) -> None:
    """An ``unchanged`` chunk (FORMAT.md 3.5: the bytes of its base step, stored as nothing)
    that stores bytes or has params is a FormatError when its metadata is read; one whose
    checksum is not that of the bytes its base restores, a CorruptionError naming the step,
    tensor and file when restored, and a problem of the step for a deep verify."""
    name = "rng/python/1"
    assert [c["codec"] for c in _chunks(json.loads(_text(ckpt, DELTA)), name)] == ["unchanged"]
    path = edit_metadata(_path(ckpt, DELTA), lambda m: _chunks(m, name)[0].update(
        UNCHANGED_EDITS[case]))
    mgr = CheckpointManager(ckpt, read_only=True)
    if case == "of other bytes":
        with pytest.raises(CorruptionError, match=rf"step {DELTA}, tensor '{name}', file "
                           r".*: decoded bytes do not match their checksum"):
            mgr.restore(DELTA)
        assert mgr.verify(DELTA, deep=True)[DELTA]
        return
    with pytest.raises(FormatError, match="an unchanged chunk stores no bytes and has no params"
                       ) as info:
        mgr.restore(DELTA)
    assert str(path) in str(info.value) and repr(name) in str(info.value)


TORCH_STATE = 5056  # bytes of torch's CPU generator state; its 624 words from byte 24
PATCH_EDITS: dict[str, tuple[dict[str, Any], str]] = {
    "no twists": ({"twists": 0}, "patch params .* twists must be 1 to 4096"),
    "twists beyond the bound": ({"twists": 4097}, "twists must be 1 to 4096"),
    "twists a bool": ({"twists": True}, "are not {} or the integers twists, offset and word"),
    "words of 2 bytes": ({"word": 2}, "word one of"),
    "offset off its words": ({"offset": 20}, "from offset .* lie in the chunk's 5056 bytes"),
    "words beyond the chunk": ({"offset": 72}, "lie in the chunk's 5056 bytes"),
    "another key": ({"seed": 1}, "are not {} or the integers twists, offset and word"),
}


@pytest.fixture(scope="module")
def pristine_patched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 1 (full) and step 2 (a delta on it) of a model, torch's RNG state drawn from
    between them (in one chunk: the ``pristine`` one's chunks of 4 KiB split it)."""
    root = tmp_path_factory.mktemp("patched") / "ckpt"
    model = _model()
    with CheckpointManager(root) as mgr:
        for step in (FULL, DELTA):
            torch.randn(4096)
            mgr.save(step, model)
    return root


@pytest.fixture
def patched(pristine_patched: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine_patched, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _patched(m: dict[str, Any]) -> dict[str, Any]:
    """The delta's patch chunk of torch's RNG state: twisted on, as randn drew."""
    chunk = _chunks(m, "rng/torch")[0]
    assert chunk["codec"] == "patch" and chunk["raw_length"] == TORCH_STATE
    assert chunk["params"]["word"] == 8 and chunk["params"]["offset"] == 24
    return chunk


@pytest.mark.parametrize("case", list(PATCH_EDITS))
def test_patch_params_out_of_bounds_are_refused(patched: Path, case: str) -> None:
    """A ``patch`` chunk (FORMAT.md 3.6) whose params are not a bounded count of twists of 624
    aligned words inside the chunk is a FormatError naming the file and tensor when its
    metadata is read, before any twist runs."""
    update, message = PATCH_EDITS[case]
    path = edit_metadata(_path(patched, DELTA), lambda m: _patched(m)["params"].update(update))
    with pytest.raises(FormatError, match=message) as info:
        CheckpointManager(patched, read_only=True).restore(DELTA)
    assert str(path) in str(info.value) and "'rng/torch'" in str(info.value)


def test_patch_chunk_without_twists_or_bytes_is_refused(patched: Path) -> None:
    """A ``patch`` chunk with neither twists nor stored bytes would be an unchanged chunk:
    refused, as writers write none; so is one of more than 64 KiB."""
    edit_metadata(_path(patched, DELTA), lambda m: _patched(m).update(params={}, length=0))
    with pytest.raises(FormatError, match="a patch chunk with no twists stores no bytes"):
        CheckpointManager(patched, read_only=True).restore(DELTA)
    edit_metadata(_path(patched, DELTA), lambda m: _chunks(m, "rng/torch")[0].update(
        params={"twists": 1, "offset": 24, "word": 8}, raw_length=(1 << 16) + 8))
    with pytest.raises(FormatError, match="patch chunks hold at most 65536"):
        CheckpointManager(patched, read_only=True).restore(DELTA)


def test_patch_chunk_twisted_otherwise_fails_its_checksum(patched: Path) -> None:
    """A ``patch`` chunk of valid params that do not give its bytes (one twist more, re-sealed)
    is a CorruptionError naming the step, tensor and file, and a problem for a deep verify."""
    edit_metadata(_path(patched, DELTA), lambda m: _patched(m)["params"].update(
        twists=_patched(m)["params"]["twists"] + 1))
    mgr = CheckpointManager(patched, read_only=True)
    with pytest.raises(CorruptionError, match=rf"step {DELTA}, tensor 'rng/torch', file .*: "
                       "decoded bytes do not match their checksum"):
        mgr.restore(DELTA)
    assert mgr.verify(DELTA, deep=True)[DELTA]


@pytest.mark.parametrize("elem", [[], [4], 4.0, {"a": 1}], ids=["[]", "[4]", "4.0", "object"])
def test_codec_params_of_another_type_are_a_format_error(ckpt: Path, elem: Any) -> None:
    """A byteplane chunk whose element size is not an integer fails its restore with FormatError
    naming the step and tensor (the codec checks its params when it decodes)."""
    def edit(m: dict[str, Any]) -> None:
        chunk = _coded(m)
        assert chunk["codec"] == "byteplane"
        chunk["params"]["elem"] = elem

    edit_metadata(_path(ckpt, FULL), edit)
    with pytest.raises(FormatError, match=f"step {FULL}, tensor .*byteplane params"):
        CheckpointManager(ckpt, read_only=True).restore(FULL)


def test_valid_edits_still_restore(ckpt: Path) -> None:
    """The validation cases' starting point is valid: re-sealed unchanged, step 1 restores."""
    edit_metadata(_path(ckpt, FULL), lambda m: None)
    assert CheckpointManager(ckpt, read_only=True).restore(FULL).extra["epoch"] == FULL


def test_delta_holding_other_tensors_than_its_base(ckpt: Path) -> None:
    """A delta whose tensors differ from its base step's (here a role) cannot be restored: the
    error names both steps, before anything is decoded."""
    edit_metadata(_path(ckpt, DELTA), lambda m: _tensor(m, "model/1.bias").update(role="buffer"))
    with pytest.raises(CorruptionError, match=f"step {DELTA} is a delta on step {FULL}, which "
                                              "holds other tensors"):
        CheckpointManager(ckpt, read_only=True).restore(DELTA)


def test_metadata_larger_than_the_bound_is_not_read(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A metadata file larger than readers accept is refused by its size, before it is read
    (the bound lowered to the file's size minus one)."""
    size = _path(ckpt, FULL).stat().st_size
    monkeypatch.setattr(reader_module, "MAX_METADATA_BYTES", size - 1)
    monkeypatch.setattr(storage_module.LocalStorage, "read_bytes", _no_read)
    with pytest.raises(FormatError, match=f"{size} bytes, more than metadata may take"):
        read_metadata(open_storage(ckpt), FULL)


def _no_read(*args: Any) -> bytes:
    raise AssertionError("the metadata file was read")


@pytest.mark.parametrize("step", [None, 10**400], ids=["missing", "401 digits"])
def test_optimizer_state_torch_refuses_is_a_state_mismatch(ckpt: Path, step: int | None) -> None:
    """Optimizer state that passes validation but that torch's AdamW refuses (a parameter's state
    without ``step``, or with a step of 401 digits) raises StateMismatchError from load, before
    the model changes; restore still gives it."""
    def edit(m: dict[str, Any]) -> None:
        state = m["state"]["optimizer"]["state"]["1.weight"]
        if step is None:
            del state["step"]
        else:
            state["step"] = step

    edit_metadata(_path(ckpt, FULL), edit)
    mgr = CheckpointManager(ckpt, read_only=True)
    assert mgr.restore(FULL).optimizer["state"]["1.weight"].get("step") == step
    model, optimizer = _live()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError, match="optimizer state does not load into AdamW"):
        mgr.load(FULL, model, optimizer)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_rng_state_torch_refuses_is_a_state_mismatch(ckpt: Path) -> None:
    """A torch RNG state of the right type but a length torch refuses raises StateMismatchError
    from load, and the process's RNG is as it was."""
    edit_metadata(_path(ckpt, FULL), _set((*RNG, "torch"), {"$tensor": "extra/codes"}))
    before = torch.get_rng_state()
    with pytest.raises(StateMismatchError, match="RNG states cannot be restored"):
        CheckpointManager(ckpt, read_only=True).load(FULL, *_live())
    assert torch.equal(torch.get_rng_state(), before)


def test_state_nesting_bound_on_save(tmp_path: Path) -> None:
    """A value nesting 64 levels once encoded (``extra``'s dict and 63 lists) saves and restores;
    one more level is refused at save with TypeError naming where, and nothing is written."""
    deep: Any = 1
    for _ in range(63):
        deep = [deep]
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, extra={"deep": deep}, rng=False)
        assert mgr.restore(1).extra["deep"] == deep
        with pytest.raises(TypeError, match=r"extra\['deep'\].*nested deeper than 64 levels"):
            mgr.save(2, extra={"deep": [deep]}, rng=False)
        assert mgr.steps() == [1]


def test_metadata_that_compresses_too_well_is_stored_as_text(tmp_path: Path) -> None:
    """A delta whose metadata text is more than 64 times its zstd frame (an ``extra`` of 200000
    zeros) is stored as plain text, which readers accept; an ordinary delta's is compressed."""
    model = nn.Linear(64, 64)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, model, rng=False)
        mgr.save(2, model, rng=False)
        mgr.save(3, model, rng=False, extra={"zeros": [0] * 200_000})
        assert [mgr.metadata(s).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
        assert mgr.restore(3).extra == {"zeros": [0] * 200_000}
    assert _path(tmp_path / "ckpt", 2).read_bytes()[:4] == ZSTD_MAGIC
    assert _path(tmp_path / "ckpt", 3).read_bytes()[:1] == b"{"


def test_delta_metadata_is_compressed_at_its_own_level(tmp_path: Path) -> None:
    """A delta's metadata frame is its text at ``METADATA_LEVEL``, smaller than the level of
    the data's frames would make it."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(8)))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, model, rng=False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        mgr.save(2, model, rng=False)
    frame = _path(tmp_path / "ckpt", 2).read_bytes()
    text = zstandard.ZstdDecompressor().decompress(frame)
    at = {level: len(zstandard.ZstdCompressor(level=level).compress(text))
          for level in (ZSTD_LEVEL, METADATA_LEVEL)}
    assert len(frame) == at[METADATA_LEVEL] < at[ZSTD_LEVEL]


def test_seal_json_appends_the_checksum() -> None:
    """``seal_json`` is what writers and these tests seal with: the object gains one last member."""
    sealed = seal_json('{"a":1}')
    assert json.loads(sealed) == {"a": 1, "xxh3": xxhash.xxh3_64_hexdigest(b'{"a":1,')}
