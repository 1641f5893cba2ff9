"""Readers restoring steps while the writer's retention deletes and re-codes them (issue 27).

One process trains a small model and saves it about every ``interval`` seconds with
``keep="last=3"`` and ``full_every=4``: after each save the gc deletes a step and
re-codes the kept deltas whose chain lost it. Reader processes list the steps and restore
the second-newest (kept through the next save) and the oldest listed (deleted by the next
gc) as fast as they can. Each outcome is counted: ``restored`` (the values match the
checksums the step's metadata records, which the restore checks), ``deleted`` (a
:class:`StepNotFoundError`: the gc deleted the step while it was read, which is true),
``false_damage`` (a :class:`CorruptionError`, for a step that is not damaged: nothing
damages it here) and ``other`` (any other exception, with its text). With ``commands`` the
readers run ``deltackpt ls``, ``verify`` and ``du`` instead, each ``checked`` when it exits 0
with nothing on stderr.

Shared by ``tests/test_reader_race.py`` and ``bench/metadata_audit.py``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import multiprocessing
import time
from typing import Any

import torch

from deltackpt import CheckpointManager, CorruptionError, StepNotFoundError
from deltackpt.app.cli import main


def _writer(url: str, options: dict | None, seconds: float, interval: float,
            started: Any, settings: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(256, 32), torch.randn(256, 8)
    with CheckpointManager(url, full_every=4, keep="last=3", workers=1,
                           storage_options=options, **settings) as mgr:
        end, step = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            for _ in range(5):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                step += 1
            mgr.save(step, model, optimizer)
            if step == 15:
                started.set()
            time.sleep(interval)


def _reader(url: str, options: dict | None, seconds: float, started: Any,
            results: Any) -> None:
    torch.set_num_threads(1)
    counts: collections.Counter = collections.Counter()
    others: list[str] = []
    started.wait()
    reader = CheckpointManager(url, read_only=True, workers=1, storage_options=options)
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        steps = reader.steps()
        if len(steps) < 3:
            continue
        step = steps[-2] if turn % 2 == 0 else steps[0]
        turn += 1
        try:
            reader.restore(step)
            counts["restored"] += 1
        except StepNotFoundError:
            counts["deleted"] += 1
        except CorruptionError as exc:
            counts["false_damage"] += 1
            others.append(f"step {step}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # what the race looks for
            counts["other"] += 1
            others.append(f"step {step}: {type(exc).__name__}: {exc}")
    results.put((dict(counts), others[:20]))


def _commands(url: str, options: dict | None, seconds: float, started: Any,
              results: Any) -> None:
    """``deltackpt ls``, ``verify`` and ``du`` in turn: ``checked`` when one exits 0 with
    nothing on stderr, else ``other`` with what it said."""
    counts: collections.Counter = collections.Counter()
    others: list[str] = []
    started.wait()
    end, turn = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        command = ("ls", "verify", "du")[turn % 3]
        turn += 1
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([command, url])
        if code == 0 and not err.getvalue():
            counts["checked"] += 1
        else:
            counts["other"] += 1
            others.append(f"{command}: exit {code}: {err.getvalue().strip()} "
                          f"{out.getvalue().strip()[-300:]}")
    results.put((dict(counts), others[:20]))


def race(url: str, *, seconds: float, readers: int = 2, interval: float = 0.05,
         options: dict | None = None, writer: dict | None = None, commands: bool = False
         ) -> tuple[collections.Counter, list[str]]:
    """Run the writer (a manager with ``writer``'s further arguments) and ``readers`` reader
    processes (with ``commands``: processes running the CLI's checks instead) for ``seconds``;
    the readers' summed outcomes and the text of the first unexpected errors."""
    ctx = multiprocessing.get_context("spawn")
    started, results = ctx.Event(), ctx.Queue()
    writing = ctx.Process(target=_writer, args=(url, options, seconds + 5, interval, started,
                                                writer or {}))
    writing.start()
    procs = [ctx.Process(target=_commands if commands else _reader,
                         args=(url, options, seconds, started, results))
             for _ in range(readers)]
    for proc in procs:
        proc.start()
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    for _ in procs:
        part, others = results.get(timeout=seconds + 300)
        counts.update(part)
        errors += others
    for proc in procs:
        proc.join()
    writing.join()
    if writing.exitcode != 0:
        errors.append(f"the writer exited with {writing.exitcode}")
    return counts, errors
