"""deltackpt: small, fast, portable checkpoints for long PyTorch training runs.

The public API is :class:`CheckpointManager` (save, restore, load steps),
:class:`CompressionConfig` and :class:`Quantizer` (what delta steps keep),
:class:`RetentionPolicy` and :class:`KeepSteps` (which steps to keep), :class:`UniversalCheckpoint`
(a restored step, one whole tensor per name) and :func:`load_universal`.
The on-disk format is specified in docs/FORMAT.md.
"""

from typing import TYPE_CHECKING

from deltackpt._lazy import lazy_attributes
from deltackpt._version import __version__
from deltackpt.errors import (
    BackgroundSaveError,
    ChainChangedError,
    ConfigError,
    CorruptionError,
    DeltackptError,
    DistributedError,
    FormatError,
    IntegrationError,
    NotACheckpointError,
    OtherRunError,
    ReadFailedError,
    SaveInFlightError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsafePathError,
    WriteFailedError,
    WriterLockedError,
)

# Imported when first used: these import torch and the Numba kernels, which the commands that
# only read metadata (deltackpt ls, info, du, verify) do without.
__getattr__, __dir__ = lazy_attributes(__name__, {
    "EXACT": "deltackpt.encode.policy",
    "CompressionConfig": "deltackpt.encode.policy",
    "Quantizer": "deltackpt.encode.policy",
    "LoadReport": "deltackpt.restore.loading",
    "CheckpointManager": "deltackpt.manager",
    "SaveHandle": "deltackpt.save.queue",
    "SaveInfo": "deltackpt.save.info",
    "GCReport": "deltackpt.ops.retention",
    "KeepSteps": "deltackpt.ops.retention",
    "RetentionPolicy": "deltackpt.ops.retention",
    "UniversalCheckpoint": "deltackpt.restore.universal",
    "load_universal": "deltackpt.manager",
})

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from deltackpt.encode.policy import EXACT, CompressionConfig, Quantizer
    from deltackpt.manager import CheckpointManager, load_universal
    from deltackpt.ops.retention import GCReport, KeepSteps, RetentionPolicy
    from deltackpt.restore.loading import LoadReport
    from deltackpt.restore.universal import UniversalCheckpoint
    from deltackpt.save.info import SaveInfo
    from deltackpt.save.queue import SaveHandle

__all__ = [
    "EXACT",
    "BackgroundSaveError",
    "ChainChangedError",
    "CheckpointManager",
    "CompressionConfig",
    "ConfigError",
    "CorruptionError",
    "DeltackptError",
    "DistributedError",
    "FormatError",
    "GCReport",
    "IntegrationError",
    "KeepSteps",
    "LoadReport",
    "NotACheckpointError",
    "OtherRunError",
    "Quantizer",
    "ReadFailedError",
    "RetentionPolicy",
    "SaveHandle",
    "SaveInFlightError",
    "SaveInfo",
    "StateMismatchError",
    "StepExistsError",
    "StepNotFoundError",
    "StorageError",
    "UniversalCheckpoint",
    "UnsafePathError",
    "WriteFailedError",
    "WriterLockedError",
    "__version__",
    "load_universal",
]
