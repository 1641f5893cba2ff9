"""The lossy ``quant`` codec of delta steps (docs/FORMAT.md, section 3.2).

A chunk's stored bytes are one zstd frame of the symbol stream of
:mod:`deltackpt.kernels.quant` in bit planes, or, for a chunk whose symbols are grouped by their
dither (first moments), a frame of its widths and the rANS body of its planes
(:mod:`deltackpt.kernels.rans`). Decoding needs the chunk's prediction: zero,
or the reconstruction of the same elements in the base step (``pred:
"base"``), which the restore chain (:mod:`deltackpt.restore.chain`) supplies, and for
a chunk with a ``scale`` the decoded values of the tensor it names, whose
square roots scale its step element by element (and, with a ``floor``, shape
it: finer where they are larger). The decoded values are
float32: the running reconstruction. A tensor of a 16-bit dtype is that
reconstruction rounded to its dtype.

An element that is exactly zero stays exactly zero (since format 2.4): a
dithered step would restore it as a fraction of a step, and an optimizer
state that is zero says "no gradient yet" (an embedding row no input has
used: Adam's update from a moment of a fraction of a step over ``eps`` is
a learning rate a step). A chunk lists the elements its kernels did not
restore as zero in a bitmap before its symbols (``zeros``), and both the
writer's running reconstruction and a reader's set them to zero.

:func:`decode_quant` decodes one chunk; a restore chain checks each step's
chunk with :func:`quant_stream` and applies all of them at once with
:func:`apply_quant_streams`.

Kernels: arrays (``x``, ``out``) that are CUDA tensors are coded on their
device by the Triton kernels of :mod:`deltackpt.kernels.gpu_quant`, host
arrays (numpy, or CPU tensors) by the Numba kernels of
:mod:`deltackpt.kernels.quant`; both follow FORMAT.md 3.2's arithmetic and
give the same bytes. The environment variable ``DELTACKPT_KERNELS=triton``
routes host arrays through the Triton kernels too, which then run in
Triton's interpreter (set ``TRITON_INTERPRET=1`` too, before triton is
imported): how the tests code a whole step through them on a machine
without a GPU. ``auto`` (the default) is the rule above.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import zstandard

from deltackpt.codecs.base import EncodedChunk
from deltackpt.codecs.lossless import zstd_compress, zstd_decompress
from deltackpt.errors import CorruptionError, FormatError
from deltackpt.format.checks import check_choice
from deltackpt.kernels import quant as numba_kernels
from deltackpt.kernels.planes import MAX_WIDTH, plane_starts
from deltackpt.kernels.quant import (
    MAX_DITHERED_KEY_STEP,
    MAX_GROUPED_BLOCK,
    MAX_KEY,
    N_GROUPS,
    check_stream,
)

# What the encoder needs of the kernels, given through the codec: the columns of the block
# statistics each chunk's coding returns, and the numpy forms of the key and dither arithmetic
# that estimate a step's cost from a sample (FORMAT.md 3.2).
from deltackpt.kernels.quant import N_STATS as N_STATS
from deltackpt.kernels.quant import STAT_BAD as STAT_BAD
from deltackpt.kernels.quant import STAT_CLIPPED as STAT_CLIPPED
from deltackpt.kernels.quant import STAT_LOST_ZEROS as STAT_LOST_ZEROS
from deltackpt.kernels.quant import STAT_MAX_ABS as STAT_MAX_ABS
from deltackpt.kernels.quant import STAT_MAX_REL as STAT_MAX_REL
from deltackpt.kernels.quant import STAT_NONZERO as STAT_NONZERO
from deltackpt.kernels.quant import STAT_SUM_SQ as STAT_SUM_SQ
from deltackpt.kernels.quant import STAT_SUM_SQ_ERR as STAT_SUM_SQ_ERR
from deltackpt.kernels.quant import numpy_dither as numpy_dither
from deltackpt.kernels.quant import numpy_fold as numpy_fold
from deltackpt.kernels.quant import numpy_keys as numpy_keys
from deltackpt.kernels.rans import (
    BODY_LONG,
    BODY_OK,
    BODY_SHORT,
    BODY_STATES,
    MAX_BINS,
    decode_planes,
    encode_planes,
)

NAME = "quant"
PARAM_KEYS = frozenset({"domain", "pred", "step", "block", "dither", "dither_signs",
                        "dither_groups", "scale", "eps", "floor_log2", "zeros", "bit_planes",
                        "rans_bins"})
MAX_FLOOR_LOG2 = 127  # a scaled chunk's floor is 2**floor_log2, a normal float32 value
MIN_FLOOR_LOG2 = -126
KERNELS_ENV = "DELTACKPT_KERNELS"  # "auto" (default) or "triton": see the module docstring
HEAD_LENGTH_BYTES = 4  # a rANS-coded chunk's first bytes: its head frame's length
_BODY_PROBLEMS = {BODY_SHORT: "ends before its planes do", BODY_LONG: "holds bytes past its planes",
                  BODY_STATES: "does not end in the states it starts from"}


def _kernels(*arrays: Any) -> tuple[Callable[[Any], Any], ModuleType]:
    """The kernels that code ``arrays`` and how to pass them an array: the Triton kernels of
    :mod:`deltackpt.kernels.gpu_quant` (torch tensors) when one of ``arrays`` is a CUDA tensor
    or ``DELTACKPT_KERNELS=triton``, else the Numba kernels (numpy arrays). Both modules have
    ``encode_block_stream``, ``decode_block_stream`` and ``decode_step_streams``."""
    choice = check_choice(os.environ.get(KERNELS_ENV, "auto"), KERNELS_ENV, ("auto", "triton"))
    if choice == "auto" and not any(getattr(a, "is_cuda", False) for a in arrays):
        return _array, numba_kernels
    from deltackpt.kernels import gpu_quant  # imports triton: only where it is used

    return _tensor, gpu_quant


def _tensor(a: Any) -> Any:
    """``a`` as a torch tensor for the Triton kernels (a numpy array shares its memory)."""
    if a is None or not isinstance(a, np.ndarray):
        return a
    import torch

    return torch.from_numpy(np.require(a, requirements="W"))  # read-only arrays: a copy


def _array(a: Any) -> Any:
    """``a`` as a numpy array for the Numba kernels (a CPU tensor shares its memory)."""
    return a if a is None or isinstance(a, np.ndarray) else a.numpy()


def dither_context(ordinal: bool, dither: int | None, block: int,
                   with_base: bool) -> dict[str, bool]:
    """How deltackpt's writers code a chunk's symbols given its dither (FORMAT.md 3.2), as the
    kernels' ``dither_signs`` and ``dither_groups``. In every dithered chunk of the linear
    domain they fold the symbols' signs by it (since 2.2), which costs a sign flip an element
    and saves the sign bit of small values (Adam's first moment, coded anew each save at about
    a step: 0.58 bits an element where it took 0.80, on a GPT). In such a chunk coded from
    zero (first moments, momentum), whose values mostly lie within a step, they also group
    each block's symbols by the dither's size (since 2.5; blocks of at most
    ``MAX_GROUPED_BLOCK`` elements): small offsets leave small values at 0 (the same first
    moments: 0.62 bits an element, 0.55 grouped; 4-17% fewer bits on the AdamW cells), for
    0.6-1.0 ns an element more to code and to decode. Weights' residuals against their base,
    mostly over a step, gained 0.8-1.7% for the same cost: not grouped."""
    signs = dither is not None and not ordinal
    return {"dither_signs": signs,
            "dither_groups": signs and not with_base and block <= MAX_GROUPED_BLOCK}


def encode_quant(x: np.ndarray, pred: np.ndarray | None, recon: np.ndarray, *, ordinal: bool,
                 step: float | int, block: int, dither: int | None = None, first: int = 0,
                 scale: Scale | None = None) -> tuple[EncodedChunk | None, np.ndarray]:
    """Quantize float32 ``x`` against ``pred`` (or zero), writing the reconstruction to ``recon``;
    dithered with seed ``dither`` (``first``: index of the chunk's first element in its tensor),
    and with steps scaled (and shaped) element by element by ``scale``. Arrays are numpy arrays or torch
    tensors; CUDA tensors are coded on their device (module docstring), where ``x`` may also
    be bfloat16 or float16, and ``recon`` stays (or, given on the host, is copied back).

    Returns the chunk and its per-block statistics (``kernels.quant.STAT_*``),
    or ``None`` for the chunk when an element cannot be coded within half a
    step (non-finite values, or a change beyond the 16-bit symbol range,
    e.g. a sign flip in the ordinal domain); ``recon`` then holds garbage
    and the caller stores ``x`` exactly.
    """
    convert, kernels = _kernels(x, recon)
    stream, stats = kernels.encode_block_stream(
        convert(x), convert(pred), convert(recon), ordinal=ordinal, step=step, block=block,
        dither=dither, **dither_context(ordinal, dither, block, pred is not None), first=first,
        scale=None if scale is None else convert(scale.values),
        eps=0.0 if scale is None else scale.eps, floor=0.0 if scale is None else scale.floor,
        bit_planes=True)
    if stats[:, STAT_BAD].any() or stats[:, STAT_CLIPPED].any():
        return None, stats
    return quant_chunk(stream, x.shape[0], ordinal=ordinal, with_base=pred is not None,
                       step=step, block=block, dither=dither,
                       scale=None if scale is None else (scale.tensor, scale.eps, scale.floor),
                       zeros=zeros_bitmap(zero_lost(convert(x), convert(recon)))
                       if stats[:, STAT_LOST_ZEROS].any() else None), stats


def zero_lost(x: Any, recon: Any) -> Any:
    """Set to zero the elements of ``recon`` that are exactly zero in ``x`` (either sign) but
    not in ``recon`` (numpy arrays, or torch tensors on one device: no synchronization), which
    the kernels count (``STAT_LOST_ZEROS``); returns their mask."""
    lost = (x == 0) & (recon != 0)
    recon[lost] = 0
    return lost


def zeros_bitmap(lost: Any) -> np.ndarray:
    """The bitmap a chunk stores of the mask ``lost`` (FORMAT.md 3.2, ``zeros``)."""
    return np.packbits(lost if isinstance(lost, np.ndarray) else lost.cpu().numpy(),
                       bitorder="little")


def on_device(*arrays: Any) -> bool:
    """Whether the Triton kernels code ``arrays`` (:func:`_kernels`' choice): on their device,
    :func:`deltackpt.kernels.gpu_quant.encode_on_device` takes them as they are."""
    return _kernels(*arrays)[0] is _tensor


def quant_chunk(stream: np.ndarray, n: int, *, ordinal: bool, with_base: bool,
                step: float | int, block: int, dither: int | None = None,
                scale: tuple[str, float, float] | None = None,
                zeros: np.ndarray | None = None) -> EncodedChunk:
    """The quant chunk of a symbol ``stream`` of ``n`` elements in bit planes (FORMAT.md 3.2,
    ``bit_planes``) coded with these arguments (those of
    :func:`encode_quant`, coded given its dither as :func:`dither_context` says;
    ``with_base``: coded against a prediction; ``scale``: the tensor whose values scale the
    steps, eps and the floor that shapes them, a power of two, 0 for none; ``zeros``: the
    bitmap of :func:`zeros_bitmap`, stored before the stream)."""
    params = {"domain": "ordinal" if ordinal else "linear",
              "pred": "base" if with_base else "zero", "step": step, "block": block}
    if dither is not None:
        params["dither"] = dither
    params.update({key: True for key, given
                   in dither_context(ordinal, dither, block, with_base).items() if given})
    if scale is not None:
        params.update(scale=scale[0], eps=scale[1])
        if scale[2]:
            params["floor_log2"] = floor_log2(scale[2])
    params["bit_planes"] = True
    if zeros is not None:
        params["zeros"] = int(np.unpackbits(zeros).sum())
    stored, bins = stored_stream(stream, n, block, "dither_groups" in params, zeros)
    if bins is not None:
        params["rans_bins"] = bins
    return EncodedChunk(NAME, params, [stored])


def stored_stream(stream: np.ndarray, n: int, block: int, grouped: bool,
                  zeros: np.ndarray | None = None) -> tuple[bytes, int | None]:
    """A plane stream's stored bytes (after the bitmap of ``zeros``) as deltackpt's writers
    store it, and its ``rans_bins`` (None: one zstd frame): a stream whose symbols are
    ``grouped`` by their dither is coded by rANS in ``N_GROUPS`` bins where that is smaller
    than its zstd frame (:func:`rans_coded`)."""
    frame = zstd_compress(stream if zeros is None else np.concatenate([zeros, stream]), "packed")
    if grouped:
        coded = rans_coded(stream, n, block, N_GROUPS, zeros)
        if len(coded) < len(frame):
            return coded, N_GROUPS
    return frame, None


def rans_coded(stream: np.ndarray, n: int, block: int, bins: int,
               zeros: np.ndarray | None = None) -> bytes:
    """A plane stream's stored bytes with ``rans_bins`` (FORMAT.md 3.2, *Plane coding*): its
    head frame's length, the frame (the bitmap of ``zeros``, the width bytes, the models) and
    the rANS body of its planes."""
    models, body = encode_planes(stream, n, block, bins)
    widths = stream[: -(-n // block)]
    head = zstd_compress(b"".join([b"" if zeros is None else zeros.tobytes(), widths.tobytes(),
                                   models.astype("<u2").tobytes()]), "packed")
    return len(head).to_bytes(HEAD_LENGTH_BYTES, "little") + head + body.tobytes()


@dataclass(frozen=True)
class Scale:
    """The per-element scale of a quant chunk (FORMAT.md 3.2): the decoded ``values`` of the
    elements of tensor ``tensor`` in the same step (an array as the chunk's), ``eps`` (a
    positive float32 value) and the ``floor`` that shapes the steps (a positive float32
    power of two; 0: not shaped)."""

    tensor: str
    values: Any
    eps: float
    floor: float = 0.0


def quant_params(params: dict[str, Any]
                 ) -> tuple[bool, bool, float | int, int, int | None, bool, bool]:
    """Validated ``(ordinal, uses_base, step, block, dither, dither_signs, dither_groups)`` of a
    quant chunk (and its scale: :func:`scale_source`)."""
    domain, pred, step, block, dither = (params.get(k) for k in ("domain", "pred", "step", "block",
                                                                  "dither"))
    ok = (params.keys() <= PARAM_KEYS and domain in ("linear", "ordinal") and pred in ("base", "zero")
          and isinstance(block, int) and not isinstance(block, bool) and 1 <= block <= 1 << 24)
    if ok and domain == "ordinal":
        ok = isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= MAX_KEY
    elif ok:
        ok = (isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0
              and float(np.float32(step)) == step)
    if ok and dither is not None:
        ok = (isinstance(dither, int) and not isinstance(dither, bool) and 0 <= dither < 1 << 32
              and (domain == "linear" or step <= MAX_DITHERED_KEY_STEP))
    signs, groups = params.get("dither_signs", False), params.get("dither_groups", False)
    for key in ("dither_signs", "dither_groups"):
        if ok and key in params:
            ok = params[key] is True and dither is not None and domain == "linear"
    if ok and groups:
        ok = block <= MAX_GROUPED_BLOCK
    if ok and "bit_planes" in params:
        ok = params["bit_planes"] is True
    if ok and "rans_bins" in params:
        bins = params["rans_bins"]
        ok = ("bit_planes" in params and isinstance(bins, int) and not isinstance(bins, bool)
              and 1 <= bins <= MAX_BINS)
    if ok and ("scale" in params or "eps" in params or "floor_log2" in params):
        exponent = params.get("floor_log2", 0)
        eps = params.get("eps")
        ok = (isinstance(params.get("scale"), str) and (domain, pred) == ("linear", "zero")
              and isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0
              and math.isfinite(eps) and float(np.float32(eps)) == eps
              and isinstance(exponent, int) and not isinstance(exponent, bool)
              and MIN_FLOOR_LOG2 <= exponent <= MAX_FLOOR_LOG2)
    if ok and "zeros" in params:
        zeros = params["zeros"]
        ok = isinstance(zeros, int) and not isinstance(zeros, bool) and zeros >= 1
    if not ok:
        raise FormatError(f"quant params {params} are invalid")
    return domain == "ordinal", pred == "base", step, block, dither, signs, groups


def floor_log2(floor: float) -> int:
    """The exponent of a floor that shapes scaled steps, a power of two in float32's normal range
    (FORMAT.md 3.2's ``floor_log2``)."""
    exponent = math.frexp(floor)[1] - 1
    if not (MIN_FLOOR_LOG2 <= exponent <= MAX_FLOOR_LOG2 and floor == 2.0**exponent):
        raise ValueError(f"a floor must be a power of two from 2**{MIN_FLOOR_LOG2} to "
                         f"2**{MAX_FLOOR_LOG2}, got {floor!r}")
    return exponent


def scale_source(params: dict[str, Any]) -> str | None:
    """The tensor whose values scale a quant chunk's steps, or None (params not validated)."""
    return params.get("scale")


def uses_base(params: dict[str, Any]) -> bool:
    """Whether a quant chunk is coded against its base step's reconstruction."""
    return params.get("pred") == "base"


@dataclass(frozen=True)
class QuantStream:
    """The checked symbol stream of one quant chunk and its validated parameters."""

    data: np.ndarray
    ordinal: bool
    with_base: bool
    step: float | int
    block: int
    dither: int | None
    dither_signs: bool
    dither_groups: bool
    eps: float | None  # set for a chunk whose steps are scaled by another tensor
    floor: float  # the floor that shapes those steps (2**floor_log2); 0 for none
    zeros: np.ndarray | None  # the elements restored as zero (a boolean mask), if any
    bit_planes: bool  # the stream is stored as bit planes (since 2.8), else packed


def quant_stream(stored: memoryview, params: dict[str, Any], n: int) -> QuantStream:
    """The symbol stream of a quant chunk of ``n`` elements (and its bitmap of zeros),
    decompressed and checked.

    Raises :class:`FormatError` for invalid params and :class:`CorruptionError`
    for a frame or stream that does not decode, so a stream returned here
    always decodes.
    """
    ordinal, with_base, step, block, dither, signs, groups = quant_params(params)
    mask_bytes = -(-n // 8) if "zeros" in params else 0
    planes = "bit_planes" in params
    n_blocks = -(-n // block)
    if "rans_bins" in params:
        data = _rans_decoded(stored, n, block, params["rans_bins"], mask_bytes)
    else:
        # A stream can never exceed its widths plus 16 bits an element (and with planes, 16
        # bytes of padding a block); refuse to inflate more.
        data = np.frombuffer(zstd_decompress_bounded(
            stored, mask_bytes + n_blocks * (17 if planes else 1) + 2 * n), dtype=np.uint8)
    zeros = None
    if mask_bytes:
        if data.size < mask_bytes:
            raise CorruptionError(f"quant chunk holds {data.size} bytes, short of its "
                                  f"{mask_bytes}-byte bitmap of zeros")
        zeros = np.unpackbits(data[:mask_bytes], bitorder="little").view(bool)
        if zeros[n:].any() or int(zeros.sum()) != params["zeros"]:
            raise CorruptionError(f"quant chunk's bitmap of zeros holds {int(zeros[:n].sum())} "
                                  f"of its {n} elements (and {int(zeros[n:].sum())} past "
                                  f"them), its params say {params['zeros']}")
        zeros, data = zeros[:n], data[mask_bytes:]
    try:
        check_stream(data, n, block, planes)
    except ValueError as exc:
        raise CorruptionError(f"quant stream does not decode ({exc})") from None
    return QuantStream(data, ordinal, with_base, step, block, dither, signs, groups,
                       params.get("eps"),
                       2.0 ** params["floor_log2"] if "floor_log2" in params else 0.0, zeros,
                       planes)


def decode_quant(stored: memoryview, params: dict[str, Any], pred: np.ndarray | None,
                 out: np.ndarray, first: int, scale: np.ndarray | None = None) -> None:
    """Decode a quant chunk into float32 ``out`` (may be ``pred``: updated in place);
    ``first`` is the index of the chunk's first element in its tensor, ``scale`` the values of
    the same elements of the tensor the chunk's ``scale`` param names. Arrays as
    :func:`encode_quant`'s: a CUDA ``out`` is decoded on its device."""
    stream = quant_stream(stored, params, out.shape[0])
    if stream.with_base and pred is None:
        raise FormatError("quant chunk is coded against its base step, which was not given")
    if (stream.eps is None) != (scale is None):
        raise FormatError("quant chunk is scaled by another tensor, whose values were not given"
                          if scale is None else "quant chunk has no scale, yet one was given")
    convert, kernels = _kernels(out)
    kernels.decode_block_stream(
        stream.data, convert(pred) if stream.with_base else None, convert(out),
        ordinal=stream.ordinal, step=stream.step, block=stream.block, dither=stream.dither,
        dither_signs=stream.dither_signs, dither_groups=stream.dither_groups, first=first,
        scale=convert(scale), eps=stream.eps or 0.0, floor=stream.floor,
        bit_planes=stream.bit_planes)
    _set_zeros(convert(out), stream.zeros)


def _rans_decoded(stored: memoryview, n: int, block: int, bins: int, mask_bytes: int
                  ) -> np.ndarray:
    """The bitmap of zeros (``mask_bytes``) and plane stream of a chunk with ``rans_bins``
    (:func:`rans_coded`), checked as far as its planes' bytes: the stream's own check follows."""
    n_blocks = -(-n // block)
    size = int.from_bytes(stored[:HEAD_LENGTH_BYTES], "little")
    if len(stored) < HEAD_LENGTH_BYTES or size > len(stored) - HEAD_LENGTH_BYTES:
        raise CorruptionError(f"quant chunk of {len(stored)} bytes is too short for its "
                              f"{size}-byte head")
    head = np.frombuffer(zstd_decompress_bounded(
        stored[HEAD_LENGTH_BYTES:HEAD_LENGTH_BYTES + size],
        mask_bytes + n_blocks + 2 * MAX_WIDTH * bins), dtype=np.uint8)
    widths = head[mask_bytes:mask_bytes + n_blocks]
    planes = int(widths.max(initial=0))
    if widths.size < n_blocks or planes > MAX_WIDTH:
        raise CorruptionError(f"quant chunk's head holds {widths.size} widths of its {n_blocks} "
                              f"blocks, at most {planes} bits wide (at most {MAX_WIDTH})")
    models = head[mask_bytes + n_blocks:]
    if models.size != 2 * planes * bins:
        raise CorruptionError(f"quant chunk's head holds {models.size} bytes of models, its "
                              f"{planes} planes in {bins} bins take {2 * planes * bins}")
    stream = np.empty(mask_bytes + int(plane_starts(widths, n, block, n_blocks)[-1]), np.uint8)
    stream[: mask_bytes + n_blocks] = head[: mask_bytes + n_blocks]
    status = decode_planes(np.frombuffer(stored[HEAD_LENGTH_BYTES + size:], np.uint8),
                           models.view("<u2").astype(np.uint16), stream[mask_bytes:], n, block,
                           bins)
    if status != BODY_OK:
        raise CorruptionError(f"quant chunk's rANS body {_BODY_PROBLEMS[status]}")
    return stream


def _set_zeros(values: Any, zeros: np.ndarray | None) -> None:
    """Set the elements of ``values`` (a numpy array or a torch tensor) that ``zeros`` marks."""
    if zeros is None:
        return
    if isinstance(values, np.ndarray):
        values[zeros] = 0
    else:
        import torch

        values[torch.from_numpy(zeros).to(values.device)] = 0


def apply_quant_streams(streams: list[QuantStream], values: np.ndarray, first: int) -> None:
    """Apply the streams of one chunk in consecutive steps, in order, to its running values
    (``first``: the index of the chunk's first element in its tensor).

    ``values`` (float32) holds the running values before the first step
    (unused when that step predicts from zero) and is updated in place: the
    result is bit for bit that of :func:`decode_quant` once per step. Runs of
    steps with one block size are decoded in a single pass (on the device of a
    CUDA ``values``), up to a step that sets zeros.
    """
    convert, kernels = _kernels(values)
    values = convert(values)
    start = 0
    for i in range(1, len(streams) + 1):
        if i == len(streams) or streams[i].block != streams[start].block \
                or not streams[i].with_base or streams[i - 1].zeros is not None:
            run = streams[start:i]
            kernels.decode_step_streams(
                [s.data for s in run], values, ordinal=[s.ordinal for s in run],
                steps=[s.step for s in run], block=run[0].block, zero_start=not run[0].with_base,
                dithers=[s.dither for s in run], dither_signs=[s.dither_signs for s in run],
                dither_groups=[s.dither_groups for s in run], first=first,
                bit_planes=[s.bit_planes for s in run])
            _set_zeros(values, run[-1].zeros)
            start = i


def zstd_decompress_bounded(stored: memoryview, limit: int) -> bytes:
    """Decompress a zstd frame whose content size is stated and at most ``limit``."""
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"quant chunk: not a zstd frame ({exc})") from None
    if size < 0 or size > limit:
        raise CorruptionError(f"quant chunk: frame holds {size} bytes, at most {limit} possible")
    return zstd_decompress(stored, size, "quant chunk")
