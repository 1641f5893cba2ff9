"""Errors: missing steps, overwrites, mismatched state, foreign or newer formats, bad metadata, locks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_same_value,
    assert_state_dicts_equal,
    edit_metadata,
    files_under,
    step_dir,
)
from torch import nn

from deltackpt import (
    CheckpointManager,
    CorruptionError,
    DeltackptError,
    FormatError,
    NotACheckpointError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    WriterLockedError,
)
from deltackpt.format.metadata import FORMAT_VERSION


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def mgr(ckpt_dir: Path) -> Iterator[CheckpointManager]:
    # lossless: every step full and independent (deltas: test_delta_base_cannot_be_overwritten)
    manager = CheckpointManager(ckpt_dir, compression="lossless", chunk_bytes=4096)
    yield manager
    manager.close()


def _metadata_path(root: Path, step: int) -> Path:
    return step_dir(root, step) / "metadata.json"


def _edit_metadata(root: Path, step: int, edit: Callable[[dict[str, Any]], None]) -> Path:
    return edit_metadata(_metadata_path(root, step), edit)


# -- steps --------------------------------------------------------------------------------------------

def test_step_not_found_lists_available_steps(mgr: CheckpointManager) -> None:
    """Restoring, loading, reading or verifying a missing step raises StepNotFoundError listing the
    steps there are."""
    with pytest.raises(StepNotFoundError, match="no committed steps"):
        mgr.restore()
    for step in (0, 20, 3):
        mgr.save(step, extra={"s": step}, rng=False)
    for call in (lambda: mgr.restore(5), lambda: mgr.load(5), lambda: mgr.metadata(5), lambda: mgr.info(5)):
        with pytest.raises(StepNotFoundError) as info:
            call()
        message = str(info.value)
        assert "step 5" in message and "available steps: 0, 3, 20" in message
        assert isinstance(info.value, KeyError) and isinstance(info.value, DeltackptError)
    with pytest.raises(StepNotFoundError, match="available steps: 0, 3, 20"):
        mgr.verify(5)


def test_existing_step_needs_overwrite(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """Saving an existing step raises StepExistsError; overwrite=True replaces it, keeping the old
    data only for readers (named by a retired record: FORMAT.md 1.4)."""
    mgr.save(4, extra={"v": torch.full((3000,), 1.0)}, rng=False)
    old_meta = mgr.metadata(4)
    old_files = sorted(p.name for p in step_dir(ckpt_dir, 4).iterdir())
    with pytest.raises(StepExistsError, match="step 4"):
        mgr.save(4, extra={"v": torch.full((3000,), 2.0)}, rng=False)
    assert sorted(p.name for p in step_dir(ckpt_dir, 4).iterdir()) == old_files
    assert_bitwise_equal(mgr.restore(4).extra["v"], torch.full((3000,), 1.0))

    mgr.save(4, extra={"v": torch.full((3000,), 2.0), "new": True}, rng=False, overwrite=True)
    new_meta = mgr.metadata(4)
    assert new_meta.save_id != old_meta.save_id
    names = {p.name for p in step_dir(ckpt_dir, 4).iterdir()}
    old_data = {f.name for f in old_meta.files}
    assert names == {"metadata.json", *(f.name for f in new_meta.files)} | old_data
    retired = [json.loads(p.read_text())["files"] for p in ckpt_dir.glob("retired-*.json")]
    assert retired == [sorted(f"{step_dir(ckpt_dir, 4).name}/{n}" for n in old_data)]
    assert all(f.name.startswith(f"d-{new_meta.save_id}-") for f in new_meta.files)
    extra = mgr.restore(4).extra
    assert extra["new"] is True
    assert_bitwise_equal(extra["v"], torch.full((3000,), 2.0))
    assert mgr.steps() == [4]


def test_delta_base_cannot_be_overwritten(ckpt_dir: Path) -> None:
    """Overwriting a step that a delta step is coded against raises StepExistsError naming the delta and
    changes neither step; once no delta depends on it, the step can be overwritten."""
    with CheckpointManager(ckpt_dir, chunk_bytes=4096) as mgr:  # default: deltas between full steps
        mgr.save(1, extra={"v": torch.full((3000,), 1.0)}, rng=False)
        mgr.save(2, extra={"v": torch.full((3000,), 2.0)}, rng=False)
        assert (mgr.metadata(2).kind, mgr.metadata(2).base_step) == ("delta", 1)
        assert mgr.dependents(1) == [2]
        before = files_under(ckpt_dir)
        with pytest.raises(StepExistsError, match=r"step 1 .*\[2\]"):
            mgr.save(1, extra={"v": torch.full((3000,), 3.0)}, rng=False, overwrite=True)
        assert files_under(ckpt_dir) == before
        assert_bitwise_equal(mgr.restore(1).extra["v"], torch.full((3000,), 1.0))
        assert_bitwise_equal(mgr.restore(2).extra["v"], torch.full((3000,), 2.0))
    with CheckpointManager(ckpt_dir, compression="lossless", chunk_bytes=4096) as mgr:
        mgr.save(2, extra={"v": torch.full((3000,), 4.0)}, rng=False, overwrite=True)  # now a full step
        assert mgr.dependents(1) == []
        mgr.save(1, extra={"v": torch.full((3000,), 3.0)}, rng=False, overwrite=True)
        assert_bitwise_equal(mgr.restore(1).extra["v"], torch.full((3000,), 3.0))
        assert_bitwise_equal(mgr.restore(2).extra["v"], torch.full((3000,), 4.0))


@pytest.mark.parametrize("step", [-1, -100, 1.0, 2.5, "3", None, True, False])
def test_invalid_step_numbers(mgr: CheckpointManager, ckpt_dir: Path, step: Any) -> None:
    """Negative or non-int steps raise ValueError everywhere, and save writes nothing."""
    before = files_under(ckpt_dir)
    with pytest.raises(ValueError, match="step"):
        mgr.save(step, extra={"x": 1}, rng=False)
    assert files_under(ckpt_dir) == before
    calls = [mgr.restore, mgr.load, mgr.metadata, mgr.info] if step is not None else [mgr.metadata]
    for call in calls:
        with pytest.raises(ValueError, match="step"):
            call(step)


@pytest.mark.parametrize("step", [np.int64(7), torch.tensor(7)], ids=["numpy", "tensor"])
def test_integer_like_steps_are_accepted(mgr: CheckpointManager, step: Any) -> None:
    """A step held in a numpy integer or a 0-d integer tensor (as training loops often have) is an int."""
    info = mgr.save(step, extra={"x": 1}, rng=False)
    assert info.step == 7 and type(info.step) is int
    assert mgr.steps() == [7] and mgr.restore(step).extra == {"x": 1}


def test_manager_arguments_are_checked(ckpt_dir: Path) -> None:
    """full_every must be a positive int and chunk_bytes at least 1024."""
    with pytest.raises(ValueError, match="full_every"):
        CheckpointManager(ckpt_dir, full_every=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        CheckpointManager(ckpt_dir, chunk_bytes=100)


def test_optimizer_needs_its_model(mgr: CheckpointManager) -> None:
    """Saving an optimizer without its model, or one with foreign parameters, raises ValueError."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="model"):
        mgr.save(0, optimizer=opt)
    foreign = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0, parameter 2 \(shape \(3,\)\)"):
        mgr.save(0, model=model, optimizer=foreign)
    assert mgr.steps() == []


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_names_the_tensor(mgr: CheckpointManager) -> None:
    """A tensor dtype the format cannot store raises TypeError naming the tensor; no step appears."""
    model = nn.Module()
    model.register_buffer("half_complex", torch.zeros(3, dtype=torch.complex32))
    with pytest.raises(TypeError, match="model/half_complex"):
        mgr.save(0, model=model, rng=False)
    assert mgr.steps() == []


# -- strict and partial loads ---------------------------------------------------------------------------

class Saved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keep = nn.Linear(4, 3)
        self.shape = nn.Parameter(torch.randn(2, 3))
        self.dtype = nn.Parameter(torch.randn(2, 2))
        self.gone = nn.Parameter(torch.randn(1, 1))


class Target(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keep = nn.Linear(4, 3)
        self.shape = nn.Parameter(torch.randn(5, 3))
        self.dtype = nn.Parameter(torch.randn(2, 2, dtype=torch.float64))
        self.new = nn.Parameter(torch.randn(2, 1))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    sum((p.double() ** 2).sum() for p in model.parameters()).backward()
    opt.step()


def _saved_and_target(mgr: CheckpointManager) -> tuple[Saved, Target, torch.optim.Optimizer]:
    torch.manual_seed(0)
    saved = Saved()
    saved_opt = torch.optim.Adam(saved.parameters(), lr=0.1)
    _step(saved, saved_opt)
    mgr.save(1, model=saved, optimizer=saved_opt)
    target = Target()
    target_opt = torch.optim.Adam(target.parameters(), lr=0.5)
    _step(target, target_opt)
    return saved, target, target_opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    sd = opt.state_dict()
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
             "param_groups": [dict(g) for g in sd["param_groups"]]})


EXPECTED_MISMATCHED = ["shape: checkpoint float32[2, 3], model float32[5, 3]",
                       "dtype: checkpoint float32[2, 2], model float64[2, 2]"]


def test_strict_load_lists_every_problem_and_changes_nothing(mgr: CheckpointManager) -> None:
    """Missing, unexpected, shape- and dtype-mismatched names all appear in one StateMismatchError, and
    the model, the optimizer and the RNG are left exactly as they were."""
    _, target, target_opt = _saved_and_target(mgr)
    model_before, opt_before = _snapshot(target, target_opt)
    rng_before = torch.get_rng_state()
    for load in (lambda: mgr.load(1, model=target, optimizer=target_opt),
                 lambda: mgr.restore(1).load_into(target, target_opt)):
        with pytest.raises(StateMismatchError) as info:
            load()
        message = str(info.value)
        for item in ["new", "gone", *EXPECTED_MISMATCHED, "new: parameter not in the saved optimizer",
                     "gone: in the saved optimizer, not in this one"]:
            assert item in message, (item, message)
        assert_state_dicts_equal(target.state_dict(), model_before, "model after refused load")
        _, opt_after = _snapshot(target, target_opt)
        assert_same_value(opt_after, opt_before, "optimizer after refused load")
        assert torch.equal(torch.get_rng_state(), rng_before)


def test_non_strict_load_loads_the_intersection(mgr: CheckpointManager) -> None:
    """strict=False loads what matches, warns about the rest, and load_into reports it precisely."""
    saved, target, target_opt = _saved_and_target(mgr)
    model_before, _ = _snapshot(target, target_opt)
    with pytest.warns(UserWarning, match="loaded partially") as record:
        mgr.load(1, model=target, optimizer=target_opt, strict=False)
    warning = str(record[0].message)
    assert "new" in warning and "gone" in warning and "shape: checkpoint" in warning
    for name in ("keep.weight", "keep.bias"):
        assert_bitwise_equal(target.state_dict()[name], saved.state_dict()[name], name)
    for name in ("shape", "dtype", "new"):
        assert_bitwise_equal(target.state_dict()[name], model_before[name], name)

    target2 = Target()
    target2_opt = torch.optim.Adam(target2.parameters(), lr=0.5)
    report = mgr.restore(1).load_into(target2, target2_opt, strict=False, rng=False)
    assert report.missing == ["new"]
    assert report.unexpected == ["gone"]
    assert report.mismatched == EXPECTED_MISMATCHED
    assert sorted(report.optimizer) == sorted([
        "shape: saved for shape [2, 3], parameter is [5, 3]",
        "new: parameter not in the saved optimizer",
        "gone: in the saved optimizer, not in this one"])
    assert not report.ok
    assert "missing from the checkpoint (1):" in report.describe()
    # optimizer state was loaded for the parameters that match by name and shape
    params = dict(target2.named_parameters())
    saved_state = {n: target_opt.state[p] for n, p in target.named_parameters()}
    assert set(target2_opt.state) == {params["keep.weight"], params["keep.bias"], params["dtype"]}
    assert_bitwise_equal(target2_opt.state[params["keep.weight"]]["exp_avg"],
                         saved_state["keep.weight"]["exp_avg"])
    assert target2_opt.state[params["dtype"]]["exp_avg"].dtype == torch.float64
    assert target2_opt.param_groups[0]["lr"] == 0.1


def test_load_without_saved_optimizer_is_reported(mgr: CheckpointManager) -> None:
    """Loading an optimizer from a step saved without one fails strictly and is reported otherwise."""
    model = nn.Linear(3, 3)
    mgr.save(0, model=model, rng=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(StateMismatchError, match="no optimizer state"):
        mgr.load(0, model=model, optimizer=opt)
    report = mgr.restore(0).load_into(model, opt, strict=False)
    assert report.optimizer == ["the checkpoint has no optimizer state"]
    assert report.missing == report.unexpected == report.mismatched == []


# -- versions and foreign directories ---------------------------------------------------------------

def test_newer_major_metadata_is_refused(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A step whose metadata says format_version 3.0 is refused, naming both versions and the file."""
    mgr.save(1, extra={"a": 1}, rng=False)
    mgr.save(2, extra={"a": 2}, rng=False)
    path = _edit_metadata(ckpt_dir, 1, lambda m: m.update(format_version="3.0"))
    reader = CheckpointManager(ckpt_dir, read_only=True)
    for manager in (mgr, reader):
        with pytest.raises(FormatError) as info:
            manager.restore(1)
        message = str(info.value)
        assert "3.0" in message and FORMAT_VERSION in message and str(path) in message
        assert manager.restore(2).extra == {"a": 2}


def test_newer_minor_metadata_with_unknown_keys_is_read(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """Format 1.9 metadata with unknown keys (at every level) is read: minor versions only add things."""
    mgr.save(1, extra={"t": torch.arange(2000.0)}, rng=False)

    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = "1.9"
        m["future_key"] = {"anything": [1, 2]}
        m["files"][0]["future"] = 1
        for tensor in m["tensors"]:
            tensor["future"] = "x"
            for fragment in tensor["fragments"]:
                fragment["future"] = None
                for chunk in fragment["chunks"]:
                    chunk["future"] = 3.5

    _edit_metadata(ckpt_dir, 1, edit)
    assert_bitwise_equal(mgr.restore(1).extra["t"], torch.arange(2000.0))
    assert mgr.verify() == {1: []}


def test_newer_minor_metadata_with_a_new_role_is_read(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """FORMAT.md 4: minor versions may add roles; a 1.x reader still restores the step."""
    mgr.save(1, extra={"t": torch.arange(10.0)}, rng=False)

    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = "1.9"
        m["tensors"][0]["role"] = "activation_statistics"

    _edit_metadata(ckpt_dir, 1, edit)
    ckpt = mgr.restore(1)
    assert_bitwise_equal(ckpt.tensors["extra/t"], torch.arange(10.0))


def test_unknown_codec_names_codec_step_tensor_and_file(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A chunk coded with a codec this version does not know fails with FormatError naming it."""
    mgr.save(1, extra={"t": torch.zeros(5000)}, rng=False)
    meta = mgr.metadata(1)

    def edit(m: dict[str, Any]) -> None:
        m["format_version"] = "1.9"
        m["tensors"][0]["fragments"][0]["chunks"][0]["codec"] = "hyperzip"

    _edit_metadata(ckpt_dir, 1, edit)
    with pytest.raises(FormatError) as info:
        mgr.restore(1)
    message = str(info.value)
    assert "hyperzip" in message and "step 1" in message and "'extra/t'" in message
    assert meta.files[meta.tensors[0].fragments[0].chunks[0].file].name in message


def test_newer_major_root_marker_is_refused(ckpt_dir: Path) -> None:
    """A directory whose deltackpt.json has a newer major version is refused for reading and writing."""
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, rng=False, extra={"a": 1})
    marker = ckpt_dir / "deltackpt.json"
    marker.write_text(json.dumps({"format": "deltackpt", "format_version": "3.2"}))
    before = files_under(ckpt_dir)
    for read_only in (False, True):
        with pytest.raises(FormatError) as info:
            CheckpointManager(ckpt_dir, read_only=read_only)
        assert "3.2" in str(info.value) and FORMAT_VERSION in str(info.value)
    assert files_under(ckpt_dir) == before


def test_foreign_root_marker_is_refused(ckpt_dir: Path) -> None:
    """A deltackpt.json that is not JSON or not ours makes the directory not a checkpoint."""
    ckpt_dir.mkdir()
    marker = ckpt_dir / "deltackpt.json"
    for text in ("not json", json.dumps({"format": "other", "format_version": "1.0"}), "[1]"):
        marker.write_text(text)
        with pytest.raises(NotACheckpointError, match=r"deltackpt\.json"):
            CheckpointManager(ckpt_dir)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    """A path that is a regular file raises NotACheckpointError and the file is untouched."""
    path = tmp_path / "file.bin"
    path.write_bytes(b"data")
    for read_only in (False, True):
        with pytest.raises(NotACheckpointError, match="file"):
            CheckpointManager(path, read_only=read_only)
    assert path.read_bytes() == b"data"
    assert files_under(tmp_path) == {"file.bin"}


def test_non_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    """A non-empty directory without deltackpt.json is refused and nothing is written into it."""
    path = tmp_path / "data"
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    before = files_under(path)
    with pytest.raises(NotACheckpointError, match="refusing to write"):
        CheckpointManager(path)
    with pytest.raises(NotACheckpointError):
        CheckpointManager(path, read_only=True)
    assert files_under(path) == before


def test_empty_directory_becomes_a_checkpoint(tmp_path: Path) -> None:
    """An existing empty directory is adopted: it gets the root marker of FORMAT.md 1."""
    path = tmp_path / "empty"
    path.mkdir()
    with CheckpointManager(path) as mgr:
        assert mgr.steps() == []
    assert json.loads((path / "deltackpt.json").read_text()) == {"format": "deltackpt",
                                                                  "format_version": FORMAT_VERSION}


def test_file_url_and_unknown_scheme(tmp_path: Path) -> None:
    """A file:// URL is the same directory as its path; an unknown URL scheme raises StorageError
    listing the schemes available."""
    path = tmp_path / "ckpt"
    with CheckpointManager(f"file://{path}") as mgr:
        mgr.save(1, extra={"a": 1}, rng=False)
    assert CheckpointManager(path, read_only=True).restore(1).extra == {"a": 1}
    with pytest.raises(StorageError, match="unknown storage scheme 'nosuch'; available: local paths"):
        CheckpointManager("nosuch://bucket/ckpt")


def test_read_only_on_missing_path(tmp_path: Path) -> None:
    """A read_only manager on a path that does not exist raises NotACheckpointError and creates nothing."""
    with pytest.raises(NotACheckpointError, match="does not exist"):
        CheckpointManager(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()


def test_read_only_manager_cannot_save(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """A read_only manager refuses to save."""
    mgr.save(0, rng=False)
    reader = CheckpointManager(ckpt_dir, read_only=True)
    with pytest.raises(PermissionError):
        reader.save(1, rng=False)
    assert reader.steps() == [0]


# -- invalid metadata -------------------------------------------------------------------------------

def _first_chunked(m: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in m["tensors"] if t["fragments"] and t["fragments"][0]["chunks"])


def _set_box(m: dict[str, Any]) -> None:
    _first_chunked(m)["fragments"][0]["offsets"] = [1]


def _bad_file_name(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["files"][0]["name"] = name
    return edit


INVALID_METADATA: dict[str, Callable[[dict[str, Any]], None]] = {
    "box exceeds shape": _set_box,
    "fragment larger than shape": lambda m: _first_chunked(m)["fragments"][0].update(sizes=[10**6]),
    "fragment rank": lambda m: _first_chunked(m)["fragments"][0].update(offsets=[0, 0], sizes=[1, 1]),
    "parent data file": _bad_file_name("../d-00-r00000-000.bin"),
    "absolute data file": _bad_file_name("/etc/passwd"),
    "nested data file": _bad_file_name("d-00-r00000-000.bin/../../x.bin"),
    "data file pattern": _bad_file_name("data.bin"),
    "file index": lambda m: _first_chunked(m)["fragments"][0]["chunks"][0].update(file=5),
    "chunks do not tile": lambda m: _first_chunked(m)["fragments"][0]["chunks"][1].update(raw_offset=0),
    "missing chunk": lambda m: _first_chunked(m)["fragments"][0]["chunks"].pop(),
    "negative offset": lambda m: _first_chunked(m)["fragments"][0]["chunks"][0].update(offset=-1),
    "bad checksum text": lambda m: _first_chunked(m)["fragments"][0]["chunks"][0].update(xxh3="XYZ"),
    "unknown dtype": lambda m: _first_chunked(m).update(dtype="float128"),
    "alias of unknown": lambda m: m["tensors"][0].update(alias_of="model/nothing", fragments=[]),
    "alias with fragments": lambda m: _first_chunked(m).update(alias_of=m["tensors"][-1]["name"]),
    "duplicate names": lambda m: m["tensors"].append(m["tensors"][0]),
    "bool step": lambda m: m.update(step=True),
    "string size": lambda m: m["files"][0].update(size="12"),
    "missing tensors": lambda m: m.pop("tensors"),
    "delta without base": lambda m: m.update(kind="delta"),
    "full with base": lambda m: m.update(base_step=0),
    "unknown kind": lambda m: m.update(kind="sparse"),
    "not ours": lambda m: m.update(format="safetensors"),
    "bad version": lambda m: m.update(format_version="one"),
    "state not an object": lambda m: m.update(state=[1]),
}


@pytest.mark.parametrize("case", list(INVALID_METADATA))
def test_invalid_metadata_is_a_format_error_naming_the_file(mgr: CheckpointManager, ckpt_dir: Path,
                                                            case: str) -> None:
    """Metadata that breaks FORMAT.md raises FormatError naming the metadata file; verify reports it."""
    mgr.save(1, extra={"t": torch.arange(3000.0), "u": torch.ones(2)}, rng=False)
    mgr.save(2, extra={"t": torch.zeros(3)}, rng=False)
    path = _edit_metadata(ckpt_dir, 1, INVALID_METADATA[case])
    with pytest.raises(FormatError) as info:
        mgr.restore(1)
    assert str(path) in str(info.value)
    report = mgr.verify()
    assert report[2] == [] and len(report[1]) == 1 and str(path) in report[1][0]
    assert_bitwise_equal(mgr.restore(2).extra["t"], torch.zeros(3))


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b"\xff\xfe", b"null", b'{"format": "deltackpt"}'])
def test_unparseable_metadata_is_a_format_error(mgr: CheckpointManager, ckpt_dir: Path, text: bytes) -> None:
    """Empty, truncated, non-object or non-UTF-8 metadata.json raises FormatError naming the file."""
    mgr.save(1, rng=False)
    path = _metadata_path(ckpt_dir, 1)
    path.write_bytes(text)
    with pytest.raises(FormatError, match=re.escape(str(path))):
        mgr.restore(1)


def test_metadata_of_another_step(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """metadata.json recording another step than its directory's is reported as corruption."""
    mgr.save(1, rng=False)
    path = _edit_metadata(ckpt_dir, 1, lambda m: m.update(step=9))
    with pytest.raises(CorruptionError, match=re.escape(str(path))):
        mgr.restore(1)


# -- writer lock --------------------------------------------------------------------------------------

def test_second_writer_is_locked_out_until_close(ckpt_dir: Path) -> None:
    """While one manager writes, another cannot save but can list, restore and verify; after close it can."""
    first = CheckpointManager(ckpt_dir)
    first.save(0, extra={"by": "first"}, rng=False)
    second = CheckpointManager(ckpt_dir)
    with pytest.raises(WriterLockedError, match="another"):
        second.save(1, extra={"by": "second"}, rng=False)
    assert second.steps() == [0]
    assert second.restore(0).extra == {"by": "first"}
    assert second.verify() == {0: []}
    assert second.verify(deep=True) == {0: []}
    first.save(1, extra={"by": "first"}, rng=False)  # the holder keeps writing
    assert second.steps() == [0, 1]

    first.close()
    second.save(2, extra={"by": "second"}, rng=False)
    with pytest.raises(WriterLockedError):
        first.save(3, rng=False)
    second.close()
    with CheckpointManager(ckpt_dir) as third:
        third.save(3, extra={"by": "third"}, rng=False)
        assert third.steps() == [0, 1, 2, 3]
        assert [third.restore(s).extra["by"] for s in third.steps()] == ["first", "first", "second", "third"]
