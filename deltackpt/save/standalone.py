"""One step written alone into a checkpoint directory of its own: what
:meth:`~deltackpt.UniversalCheckpoint.save_universal` and the ``deltackpt`` export write."""

from __future__ import annotations

import os
from pathlib import Path

from deltackpt.dist.group import Group
from deltackpt.encode.policy import CompressionConfig
from deltackpt.format.state import CapturedState
from deltackpt.io.pool import WorkerPool, rank_threads
from deltackpt.io.publish import publish_directory
from deltackpt.io.root import open_root
from deltackpt.io.storage import LOCK_FILE, is_url, open_storage
from deltackpt.io.writer import DEFAULT_CHUNK_BYTES
from deltackpt.save.driver import SaveSettings, Writer, save_step
from deltackpt.save.info import SaveInfo
from deltackpt.save.reference import Reference
from deltackpt.save.target import SaveTarget


def save_standalone(captured: CapturedState, step: int, path: str | os.PathLike[str], *,
                    overwrite: bool = False) -> SaveInfo:
    """Write ``captured`` losslessly as step ``step`` of the deltackpt directory at ``path``.

    A new or empty ``path`` appears whole, in one rename of a private temporary directory, and
    holds no writer lock file (nothing writes to it). Into an existing checkpoint directory, or
    at an object store URL, the step is saved as any step is (``overwrite`` replaces it).
    Under torch.distributed every rank calls it, as it calls a save.
    """
    if is_url(path):  # an object store has no rename; the step's commit is atomic there
        return _save_lossless(captured, step, path, overwrite)
    out = Path(open_storage(path).url)
    if out.exists() and any(out.iterdir()):
        return _save_lossless(captured, step, out, overwrite)
    saved = []

    def write(tmp: Path) -> None:
        saved.append(_save_lossless(captured, step, tmp, overwrite))
        (tmp / LOCK_FILE).unlink()  # the directory is private: no other writer can hold the lock

    publish_directory(out, write)
    return saved[0]


def _save_lossless(captured: CapturedState, step: int, path: str | os.PathLike[str],
                   overwrite: bool) -> SaveInfo:
    """Save ``captured`` as a full step of the checkpoint directory at ``path`` (created if
    missing or empty), holding its writer lock for the save."""
    storage = open_storage(path)
    open_root(storage, create=True)
    target = SaveTarget(storage)
    group = Group.current() or Group.single()
    pool = WorkerPool(rank_threads(group))
    settings = SaveSettings(CompressionConfig.preset("lossless"), full_every=1,
                            chunk_bytes=DEFAULT_CHUNK_BYTES)
    try:
        return save_step(Writer(target, settings, Reference()), step, captured, group, pool,
                         overwrite=overwrite, progress=False).info
    finally:
        target.release()
        pool.close()
