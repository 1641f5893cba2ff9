"""Fuzzed metadata: every outcome is a DeltackptError or a correct restore, within bounded memory.

The cases come from ``tests/metadata_fuzz.py`` (seeded, so a failure reproduces): damage the
checksum must catch, and mutations re-sealed with a new checksum that validation must catch
(FORMAT.md 2). Each case is read under a 1 GiB cap on this process's address space, so an
allocation on the word of a hostile number fails the test instead of exhausting the machine.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from metadata_fuzz import Mutator, audit, fresh_objects, memory_limit, prepared, run_case

CASES = 400


def test_fuzzed_metadata_is_refused_or_restored_exactly(tmp_path: Path) -> None:
    """Damaged metadata (its checksum unchanged) raises a DeltackptError or restores exactly what
    was saved; re-sealed mutations raise a DeltackptError or restore without any other exception.
    Both paths run: the checksum catches damage, validation catches re-sealed mutations."""
    results = audit(tmp_path / "ckpt", CASES, seed=15)
    crashes = [(case.kind, case.step, outcome.detail) for case, outcome in results
               if outcome.result == "crash"]
    assert not crashes, f"{len(crashes)} of {CASES} cases raised other exceptions: {crashes[:10]}"
    silent = [(case.kind, case.step) for case, outcome in results
              if not case.sealed and outcome.result == "changed"]
    assert not silent, f"damage restored changed values without an error: {silent}"
    counts = collections.Counter((case.sealed, outcome.result) for case, outcome in results)
    checksum = sum(not case.sealed and "checksum" in outcome.detail for case, outcome in results)
    validated = sum(case.sealed and outcome.result == "error" and "checksum" not in outcome.detail
                    for case, outcome in results)
    assert checksum > 50 and validated > 50, counts
    assert counts[True, "changed"] + counts[True, "equal"] > 20, counts  # valid mutations restore


@pytest.mark.parametrize("step", [1, 2])
def test_audit_cases_are_refused_before_allocating(tmp_path: Path, step: int) -> None:
    """The audit's crashes and exhaustions, re-sealed, in a full step (1) and a delta (2): a chunk
    of 10**12 bytes, a tensor of 10**9 elements (also with a chunk and data file said to hold
    them), integers beyond int64 and of 5000 digits, nesting 100000 and 70 levels deep, NaN, a zstd
    frame inflating to twice the metadata bound: each a DeltackptError, under a 1 GiB cap."""
    originals, expected = prepared(tmp_path / "ckpt")
    objects = fresh_objects()
    cases = [c for c in Mutator(originals, seed=0).targeted() if c.step == step]
    assert len(cases) >= 9
    with memory_limit(1 << 30):
        outcomes = {case.kind: run_case(tmp_path / "ckpt", case, expected, objects) for case in cases}
    assert all(o.result == "error" for o in outcomes.values()), outcomes
