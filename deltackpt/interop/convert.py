"""Converting a checkpoint from one format to another, losslessly: read it into a
:class:`~deltackpt.format.state.CapturedState` (:mod:`~deltackpt.interop.sources`) and write that
(:mod:`~deltackpt.interop.exporters`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deltackpt.interop.exporters import export
from deltackpt.interop.files import prepare_out
from deltackpt.interop.formats import OUT_FORMATS
from deltackpt.interop.patterns import ShardingSpec
from deltackpt.interop.sources import read_checkpoint, source_paths
from deltackpt.io.objectstore import redact_url
from deltackpt.io.storage import is_url
from deltackpt.save.standalone import save_standalone

PathLike = str | os.PathLike[str]


@dataclass
class ConvertReport:
    """What :func:`convert` read and wrote."""

    source_format: str
    out_format: str
    out: Path | str  # a str: the URL of a checkpoint on an object store
    step: int
    files: list[Path]  # (local outputs only)
    left_out: list[str]  # parts of the state the output format has no place for
    notes: list[str]  # what the reader could not take over from the source


def convert(source: PathLike | Sequence[PathLike], out: PathLike, *, source_format: str | None = None,
            out_format: str = "deltackpt", step: int | None = None, overwrite: bool = False,
            optimizer_class: str | None = None, sharding: ShardingSpec | None = None,
            model_only: bool = False) -> ConvertReport:
    """Convert the checkpoint at ``source`` into ``out_format`` in the directory ``out``.

    ``source`` is a ``torch.save`` file, a DCP directory, safetensors files
    (one, several, or a directory) or a DeepSpeed universal checkpoint
    folder; ``source_format`` (``"torch"``, ``"dcp"``, ``"safetensors"``,
    ``"deepspeed"``) is detected when None. ``out_format`` is
    ``"deltackpt"`` (a standalone checkpoint directory holding one full,
    lossless step), ``"safetensors"``, ``"dcp"`` or ``"torch"``. ``step`` is
    the step number to record (default: the source's own, else 0).
    ``optimizer_class`` names the optimizer's class where the source does
    not record it and its hyperparameters do not tell. With ``sharding``
    (a :class:`~deltackpt.interop.patterns.ShardingSpec`), ``source`` lists the
    checkpoints of the tensor-parallel ranks of a hand-sharded run, in rank
    order, merged into whole tensors by that spec (docs/PATTERNS.md). With
    ``model_only``, only the model (parameters and buffers) and the step are
    converted, and the optimizer and other state are left out unread (the
    report's notes name them).

    The source is never modified. ``out`` must be new or empty unless
    ``overwrite``; output files appear complete or not at all. For
    ``deltackpt`` output ``out`` may be an object store URL
    (``s3://bucket/run1``; its store's standard credentials apply).
    """
    if out_format not in OUT_FORMATS:
        raise ValueError(f"unknown output format {out_format!r}; choose one of {', '.join(OUT_FORMATS)}")
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    paths = source_paths(source)
    remote = is_url(out)
    if remote and out_format != "deltackpt":
        raise ValueError(f"{out}: only deltackpt output can be written to a URL; write "
                         f"{out_format} to a local directory")
    target = out if remote else prepare_out(Path(out), paths, overwrite)
    read = read_checkpoint(paths, source_format, optimizer_class, sharding, model_only)
    if step is None:
        step = read.step if read.step is not None else 0
    if remote:
        save_standalone(read.state, step, out, overwrite=overwrite)
        return ConvertReport(read.format, out_format, redact_url(os.fspath(out)), step, [], [],
                             read.notes)
    written = export(read.state, step, target, out_format, overwrite=overwrite)
    return ConvertReport(read.format, out_format, target, step, written.files, written.left_out, read.notes)
