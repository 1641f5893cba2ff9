"""deltackpt: small, fast, portable checkpoints for long PyTorch training runs.

The public API is :class:`CheckpointManager` (save, restore, load steps),
:class:`CompressionConfig` and :class:`Quantizer` (what delta steps keep),
:class:`RetentionPolicy` (which steps to keep), :class:`UniversalCheckpoint`
(a restored step, one whole tensor per name) and :func:`load_universal`.
The on-disk format is specified in docs/FORMAT.md.
"""

__version__ = "0.1.0"

from deltackpt.compression import EXACT, CompressionConfig, Quantizer
from deltackpt.errors import (
    ConfigError,
    CorruptionError,
    DeltackptError,
    DistributedError,
    FormatError,
    NotACheckpointError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    UnsafePathError,
    WriteFailedError,
    WriterLockedError,
)
from deltackpt.loading import LoadReport
from deltackpt.manager import CheckpointManager, SaveInfo
from deltackpt.retention import GCReport, RetentionPolicy
from deltackpt.universal import UniversalCheckpoint, load_universal

__all__ = [
    "EXACT",
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
    "SaveInfo",
    "StateMismatchError",
    "StepExistsError",
    "StepNotFoundError",
    "UniversalCheckpoint",
    "UnsafePathError",
    "WriteFailedError",
    "WriterLockedError",
    "__version__",
    "load_universal",
]
