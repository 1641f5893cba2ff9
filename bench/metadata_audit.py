"""Reruns the fault audit's figures on damaged and hostile checkpoints (issue 15, items 10 and 11).

    python bench/metadata_audit.py [--flips 500] [--cases 1100] [--seed 0]

On the checkpoint of ``tests/metadata_fuzz.py`` (a full step and two deltas: model with a tied
weight, AdamW, RNG states, an ``extra`` of every tag), it reports:

* **flips in data files**: one random bit flipped at a time in a data file; detected when
  ``verify`` reports damage or a restore of some step raises a ``DeltackptError``, silent when
  a restore returns other values without either, a crash when another exception escapes;
* **flips in metadata files**: the same in the ``metadata.json`` files; a flip that changes
  nothing a reader sees (a restore equal to the original, ``verify`` clean: possible inside a
  delta's zstd frame) is counted apart as harmless;
* **fuzzed manifests**: seeded mutations of one ``metadata.json`` at a time (``Mutator.cases``:
  byte damage, JSON-aware damage, JSON mutations re-sealed with a new checksum, zstd bombs) and
  the audit's targeted cases, each read as a user would (open, verify, restore, read the
  optimizer, ``extra`` and RNG, load into a model and optimizer, ``deltackpt info``) under a
  1 GiB address-space cap; clean when the outcome is a ``DeltackptError``, or a restore equal to
  the original (damage) or any restore (re-sealed), never another exception.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the shared fuzzer

from metadata_fuzz import (
    STEPS,
    Mutator,
    fresh_objects,
    memory_limit,
    prepared,
    restored,
    run_case,
)

from deltackpt import CheckpointManager, DeltackptError
from deltackpt.format.metadata import METADATA_FILE, step_dir_name


def _flip_outcome(root: Path, expected: dict) -> str:
    """``detected``, ``harmless``, ``silent`` or ``crash`` (another exception than a
    DeltackptError): what readers make of the checkpoint as it is now."""
    try:
        with CheckpointManager(root, read_only=True) as mgr:
            if any(mgr.verify().values()):
                return "detected"
            same = all(restored(mgr, step) == expected[step] for step in STEPS)
    except DeltackptError:
        return "detected"
    except Exception:  # what the audit looks for
        return "crash"
    return "harmless" if same else "silent"


def flips(root: Path, files: list[Path], n: int, seed: int, expected: dict) -> collections.Counter:
    """Flip one random bit of one of ``files`` (weighted by size) ``n`` times, one at a time."""
    rng = random.Random(seed)
    sizes = [p.stat().st_size for p in files]
    counts: collections.Counter = collections.Counter()
    for _ in range(n):
        path = rng.choices(files, weights=sizes)[0]
        original = path.read_bytes()
        data = bytearray(original)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            counts[_flip_outcome(root, expected)] += 1
        finally:
            path.write_bytes(original)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flips", type=int, default=500, help="bit flips per kind of file")
    parser.add_argument("--cases", type=int, default=1100, help="fuzzed manifests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        originals, expected = prepared(root)
        metadata = [root / step_dir_name(s) / METADATA_FILE for s in STEPS]
        data = sorted(p for s in STEPS for p in (root / step_dir_name(s)).glob("d-*.bin"))
        started = time.perf_counter()
        data_flips = flips(root, data, args.flips, args.seed, expected)
        meta_flips = flips(root, metadata, args.flips, args.seed + 1, expected)

        mutator = Mutator(originals, args.seed)
        objects = fresh_objects()
        outcomes: collections.Counter = collections.Counter()
        unclean = []
        with memory_limit(1 << 30):
            cases = [*mutator.cases(args.cases), *mutator.targeted()]
            for case in cases:
                outcome = run_case(root, case, expected, objects)
                outcomes["sealed" if case.sealed else "damage", outcome.result] += 1
                if outcome.result == "crash" or (not case.sealed and outcome.result == "changed"):
                    unclean.append(f"{case.kind} (step {case.step}): {outcome.result} {outcome.detail}")
        seconds = time.perf_counter() - started

    def share(counts: collections.Counter) -> str:
        total = sum(counts.values())
        return (f"{counts['detected']} of {total} detected ({100 * counts['detected'] / total:.1f}%), "
                f"{counts['harmless']} harmless, {counts['silent']} silent, {counts['crash']} "
                "other exceptions")

    print(f"flips in data files:      {share(data_flips)}")
    changed = meta_flips["detected"] + meta_flips["silent"]
    print(f"flips in metadata files:  {share(meta_flips)}; of the flips that change what a "
          f"reader sees, {100 * meta_flips['detected'] / max(1, changed):.1f}% detected")
    print(f"fuzzed manifests:         {len(cases) - len(unclean)} of {len(cases)} clean "
          f"({args.cases} seeded, {len(cases) - args.cases} targeted)")
    for (kind, result), count in sorted(outcomes.items()):
        print(f"  {kind:7s} {result:8s} {count}")
    for line in unclean:
        print(f"  UNCLEAN {line}")
    print(f"({seconds:.0f} s)")


if __name__ == "__main__":
    main()
