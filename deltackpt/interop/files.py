"""Safe file handling for conversions: inputs are never unpickled beyond what
``torch.load(weights_only=True)`` accepts, never read outside their directory and never
written to (outputs appear whole: :mod:`deltackpt.io.publish`)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from deltackpt.errors import ConversionError


def prepare_out(out: Path, sources: Sequence[Path], overwrite: bool) -> Path:
    """The absolute output directory, after refusing one that overlaps a source, a file, or
    (without ``overwrite``) a non-empty directory."""
    target = out.expanduser().resolve()
    for source in sources:
        source = source.expanduser().resolve()
        if target == source or source in target.parents:
            raise ValueError(f"output directory {out} is inside the checkpoint directory {source}, "
                             "which is never written to; choose another directory")
        if target in source.parents:
            raise ValueError(f"output directory {out} contains the checkpoint {source}, "
                             "which is never written to; choose another directory")
    if target.exists() and not target.is_dir():
        raise ValueError(f"output directory {out} exists and is not a directory")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"output directory {out} is not empty; refusing to write into it "
                         "(pass --force, or overwrite=True, to write there anyway)")
    return target


def inside(root: Path, path: Path, named_by: str | None = None) -> Path:
    """``path``, a file of the checkpoint directory ``root``, after refusing one that leads out of
    it: an absolute or ``..`` path, or a symbolic link (the file or a directory on the way) to
    somewhere else. ``named_by`` says what named the path (an index file), for the error.

    A conversion reads its source and nothing else: a crafted index must not make it read, and
    copy into its output, another file of the machine.
    """
    real, real_root = path.resolve(), root.resolve()
    if real_root != real and real_root not in real.parents:
        to = "" if real == Path(os.path.abspath(path)) else f" (it leads to {real})"
        raise ConversionError(f"{named_by + ' names ' if named_by else ''}{path}, which is outside the "
                              f"checkpoint directory {root}{to}; convert reads only files inside it")
    return path


def load_weights_only(source: Path | IO[bytes], what: str | None = None) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU, with errors that name ``what``
    (default: the file).

    deltackpt never unpickles anything else: a file holding other objects
    (classes of the program that wrote it) is refused, naming them.
    """
    what = what or str(source)
    if isinstance(source, Path) and not source.is_file():
        raise FileNotFoundError(f"{source} {'is not a file' if source.exists() else 'does not exist'}")
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            if not isinstance(source, Path):
                source.seek(0)
            unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(source))
        except Exception:  # damaged beyond listing its globals
            unsafe = "objects it cannot list"
        raise ConversionError(f"{what}: torch.load(weights_only=True) refuses it, as it holds {unsafe}; "
                              "deltackpt never unpickles arbitrary objects") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ConversionError(f"{what}: not a readable torch.save file ({exc})") from None
