"""Delta steps of a state held on a device, encoded there at the call (the plan and encode
stages of a save, for tensors the Triton kernels code).

A delta whose lossily coded tensors the Triton kernels code (CUDA tensors;
any float tensor with ``DELTACKPT_KERNELS=triton``: the one rule of
:func:`deltackpt.codecs.quant.on_device`) is planned and encoded by the
call to ``save`` (:func:`begin_encoding`, :class:`DeviceDelta`): the chunks of
those tensors, on the writer's chunk boundaries
(:func:`deltackpt.io.writer.chunk_spans`), are quantized on their device by
:func:`deltackpt.kernels.gpu_quant.encode_on_device` against the running
reconstruction, into the delta's own running values there (its base's, on
their last use: :class:`StepEncoder`'s ``in_place``). Only the packed symbol
streams, the block statistics and the digests of the decoded bytes cross to
the host; the save thread compresses, writes and commits them, and the step
is byte for byte the one the host (Numba) path writes for the same state.
The other tensors of the delta (stored exactly, cast, bitsandbytes states)
are snapshotted into host buffers as for any save, and the encoded ones
travel to the writer as tensors on the ``meta`` device (no bytes).

Ordering on a CUDA device: the encodes run on a side stream that first
waits for an event recorded on the training stream (the work queued before
the call); the training stream then waits, on the device, for the side
stream's work, so in-place updates queued after the call cannot race it.
The call synchronizes with the device once per coding phase (a phase is
coded after the tensors it reads: :attr:`StepEncoder.coded_last`), reading
back one flag and one length per chunk: a chunk the kernels cannot code
(non-finite values, a change out of the symbol range) is stored exactly,
its raw bytes copied to the host then, while they still are the state at
the call, and its running values set to them before a later phase reads
them. Planning (:class:`StepEncoder`) reads strided samples of the tensors
to the host, another synchronization; ``SaveInfo.blocked_seconds`` counts
both.

Where the running values of device-coded tensors live is a manager's
choice (:class:`RunningValues`): float32 tensors on their device (default),
or in pinned host memory (``"host"``), which the kernels read and update
over PCIe (8 bytes an element) to spare the device's memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from deltackpt.codecs import EncodedChunk, encode_lossless
from deltackpt.codecs.quant import (
    N_STATS,
    STAT_BAD,
    STAT_CLIPPED,
    STAT_LOST_ZEROS,
    STAT_MAX_ABS,
    STAT_MAX_REL,
    STAT_NONZERO,
    STAT_SUM_SQ,
    STAT_SUM_SQ_ERR,
    dither_context,
    on_device,
    quant_chunk,
    zero_lost,
    zeros_bitmap,
)
from deltackpt.dist.shards import Part, local_parts, local_values, with_local
from deltackpt.encode.encoder import StepEncoder, host_array, shrunk_variances
from deltackpt.encode.optimizers import captured_bnb_states
from deltackpt.encode.policy import LOSSY_DTYPES, CompressionConfig, ScaleController
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.format.checks import check_choice
from deltackpt.format.dtypes import DTypeSpec, dtype_bytes, raw_bytes, spec_for
from deltackpt.format.state import CapturedState
from deltackpt.io.writer import PendingDigest, chunk_spans
from deltackpt.kernels.quant import to_planes

RECONSTRUCTION_PLACES = ("device", "host")
"""Where a manager keeps the running values of tensors coded on a device."""


def device_coded(captured: CapturedState) -> dict[str, torch.device]:
    """The stored tensors of ``captured`` of a dtype a delta may code lossily whose chunks the
    Triton kernels code, by name, with the device of their values (a DTensor's local shard).
    Not bitsandbytes' code maps and ``absmax``: the host codes them, from their moment's
    reconstruction or as unchanged (:class:`deltackpt.encode.encoder.StepEncoder`), against running
    values in host memory."""
    out = {}
    coded_on: dict[torch.device, bool] = {}  # the kernels' choice depends on the device alone
    host_coded = {name for b in captured_bnb_states(captured).values()
                  for name in (b.absmax, b.qmap)}
    for item in captured.tensors:
        if item.alias_of is None and item.name not in host_coded:
            values = local_values(item.tensor)
            device = values.device
            if device not in coded_on:
                coded_on[device] = not values.is_meta and on_device(values)
            if coded_on[device] and spec_for(values.dtype, item.name).name in LOSSY_DTYPES:
                out[item.name] = device
    return out


def reconstruction_bytes(*recons: Reconstruction) -> dict[str, int]:
    """Memory of reconstructions' running values and kept bytes by device kind (``"cpu"``,
    ``"cuda"``), each array once."""
    out: dict[str, int] = {}
    arrays = {id(v): v for recon in recons
              for v in [*recon.values.values(), *recon.kept.values()]}
    for values in arrays.values():
        kind = "cpu" if isinstance(values, np.ndarray) else values.device.type
        out[kind] = out.get(kind, 0) + values.nbytes
    return out


class RunningValues:
    """Keeps the running values of device-coded tensors where ``place`` says: ``"device"``,
    float32 tensors on the device of the tensor; ``"host"``, in pinned host memory (host
    memory on a CPU). Other tensors' are numpy arrays. Values already where they belong stay
    as they are; others are copied into buffers of their own: a writer holds several steps'
    values at once (one a level of its schedule), so none may share a buffer."""

    def __init__(self, place: str = "device") -> None:
        self.place = check_choice(place, "reconstruction", RECONSTRUCTION_PLACES)

    def placed(self, recon: Reconstruction | None,
               devices: Mapping[str, torch.device]) -> Reconstruction | None:
        """``recon`` with each tensor's values where they belong: those of tensors coded on
        ``devices`` as :class:`RunningValues` says, the others as numpy arrays."""
        if recon is None:
            return None
        values = {}
        for name, current in recon.values.items():
            device = devices.get(name)
            if device is None:
                values[name] = host_array(current)
            else:
                with _stream_of(device, _placing_streams):  # not the training's stream
                    values[name] = self._put(current, device)
        for device in {v.device for v in values.values() if isinstance(v, torch.Tensor)}:
            # copies into them (here, or on this thread's stream by a step's exact chunks)
            # complete before the side stream of the next delta reads them
            if device.type == "cuda":
                _placing_streams[device].synchronize()
                torch.cuda.current_stream(device).synchronize()
        return replace(recon, values=values)

    def _put(self, current: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
        pinned = self.place == "host" and device.type == "cuda"
        target = torch.device("cpu") if self.place == "host" else device
        if isinstance(current, torch.Tensor) and current.device == target \
                and (current.is_pinned() or not pinned):
            return current
        source = torch.from_numpy(current) if isinstance(current, np.ndarray) else current
        if target.type == "cpu" and not pinned:  # the host's memory is the device's
            return source.cpu()
        buffer = torch.empty(source.numel(), dtype=torch.float32, device=target,
                             pin_memory=pinned)
        return buffer.copy_(source)


@dataclass
class Encoding:
    """A save's encoding, begun: its base (None: a full step), its encoder, the state the
    writer writes (tensors encoded on their device as ``meta`` tensors) and that device work,
    if any."""

    base: Reconstruction | None
    encoder: StepEncoder
    captured: CapturedState
    device: DeviceDelta | None = None

    def ready(self) -> None:
        """Wait for the device work the writer reads (from any thread)."""
        if self.device is not None:
            self.device.ready()


def begin_encoding(captured: CapturedState, base: Reconstruction | None,
                   parts: dict[str, list[Part]], devices: Mapping[str, torch.device], *,
                   config: CompressionConfig, controller: ScaleController | None, keep: bool,
                   in_place: bool, chunk_bytes: int, running: RunningValues) -> Encoding:
    """Begin encoding ``captured`` (this rank's ``parts``) against ``base`` (None: a full
    step): its encoder and, for a delta, the chunks of the tensors coded on ``devices`` (of
    :func:`device_coded`; empty: none) encoded there now (:class:`DeviceDelta`). ``base``'s
    values are first placed as ``running`` keeps them; a delta updates them ``in_place`` or
    writes values of its own (:class:`StepEncoder`)."""
    base = running.placed(base, devices)
    encoder = StepEncoder(captured, config, base, controller, keep=keep, in_place=in_place,
                          local=local_parts(parts))
    if base is None or not devices:
        return Encoding(base, encoder, captured)
    delta = DeviceDelta(encoder, devices, chunk_bytes)
    return Encoding(base, encoder, delta.without_encoded(captured), delta)


@dataclass
class _Chunk:
    """One chunk of a tensor encoded on its device."""

    name: str
    spec: DTypeSpec
    raw_offset: int  # of the chunk's first byte in the tensor's (this rank's fragment's) bytes
    raw_size: int
    lo: int  # its elements
    hi: int
    coded: Any  # gpu_quant.DeviceStream
    rounded: torch.Tensor | None = None  # a 16-bit tensor's statistics of its rounded values
    exact: np.ndarray | None = None  # the raw bytes at the call of a chunk stored exactly
    digest: PendingDigest | None = None  # of the decoded bytes, where they stay on the device
    shrunk: Any = 0  # grad_avg: elements whose variance shrank too far (a device count)
    lost: Any = None  # elements exactly zero the kernels did not restore so (a device mask)
    zeros: np.ndarray | None = None  # their bitmap, where there are some
    host: list[torch.Tensor] = field(default_factory=list)  # stream, statistics (, rounded)


_side_streams: dict[torch.device, Any] = {}  # a CUDA device's, of the encodes at the call
_placing_streams: dict[torch.device, Any] = {}  # of the copies into running values


def _stream_of(device: torch.device, streams: dict[torch.device, Any],
               ) -> contextlib.AbstractContextManager:
    """Make a CUDA ``device``'s stream of ``streams`` (created at its first use) the current
    one; elsewhere, nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(stream)
# Elements encoded between two synchronizations of the call: bounds the device memory their
# streams take (2 bytes an element at most) until they are copied to the host.
BATCH_ELEMENTS = 1 << 27


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[list[Any]]:
    """Run the block's device work on a side stream of a CUDA ``device``, after the work queued
    on its current (training) stream, which waits (on the device) for it; yields the list the
    event marking its end is appended to. Elsewhere, the block runs as it is."""
    done: list[Any] = []
    if device.type != "cuda":
        yield done
        return
    training = torch.cuda.current_stream(device)
    queued = torch.cuda.Event()
    queued.record(training)
    with _stream_of(device, _side_streams):
        side = torch.cuda.current_stream(device)
        side.wait_event(queued)
        try:
            yield done
        finally:  # also after a failure, once kernels were queued that read the state
            end = torch.cuda.Event()
            end.record(side)
            training.wait_event(end)
            done.append(end)


class DeviceDelta:
    """The chunks of a delta's tensors coded on their devices (``devices``: of
    :func:`device_coded`) that ``encoder`` quantizes from their own values, encoded at
    construction (the call); ``encoder`` then finishes each when the writer asks for it."""

    def __init__(self, encoder: StepEncoder, devices: Mapping[str, torch.device],
                 chunk_bytes: int) -> None:
        from deltackpt.kernels import gpu_quant  # imports triton: only where it is used

        self.encoder = encoder
        self._gpu = gpu_quant
        self.names = [name for name in devices
                      if name in encoder.local and encoder.quantized_as_is(name) is not None]
        self._done: list[Any] = []
        phases = encoder.coded_last
        for device in {devices[name] for name in self.names}:
            names = [name for name in self.names if devices[name] == device]
            with _side_stream(device) as done:
                for phase in sorted({phases.get(name, 0) for name in names}):
                    batch: list[_Chunk] = []
                    elements = 0
                    for name in names:
                        if phases.get(name, 0) != phase:
                            continue
                        for span in self._spans(name, chunk_bytes):
                            batch.append(self._encode(name, *span))
                            elements += batch[-1].hi - batch[-1].lo
                            if elements >= BATCH_ELEMENTS:
                                self._settle(batch, device)
                                batch, elements = [], 0
                    self._settle(batch, device)
            self._done += done

    def _spans(self, name: str, chunk_bytes: int) -> Iterator[tuple[int, int]]:
        values = self.encoder.local[name]
        itemsize = values.element_size()
        return chunk_spans(values.numel() * itemsize, itemsize, chunk_bytes)

    def _encode(self, name: str, start: int, stop: int) -> _Chunk:
        """Queue the encode of the chunk of bytes ``start:stop`` of tensor ``name``."""
        x = self.encoder.local[name].detach().reshape(-1)
        spec = spec_for(x.dtype, name)
        lo, hi = start // spec.itemsize, stop // spec.itemsize
        coding = self.encoder.quantized_as_is(name)
        encoder = self.encoder
        recon = encoder.running(name)[lo:hi]
        scale = None if coding.scale is None else encoder.running(coding.scale[0])[lo:hi]
        pred = encoder.base_values(name)[lo:hi] if coding.with_base else None
        coded = self._gpu.encode_on_device(
            x[lo:hi], pred, recon, ordinal=coding.ordinal,
            step=coding.step, block=coding.block, dither=coding.dither,
            **dither_context(coding.ordinal, coding.dither, coding.block, coding.with_base),
            first=lo, scale=scale,
            eps=0.0 if coding.scale is None else coding.scale[1],
            floor=0.0 if coding.scale is None else coding.scale[2])
        chunk = _Chunk(name, spec, start, stop - start, lo, hi, coded,
                       lost=zero_lost(x[lo:hi], recon))
        check = self.encoder.variance_check(name)
        if check is not None:
            chunk.shrunk = shrunk_variances(recon, x[lo:hi], encoder.running(check[0])[lo:hi],
                                            check[1])
        if spec.itemsize < 4:
            chunk.rounded = _rounded_stats(x[lo:hi], recon, coded.stats[:, STAT_NONZERO].sum())
        return chunk

    def _settle(self, chunks: list[_Chunk], device: torch.device) -> None:
        """Once a batch's encodes ran (one synchronization, reading back a flag and a length per
        chunk): store the chunks the kernels could not code exactly, with their bytes at the
        call, their running values set to them; queue the digests of the others' decoded
        bytes, where these stay on the device, and the copies of their streams and statistics
        to host memory (pinned, from a CUDA device). Each chunk is then the encoder's to
        finish."""
        if not chunks:
            return
        from deltackpt.kernels.gpu_xxh3 import xxh3_64_on_device  # a device kernel

        flags, lengths, lost = torch.stack([
            torch.stack([c.coded.stats[:, STAT_BAD].sum() + c.coded.stats[:, STAT_CLIPPED].sum()
                         + c.shrunk, c.coded.length.double(),
                         c.coded.stats[:, STAT_LOST_ZEROS].sum()]) for c in chunks]).cpu().T.tolist()
        pinned = device.type == "cuda"
        for chunk, flag, length, zeros in zip(chunks, flags, lengths, lost, strict=True):
            x = self.encoder.local[chunk.name].detach().reshape(-1)[chunk.lo : chunk.hi]
            recon = self.encoder.running(chunk.name)[chunk.lo : chunk.hi]
            if flag:
                recon.copy_(x)
                chunk.exact = raw_bytes(x).copy()  # (of a CPU tensor, a view otherwise)
            else:
                if zeros:
                    chunk.zeros = zeros_bitmap(chunk.lost)
                if recon.device == device:
                    decoded = recon if chunk.spec.itemsize == 4 else recon.to(x.dtype)
                    chunk.digest = xxh3_64_on_device(decoded.view(torch.uint8))
                sources = [chunk.coded.stream[: int(length)], chunk.coded.stats]
                if chunk.rounded is not None:
                    sources.append(chunk.rounded)
                for source in sources:
                    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
                    host.copy_(source, non_blocking=pinned)
                    chunk.host.append(host)
            chunk.coded = chunk.rounded = chunk.lost = None  # free once copied
            self.encoder.coded_before[chunk.name, chunk.raw_offset] = functools.partial(
                self._finish, chunk)

    def ready(self) -> None:
        """Wait until the device work is complete (the save thread, before writing)."""
        for event in self._done:
            event.synchronize()
        self._done = []

    def _finish(self, chunk: _Chunk) -> tuple[EncodedChunk, np.ndarray | PendingDigest]:
        """The chunk's stored form (its stream compressed), accounted by the encoder, and its
        decoded bytes or their digest (the writer's :data:`ChunkEncoder` contract)."""
        encoder = self.encoder
        if chunk.exact is not None:
            stored = encode_lossless(chunk.exact, chunk.spec)
            encoder.count_exact(chunk.name, stored, chunk.raw_offset, chunk.raw_size,
                                chunk.hi - chunk.lo)
            return stored, chunk.exact
        coding = encoder.quantized_as_is(chunk.name)
        stream, stats, *rounded = (h.numpy() for h in chunk.host)
        stored = quant_chunk(to_planes(stream, chunk.hi - chunk.lo, coding.block),
                             chunk.hi - chunk.lo, ordinal=coding.ordinal, with_base=coding.with_base,
                             step=coding.step, block=coding.block, dither=coding.dither,
                             scale=coding.scale, zeros=chunk.zeros)
        encoder.count_coded(chunk.name, stored, chunk.raw_offset, chunk.raw_size,
                            chunk.hi - chunk.lo, stats, rounded[0] if rounded else None)
        if chunk.digest is not None:
            return stored, chunk.digest
        values = encoder.running(chunk.name)[chunk.lo : chunk.hi]  # in host memory
        return stored, dtype_bytes(host_array(values), chunk.spec.name)

    def without_encoded(self, captured: CapturedState) -> CapturedState:
        """``captured`` with the tensors encoded here as ``meta`` tensors of their shape and
        dtype (DTensors of ``meta`` shards, laid out as they are): what the writer and the
        snapshot take (they hold no bytes)."""
        encoded = set(self.names)
        tensors = [replace(item, tensor=with_local(item.tensor, torch.empty_like(
                       local_values(item.tensor), device="meta")))
                   if item.name in encoded else item for item in captured.tensors]
        return CapturedState(tensors, captured.tree)


def _rounded_stats(x: torch.Tensor, recon: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """The statistics row (``STAT_*``) of a chunk of a 16-bit tensor ``x`` restored as its
    running values ``recon`` rounded to its dtype, on ``x``'s device (``delta._error_stats``)."""
    x64 = x.double()
    # From host memory (reconstruction="host"), a copy queued after the one that fills it:
    # converting on the host would read it before.
    err = (recon.to(x.device, non_blocking=True).to(x.dtype).double() - x64).abs()
    rel = torch.where(x64 != 0, err / x64.abs(), 0.0)
    row = torch.zeros((1, N_STATS), dtype=torch.float64, device=x.device)
    row[0, STAT_MAX_ABS] = err.max()
    row[0, STAT_MAX_REL] = rel.max()
    row[0, STAT_SUM_SQ_ERR] = err.dot(err)
    row[0, STAT_SUM_SQ] = x64.dot(x64)
    row[0, STAT_NONZERO] = nonzero
    return row

