"""Exceptions. Every message names what is wrong: the step, tensor or file."""

from __future__ import annotations


class DeltackptError(Exception):
    """Base class of every error deltackpt raises on purpose."""


class ConfigError(DeltackptError, ValueError):
    """A setting that cannot be used (a manager argument, a compression config, preset or
    override, a retention policy); names the setting and the value."""


class NotACheckpointError(DeltackptError):
    """The path is not a deltackpt checkpoint directory."""


class FormatError(DeltackptError):
    """Metadata that does not follow docs/FORMAT.md, or from an unknown major version."""


class StepNotFoundError(DeltackptError, KeyError):
    """The requested step was never committed."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


class StepExistsError(DeltackptError):
    """Saving a step that already exists without ``overwrite=True``."""


class CorruptionError(DeltackptError):
    """Stored bytes are missing, truncated or fail their checksum."""


class StateMismatchError(DeltackptError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""


class StorageError(DeltackptError):
    """Storage that cannot be used: an unknown URL scheme (names the package to install), a missing
    bucket, missing or refused credentials, an unreachable endpoint. Names the URL, never a
    credential."""


class WriterLockedError(DeltackptError):
    """Another process (or manager) is writing to the same checkpoint directory."""


class DistributedError(DeltackptError):
    """A collective save or load failed on some rank; raised on every rank, naming it."""


class SaveInFlightError(DeltackptError, ValueError):
    """Saving a step that an asynchronous save of the same manager is still writing, or a step
    older than one it is writing (a delta is coded against the save before it); names both."""


class BackgroundSaveError(DeltackptError):
    """An asynchronous save failed in the background; raised by the manager's next ``save``,
    ``wait`` or ``close``, naming the step, with the original error chained (``__cause__``)."""


class ConversionError(DeltackptError):
    """A checkpoint of another format that cannot be read or converted; names the file and entry."""


class UnsafePathError(CorruptionError):
    """An entry inside a checkpoint directory that deltackpt never writes there, so never follows,
    opens or deletes through: a symbolic link, FIFO, device or socket, a directory where a file
    belongs or a file where a directory belongs; names the path and what it is."""


class WriteFailedError(DeltackptError, OSError):
    """Writing a step failed (disk full, I/O error); names the step and the file, and keeps the
    ``errno`` of the failure. What the failed write left is removed; earlier steps are intact."""


class ChainChangedError(DeltackptError):
    """A step whose chain the writer's retention replaced during every one of several reads
    (each read starts over on the current chain); names the step. Nothing is damaged."""


class ReadFailedError(DeltackptError, OSError):
    """Reading a checkpoint failed for a reason its bytes do not explain (permission denied, a
    read-only or failing disk, a name the file system refuses): names the file, and with it the
    checkpoint and step, and keeps the ``errno``. Says nothing of the step's integrity:
    ``verify`` reports such a step as not checked, not as damaged."""


def os_failure(kind: type[OSError], path: str, exc: OSError, prefix: str = "",
               suffix: str = "") -> OSError:
    """A ``kind`` (:class:`ReadFailedError` or :class:`WriteFailedError`) for ``exc``, an OS
    error on file ``path`` (or one already made by this function): ``{prefix}{path}: {reason}
    {suffix}``, with the ``errno``, and the ``path`` and ``reason`` apart."""
    reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
    error = kind(f"{prefix}{path}: {reason}{suffix}")
    error.errno, error.path, error.reason = exc.errno, path, reason
    return error


class IntegrationError(DeltackptError):
    """A framework an integration drives is missing, of a version deltackpt is not tested with,
    or hands over what the integration cannot map (names both versions, or the names)."""


class OtherRunError(DeltackptError):
    """An integration was asked to save into a checkpoint that holds another run's steps,
    without being told to continue that run."""
