"""A checkpoint directory as a reader sees it: its committed steps, their metadata, and a check
of their stored bytes and delta chains.

None of this needs torch or the Numba kernels, and this module imports neither (a deep
:meth:`~CheckpointDirectory.verify`, which decodes, imports them when it runs): the
commands that only read metadata (``deltackpt ls``, ``info``, ``du``, ``verify``) start
in a fraction of the time ``import torch`` takes. :class:`~deltackpt.manager.CheckpointManager`
adds saving, restoring, loading and retention to it.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

from deltackpt.errors import StepNotFoundError
from deltackpt.format.metadata import (
    METADATA_FILE,
    StepMetadata,
    step_dir_name,
)
from deltackpt.io.reader import dependents, list_steps, read_metadata, step_not_found
from deltackpt.io.root import open_root
from deltackpt.io.storage import Storage, open_storage
from deltackpt.ops.verify import VerifyReport, verify_steps


class CheckpointDirectory:
    """The committed steps of a checkpoint directory, read without torch.

    Opening one reads and checks the directory's root marker; nothing is
    ever locked or changed, so any number of readers may open a directory
    while a writer saves to it.

    Args:
        path: the checkpoint directory, a ``file://`` URL, or an fsspec URL of a prefix on an
            object store (``s3://bucket/run1``).
        workers: threads used to check (and decode) chunks (default: usable CPUs).
        create: create an empty checkpoint directory if ``path`` does not
            exist or is empty (else: raise :class:`NotACheckpointError`).
        storage_options: options of the object store of an fsspec ``path``: endpoint,
            credentials and the like, passed to its fsspec file system; without them its
            client's environment variables and configuration files apply. They are never
            written anywhere nor shown in errors.
    """

    def __init__(self, path: str | os.PathLike[str], *, workers: int | None = None,
                 create: bool = False, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage: Storage = open_storage(path, storage_options)
        self.path = self.storage.url
        self.workers = workers
        open_root(self.storage, create=create)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return list_steps(self.storage)

    def latest_step(self) -> int | None:
        """The highest committed step, or ``None`` if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> StepMetadata:
        """The validated metadata of ``step``."""
        return read_metadata(self.storage, check_step(step))

    def resolve_step(self, step: int | None = None) -> int:
        """``step`` if it is committed, the latest step if ``step`` is None.

        Raises :class:`StepNotFoundError` listing the committed steps otherwise.
        """
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise StepNotFoundError(f"{self.path} has no committed steps")
            return latest
        step = check_step(step)
        if not self.storage.exists(f"{step_dir_name(step)}/{METADATA_FILE}"):
            raise step_not_found(self.storage, step)
        return step

    def dependents(self, step: int) -> list[int]:
        """Committed delta steps coded directly against ``step``."""
        return dependents(check_step(step), self.steps(), self.metadata)

    def verify(self, step: int | None = None, *, deep: bool = False,
               progress: bool = False) -> VerifyReport:
        """Check one step (or all) against their checksums, with their delta chains.

        Returns ``{step: [problem, ...]}`` for every checked step; an empty
        list means the step can be restored. A delta step also lists, once
        each, the damaged steps of its chain, and a missing base; the
        report's ``damage`` gives every damaged file once, with the steps that
        depend on it (:class:`~deltackpt.ops.verify.VerifyReport`). ``deep``
        also decodes every chunk (a delta step by restoring its chain).
        """
        steps = [self.resolve_step(step)] if step is not None else self.steps()
        return verify_steps(self.storage, steps, deep=deep, workers=self.workers, progress=progress)


def check_step(step: Any) -> int:
    """``step`` as an int; any integer type (numpy, 0-d integer tensors) is accepted."""
    try:
        value = operator.index(step)
    except TypeError:
        value = None
    if isinstance(step, bool) or value is None or value < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return value
