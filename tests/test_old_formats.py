"""Checkpoints written by earlier format versions restore bit for bit as they did then.

Each ``tests/fixtures/format-<version>/`` holds a small full + delta chain written by the
deltackpt of that version (``tests/fixtures/make_fixture.py``) and the xxh3-64 of every tensor
each step restored to at the time. A new version must read them unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import edit_metadata, step_dir

from deltackpt import CheckpointManager
from deltackpt.errors import FormatError

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("format-*"))


def _hash(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.name for p in FIXTURES])
def test_old_format_restores_bit_for_bit(fixture: Path, tmp_path: Path) -> None:
    """Every step of the old chain restores to the very bytes recorded when it was written."""
    expected = json.loads((fixture / "expected.json").read_text())
    shutil.copytree(fixture / "ckpt", tmp_path / "ckpt")  # read-only in CI: readers need no writes
    with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
        assert [str(s) for s in mgr.steps()] == sorted(expected, key=int)
        problems = mgr.verify(deep=True)
        assert not any(problems.values()), f"{fixture.name}: {problems}"
        for step, hashes in expected.items():
            ckpt = mgr.restore(int(step))
            got = {f"model/{k}": _hash(v) for k, v in ckpt.model.items()}
            got.update({f"optimizer/{fqn}/{key}": _hash(v) for fqn, state in
                        ckpt.optimizer["state"].items() for key, v in state.items()
                        if isinstance(v, torch.Tensor)})
            got.update({f"extra/{i}/momentum_buffer": _hash(s["momentum_buffer"])
                        for i, s in ckpt.extra["sgd"]["state"].items()})
            if "rng/torch" in hashes:  # recorded since 2.7
                got["rng/torch"] = _hash(ckpt.rng["torch"])
                got["rng/python/1"] = _hash(torch.tensor(ckpt.rng["python"][1], dtype=torch.int64))
            assert got == hashes, f"{fixture.name}, step {step}: restored tensors differ"


def test_fixtures_exist() -> None:
    """The old-format fixtures are in the tree (a missing directory would skip every check)."""
    assert {"format-1.4", "format-1.6", "format-1.7", "format-1.8", "format-2.0", "format-2.1",
            "format-2.2", "format-2.3", "format-2.4", "format-2.5", "format-2.6", "format-2.7",
            "format-2.8", "format-2.9"} <= {p.name for p in FIXTURES}


@pytest.mark.parametrize(("fixture", "key", "older"), [("format-2.2", "dither_signs", "2.1"),
                                                       ("format-2.3", "floor_log2", "2.2"),
                                                       ("format-2.4", "zeros", "2.3"),
                                                       ("format-2.5", "dither_groups", "2.4"),
                                                       ("format-2.8", "bit_planes", "2.7"),
                                                       ("format-2.9", "rans_bins", "2.8")])
def test_newer_params_are_refused_in_older_metadata(fixture: str, key: str, older: str,
                                                    tmp_path: Path) -> None:
    """A quant chunk with a param of a later version (2.2's ``dither_signs``: its signs folded by
    its dither; 2.3's ``floor_log2``: its scaled steps shaped; 2.4's ``zeros``: elements
    restored as zero; 2.5's ``dither_groups``: its symbols grouped by its dither; 2.8's
    ``bit_planes``: its symbols stored as bit planes; 2.9's ``rans_bins``: its planes coded by
    rANS) in a step that says it is of an earlier
    format: refused when read, naming the tensor and both versions, rather than decoded with
    the wrong signs, steps, zeros, order or layout."""
    shutil.copytree(Path(__file__).parent / "fixtures" / fixture / "ckpt", tmp_path / "ckpt")
    edit_metadata(step_dir(tmp_path / "ckpt", 2) / "metadata.json",
                  lambda obj: obj.update(format_version=older))
    since = re.escape(fixture.removeprefix("format-"))
    with pytest.raises(FormatError, match=rf"step-000000000002/metadata\.json: tensor '[^']+': a "
                       rf"chunk's '{key}' is of format {since}, this step's format_version "
                       rf"is {re.escape(older)}"):
        CheckpointManager(tmp_path / "ckpt", read_only=True).restore(2)


@pytest.mark.parametrize(("fixture", "codec", "older"), [("format-2.6", "unchanged", "2.5"),
                                                         ("format-2.7", "patch", "2.6")])
def test_newer_codecs_are_refused_in_older_metadata(fixture: str, codec: str, older: str,
                                                    tmp_path: Path) -> None:
    """A chunk of a codec of a later version (2.6's ``unchanged``: bytes of the base step,
    stored as nothing; 2.7's ``patch``: those bytes twisted and patched) in a step that says it
    is of an earlier format: refused when read, naming the tensor and both versions."""
    shutil.copytree(Path(__file__).parent / "fixtures" / fixture / "ckpt", tmp_path / "ckpt")
    edit_metadata(step_dir(tmp_path / "ckpt", 2) / "metadata.json",
                  lambda obj: obj.update(format_version=older))
    since = re.escape(fixture.removeprefix("format-"))
    with pytest.raises(FormatError, match=rf"step-000000000002/metadata\.json: tensor '[^']+': a "
                       rf"chunk of codec '{codec}' is of format {since}, this step's "
                       rf"format_version is {re.escape(older)}"):
        CheckpointManager(tmp_path / "ckpt", read_only=True).restore(2)
