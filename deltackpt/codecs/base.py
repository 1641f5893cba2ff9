"""The codec interface and registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from deltackpt.errors import CorruptionError, FormatError


@dataclass
class EncodedChunk:
    """Stored form of one chunk: what to write and how to read it back.

    ``parts`` are written one after another; keeping them separate lets a
    raw byte plane go to the file without being copied into one buffer.
    """

    codec: str
    params: dict[str, Any]
    parts: list[Any] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Number of stored bytes."""
        return sum(memoryview(p).nbytes for p in self.parts)


class Codec(Protocol):
    """Decodes the stored bytes of a chunk into a preallocated buffer."""

    name: str

    def decode(self, stored: memoryview, params: dict[str, Any], out: np.ndarray) -> None:
        """Fill ``out`` (uint8, exactly the chunk's raw length) from ``stored``.

        Raises :class:`CorruptionError` when the stored bytes do not decode to
        exactly ``out.nbytes`` bytes.
        """


CODECS: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make ``codec`` available to readers under ``codec.name``."""
    CODECS[codec.name] = codec
    return codec


def codec_named(name: str) -> Codec:
    """The registered codec ``name``; raises :class:`FormatError` naming it if there is none."""
    try:
        return CODECS[name]
    except KeyError:
        raise FormatError(f"unknown codec {name!r} (this deltackpt knows {sorted(CODECS)}); "
                          "the checkpoint was written by a newer version") from None


def decode_into(codec: str, params: dict[str, Any], stored: memoryview, out: np.ndarray) -> None:
    """Decode one chunk with the codec its metadata names."""
    codec_named(codec).decode(stored, params, out)


def check_length(actual: int, expected: int, what: str) -> None:
    """Raise :class:`CorruptionError` unless a decoded length is what metadata promised."""
    if actual != expected:
        raise CorruptionError(f"{what} decoded to {actual} bytes, metadata says {expected}")
