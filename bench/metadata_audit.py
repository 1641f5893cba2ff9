"""Reruns the fault audit's figures on damaged and hostile checkpoints (issue 15, items 10 and 11).

    python bench/metadata_audit.py [--flips 500] [--cases 1100] [--seed 0] [--race-seconds 60]

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
  the original (damage) or any restore (re-sealed), never another exception;
* **permissions**: a step directory, a ``metadata.json``, a data file and the root made
  unreadable, each read by ``ls``, ``verify``, ``du``, ``info`` and ``restore`` and written by
  a save, as a user whom permissions stop (``tests/other_user.py``); clean when every outcome
  is an exit code the CLI documents (0, 2, 3; a save succeeds or raises a DeltackptError) with
  at most one line on stderr and no traceback;
* **readers during retention** (``--race-seconds``, 0 skips it): a writer saving a small model
  every ~0.05 s with ``keep="last=3"`` and two reader processes restoring the second-newest
  and the oldest step, on a local directory (``reader_grace`` 0 and the default) and on a
  moto S3 server (``reader_grace`` 0; ``tests/reader_race.py``): restores, steps found
  deleted, false damage, other errors;
  and one process running ``deltackpt ls``, ``verify`` and ``du`` in turn: each must exit 0.
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

import fsspec
import torch
from metadata_fuzz import (
    STEPS,
    Mutator,
    fresh_objects,
    memory_limit,
    prepared,
    restored,
    run_case,
)
from other_user import as_other_user, checkpoint, cli, shared_dir
from reader_race import race
from s3_server import moto_server

from deltackpt import CheckpointManager, DeltackptError
from deltackpt.format.metadata import METADATA_FILE, step_dir_name
from deltackpt.io.retired import DEFAULT_GRACE


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


def races(seconds: float) -> list[tuple[str, collections.Counter, list[str]]]:
    """The reader/retention race on each storage: its cell, outcomes and unexpected errors."""
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for grace in (0, DEFAULT_GRACE):
            counts, errors = race(f"{tmp}/grace{grace}", seconds=seconds,
                                  writer={"reader_grace": grace})
            cells.append((f"local, reader_grace={grace:g}", counts, errors))
        counts, errors = race(f"{tmp}/commands", seconds=seconds, readers=1, commands=True,
                              writer={"reader_grace": 0})
        cells.append(("local, ls/verify/du", counts, errors))
    with moto_server(own_process=True) as endpoint:
        options = {"key": "AKIAAUDIT", "secret": "not-a-secret", "endpoint_url": endpoint,
                   "skip_instance_cache": True}
        fsspec.filesystem("s3", **options).mkdir("audit")
        counts, errors = race("s3://audit/run", seconds=seconds, options=options,
                              writer={"reader_grace": 0})
        cells.append(("moto S3, reader_grace=0", counts, errors))
    return cells


UNREADABLE = {
    "step directory": lambda root: root / step_dir_name(3),
    "metadata.json": lambda root: root / step_dir_name(3) / METADATA_FILE,
    "data file": lambda root: sorted((root / step_dir_name(3)).glob("d-*.bin"))[0],
    "root": lambda root: root,
}
COMMANDS = [("ls",), ("verify",), ("du",), ("info", "--step", "3"), ("restore", "--step", "5")]


def permissions() -> list[tuple[str, str, str, bool]]:
    """Each unreadable entry read by each command and written by a save: (entry, what ran,
    outcome, clean)."""
    rows = []
    for entry, path_of in UNREADABLE.items():
        with shared_dir() as shared:
            root = shared / "ckpt"
            checkpoint(root)
            path_of(root).chmod(0)
            for command in COMMANDS:
                out = ["--out", str(shared / f"out-{command[0]}")] if command[0] == "restore" else []
                ran = cli(command[0], str(root), *command[1:], *out)
                lines = ran.stderr.strip().splitlines()
                clean = ran.returncode in (0, 2, 3) and len(lines) <= 1 and \
                    "Traceback" not in ran.stderr
                rows.append((entry, " ".join(command), f"exit {ran.returncode}"
                             + (f": {lines[0][:100]}" if lines else ""), clean))

            def save(root: Path = root) -> str:
                try:
                    with CheckpointManager(root, full_every=10) as mgr:
                        return f"saved step 6 ({mgr.save(6, torch.nn.Linear(64, 64)).kind})"
                except DeltackptError as exc:
                    return f"{type(exc).__name__}: {str(exc)[:100]}"

            try:
                rows.append((entry, "save", as_other_user(save), True))
            except AssertionError as exc:  # another exception than a DeltackptError
                rows.append((entry, "save", str(exc)[:120], False))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flips", type=int, default=500, help="bit flips per kind of file")
    parser.add_argument("--cases", type=int, default=1100, help="fuzzed manifests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--race-seconds", type=float, default=60,
                        help="seconds of each reader/retention race (0: none)")
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
    rows = permissions()
    print(f"permissions:              {sum(r[3] for r in rows)} of {len(rows)} clean")
    for entry, what, outcome, clean in rows:
        print(f"  {'' if clean else 'UNCLEAN '}unreadable {entry:15s} {what:22s} {outcome}")
    if args.race_seconds > 0:
        print(f"readers during retention ({args.race_seconds:.0f} s each, 2 readers):")
        for cell, counts, errors in races(args.race_seconds):
            done = f"{counts['checked']} commands exited 0" if "checked" in counts else (
                f"{counts['restored']} restored, {counts['deleted']} found deleted, "
                f"{counts['false_damage']} false damage")
            print(f"  {cell:26s} {done}, {counts['other']} other outcomes")
            for error in errors:
                print(f"    {error}")


if __name__ == "__main__":
    main()
