"""The ``cast`` chunk of delta steps: a 16-bit parameter taken from its float32 master copy
(docs/FORMAT.md, section 3.3).

Mixed-precision optimizers (TransformerEngine's ``FusedAdam(master_weights=True)``,
Megatron-style ones) keep a float32 master copy of each bfloat16/float16
parameter in the parameter's optimizer state, under ``master_param``, and
set the parameter to the master rounded to its dtype after every step. The
master is what training accumulates small updates in, so a delta step codes
the master like a weight and stores the parameter as ``cast`` chunks: no
bytes at all, the values being the master's running values in the same
step rounded to the parameter's dtype. A restored parameter is then exactly
its restored master rounded, as the optimizer would have made it.

Like a ``quant`` chunk, a cast chunk decodes only through the restore chain
(:mod:`deltackpt.restore.chain`), which has the master's running values.
"""

from __future__ import annotations

from typing import Any

from deltackpt.codecs.base import EncodedChunk
from deltackpt.errors import FormatError

NAME = "cast"
# Optimizer-state keys that hold a float32 master copy of a parameter.
MASTER_KEYS = ("master_param",)
CAST_DTYPES = ("bfloat16", "float16")


def encode_cast(source: str) -> EncodedChunk:
    """A chunk whose values are those of tensor ``source`` in the same step, rounded."""
    return EncodedChunk(NAME, {"source": source})


def cast_source(params: dict[str, Any]) -> str:
    """The validated name of the tensor a cast chunk takes its values from."""
    source = params.get("source")
    if not isinstance(source, str) or set(params) != {"source"}:
        raise FormatError(f"cast chunk params must be {{'source': <tensor name>}}, got {params!r}")
    return source

