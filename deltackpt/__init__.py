"""deltackpt: small, fast, portable checkpoints for long PyTorch training runs.

The public API is :class:`CheckpointManager` (save, restore, load steps),
:class:`CompressionConfig` and :class:`Quantizer` (what delta steps keep),
:class:`RetentionPolicy` (which steps to keep), :class:`UniversalCheckpoint`
(a restored step, one whole tensor per name) and :func:`load_universal`.
The on-disk format is specified in docs/FORMAT.md.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

from deltackpt.errors import (
    BackgroundSaveError,
    ConfigError,
    CorruptionError,
    DeltackptError,
    DistributedError,
    FormatError,
    NotACheckpointError,
    SaveInFlightError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsafePathError,
    WriteFailedError,
    WriterLockedError,
)
from deltackpt.lazy import lazy_attributes

# Imported when first used: these import torch and the Numba kernels, which the commands that
# only read metadata (deltackpt ls, info, du, verify) do without.
__getattr__, __dir__ = lazy_attributes(__name__, {
    "EXACT": "deltackpt.compression",
    "CompressionConfig": "deltackpt.compression",
    "Quantizer": "deltackpt.compression",
    "LoadReport": "deltackpt.loading",
    "CheckpointManager": "deltackpt.manager",
    "SaveHandle": "deltackpt.pipeline",
    "SaveInfo": "deltackpt.saving",
    "GCReport": "deltackpt.retention",
    "RetentionPolicy": "deltackpt.retention",
    "UniversalCheckpoint": "deltackpt.universal",
    "load_universal": "deltackpt.universal",
})

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from deltackpt.compression import EXACT, CompressionConfig, Quantizer
    from deltackpt.loading import LoadReport
    from deltackpt.manager import CheckpointManager
    from deltackpt.pipeline import SaveHandle
    from deltackpt.retention import GCReport, RetentionPolicy
    from deltackpt.saving import SaveInfo
    from deltackpt.universal import UniversalCheckpoint, load_universal

__all__ = [
    "EXACT",
    "BackgroundSaveError",
    "CheckpointManager",
    "CompressionConfig",
    "ConfigError",
    "CorruptionError",
    "DeltackptError",
    "DistributedError",
    "FormatError",
    "GCReport",
    "LoadReport",
    "NotACheckpointError",
    "Quantizer",
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
