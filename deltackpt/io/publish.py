"""Directories that appear whole or not at all: written beside their place, then moved in."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path


def publish_directory(out: Path, write: Callable[[Path], None], commit_file: str | None = None
                      ) -> list[Path]:
    """Run ``write(tmp)`` on a fresh sibling directory of ``out`` and move what it wrote into ``out``.

    A new or empty ``out`` is replaced by the finished directory in one
    rename. Into a non-empty ``out`` (overwriting) the files are moved one
    by one, replacing those of the same name and keeping the others;
    ``commit_file`` (the file that makes the directory a checkpoint, as
    DCP's ``.metadata``) is removed first and moved last, so an interrupted
    move never leaves a checkpoint whose index names the wrong data.
    Every file gets the permissions the user's umask gives a new file,
    whatever its writer created it with. Returns the paths of the files
    written, sorted.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        write(tmp)
        _apply_umask(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        if not out.exists() or not any(out.iterdir()):
            os.replace(tmp, out)  # rename(2) replaces an empty directory
        else:
            if commit_file is not None:
                (out / commit_file).unlink(missing_ok=True)
            for name in sorted(names, key=lambda n: n == commit_file):
                os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in names]


def _apply_umask(root: Path) -> None:
    """Give every file under ``root`` the mode the umask gives a new file (``0o666`` less the
    umask), as ``open`` would: writers that go through a private temporary file, as safetensors
    does, leave it ``0o600``. The umask is read off ``root``, made with ``mkdir``'s default mode
    (``0o777`` less the umask), since reading it with ``os.umask`` changes it for a moment for
    every thread of the process."""
    mode = stat.S_IMODE(root.stat().st_mode) & 0o666
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            if not path.is_symlink():
                path.chmod(mode)
