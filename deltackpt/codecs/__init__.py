"""Chunk codecs behind one interface (docs/FORMAT.md, section 3).

A codec turns the raw bytes of one chunk into stored bytes and back. Every
codec is registered under the name written into each chunk's metadata, so
a reader finds the decoder from the metadata alone.
"""

from __future__ import annotations

from deltackpt.codecs.base import CODECS, Codec, EncodedChunk, decode_into, register
from deltackpt.codecs.lossless import encode_lossless

__all__ = ["CODECS", "Codec", "EncodedChunk", "decode_into", "encode_lossless", "register"]
