"""The snapshot of an asynchronous save: the state at the call, in buffers training never touches.

``save(..., blocking=False)`` returns once every tensor of the captured state
is copied into a :class:`HostBuffers` set; the save's encoding and writing
then read those copies in the background while training changes the live
tensors in place. Nothing is written while it can still change: a tensor
is copied whole before the call returns, so a step can never hold values of
two training steps (the bug class of pytorch#144657).

A set is allocated at the first save that takes it and reused by the saves
after it (a tensor's buffer is replaced only when its shape, dtype or
device kind changed), so saving allocates nothing of the state's size once
running. A manager keeps at most ``max_in_flight`` sets (:class:`SnapshotPool`):
its snapshot memory is bounded by that many copies of the state.

CPU tensors are copied with a plain memory copy. CUDA tensors are copied into
pinned host buffers on a side stream of their device, after the training
stream's pending work (an event recorded on the training stream, which the
side stream waits for); the training stream in turn waits on the device
for the copies before its next kernels, so that an in-place update queued
after the call cannot overwrite a tensor before it is copied, and the host
never synchronizes with the device: the background thread waits for the
copies (:meth:`Snapshot.ready`) before it reads them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from deltackpt.dist.shards import local_values, with_local
from deltackpt.format.dtypes import spec_for
from deltackpt.format.state import CapturedState


@dataclass
class Snapshot:
    """A captured state whose tensors are copies held in a :class:`HostBuffers` set."""

    captured: CapturedState
    nbytes: int  # of the buffers holding its tensors
    _device_copies: list[Any] = field(default_factory=list)  # CUDA events of pending copies

    def ready(self) -> None:
        """Wait until the device-to-host copies of CUDA tensors are complete (the background
        thread calls it before reading the snapshot; CPU copies are complete at the call)."""
        for event in self._device_copies:
            event.synchronize()
        self._device_copies = []


def _allocate(shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host buffer for one tensor; pinned for copies from a CUDA device."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def _copy_on_host(buffer: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` (not on a CUDA device) into host ``buffer`` of its shape and dtype: a
    plain memory copy on this thread where it is a contiguous CPU tensor. (``Tensor.copy_``
    shares large copies out between torch's threads, which is many times slower on a machine
    whose cores are busy, as they are while saves encode in the background.)"""
    if source.device.type == "cpu" and source.is_contiguous() \
            and not (source.is_conj() or source.is_neg()):
        np.copyto(_bytes(buffer), _bytes(source))
    else:
        buffer.copy_(source)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a numpy array sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class HostBuffers:
    """One host buffer per stored tensor of the state, reused from one snapshot to the next."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()  # names of the pinned buffers
        self._side_streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The buffer for tensor ``name``: the one it had, when it still fits."""
        pinned = tensor.is_cuda
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype \
                or (name in self._pinned) != pinned:  # (Tensor.is_pinned() is slow)
            buffer = self._buffers[name] = _allocate(tensor.shape, tensor.dtype, pinned)
            if pinned:
                self._pinned.add(name)
            else:
                self._pinned.discard(name)
        return buffer

    def take(self, captured: CapturedState) -> Snapshot:
        """Copy every tensor of ``captured`` into these buffers; the returned state names them
        instead (aliases the buffer of the tensor they alias). Its tree, already tagged JSON
        built at the capture, holds no reference to the live objects. Tensors on the ``meta``
        device (a delta coded them on their device at the call: :mod:`deltackpt.encode.device`)
        stay as they are, and their buffers are kept for the next snapshot that copies them."""
        copies: dict[str, torch.Tensor] = {}
        from_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for item in captured.tensors:
            if item.alias_of is not None:
                continue
            source = local_values(item.tensor)  # a DTensor's shard, copied as its local tensor
            if source.is_meta:
                copies[item.name] = source
                continue
            spec_for(source.dtype, item.name)  # an unsupported dtype fails now, at the call
            buffer = copies[item.name] = self._buffer(item.name, source)
            if source.is_cuda:
                from_device.setdefault(source.device, []).append((source, buffer))
            else:
                _copy_on_host(buffer, source)
        for name in self._buffers.keys() - copies.keys():  # tensors the state no longer holds
            del self._buffers[name]
            self._pinned.discard(name)
        events = [self._copy_from_device(device, pairs) for device, pairs in from_device.items()]
        tensors = [replace(item, tensor=with_local(item.tensor, copies[item.alias_of or item.name]))
                   for item in captured.tensors]
        return Snapshot(CapturedState(tensors, captured.tree), self.nbytes, events)

    def _copy_from_device(self, device: torch.device,
                          pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue the copies of ``device``'s tensors into their pinned buffers on a side stream,
        after the work queued so far on the training stream, and make the training stream's
        later work wait for them (on the device). Returns the event that marks them done."""
        training = torch.cuda.current_stream(device)
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        queued = torch.cuda.Event()
        queued.record(training)
        side.wait_event(queued)
        with torch.cuda.stream(side):
            for source, buffer in pairs:
                buffer.copy_(source, non_blocking=True)
                source.record_stream(side)  # its memory is not reused before the copy ran
        done = torch.cuda.Event()
        done.record(side)
        training.wait_event(done)
        return done


class SnapshotPool:
    """At most ``slots`` :class:`HostBuffers` sets: a save takes one for its snapshot and gives
    it back once written, so that at most ``slots`` saves are in flight. Sets are allocated
    when first taken, and kept."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: list[HostBuffers] = []
        self._sets: list[HostBuffers] = []
        self._available = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Host memory held by every set."""
        return sum(s.nbytes for s in self._sets)

    def acquire(self) -> tuple[HostBuffers, float]:
        """A free set, waiting while all ``slots`` are taken; and the seconds waited."""
        started = time.perf_counter()
        with self._available:
            while not self._free and len(self._sets) >= self.slots:
                self._available.wait()
            if self._free:
                buffers = self._free.pop()
            else:
                buffers = HostBuffers()
                self._sets.append(buffers)
        return buffers, time.perf_counter() - started

    def release(self, buffers: HostBuffers) -> None:
        """Give a set back (its save is written, or failed)."""
        with self._available:
            self._free.append(buffers)
            self._available.notify()
