"""The lossy ``quant`` codec of delta steps (docs/FORMAT.md, section 3.2).

A chunk's stored bytes are one zstd frame of the packed symbol stream of
:mod:`deltackpt.kernels.quant`. Decoding needs the chunk's prediction: zero,
or the reconstruction of the same elements in the base step (``pred:
"base"``), which the restore chain (:mod:`deltackpt.chain`) supplies. The
decoded values are float32: the running reconstruction. A tensor of a
16-bit dtype is that reconstruction rounded to its dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from deltackpt.codecs.base import EncodedChunk
from deltackpt.codecs.lossless import zstd_compress, zstd_decompress
from deltackpt.errors import CorruptionError, FormatError
from deltackpt.kernels.quant import (
    MAX_KEY,
    STAT_BAD,
    STAT_CLIPPED,
    decode_block_stream,
    encode_block_stream,
)

NAME = "quant"


def encode_quant(x: np.ndarray, pred: np.ndarray | None, recon: np.ndarray, *, ordinal: bool,
                 step: float | int, block: int) -> tuple[EncodedChunk | None, np.ndarray]:
    """Quantize float32 ``x`` against ``pred`` (or zero), writing the reconstruction to ``recon``.

    Returns the chunk and its per-block statistics (``kernels.quant.STAT_*``),
    or ``None`` for the chunk when an element cannot be coded within half a
    step (non-finite values, or a change beyond the 16-bit symbol range,
    e.g. a sign flip in the ordinal domain); ``recon`` then holds garbage
    and the caller stores ``x`` exactly.
    """
    stream, stats = encode_block_stream(x, pred, recon, ordinal=ordinal, step=step, block=block)
    if stats[:, STAT_BAD].any() or stats[:, STAT_CLIPPED].any():
        return None, stats
    params = {"domain": "ordinal" if ordinal else "linear",
              "pred": "zero" if pred is None else "base", "step": step, "block": block}
    return EncodedChunk(NAME, params, [zstd_compress(stream)]), stats


def quant_params(params: dict[str, Any]) -> tuple[bool, bool, float | int, int]:
    """Validated ``(ordinal, uses_base, step, block)`` of a quant chunk."""
    domain, pred, step, block = (params.get(k) for k in ("domain", "pred", "step", "block"))
    ok = (domain in ("linear", "ordinal") and pred in ("base", "zero")
          and isinstance(block, int) and not isinstance(block, bool) and 1 <= block <= 1 << 24)
    if ok and domain == "ordinal":
        ok = isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= MAX_KEY
    elif ok:
        ok = (isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0
              and float(np.float32(step)) == step)
    if not ok:
        raise FormatError(f"quant params {params} are invalid")
    return domain == "ordinal", pred == "base", step, block


def uses_base(params: dict[str, Any]) -> bool:
    """Whether a quant chunk is coded against its base step's reconstruction."""
    return params.get("pred") == "base"


def decode_quant(stored: memoryview, params: dict[str, Any], pred: np.ndarray | None,
                 out: np.ndarray) -> None:
    """Decode a quant chunk into float32 ``out`` (may be ``pred``: updated in place)."""
    ordinal, with_base, step, block = quant_params(params)
    if with_base and pred is None:
        raise FormatError("quant chunk is coded against its base step, which was not given")
    n = out.shape[0]
    n_blocks = -(-n // block)
    # A stream can never exceed its widths plus 16 bits an element; refuse to inflate more.
    stream = np.frombuffer(zstd_decompress_bounded(stored, n_blocks + 2 * n), dtype=np.uint8)
    try:
        decode_block_stream(stream, pred if with_base else None, out, ordinal=ordinal, step=step,
                            block=block)
    except ValueError as exc:
        raise CorruptionError(f"quant stream does not decode ({exc})") from None


def zstd_decompress_bounded(stored: memoryview, limit: int) -> bytes:
    """Decompress a zstd frame whose content size is stated and at most ``limit``."""
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"quant chunk: not a zstd frame ({exc})") from None
    if size < 0 or size > limit:
        raise CorruptionError(f"quant chunk: frame holds {size} bytes, at most {limit} possible")
    return zstd_decompress(stored, size, "quant chunk")
