"""The ``unchanged`` chunk of delta steps: bytes a tensor had in the step's base, stored as
nothing (docs/FORMAT.md, section 3.5).

A delta stores the tensors it does not code lossily exactly, and many of them do not change
from save to save: the numpy and Python RNG states of a run that draws only from torch's, a
model's index and mask buffers, frozen integer tensors. Each would be stored again in full at
every save (the two RNG states alone about 6 KB). A chunk whose raw bytes are those of the
chunk of the same bytes in the base step is stored as an ``unchanged`` chunk instead, and
decodes only through the restore chain (:mod:`deltackpt.restore.chain`), which has the base's
bytes.
"""

from __future__ import annotations

from deltackpt.codecs.base import EncodedChunk
from deltackpt.format.metadata import UNCHANGED as NAME


def encode_unchanged() -> EncodedChunk:
    """A chunk whose raw bytes are those of the same chunk in the base step."""
    return EncodedChunk(NAME, {})
