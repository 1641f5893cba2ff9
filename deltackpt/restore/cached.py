"""Restoring through a local cache: a chain read from the cache in front of a remote checkpoint
where the cache holds the same steps, and from the checkpoint otherwise."""

from __future__ import annotations

import logging
from typing import Any

import torch

from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import CorruptionError
from deltackpt.format.metadata import StepMetadata
from deltackpt.io.reader import chain_of
from deltackpt.io.storage import Storage
from deltackpt.io.tiering import UploadCache
from deltackpt.restore.chain import restore_chain

log = logging.getLogger("deltackpt")


def restore_cached(storage: Storage, cache: UploadCache | None, meta: StepMetadata,
                   **kwargs: Any) -> tuple[dict[str, torch.Tensor], Reconstruction]:
    """:func:`~deltackpt.restore.chain.restore_chain` of ``meta`` from ``cache`` where it holds
    the same chain, and from ``storage`` otherwise or when a cached chunk fails its checksum."""
    if cache is not None and cache.holds(chain_of(storage, meta, kwargs.get("read"))):
        try:
            return restore_chain(cache.storage, meta, **kwargs)
        except CorruptionError as exc:
            log.warning("%s: the cached copy of step %d is damaged (%s); reading %s",
                        cache.storage.url, meta.step, exc, storage.url)
    return restore_chain(storage, meta, **kwargs)
