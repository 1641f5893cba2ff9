"""torchtitan's checkpointing through deltackpt: a subclass of its ``CheckpointManager`` whose
``dcp.save``/``dcp.async_save``/``dcp.load`` go through :mod:`deltackpt.dcp`.

Its ``checkpoint.folder`` becomes one deltackpt checkpoint directory: each save is a step of it,
full or delta by ``full_every``, ``depth`` and ``compression``, and ``keep_latest_k`` is its
retention (``keep="last=k"``), which never deletes a step a kept delta needs. Loading (the latest
step, or ``load_step``) reads it back at any world size; an ``initial_load_path`` that is not a
deltackpt step, or a Hugging Face load, is torchtitan's own. The last step in Hugging Face format
is refused: ``deltackpt export`` writes it from any step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from deltackpt.errors import ConfigError
from deltackpt.format.checks import check_bool, check_int
from deltackpt.format.metadata import METADATA_FILE, step_dir_name
from deltackpt.integrations.dcp import Reader, Writer
from deltackpt.integrations.frameworks import require
from deltackpt.manager import CheckpointManager as DeltackptManager
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY

require("torchtitan")

from torchtitan.components.checkpoint import MODEL, AsyncMode  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager as TitanManager  # noqa: E402
from torchtitan.tools import filesystem  # noqa: E402
from torchtitan.tools.utils import GarbageCollection  # noqa: E402

_STEP_ID = re.compile(r"step-(\d+)")


class CheckpointManager(TitanManager):
    """torchtitan's DCP ``CheckpointManager`` saving deltackpt steps: configure it with
    :class:`CheckpointManager.Config` where torchtitan's would be."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanManager.Config):
        """torchtitan's checkpoint options, and deltackpt's."""

        full_every: int = DEFAULT_FULL_EVERY
        """A full (lossless) step every this many saves, deltas in between."""

        depth: int = DEFAULT_DEPTH
        """Restore through at most this many deltas."""

        compression: str = "balanced"
        """deltackpt's preset: balanced, aggressive or lossless."""

        continue_run: bool = False
        """Save into a folder holding another run's steps, after them."""

        def __post_init__(self) -> None:
            TitanManager.Config.__post_init__(self)
            check_int(self.full_every, "full_every")
            check_int(self.depth, "depth")
            check_bool(self.continue_run, "continue_run")
            if self.last_save_in_hf:
                raise ConfigError("deltackpt's torchtitan CheckpointManager does not write the "
                                  "last step in Hugging Face format (last_save_in_hf): "
                                  "`deltackpt export` writes one from any step")
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                raise ConfigError("async_mode='async_with_pinned_mem' runs DCP's save in another "
                                  "process, which deltackpt's saves do not support: use 'async'")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.deltackpt_config = config

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """Save ``state_dict`` as the step ``checkpoint_id`` names, blocking or on DCP's
        thread (``async``, on torchtitan's gloo group)."""
        config = self.deltackpt_config
        writer = Writer(self.folder, _step_of(checkpoint_id), full_every=config.full_every,
                        depth=config.depth, compression=config.compression,
                        continue_run=config.continue_run,
                        keep=f"last={self.keep_latest_k}" if self.keep_latest_k > 0 else None,
                        process_group=self.pg)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer)
            result = None
        else:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """Load the deltackpt step ``checkpoint_id`` names; anything else as torchtitan does."""
        if from_hf or not self._is_step(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=Reader(self.folder, _step_of(checkpoint_id)))
        if MODEL in self.states:  # torchtitan flattens the model's state: load it itself
            self.states[MODEL].load_state_dict(state_dict)

    def _is_step(self, checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` is a committed step of this manager's folder."""
        m = _STEP_ID.fullmatch(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
        return m is not None and checkpoint_id == self._create_checkpoint_id(int(m[1])) \
            and filesystem.isfile(filesystem.join(checkpoint_id, METADATA_FILE))

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return filesystem.join(folder or self.folder, step_dir_name(step))

    def _find_load_step(self, folder: str = "") -> int:
        """The latest committed step of the folder, or -1."""
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1
        steps = DeltackptManager(folder, read_only=True).steps()
        return steps[-1] if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: ``keep_latest_k`` is the retention each save applies, which keeps the steps
        a kept delta needs."""


def _step_of(checkpoint_id: str) -> int:
    """The step of torchtitan's ``<folder>/step-<N>``."""
    m = _STEP_ID.fullmatch(checkpoint_id.rstrip("/").rsplit("/", 1)[-1])
    if m is None:
        raise ConfigError(f"{checkpoint_id}: not a torchtitan checkpoint id (<folder>/step-<N>)")
    return int(m[1])
