"""The universal checkpoint: one consolidated tensor per name, independent of how it was saved."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deltackpt.format.metadata import StepMetadata
from deltackpt.format.state import CapturedState, CapturedTensor
from deltackpt.format.tree import decode_tree
from deltackpt.restore.loading import LoadReport, load_into
from deltackpt.save.capture import python_rng_state
from deltackpt.save.info import SaveInfo
from deltackpt.save.standalone import save_standalone


@dataclass
class UniversalCheckpoint:
    """A restored step: every tensor whole, by its universal name, plus the step's metadata.

    ``tensors`` uses the names of docs/FORMAT.md 2.3 (``model/<fqn>``,
    ``optimizer/state/<fqn>/<key>``, ...); tied parameters are the same
    tensor object under both names. The properties give the familiar views.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    metadata: StepMetadata

    def _tree(self, key: str) -> Any:
        return decode_tree(self.metadata.state.get(key), self.tensors.__getitem__)

    @property
    def model(self) -> dict[str, torch.Tensor]:
        """The model's state dict (parameters and persistent buffers) by FQN."""
        return {r.fqn: self.tensors[r.name] for r in self.metadata.tensors
                if r.role in ("param", "buffer")}

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """``{"class", "param_groups", "state"}`` with state keyed by parameter FQN."""
        return self._tree("optimizer")

    @property
    def extra(self) -> Any:
        """The ``extra`` passed to ``save``."""
        return self._tree("extra")

    @property
    def rng(self) -> dict[str, Any] | None:
        """RNG states captured at save time (``python`` as ``random.getstate`` gives it)."""
        rng = self._tree("rng")
        if rng is not None and "python" in rng:
            rng["python"] = python_rng_state(rng["python"])
        return rng

    def load_into(self, model: nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None, *,
                  strict: bool = True, rng: bool = True, copy: bool = True) -> LoadReport:
        """Copy this checkpoint into ``model`` and ``optimizer`` (and the RNGs).

        Optimizer state is matched by parameter name, so the optimizer may
        list its parameters in another order or in other param groups. In
        strict mode any mismatch raises before anything changes; otherwise
        what matches is loaded and the report lists the rest. ``report.extra``
        holds the saved ``extra``. ``copy=False`` hands the optimizer this
        checkpoint's state tensors instead of copies (saves memory and time
        when the checkpoint is not used again).
        """
        report = load_into(model, optimizer, saved_model=self.model, saved_optimizer=self.optimizer,
                           saved_rng=self.rng, strict=strict, rng=rng, copy=copy)
        report.extra = self.extra
        return report

    def captured(self) -> CapturedState:
        """This checkpoint as state to write again."""
        return CapturedState(
            [CapturedTensor(r.name, r.role, self.tensors[r.name], r.fqn, r.state_key, r.alias_of)
             for r in self.metadata.tensors],
            self.metadata.state)

    def save_universal(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> SaveInfo:
        """Write this step, losslessly, as a standalone checkpoint directory at ``path``.

        The result is an ordinary deltackpt directory holding one full step:
        ``deltackpt.load_universal(path)`` or any tool of this package reads it.
        """
        return save_standalone(self.captured(), self.step, path, overwrite=overwrite)
