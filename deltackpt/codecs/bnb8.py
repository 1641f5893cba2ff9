"""The ``bnb8`` chunks of delta steps: bitsandbytes 8-bit optimizer states coded by meaning
(docs/FORMAT.md, section 3.4).

bitsandbytes' 8-bit optimizers (``AdamW8bit``, ``PagedAdamW8bit``,
``Lion8bit``...) hold each moment as ``uint8`` codes (``state1``,
``state2``) into a 256-entry code map (``qmap1``, ``qmap2``), scaled per
block of ``blocksize`` elements by a float32 ``absmax1``/``absmax2``:
element ``j`` means ``qmap[code[j]] * absmax[j // blocksize]``. Stored as
bytes, the codes change almost everywhere from one save to the next, so a
delta step codes what they *mean* instead:

* the *running value* of an 8-bit state tensor is a float32 moment. In a
  chunk stored exactly (every full step) it is the dequantized codes,
  ``f32(qmap[code] * absmax[block])`` with the ``qmap`` and ``absmax`` of the
  same step; a ``bnb8`` chunk replaces it with the float32 values its
  *inner* chunk decodes to: a ``quant`` chunk (closed loop against the
  previous running values, or from zero, exactly as for float moments), or
  a lossless chunk of the float32 values themselves;
* the codes and ``absmax`` of such a step are *derived*: the running values
  requantized by bitsandbytes' own blockwise quantizer
  (``bitsandbytes.functional.quantize_blockwise`` with the step's ``qmap``
  and ``blocksize``), the very function its optimizers requantize with
  after every update, so the restored state is a valid 8-bit state.

Checksums. bitsandbytes' quantizer is native code (CPU, CUDA...) whose
choice between the two code-map entries nearest a value may differ from
machine to machine, so the restored codes are not fixed by the format.
What is fixed: a state chunk's ``raw_xxh3`` covers its float32 running
values (exactly defined by the inner codec), and an ``absmax`` chunk's
covers its decoded bytes, ``max |running value|`` per block, which every
implementation computes alike. The requantized codes are checked for what
they must be instead: each one a code-map entry as close to its value
divided by its block's ``absmax`` as the nearest one, within
``CODE_TOLERANCE`` (:func:`check_requantized`).

Reading these chunks needs bitsandbytes; nothing else in deltackpt does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deltackpt.codecs.base import EncodedChunk
from deltackpt.codecs.quant import NAME as QUANT
from deltackpt.codecs.quant import quant_params
from deltackpt.errors import DeltackptError, FormatError

NAME = "bnb8"
STATE_PARAMS = frozenset({"codec", "params", "qmap", "absmax", "blocksize"})
QMAP_SIZE = 256
BLOCKSIZES = tuple(1 << k for k in range(6, 13))  # 64..4096: bitsandbytes' optimizers use 256
INSTALL = "pip install 'deltackpt[bnb]', i.e. bitsandbytes>=0.50"
# How much farther from value / absmax than the nearest code-map entry a requantized code may be:
# bitsandbytes' native quantizers search the map approximately (up to 3e-5 measured on CPU).
CODE_TOLERANCE = 2.0**-12


def quantize_blockwise(values: np.ndarray, qmap: np.ndarray,
                       blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, absmax)`` of float32 ``values`` by bitsandbytes' blockwise quantizer.

    Raises :class:`DeltackptError` naming what to install when bitsandbytes
    is missing.
    """
    try:
        from bitsandbytes.functional import quantize_blockwise as bnb_quantize
    except ImportError as exc:
        raise DeltackptError(f"this step holds bitsandbytes 8-bit optimizer states coded as "
                             f"'bnb8' chunks, which are requantized by bitsandbytes: install it "
                             f"({INSTALL}; {exc})") from None
    codes, state = bnb_quantize(torch.from_numpy(values), code=torch.from_numpy(qmap),
                                blocksize=blocksize)
    return codes.numpy(), state.absmax.float().numpy()


def dequantize(codes: np.ndarray, absmax: np.ndarray, qmap: np.ndarray,
               blocksize: int) -> np.ndarray:
    """The float32 values an 8-bit state means: ``f32(qmap[code] * absmax[block])``."""
    scale = np.repeat(absmax.astype(np.float32, copy=False), blocksize)[: codes.size]
    return qmap.astype(np.float32, copy=False)[codes.reshape(-1)] * scale


def block_absmax(values: np.ndarray, blocksize: int) -> np.ndarray:
    """``max |value|`` of each block of float32 ``values`` (the last block may be shorter)."""
    pad = np.zeros(-values.size % blocksize, np.float32)
    return np.abs(np.concatenate([values, pad])).reshape(-1, blocksize).max(axis=1)


def check_requantized(values: np.ndarray, codes: np.ndarray, absmax: np.ndarray,
                      qmap: np.ndarray, blocksize: int) -> None:
    """Raise :class:`DeltackptError` unless ``codes`` and ``absmax`` quantize ``values``: each
    block's ``absmax`` is its largest magnitude, and each code's entry of ``qmap`` (sorted) is
    within ``CODE_TOLERANCE`` as close to ``value / absmax`` as the nearest entry (any code in
    a block of zeros)."""
    if not np.array_equal(absmax, block_absmax(values, blocksize)):
        raise DeltackptError("bitsandbytes' quantizer returned absmax values that are not the "
                             "blocks' largest magnitudes")
    scale = np.repeat(absmax, blocksize)[: values.size]
    live = scale > 0
    y = values[live] / scale[live]
    upper = np.clip(np.searchsorted(qmap, y), 1, qmap.size - 1)
    nearest = np.minimum(np.abs(qmap[upper] - y), np.abs(qmap[upper - 1] - y))
    error = np.abs(qmap[codes.reshape(-1)[live]] - y)
    if not np.all(error <= nearest + CODE_TOLERANCE):
        raise DeltackptError("bitsandbytes' quantizer returned codes that do not round their "
                             "values to a nearest code-map entry")


def encode_state(inner: EncodedChunk, qmap: str, absmax: str, blocksize: int) -> EncodedChunk:
    """A state chunk whose running values ``inner`` (a quant or lossless chunk of float32
    values) holds; ``qmap`` and ``absmax`` name the step's code map and scales."""
    return EncodedChunk(NAME, {"codec": inner.codec, "params": inner.params, "qmap": qmap,
                               "absmax": absmax, "blocksize": blocksize}, inner.parts)


def encode_absmax(state: str) -> EncodedChunk:
    """An ``absmax`` chunk derived from the running values of 8-bit state ``state``."""
    return EncodedChunk(NAME, {"state": state})


def state_params(params: dict[str, Any]) -> tuple[str, dict[str, Any], str, str, int]:
    """Validated ``(inner codec, inner params, qmap, absmax, blocksize)`` of a state chunk."""
    codec, inner, qmap, absmax, blocksize = (params.get(k) for k in (
        "codec", "params", "qmap", "absmax", "blocksize"))
    if not (params.keys() == STATE_PARAMS and isinstance(codec, str) and codec != NAME
            and isinstance(inner, dict) and isinstance(qmap, str) and isinstance(absmax, str)
            and blocksize in BLOCKSIZES and not isinstance(blocksize, bool)):
        raise FormatError(f"bnb8 state chunk params {params} are invalid")
    if codec == QUANT:
        quant_params(inner)
    return codec, inner, qmap, absmax, blocksize


def absmax_source(params: dict[str, Any]) -> str:
    """The validated name of the 8-bit state an ``absmax`` chunk is derived from."""
    state = params.get("state")
    if not isinstance(state, str) or set(params) != {"state"}:
        raise FormatError(f"bnb8 absmax chunk params must be {{'state': <tensor name>}}, "
                          f"got {params!r}")
    return state


def is_absmax_chunk(params: dict[str, Any]) -> bool:
    """Whether a ``bnb8`` chunk is an ``absmax`` chunk (else a state chunk); not validated."""
    return "state" in params


def self_contained(params: dict[str, Any]) -> bool:
    """Whether a ``bnb8`` state chunk decodes without its base step (its inner chunk is not a
    quant chunk coded against the base)."""
    return not (params.get("codec") == QUANT and isinstance(params.get("params"), dict)
                and params["params"].get("pred") == "base")
