"""The ``deltackpt`` command: list, inspect, verify, measure, export and prune checkpoint directories,
and convert checkpoints of other formats.

Every command that takes a checkpoint PATH, except ``gc`` without
``--dry-run``, only reads it (:class:`~deltackpt.directory.CheckpointDirectory`,
or ``CheckpointManager(path, read_only=True)`` to restore), so it never
creates, locks or cleans up anything there and is safe to run while a
training job writes to the same directory. The commands that only read
metadata (``ls``, ``info``, ``du``, ``verify`` without ``--deep``) and
``--help`` and ``--version`` import neither torch nor the Numba kernels:
the others import what they need when they run. ``gc`` deletes steps: it takes
the writer lock and refuses to run while another writer holds it.
``--json`` prints one JSON document on stdout instead of tables, for
scripts. Errors go to stderr as one line, ``deltackpt: error: ...``, with exit
code 2. ``verify`` and ``ls`` exit 1 when they find damage and 3 when some step
could not be read (a permission denied, an I/O error), which says nothing of its
integrity; ``du`` exits 3 then too. Output cut short by a closed pipe
(``deltackpt ls --json | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from deltackpt._version import __version__
from deltackpt.directory import CheckpointDirectory
from deltackpt.errors import DeltackptError, ReadFailedError, StepNotFoundError, WriterLockedError
from deltackpt.format.metadata import METADATA_FILE, ROLES, StepMetadata, step_dir_name
from deltackpt.interop.formats import OUT_FORMATS, SOURCE_FORMATS
from deltackpt.io.progress import human_bytes
from deltackpt.io.storage import Storage

if TYPE_CHECKING:
    from deltackpt.ops.verify import Damage, VerifyReport


# -- formatting ----------------------------------------------------------------------------


def ratio(raw: int, stored: int) -> float | None:
    """Raw bytes per stored byte; ``None`` when nothing is stored (JSON has no infinity)."""
    return raw / stored if stored else None


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _created_text(created: str) -> str:
    """The ISO-8601 commit time as ``YYYY-MM-DD HH:MM:SS`` UTC (unchanged if it does not parse)."""
    try:
        when = datetime.fromisoformat(created)
    except ValueError:
        return created
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: set[int]) -> list[str]:
    """Rows as aligned text lines; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in cells]


EXIT_DAMAGED = 1  # verify and ls found damage; gc had no space to finish
EXIT_ERROR = 2
EXIT_UNCHECKED = 3  # verify, ls and du could not read some step (no damage found)
EXIT_CLOSED_PIPE = 141  # what a shell reports for a command ended by SIGPIPE


def _outcome(damaged: bool, unchecked: bool) -> int:
    """The exit code of a command that checks steps: damage first, then what it could not read."""
    return EXIT_DAMAGED if damaged else EXIT_UNCHECKED if unchecked else 0


def _print_lines(lines: Sequence[str]) -> None:
    print("\n".join(lines))


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, allow_nan=False))


def _plain(obj: Any) -> Any:
    """Tagged JSON state (docs/FORMAT.md 2.5) as plain JSON for display.

    Tuples become lists, non-finite floats and tensors become strings, so
    the result can be printed or embedded in ``--json`` output as is.
    """
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        tag, body = next(iter(obj.items()))
        if tag in ("$tensor", "$ndarray"):
            return f"<tensor {body}>"
        if tag == "$float":
            return body
        if tag == "$tuple":
            return [_plain(v) for v in body]
        if tag == "$bytes":
            return f"<{len(base64.b64decode(body))} bytes>"
        if tag == "$npscalar":
            return _plain(body[1])
        if tag == "$dict":
            return {str(_plain(k)): _plain(v) for k, v in body}
    return {k: _plain(v) for k, v in obj.items()}


def _summary(value: Any) -> str:
    """One short phrase describing a plain JSON value."""
    if isinstance(value, dict):
        return f"dict ({len(value)} keys)"
    if isinstance(value, list):
        return f"list ({len(value)} items)"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- shared helpers ------------------------------------------------------------------------


def _open(path: str) -> CheckpointDirectory:
    """The checkpoint directory at ``path``, read without torch and never written to."""
    return CheckpointDirectory(path)


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress bars go to stderr: on when asked or when stderr is a terminal, never with --json."""
    return not args.json and (args.progress or sys.stderr.isatty())


def _step_row(meta: StepMetadata) -> dict[str, Any]:
    stats = meta.stats
    return {"step": meta.step, "kind": meta.kind, "base_step": meta.base_step,
            "raw_bytes": stats.raw_bytes, "stored_bytes": stats.stored_bytes,
            "ratio": ratio(stats.raw_bytes, stats.stored_bytes), "seconds": stats.seconds,
            "created": meta.created, "classes": _classes(meta), "compression": stats.compression}


CLASS_ORDER = ("weights", "first_moment", "second_moment", "buffers", "exact")


def _number(value: Any) -> float | None:
    """``value`` if it is a (non-bool) number, else None: the class stats are informative only
    (docs/FORMAT.md 2), so a field another writer left out or spelled otherwise shows as missing."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _classes(meta: StepMetadata) -> dict[str, dict[str, Any]] | None:
    """The per-class statistics of a step (known classes first), each with its ``ratio`` and
    ``nonzero_fraction`` (non-zero symbols per quantized element; None when nothing is quantized)."""
    classes = meta.stats.classes
    if classes is None:
        return None
    out = {}
    for name in sorted(classes, key=lambda c: (CLASS_ORDER.index(c) if c in CLASS_ORDER
                                               else len(CLASS_ORDER), c)):
        stats = classes[name]
        if not isinstance(stats, dict):
            continue
        raw, stored = _number(stats.get("raw_bytes")), _number(stats.get("stored_bytes"))
        quantized = _quantized(stats)
        nonzero = _number(stats.get("nonzero"))
        out[name] = {**stats, "ratio": ratio(raw, stored) if raw is not None and stored is not None
                     else None,
                     "nonzero_fraction": nonzero / quantized if quantized and nonzero is not None
                     else None}
    return out


def _quantized(stats: dict[str, Any]) -> int:
    """Elements of a class that were quantized (not stored exactly)."""
    elements, exact = _number(stats.get("elements")), _number(stats.get("exact_elements"))
    return max(0, int(elements - (exact or 0))) if elements is not None else 0


def _error_text(value: Any) -> str:
    value = _number(value)
    return "-" if value is None else "0" if value == 0 else f"{value:.1e}"


def _weights_error(classes: dict[str, dict[str, Any]] | None) -> str:
    """The compact error column of ``ls``: the weights' RMS error relative to their RMS and
    their largest absolute error, each with its unit, or ``-`` when no weight was quantized
    (full steps)."""
    weights = (classes or {}).get("weights")
    if weights is None or not _quantized(weights):
        return "-"
    return (f"rms {_error_text(weights.get('rms_rel_error'))} rel, "
            f"max {_error_text(weights.get('max_abs_error'))} abs")


# Under ``info``'s class table: what its error columns measure (FORMAT.md 2.4's ClassStats).
ERROR_UNITS = ("errors of the restored values against the saved ones: MAX ABS in the tensors' "
               "own units; MAX REL per element, for classes coded in the ordinal domain (second "
               "moments by default); RMS REL the root of the summed squared errors over the "
               "summed squared values")


# -- ls --------------------------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace) -> int:
    mgr = _open(args.path)
    rows, unreadable = [], []
    for step in mgr.steps():
        try:
            rows.append(_step_row(mgr.metadata(step)))
        except StepNotFoundError:  # listed, then deleted by the writer's retention
            continue
        except DeltackptError as exc:  # one damaged or unreadable step must not hide the others
            unreadable.append({"step": step, "error": str(exc),
                               "damaged": not isinstance(exc, ReadFailedError)})
    raw = sum(r["raw_bytes"] for r in rows)
    stored = sum(r["stored_bytes"] for r in rows)
    total = {"steps": len(rows), "raw_bytes": raw, "stored_bytes": stored, "ratio": ratio(raw, stored),
             "seconds": sum(r["seconds"] for r in rows)}
    if args.json:
        _print_json({"path": mgr.path, "steps": rows, "unreadable": unreadable, "total": total})
    elif not rows and not unreadable:
        print(f"no committed steps in {mgr.path}")
    else:
        table = [[r["step"], r["kind"], "-" if r["base_step"] is None else r["base_step"],
                  human_bytes(r["raw_bytes"]), human_bytes(r["stored_bytes"]), _ratio_text(r["ratio"]),
                  _weights_error(r["classes"]), f"{r['seconds']:.2f}", _created_text(r["created"])]
                 for r in rows]
        table.append([f"total ({len(rows)})", "", "", human_bytes(raw), human_bytes(stored),
                      _ratio_text(total["ratio"]), "", f"{total['seconds']:.2f}", ""])
        _print_lines(_table(["STEP", "KIND", "BASE", "RAW", "STORED", "RATIO", "WEIGHTS ERROR", "SECONDS",
                             "CREATED (UTC)"], table, right={0, 3, 4, 5, 7}))
    for item in unreadable:
        what = "is damaged" if item["damaged"] else "could not be read"
        print(f"deltackpt: step {item['step']} {what}: {item['error']}", file=sys.stderr)
    return _outcome(any(i["damaged"] for i in unreadable), bool(unreadable))


# -- info ------------------------------------------------------------------------------------


def _state_summary(state: dict[str, Any]) -> dict[str, Any]:
    """Which non-tensor state a step holds: optimizer, RNG sources, ``extra`` keys."""
    optimizer = state.get("optimizer")
    if optimizer is not None:
        groups = [{k: _plain(v) for k, v in g.items() if k not in ("params", "param_names")}
                  | {"params": len(g["params"])} for g in optimizer["param_groups"]]
        state_keys = list(dict.fromkeys(k for per_param in optimizer["state"].values() for k in per_param))
        optimizer = {"class": optimizer["class"], "param_groups": groups,
                     "params_with_state": len(optimizer["state"]), "state_keys": state_keys}
    rng = state.get("rng")
    extra = _plain(state.get("extra"))
    return {"optimizer": optimizer, "rng": None if rng is None else list(rng),
            "extra": None if extra is None else {
                "summary": _summary(extra),
                "keys": {k: _summary(v) for k, v in extra.items()} if isinstance(extra, dict) else None}}


def _compression_text(compression: dict[str, Any]) -> str:
    """The preset name, scale and target ratio a delta step was coded with, what a resume from
    it is expected to lose, whether the target needed errors beyond ``max_error``, and the
    optimizer state stored exactly for want of a known meaning."""
    scale, target = _number(compression.get("scale")), _number(compression.get("target_ratio"))
    expected = _number(compression.get("expected_steps"))
    text = (f"{compression.get('name', '?')}, scale {'?' if scale is None else f'{scale:.3g}'}, "
            f"target ratio {'-' if target is None else f'{target:g}x'}, expected cost "
            f"{'unknown' if expected is None else f'{expected:.2g} steps of progress'}")
    if compression.get("at_max_error") is True:
        max_scale = _number(compression.get("max_scale"))
        text += (" (not met: held at max_error, "
                 f"{'?' if max_scale is None else f'{max_scale:.3g}'}x the configured errors)")
    unknown = compression.get("exact_state_keys")
    if isinstance(unknown, list) and unknown:
        text += f"; optimizer state stored exactly (meaning unknown): {', '.join(map(str, unknown))}"
    return text


def _class_table(classes: dict[str, dict[str, Any]]) -> list[str]:
    """``info``'s table of the per-class statistics of a step."""
    def size(value: Any) -> str:
        value = _number(value)
        return "-" if value is None else human_bytes(int(value))

    rows = []
    for name, c in classes.items():
        quantized = _quantized(c)
        fraction = c["nonzero_fraction"]
        rows.append([name, c.get("tensors", "-"), size(c.get("raw_bytes")), size(c.get("stored_bytes")),
                     _ratio_text(c["ratio"]), "-" if fraction is None else f"{100 * fraction:.1f}%",
                     *(_error_text(c.get(k)) if quantized else "-"
                       for k in ("max_abs_error", "max_rel_error", "rms_rel_error"))])
    return _table(["CLASS", "TENSORS", "RAW", "STORED", "RATIO", "NONZERO", "MAX ABS ERR", "MAX REL ERR",
                   "RMS REL ERR"], rows, right=set(range(1, 9)))


def _cmd_info(args: argparse.Namespace) -> int:
    mgr = _open(args.path)
    meta = mgr.metadata(mgr.resolve_step(args.step))
    tensors = [{"name": r.name, "role": r.role, "fqn": r.fqn, "state_key": r.state_key, "dtype": r.dtype,
                "shape": r.shape, "alias_of": r.alias_of, "codecs": r.codecs, "raw_bytes": r.nbytes,
                "stored_bytes": r.stored_bytes,
                "ratio": None if r.alias_of else ratio(r.nbytes, r.stored_bytes)}
               for r in meta.tensors]
    state = _state_summary(meta.state)
    document = {**_step_row(meta), "path": mgr.path, "format_version": meta.format_version,
                "library_version": meta.library_version, "world_size": meta.world_size,
                "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in meta.files],
                "tensors": tensors, "state": state}
    if args.json:
        _print_json(document)
        return 0
    s = meta.stats
    lines = [
        f"step            {meta.step}",
        f"kind            {meta.kind}",
        f"base step       {'-' if meta.base_step is None else meta.base_step}",
        f"format version  {meta.format_version}",
        f"library         deltackpt {meta.library_version}",
        f"world size      {meta.world_size}",
        f"files           {len(meta.files)} data file(s), {human_bytes(sum(f.size for f in meta.files))}",
        f"created         {_created_text(meta.created)} UTC",
        f"size            raw {human_bytes(s.raw_bytes)}, stored {human_bytes(s.stored_bytes)}, "
        f"ratio {_ratio_text(ratio(s.raw_bytes, s.stored_bytes))}, saved in {s.seconds:.2f} s",
    ]
    if s.compression is not None:
        lines.append(f"compression     {_compression_text(s.compression)}")
    lines.append("")
    if document["classes"]:
        lines += _class_table(document["classes"])
        lines += [ERROR_UNITS, ""]
    rows = [[t["name"], t["role"], t["dtype"], str(t["shape"]),
             f"alias of {t['alias_of']}" if t["alias_of"] else ",".join(t["codecs"]) or "-",
             human_bytes(t["raw_bytes"]), "-" if t["alias_of"] else human_bytes(t["stored_bytes"]),
             _ratio_text(t["ratio"])] for t in tensors]
    lines += _table(["TENSOR", "ROLE", "DTYPE", "SHAPE", "CODEC", "RAW", "STORED", "RATIO"], rows,
                    right={5, 6, 7})
    lines += ["", "state"]
    opt = state["optimizer"]
    if opt is None:
        lines.append("  optimizer  -")
    else:
        lines.append(f"  optimizer  {opt['class']}: {len(opt['param_groups'])} param group(s), "
                     f"{opt['params_with_state']} parameter(s) with state "
                     f"({', '.join(opt['state_keys']) or 'none'})")
        for g, group in enumerate(opt["param_groups"]):
            hyper = ", ".join(f"{k}={json.dumps(v)}" for k, v in group.items() if k != "params")
            lines.append(f"    group {g}: {group['params']} params; {hyper}")
    lines.append(f"  rng        {', '.join(state['rng']) if state['rng'] else '-'}")
    extra = state["extra"]
    lines.append(f"  extra      {'-' if extra is None else extra['summary']}")
    if extra is not None and extra["keys"]:
        lines += [f"    {k}: {v}" for k, v in extra["keys"].items()]
    _print_lines(lines)
    return 0


# -- restore ---------------------------------------------------------------------------------


def _print_written(args: argparse.Namespace, headline: str, document: dict[str, Any],
                   files: list[Path], left_out: list[str], notes: Sequence[str] = ()) -> None:
    """The report of ``restore`` and ``convert``: ``document`` with the files and what was left
    out as JSON, or the headline, files, what was left out and ``notes`` as text."""
    rows = [{"path": str(p), "bytes": p.stat().st_size} for p in files]
    if args.json:
        _print_json({**document, "files": rows, "left_out": left_out})
        return
    print(headline)
    _print_lines([f"  {f['path']}  {human_bytes(f['bytes'])}" for f in rows])
    if left_out:
        print(f"not exported ({document['format']} has no place for it): {', '.join(left_out)}")
    _print_lines([f"note: {note}" for note in notes])


def _cmd_restore(args: argparse.Namespace) -> int:
    from deltackpt.interop import export
    from deltackpt.interop.files import prepare_out
    from deltackpt.manager import CheckpointManager

    with CheckpointManager(args.path, read_only=True) as mgr:
        step = mgr.resolve_step(args.step)
        out = prepare_out(Path(args.out), [Path(mgr.path)], args.force)
        ckpt = mgr.restore(step, progress=_show_progress(args))
    written = export(ckpt.captured(), step, out, "deltackpt" if args.format == "universal" else args.format,
                     overwrite=args.force)
    _print_written(args, f"restored step {step} of {mgr.path} as {args.format} into {out}",
                   {"step": step, "format": args.format, "out": str(out)},
                   written.files, written.left_out)
    return 0


# -- export ----------------------------------------------------------------------------------


def _cmd_export(args: argparse.Namespace) -> int:
    from deltackpt.integrations.hf_export import export_hf

    written = export_hf(args.path, args.out, args.hf_config, step=args.step,
                        tokenizer=args.tokenizer, max_shard_size=args.max_shard_size,
                        overwrite=args.force)
    _print_written(args, f"exported step {written.step} of {args.path} as a Hugging Face model "
                         f"folder into {written.out}",
                   {"step": written.step, "format": "huggingface", "out": str(written.out)},
                   written.files, [])
    return 0


# -- convert ---------------------------------------------------------------------------------


def _cmd_convert(args: argparse.Namespace) -> int:
    from deltackpt.interop import convert
    from deltackpt.interop.patterns import ShardingSpec

    sharding = ShardingSpec.load(args.spec) if args.spec else None
    report = convert(args.sources, args.out, source_format=args.source_format, out_format=args.to,
                     step=args.step, overwrite=args.force, optimizer_class=args.optimizer_class,
                     sharding=sharding, model_only=args.model_only)
    sources = ", ".join(args.sources)
    _print_written(args, f"converted {sources} ({report.source_format}) into {report.out} as "
                         f"{report.out_format}, step {report.step}",
                   {"sources": args.sources, "source_format": report.source_format,
                    "format": report.out_format, "out": str(report.out), "step": report.step,
                    "notes": report.notes},
                   report.files, report.left_out, report.notes)
    return 0


# -- verify ----------------------------------------------------------------------------------


def _verify_lines(report: VerifyReport) -> list[str]:
    """``verify``'s text report: per step OK or DAMAGED; a damaged step's problems once, under the
    file they are in, then the steps that depend on it (which name it instead of repeating them)."""
    own: dict[int, list[Damage]] = {}
    for damage in report.damage:
        own.setdefault(damage.step, []).append(damage)
    lines = []
    for step in sorted(set(report) | set(own)):
        bases = [b for b, damages in own.items() if step in damages[0].dependents]
        blind = report.unchecked.get(step, [])
        if step not in own and not bases:
            lines += [f"step {step}: COULD NOT CHECK", *(f"  {r}" for r in blind)] if blind \
                else [f"step {step}: OK"]
            continue
        found = sum(len(d.problems) for d in own.get(step, []))
        what = ([f"{found} problem{'s' if found > 1 else ''}"] if found else []) + (
            [f"depends on damaged step{'s' if len(bases) > 1 else ''} {', '.join(map(str, bases))}"]
            if bases else [])
        lines.append(f"step {step}: DAMAGED ({'; '.join(what)})")
        for damage in own.get(step, []):
            if damage.file is None:
                lines += [f"  {p}" for p in damage.problems]
            else:
                lines += [f"  in {damage.file}:", *(f"    {p}" for p in damage.problems)]
        if step in own and own[step][0].dependents:
            lines.append(f"  steps that depend on it: {', '.join(map(str, own[step][0].dependents))}")
        lines += [f"  could not check: {r}" for r in blind]
    return lines


def _cmd_verify(args: argparse.Namespace) -> int:
    mgr = _open(args.path)
    report = mgr.verify(args.step, deep=args.deep, progress=_show_progress(args))
    damaged, unchecked = report.damaged, report.unchecked
    outcome = _outcome(bool(damaged), bool(unchecked))
    if args.json:
        _print_json({"path": mgr.path, "deep": args.deep, "ok": not damaged and not unchecked,
                     "steps": [{"step": s, "ok": not p, "damaged": s in damaged,
                                "could_not_check": unchecked.get(s, []), "problems": p}
                               for s, p in report.items()],
                     "damage": [dataclasses.asdict(d) for d in report.damage]})
        return outcome
    if not report:
        print(f"no committed steps in {mgr.path}")
        return 0
    _print_lines(_verify_lines(report))
    checked = f"{len(report)} step{'s' if len(report) > 1 else ''} checked"
    found = [f"{len(damaged)} damaged"] if damaged else []
    found += [f"{len(unchecked)} could not be checked"] if unchecked else []
    print(f"{checked}{' (deep)' if args.deep else ''}: {', '.join(found) or 'all intact'}")
    return outcome


# -- du --------------------------------------------------------------------------------------


def _tree_bytes(storage: Storage, rel: str, unreadable: list[str]) -> int:
    """Bytes of every file under ``rel``; what cannot be read is left out, its error appended
    to ``unreadable``, and what the writer deleted since its directory was listed too."""
    try:
        names = storage.listdir(rel)
    except FileNotFoundError:
        return 0
    except ReadFailedError as exc:
        unreadable.append(str(exc))
        return 0
    total = 0
    for name in names:
        child = f"{rel}/{name}" if rel else name
        try:
            total += _tree_bytes(storage, child, unreadable) if storage.is_dir(child) \
                else storage.size(child)
        except FileNotFoundError:
            pass
        except ReadFailedError as exc:
            unreadable.append(str(exc))
    return total


def _cmd_du(args: argparse.Namespace) -> int:
    mgr = _open(args.path)
    storage = mgr.storage
    steps = []
    roles = {role: {"tensors": 0, "raw_bytes": 0, "stored_bytes": 0} for role in ROLES}
    for step in mgr.steps():
        step_dir = step_dir_name(step)
        try:
            on_disk = {name: storage.size(f"{step_dir}/{name}") for name in storage.listdir(step_dir)
                       if not storage.is_dir(f"{step_dir}/{name}")}
        except (DeltackptError, FileNotFoundError):  # not a directory (a link is not followed),
            on_disk = {}  # unreadable (the metadata's error says so), or deleted since listed
        row: dict[str, Any] = {"step": step, "files": 0, "data_bytes": 0,
                               "metadata_bytes": on_disk.pop(METADATA_FILE, 0), "missing_files": [],
                               "error": None}
        try:
            meta = mgr.metadata(step)
        except StepNotFoundError:  # listed, then deleted by the writer's retention
            continue
        except DeltackptError as exc:
            row["error"], row["could_not_read"] = str(exc), isinstance(exc, ReadFailedError)
        else:
            for f in meta.files:
                if f.name in on_disk:
                    row["files"] += 1
                    row["data_bytes"] += on_disk.pop(f.name)
                else:
                    row["missing_files"].append(f.name)
            for record in meta.tensors:
                if record.alias_of is None:  # a tied weight is stored (and counted) once
                    totals = roles.setdefault(record.role, {"tensors": 0, "raw_bytes": 0,
                                                            "stored_bytes": 0})
                    totals["tensors"] += 1
                    totals["raw_bytes"] += record.nbytes
                    totals["stored_bytes"] += record.stored_bytes
        row["other_bytes"] = sum(on_disk.values())  # leftovers of interrupted saves
        row["total_bytes"] = row["data_bytes"] + row["metadata_bytes"] + row["other_bytes"]
        steps.append(row)
    steps_total = sum(r["total_bytes"] for r in steps)
    unreadable: list[str] = []  # what could not be read: left out of the sums
    directory = _tree_bytes(storage, "", unreadable)
    outcome = _outcome(False, bool(unreadable) or any(r.get("could_not_read") for r in steps))
    data_total = sum(r["stored_bytes"] for r in roles.values())
    for totals in roles.values():
        totals["share"] = totals["stored_bytes"] / data_total if data_total else 0.0
    if args.json:
        _print_json({"path": mgr.path, "steps": steps, "steps_bytes": steps_total,
                     "directory_bytes": directory, "other_bytes": directory - steps_total,
                     "by_role": roles, "could_not_read": unreadable})
        return outcome
    rows = [[r["step"], r["files"], human_bytes(r["data_bytes"]), human_bytes(r["metadata_bytes"]),
             human_bytes(r["total_bytes"])] for r in steps]
    lines = _table(["STEP", "FILES", "DATA", "METADATA", "TOTAL"], rows, right={0, 1, 2, 3, 4})
    lines += [f"steps      {human_bytes(steps_total)} in {len(steps)} step(s)",
              f"directory  {human_bytes(directory)} ({human_bytes(directory - steps_total)} outside "
              "committed steps' files)", ""]
    lines += _table(["ROLE", "TENSORS", "RAW", "STORED", "SHARE"],
                    [[role, t["tensors"], human_bytes(t["raw_bytes"]), human_bytes(t["stored_bytes"]),
                      f"{100 * t['share']:.1f}%"] for role, t in roles.items()], right={1, 2, 3, 4})
    for r in steps:
        if r["error"]:
            lines.append(f"step {r['step']}: unreadable metadata: {r['error']}")
        if r["missing_files"]:
            lines.append(f"step {r['step']}: missing data files: {', '.join(r['missing_files'])}")
        if r["other_bytes"]:
            lines.append(f"step {r['step']}: {human_bytes(r['other_bytes'])} in unreferenced files "
                         "(a replaced version's, kept for readers a while, or a failed save's; "
                         "removed by the writer)")
    lines += [f"not counted, could not be read: {error}" for error in unreadable]
    _print_lines(lines)
    return outcome


# -- gc --------------------------------------------------------------------------------------


def _cmd_gc(args: argparse.Namespace) -> int:
    from deltackpt.manager import CheckpointManager
    from deltackpt.ops.retention import RetentionPolicy

    try:
        policy = RetentionPolicy.parse(args.keep)
    except ValueError as exc:
        raise ValueError(f"--keep: {exc}") from None
    with CheckpointManager(args.path, read_only=True) as reader:  # refuses what is not one
        if args.dry_run:
            report = reader.gc(policy, dry_run=True)
            path = reader.path
    if not args.dry_run:
        with CheckpointManager(args.path, reader_grace=args.reader_grace) as mgr:
            try:
                report = mgr.gc(policy)
            except WriterLockedError as exc:
                raise WriterLockedError(f"{exc}; gc deletes steps and needs the writer lock: run it "
                                        "when that writer has finished (--dry-run works meanwhile), "
                                        "or pass keep= to the writer's CheckpointManager") from None
            path = mgr.path
    if args.json:
        _print_json({"path": path, "policy": str(policy), **report.as_dict()})
        return 1 if report.needed_bytes else 0

    def steps(items: list[int]) -> str:
        return ", ".join(map(str, items)) if items else "-"

    lines = [f"{'dry run, nothing changed: ' if report.dry_run else ''}gc of {path} with --keep {policy}",
             f"  kept       {len(report.kept):>5}  {steps(report.kept)}",
             f"  removed    {len(report.removed):>5}  {steps(report.removed)}",
             f"  re-coded   {len(report.recoded):>5}  {steps(report.recoded)}"
             + ("  (delta steps coded again on a kept step: their chain loses a step)"
                if report.recoded else ""),
             f"  rewritten  {len(report.rewritten):>5}  {steps(report.rewritten)}"
             + ("  (delta steps made full: no kept step to code them on, or full is smaller)"
                if report.rewritten else "")]
    if report.held:
        why = ("the disk has no space to replace the steps that need them" if report.needed_bytes
               else "replacing the steps that need them would grow PATH")
        lines.append(f"  held       {len(report.held):>5}  {steps(report.held)}  (not kept by "
                     f"--keep, but {why})")
    if report.skipped:
        lines.append(f"  left alone {len(report.skipped):>5}  {steps(report.skipped)}  "
                     "(unreadable metadata or broken chain; run deltackpt verify)")
    freed, added = human_bytes(report.freed_bytes), human_bytes(report.added_bytes)
    before, after = human_bytes(report.bytes_before), human_bytes(report.bytes_after)
    lines.append(f"would free {freed}; the replacements would write about {added}; steps take "
                 f"{before}, about {after} after" if report.dry_run
                 else f"freed {freed}; the replacements wrote {added}; steps took {before}, "
                 f"{after} now")
    if report.needed_bytes:
        lines.append(f"the disk is full: replacing the kept steps needs about "
                     f"{human_bytes(report.needed_bytes)} of free space; free that much and run "
                     "gc again to remove the held steps")
    _print_lines(lines)
    return 1 if report.needed_bytes else 0


# -- parser ----------------------------------------------------------------------------------


def _step_arg(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, got {text!r}")
    return step


_EXPORT_FORMATS_HELP = (
    "  safetensors  DIR/model.safetensors: the model state dict by FQN (tied weights\n"
    "               stored under each name; its metadata lists buffers and tied names);\n"
    "               DIR/optimizer.safetensors: optimizer state tensors as <fqn>/<state_key>\n"
    "               (other optimizer tensors under their universal name) and, in its\n"
    "               metadata, key 'optimizer': the optimizer's class, param groups and\n"
    "               state as deltackpt tagged JSON (docs/FORMAT.md 2.5) whose $tensor\n"
    "               references are keys of that file;\n"
    "               DIR/extra.safetensors: tensors of 'extra' under their universal names,\n"
    "               with 'extra' as tagged JSON in its metadata;\n"
    "               each file only when the step has that state.\n"
    "  dcp          DIR as a torch.distributed.checkpoint directory of {'model', 'optimizer',\n"
    "               'optimizer_class', 'extra', 'step'}; 'optimizer' in the layout of\n"
    "               get_optimizer_state_dict (state and param groups by FQN), so dcp.load of\n"
    "               {'model': model.state_dict(), 'optimizer': get_optimizer_state_dict(model,\n"
    "               optimizer)} and set_state_dict restore both. DCP flattens 'extra' (dict\n"
    "               keys become strings, empty dicts vanish).\n"
    "  torch        DIR/checkpoint.pt, loadable with torch.load(weights_only=True):\n"
    "               {'step', 'model', 'optimizer', 'optimizer_class', 'extra'}; 'optimizer'\n"
    "               is a torch Optimizer.state_dict() (parameters numbered in saved group\n"
    "               order, groups list their FQNs as 'param_names').\n"
    "  In dcp and torch, numpy arrays become tensors and numpy scalars Python scalars, which\n"
    "  weights_only can load. safetensors, dcp and torch leave RNG states out.\n"
)


def _add_command(sub: Any, name: str, help_text: str, description: str, examples: str,
                 func: Callable[[argparse.Namespace], int], parents: list[argparse.ArgumentParser]
                 ) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=description, parents=parents,
                            epilog="examples:\n" + examples,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(func=func)
    return parser


def _add_demo(sub: Any) -> None:
    """The ``demo`` command. Its options are those of :mod:`deltackpt.app.demo`, which imports torch:
    the demo parses them itself when it runs (``deltackpt demo --help`` lists them), so that
    building this parser imports nothing more."""
    parser = sub.add_parser("demo", add_help=False,
                            help="train, checkpoint and resume a small GPT (under a minute)")
    parser.set_defaults(func=_cmd_demo, forwards_arguments=True)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        from deltackpt.app import demo
    except Exception as exc:  # the demo must never break the other commands
        print(f"deltackpt: error: the demo is unavailable: cannot import deltackpt.app.demo ({exc!r})",
              file=sys.stderr)
        return 2
    return demo.main(args.arguments)


def _add_warm(sub: Any) -> None:
    """The ``warm`` command."""
    _add_command(
        sub, "warm", "compile the kernels saves and restores use into Numba's cache",
        "Save and restore small models trained with AdamW, SGD with momentum, centered RMSprop,\n"
        "Adagrad and bfloat16 Adam in a temporary directory, so that the kernels their saves\n"
        "and restores call are compiled and cached: a fresh environment otherwise compiles\n"
        "them at its first saves and restore, tens of seconds more. Run it once where the\n"
        "package is installed, e.g. in a container image's build step (a minute or two).",
        "  deltackpt warm\n  RUN pip install deltackpt && deltackpt warm    (in a Dockerfile)",
        _cmd_warm, [])


def _cmd_warm(args: argparse.Namespace) -> int:
    from deltackpt.app.warm import warm

    seconds = warm(log=lambda line: print(line, flush=True))
    print(f"compiled and cached in {sum(seconds.values()):.1f} s")
    return 0


class _Parents(NamedTuple):
    """Options several commands share, as argparse parent parsers."""

    path: argparse.ArgumentParser  # PATH and --json
    one_step: argparse.ArgumentParser  # --step N
    progress: argparse.ArgumentParser  # --progress


def _parents() -> _Parents:
    """The parsers of the options several commands share."""
    path = argparse.ArgumentParser(add_help=False)
    path.add_argument("path", metavar="PATH",
                      help="checkpoint directory: a local path, file:// URL or fsspec URL (s3://bucket/run1)")
    path.add_argument("--json", action="store_true",
                      help="print one JSON document on stdout instead of text (no progress bars)")
    one_step = argparse.ArgumentParser(add_help=False)
    one_step.add_argument("--step", type=_step_arg, metavar="N", help="step to use (default: the latest)")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--progress", action="store_true",
                          help="show a progress bar on stderr even if it is not a terminal "
                               "(it is shown on a terminal anyway; never with --json)")
    return _Parents(path, one_step, progress)


def _add_ls(sub: Any, parents: _Parents) -> None:
    """The ``ls`` command."""
    _add_command(sub, "ls", "list the steps of a checkpoint directory",
                 "One row per committed step: kind (full or delta), the step it depends on, raw and "
                 "stored size, compression ratio (raw/stored), the error of its weights (relative "
                 "RMS and largest absolute error against the saved values; '-' when stored "
                 "losslessly), save time and commit time, then a total. Exits 1 if the metadata of "
                 "a step cannot be read.",
                 "  deltackpt ls runs/ckpt\n  deltackpt ls runs/ckpt --json | jq '.total'",
                 _cmd_ls, [parents.path])


def _add_info(sub: Any, parents: _Parents) -> None:
    """The ``info`` command."""
    _add_command(sub, "info", "describe one step: header, every tensor, the non-tensor state",
                 "The step's header (kind, base step, format and library version, world size, files, "
                 "sizes, the compression preset, scale and target ratio of a delta step), a table of "
                 "the tensor classes (raw and stored bytes, ratio, fraction of non-zero quantized "
                 "symbols, largest absolute and relative error, relative RMS error), a table of its "
                 "tensors (role, dtype, shape, codecs, raw and stored bytes, ratio; tied weights "
                 "show as 'alias of X') and the non-tensor state it holds "
                 "(optimizer class and param groups, RNG sources, top-level keys of extra).",
                 "  deltackpt info runs/ckpt\n  deltackpt info runs/ckpt --step 100 --json",
                 _cmd_info, [parents.path, parents.one_step])


def _add_restore(sub: Any, parents: _Parents) -> None:
    """The ``restore`` command."""
    restore = _add_command(
        sub, "restore", "export one step as a deltackpt, safetensors, DCP or torch checkpoint",
        "Decode a step and write it into DIR:\n\n"
        "  universal    a standalone deltackpt directory holding just this step (lossless,\n"
        "               keeps everything, including RNG states)\n"
        + _EXPORT_FORMATS_HELP +
        "\nPATH is never modified. DIR may not be inside PATH, and must be empty or new unless\n"
        "--force is given: then files of the same name (or, for universal, the same step of an\n"
        "existing deltackpt directory) are replaced and everything else in DIR is kept. Files\n"
        "appear complete or not at all. 'deltackpt convert' reads these formats back.",
        "  deltackpt restore runs/ckpt --out best/\n"
        "  deltackpt restore runs/ckpt --step 100 --format safetensors --out export/\n"
        "  deltackpt restore runs/ckpt --format dcp --out dcp_ckpt/\n"
        "  deltackpt restore runs/ckpt --format torch --out export/ --force",
        _cmd_restore, [parents.path, parents.one_step, parents.progress])
    restore.add_argument("--out", required=True, metavar="DIR", help="output directory")
    restore.add_argument("--format", choices=("universal", "safetensors", "dcp", "torch"),
                         default="universal", help="output format (default: %(default)s)")
    restore.add_argument("--force", action="store_true", help="write into a non-empty DIR")


def _add_export(sub: Any, parents: _Parents) -> None:
    """The ``export`` command."""
    export = _add_command(
        sub, "export", "write one step as a Hugging Face model folder (from_pretrained loads it)",
        "Write the model weights of a step into DIR as the model that --hf-config describes\n"
        "(a folder with its config.json) saves them: model.safetensors, or shards and\n"
        "model.safetensors.index.json above --max-shard-size, with config.json, and the\n"
        "tokenizer's files when --tokenizer names its folder. The training model's names\n"
        "are mapped to the config model's (torch.compile, FSDP, activation checkpointing\n"
        "and DDP wrapper names dropped); names that do not match are an error listing them.\n"
        "Nothing is downloaded. Needs transformers: pip install 'deltackpt[transformers]'.\n"
        "PATH is never modified; DIR must be empty or new unless --force is given.",
        "  deltackpt export runs/ckpt --hf-config configs/tiny-llama --out hf/\n"
        "  deltackpt export runs/ckpt --step 100 --hf-config cfg/ --tokenizer tok/ --out hf/",
        _cmd_export, [parents.path, parents.one_step])
    export.add_argument("--hf-config", required=True, metavar="CONFIG_DIR",
                        help="folder holding the model's config.json")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument("--tokenizer", metavar="TOKENIZER_DIR",
                        help="folder whose tokenizer files are copied into DIR")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file before sharding (default: %(default)s)")
    export.add_argument("--force", action="store_true", help="write into a non-empty DIR")


def _add_convert(sub: Any, parents: _Parents) -> None:
    """The ``convert`` command."""
    convert = _add_command(
        sub, "convert", "convert a torch.save, DCP, safetensors or DeepSpeed checkpoint",
        "Read a checkpoint of another format and write it, losslessly, into DIR.\n\n"
        "SRC (--from; detected from what SRC holds when not given):\n\n"
        "  torch        a torch.save file, loaded with weights_only=True: a state dict, or a\n"
        "               dict with 'model' (or 'state_dict') and 'optimizer' (or 'optim')\n"
        "               entries; the optimizer state dict keyed by FQN, or by index (with\n"
        "               'param_names' in its groups, or else named after the model's\n"
        "               parameters in order where the shapes of its state agree; the notes\n"
        "               say so). An integer 'step' is the step; other entries become extra.\n"
        "  dcp          a torch.distributed.checkpoint directory, read by torch's DCP reader\n"
        "               (non-tensor entries with weights_only=True), interpreted like torch\n"
        "  safetensors  .safetensors files, or a directory of them (a sharded set with its\n"
        "               *.safetensors.index.json), including the optimizer and extra files\n"
        "               of a safetensors export\n"
        "  deepspeed    a DeepSpeed universal checkpoint folder (zero/<param>/fp32.pt,\n"
        "               exp_avg.pt, exp_avg_sq.pt, step.pt; the folder holding\n"
        "               latest_universal also works): fp32 weights, Adam state, the\n"
        "               hyperparameters of zero/optimizer_state.pt and the buffers of\n"
        "               mp_rank_00_model_states.pt where weights_only=True can load them\n\n"
        "With --spec FILE, the SRCs are the checkpoints of the tensor-parallel ranks of a\n"
        "hand-sharded run (Megatron style), rank 0 first, each in one of these formats; the\n"
        "sharding spec in FILE (docs/PATTERNS.md) merges them into whole tensors. A DeepSpeed\n"
        "save_checkpoint folder holds every tensor-parallel rank (mp_rank_00, mp_rank_01...):\n"
        "it is the one SRC.\n\n"
        "DIR (--to):\n\n"
        "  deltackpt    a standalone deltackpt directory holding one full, lossless step\n"
        + _EXPORT_FORMATS_HELP +
        "\nWhere SRC does not record which model tensors are buffers, the tensors the optimizer\n"
        "does not train are taken to be (without an optimizer: the integer ones); where it does\n"
        "not record the optimizer's class, it is recognized from the hyperparameters, or given\n"
        "with --optimizer-class. What could not be taken over is listed as notes.\n\n"
        "SRC is never modified. DIR may not overlap SRC, and must be empty or new unless --force\n"
        "is given: then files of the same name are replaced and everything else in DIR is kept.",
        "  deltackpt convert model.pt --out runs/ckpt\n"
        "  deltackpt convert dcp_ckpt/ --to safetensors --out export/\n"
        "  deltackpt convert shards/ --from safetensors --out runs/ckpt --step 1000\n"
        "  deltackpt convert ds/global_step100 --to dcp --out dcp_ckpt/ --json\n"
        "  deltackpt convert tp0.pt tp1.pt tp2.pt tp3.pt --spec gpt_tp.json --out runs/ckpt\n"
        "  deltackpt convert ds_ckpt/global_step100 --spec gpt_tp.json --out runs/ckpt",
        _cmd_convert, [])
    convert.add_argument("sources", nargs="+", metavar="SRC",
                         help="checkpoint file or directory (several: .safetensors files, or the "
                              "ranks' checkpoints with --spec)")
    convert.add_argument("--spec", metavar="FILE",
                         help="sharding spec (JSON, docs/PATTERNS.md) merging the SRCs, one per "
                              "tensor-parallel rank in rank order")
    convert.add_argument("--out", required=True, metavar="DIR", help="output directory")
    convert.add_argument("--from", dest="source_format", choices=SOURCE_FORMATS,
                         help="format of SRC (default: detected)")
    convert.add_argument("--to", choices=OUT_FORMATS, default="deltackpt",
                         help="output format (default: %(default)s)")
    convert.add_argument("--step", type=_step_arg, metavar="N",
                         help="step number to record (default: the one SRC records, else 0)")
    convert.add_argument("--optimizer-class", metavar="NAME",
                         help="the optimizer's class (e.g. AdamW) where SRC does not tell")
    convert.add_argument("--model-only", action="store_true",
                         help="convert only the model (parameters and buffers) and the step; leave "
                              "the optimizer and other entries out, unread")
    convert.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    convert.add_argument("--json", action="store_true",
                         help="print one JSON document on stdout instead of text")


def _add_verify(sub: Any, parents: _Parents) -> None:
    """The ``verify`` command."""
    verify = _add_command(
        sub, "verify", "check stored bytes against their checksums",
        "Check every chunk of one step (or of all steps) against its xxh3 checksum and report the "
        "damaged ones by step, tensor and file: each damaged file once, followed by the steps that "
        "depend on its step (the deltas coded on it), which name it instead of repeating its "
        "problems. --deep also decodes every chunk and checks the result. Exits 0 if everything "
        "is intact, 1 if anything is damaged.",
        "  deltackpt verify runs/ckpt\n  deltackpt verify runs/ckpt --step 100 --deep",
        _cmd_verify, [parents.path, parents.progress])
    verify.add_argument("--step", type=_step_arg, metavar="N", help="step to check (default: all)")
    verify.add_argument("--deep", action="store_true", help="also decode every chunk")


def _add_du(sub: Any, parents: _Parents) -> None:
    """The ``du`` command."""
    _add_command(sub, "du", "disk usage per step and by tensor role",
                 "Bytes on disk of each step (its data files and metadata.json, measured from the "
                 "files), of the whole directory, and of the stored tensors summed over all steps by "
                 "role (param, buffer, optimizer, rng, extra).",
                 "  deltackpt du runs/ckpt\n  deltackpt du runs/ckpt --json",
                 _cmd_du, [parents.path])


def _add_gc(sub: Any, parents: _Parents) -> None:
    """The ``gc`` command."""
    gc = _add_command(
        sub, "gc", "delete the steps a retention policy does not keep",
        "Delete every step that --keep does not keep; the latest step is always kept.\n\n"
        "A kept delta step whose chain would lose a step is first re-coded as a delta on the\n"
        "nearest kept step that stays as it is (within the compression's error of the values it\n"
        "restored to), or rewritten as a full step holding exactly those values where that is\n"
        "smaller or no kept step is below it; so every kept step stays restorable. If that would\n"
        "make PATH larger, the steps the kept ones need are held instead. Nothing is changed\n"
        "unless every new version was written. On a full disk the steps no kept step needs are\n"
        "deleted first; if the new versions still do not fit, the steps they need are held and\n"
        "gc says how many bytes the new versions need (exit code 1).\n"
        "Steps whose metadata cannot be read are left alone.\n\n"
        "What it deletes or replaces is deleted at once, with the data a writer kept for\n"
        "readers (reader_grace) and no longer needs to: gc frees the space now. Readers\n"
        "restoring meanwhile read a changed step again; --reader-grace S keeps the deleted\n"
        "data S seconds for them instead (deleted by a later save or gc).\n\n"
        "--keep SPEC is a comma-separated list of rules; a step is kept if any rule keeps it:\n\n"
        "  last=K         the K highest steps\n"
        "  every=M        every step whose number is a multiple of M\n"
        "  full_within=T  every full step above (latest step - T)\n\n"
        "Unlike the other commands gc changes PATH: it takes the writer lock and fails while a\n"
        "training job (or another gc) writes there. --dry-run only reads PATH and reports what\n"
        "would be removed, re-coded, rewritten and freed, with estimated sizes.",
        "  deltackpt gc runs/ckpt --keep last=5,every=1000 --dry-run\n"
        "  deltackpt gc runs/ckpt --keep last=3,full_within=5000 --json",
        _cmd_gc, [parents.path])
    gc.add_argument("--keep", required=True, metavar="SPEC",
                    help="retention policy, e.g. last=5,every=1000,full_within=5000")
    gc.add_argument("--reader-grace", type=float, default=0.0, metavar="S",
                    help="keep what is deleted S seconds for readers (default 0: free it now)")
    gc.add_argument("--dry-run", action="store_true",
                    help="change nothing; report what would be removed, replaced and freed")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``deltackpt`` command and all its subcommands."""
    parser = argparse.ArgumentParser(
        prog="deltackpt",
        description="Inspect, verify, export and prune deltackpt checkpoint directories, and convert "
                    "torch.save, DCP, safetensors and DeepSpeed checkpoints. Commands that take PATH "
                    "(or SRC) only read it (they never create, lock or change anything there), "
                    "except gc, which deletes the steps a retention policy does not keep.",
        epilog="examples:\n  deltackpt ls runs/ckpt\n  deltackpt info runs/ckpt --step 100\n"
               "  deltackpt verify runs/ckpt --deep\n"
               "  deltackpt restore runs/ckpt --format safetensors --out export/\n"
               "  deltackpt export runs/ckpt --hf-config cfg/ --out hf_model/\n"
               "  deltackpt convert model.pt --out runs/ckpt\n"
               "  deltackpt gc runs/ckpt --keep last=5,every=1000 --dry-run\n\n"
               "exit codes: 0 success, 1 damage found (verify, ls) or no space to finish (gc), "
               "2 error, 3 some step could not be read (verify, ls, du)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"deltackpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parents = _parents()
    for add in (_add_ls, _add_info, _add_restore, _add_export, _add_convert, _add_verify, _add_du,
                _add_gc):
        add(sub, parents)
    _add_demo(sub)
    _add_warm(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``deltackpt`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "forwards_arguments", False):  # the demo parses its own options
        args.arguments = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader of our output left (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return EXIT_CLOSED_PIPE
    except (DeltackptError, OSError, ValueError) as exc:
        print(f"deltackpt: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("deltackpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
