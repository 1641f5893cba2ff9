"""The stages of a save after its snapshot: plan, encode and write, commit, on every rank.

:mod:`deltackpt.save.queue` tells the whole path of a save; :func:`save_step`
runs it from the plan on, in one way for a single process and for the ranks
of a torch.distributed run: a single process is a group of one rank
(:meth:`Group.single`), whose collectives return what they are given and
whose failures are raised as they are. Every rank calls it for the same
step, on the caller's thread for a blocking save, on the save thread for an
asynchronous one:

1. **plan** (:func:`plan_save`). The input is the rank's layout, the boxes
   of each tensor it writes (:func:`~deltackpt.dist.shards.shard_parts`; a
   single process writes every tensor whole). Against it each rank chooses
   its base, the manager's reconstruction of the last committed step, if a
   delta may be coded against it (:func:`delta_base`); the ranks must agree
   on one base, else the step is full. Rank 0 takes the writer lock, checks
   that the step may be written, creates its directory and names the save
   (``save_id``): every rank writes under that name. A failure on any rank
   is raised on every rank, before anything is written.
2. **encode and write**. Each rank codes its boxes with a
   :class:`~deltackpt.encode.encoder.StepEncoder` (full: lossless; delta: quantized
   against the base, whose values it updates in place to what a reader
   decodes) and writes them into data files of its own, on the manager's
   encoding threads (:func:`~deltackpt.io.writer.write_data`). A failure on
   any rank is raised on every rank. A delta of tensors the Triton kernels
   code (CUDA tensors) is encoded on their device first
   (:mod:`deltackpt.encode.device`); for an asynchronous save, by its call
   (:func:`encode_at_call`: the plan's check of the state and its base too,
   on every rank), before the snapshot.
3. **commit**. Rank 0 gathers what every rank wrote, merges it into the
   step's metadata and commits it (:func:`~deltackpt.io.writer.commit_step`);
   its failure is raised on every rank. A save that fails at any stage
   deletes what it wrote, unless its step was committed after all, and
   leaves the committed steps as they were.
4. **the reference advances**. Once the step is committed, the encoder's
   reconstruction becomes the manager's reference, which the next delta is
   coded against. A delta changes its base's values from the start of its
   encoding, which marks them stale until its commit: after a delta that
   failed, the reference stays the last committed step's, and the next
   delta reads them again from that step (what a reader decodes) first. Rank 0 then uploads
   the step from the cache, if the manager has one, and applies the
   retention policy (``keep``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltackpt.dist.group import Group
from deltackpt.dist.shards import Part, check_same_state, local_parts, shard_parts
from deltackpt.encode.device import Encoding, begin_encoding, device_coded
from deltackpt.encode.encoder import StepEncoder, captured_layout
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import DeltackptError
from deltackpt.format.metadata import StepMetadata, metadata_file, step_dir_name
from deltackpt.format.state import CapturedState
from deltackpt.io.reader import read_save_id
from deltackpt.io.storage import Storage
from deltackpt.io.writer import (
    WrittenData,
    commit_step,
    committed,
    merge_written,
    new_save_id,
    step_metadata,
    write_data,
    writing,
)

if TYPE_CHECKING:
    from deltackpt.io.pool import WorkerPool
    from deltackpt.manager import CheckpointManager

log = logging.getLogger("deltackpt")

# A delta within this factor of target_ratio counts as meeting it.
TARGET_TOLERANCE = 1.15


@dataclass(frozen=True)
class SaveInfo:
    """What one ``save`` wrote."""

    step: int
    kind: str
    base_step: int | None
    raw_bytes: int
    stored_bytes: int
    seconds: float
    target_ratio: float | None = None
    at_max_error: bool = False  # the target needed errors beyond max_error: steps at that floor
    # What the call that saved it cost the caller (not compared: the step's record is the same):
    # how long ``save`` blocked it, for an asynchronous save waiting for a save in flight at the
    # max_in_flight limit, capturing and copying the state, for a blocking one the whole save;
    blocked_seconds: float = field(default=0.0, compare=False)
    # of which waiting at the limit, or for the saves in flight before a delta encoded on a device
    waited_seconds: float = field(default=0.0, compare=False)
    snapshot_bytes: int = field(default=0, compare=False)  # host memory of the async snapshot

    @property
    def ratio(self) -> float:
        """Raw bytes of the state per stored byte."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @property
    def target_met(self) -> bool | None:
        """Whether a delta reached the configured ``target_ratio`` (within 15%); None without one."""
        if self.target_ratio is None:
            return None
        return self.ratio >= self.target_ratio / TARGET_TOLERANCE

    @classmethod
    def of(cls, meta: StepMetadata) -> SaveInfo:
        """The save summary recorded in a step's metadata."""
        compression = meta.stats.compression or {}
        target = compression.get("target_ratio")
        return cls(meta.step, meta.kind, meta.base_step, meta.stats.raw_bytes,
                   meta.stats.stored_bytes, meta.stats.seconds,
                   float(target) if isinstance(target, (int, float)) else None,
                   compression.get("at_max_error") is True)


@dataclass
class SavePlan:
    """One rank's part of a save, decided by every rank together before anything is encoded."""

    step: int
    captured: CapturedState
    group: Group
    storage: Storage  # where the step is written: the checkpoint, or the cache in front of it
    parts: dict[str, list[Part]]  # the rank's layout: the boxes of each tensor it writes
    base: Reconstruction | None  # what the step is a delta on; None: a full step
    save_id: str
    created: bool  # the save created the step's directory: a failed save removes it
    # Rank 0: the step's files before the save, where the storage lists them in one request;
    # the commit deletes those the step does not reference (remove_unreferenced).
    present: list[str] | None = None

    @property
    def kind(self) -> str:
        """``"delta"`` or ``"full"``."""
        return "full" if self.base is None else "delta"


def save_step(manager: CheckpointManager, step: int, captured: CapturedState, group: Group, *,
              overwrite: bool, progress: bool, encoding: Encoding | None = None,
              devices: Mapping[str, torch.device] | None = None) -> SaveInfo:
    """Plan, encode, write and commit ``captured`` as ``step`` on every rank of ``group``, then
    advance ``manager``'s reference to it (see the module doc). Any rank's failure is raised
    on every rank and leaves no step.

    ``encoding``: begun at the call (:func:`encode_at_call`), whose base the plan takes;
    ``devices``: the tensors coded on a device of the state at the call (``captured`` may be
    its host copies), whose running values are kept there (default: those of ``captured``)."""
    if group.world_size > 1 and manager._cache is not None:
        raise ValueError(f"{manager.path}: cache= serves single-process saves; under "
                         "torch.distributed every rank writes to the checkpoint itself")
    manager._settle()
    started = time.perf_counter()
    pool = manager._workers(group)  # a collective at a group's first save: before any can fail
    if devices is None:
        devices = device_coded(captured)
    plan = plan_save(manager, step, captured, group, overwrite=overwrite, pool=pool,
                     encoding=encoding)
    written, error = None, None
    try:
        try:
            if encoding is None:
                encoding = begin(manager, captured, plan.base, plan.parts, devices)
            encoding.ready()
            encoder = encoding.encoder
            parts = plan.parts if encoding.captured is captured else \
                shard_parts(encoding.captured, group)  # of the tensors encoded: meta tensors
            written = write_data(plan.storage, step, plan.save_id, encoding.captured, parts=parts,
                                 rank=group.rank, encoder=encoder, coded_last=encoder.coded_last,
                                 chunk_bytes=manager.chunk_bytes, workers=pool,
                                 progress=progress and group.rank == 0,
                                 sync_dirs=("",) if plan.created else ())
        except Exception as exc:  # raised on every rank by the check below
            error = exc
        group.check(error, f"save of step {step}")
        meta, info = commit(plan, encoder, written, started)
    except BaseException:
        _abandon(plan, written)  # the reference still is the last committed step's
        raise
    _advance(manager, plan, encoding, meta, info, devices)
    return info


def encode_at_call(manager: CheckpointManager, step: int, captured: CapturedState,
                   group: Group, devices: Mapping[str, torch.device]) -> Encoding:
    """Begin a save of ``captured`` as ``step`` at its call, once no save is in flight, on
    every rank of ``group`` (collective, on the caller's thread; for several ranks the
    manager's own gloo group): the state checked across ranks, the rank's layout, the base
    every rank agrees on, and for a delta the tensors coded on ``devices`` encoded there now
    (:mod:`deltackpt.encode.device`). The state the encoding's writer writes is then
    snapshotted, and :func:`save_step` goes on from there on the save thread. Any rank's
    failure is raised on every rank."""
    check_same_state(captured, group, at_call=True)  # the first collective: see its doc
    pool = manager._workers(group)
    parts = shard_parts(captured, group)
    what = f"save of step {step}"
    base = agreed_base(group.together(what, lambda: delta_base(manager, step, captured, parts,
                                                               pool)), group)
    return group.together(what, lambda: begin(manager, captured, base, parts, devices))


def begin(manager: CheckpointManager, captured: CapturedState, base: Reconstruction | None,
          parts: dict[str, list[Part]], devices: Mapping[str, torch.device]) -> Encoding:
    """:func:`~deltackpt.encode.device.begin_encoding` with ``manager``'s settings. A delta
    changes its base's values in place from here on: until its step commits (:func:`_advance`),
    they count as stale, so that a save that fails at any stage leaves them to be read again
    from the last committed step by the next delta."""
    manager._stale_values = manager._stale_values or base is not None
    return begin_encoding(captured, base, parts, devices, config=manager.compression,
                          controller=manager._controller,
                          keep=manager.compression.deltas and manager.full_every > 1,
                          chunk_bytes=manager.chunk_bytes, running=manager._running)


def plan_save(manager: CheckpointManager, step: int, captured: CapturedState, group: Group, *,
              overwrite: bool, pool: WorkerPool, encoding: Encoding | None = None) -> SavePlan:
    """Plan this rank's part of saving ``captured`` as ``step`` (collective): its layout, the
    base every rank agreed on (``encoding``'s, where it was begun at the call, which checked
    the state) and, from rank 0, the step's directory and the save's name. Any rank's failure
    is raised on every rank, and leaves nothing written."""
    if encoding is None:
        check_same_state(captured, group)
    storage = manager.storage if manager._cache is None else manager._cache.storage
    step_dir = step_dir_name(step)
    parts: dict[str, list[Part]] = {}
    base, save_id, created, present, error = None, None, False, None, None
    try:
        if group.rank == 0:
            present = manager._prepare_save(step, overwrite)
            if manager._cache is not None:  # the listing is the checkpoint's, not the cache's
                manager._cache.open()
                present = None
        parts = shard_parts(captured, group)
        base = encoding.base if encoding is not None else \
            delta_base(manager, step, captured, parts, pool)
        if group.rank == 0:
            with writing(storage, step, step_dir):
                # A new step directory's entry becomes durable while the data files are fsynced.
                created = storage.makedirs(step_dir, durable=False)
            save_id = new_save_id()
    except Exception as exc:  # raised on every rank by the check below
        error = exc
    try:
        group.check(error, f"save of step {step}")
        base = agreed_base(base, group)
        save_id, created = group.broadcast((save_id, created))
    except BaseException:
        if created:  # on rank 0, for another rank's failure
            _remove_step_dir(storage, step)
        raise
    return SavePlan(step, captured, group, storage, parts, base, save_id, created, present)


def agreed_base(base: Reconstruction | None, group: Group) -> Reconstruction | None:
    """``base`` where every rank of ``group`` chose the same step as its base (collective):
    every rank codes against one step, or none."""
    bases = group.all_gather(None if base is None else (base.step, base.save_id))
    return None if None in bases or len(set(bases)) > 1 else base


def delta_base(manager: CheckpointManager, step: int, captured: CapturedState,
               parts: dict[str, list[Part]], pool: WorkerPool) -> Reconstruction | None:
    """The reconstruction this rank codes ``step`` against, or None when it must be a full step:
    the manager's reference, while deltas are due, ``step`` comes after it, the rank's layout
    (``parts``) is the one it was kept in, and its step is still the one it came from, with its
    chain below. Values that a failed delta changed are read again from its step first."""
    recon = manager._recon
    if (recon is None or not manager.compression.deltas
            or recon.deltas + 1 >= manager.full_every or step <= recon.step
            or recon.layout != captured_layout(captured, local_parts(parts))):
        return None
    known = manager._kept_metadata(recon.step)  # the very file the manager wrote or read
    save_id = known.save_id if known is not None else read_save_id(manager.storage, recon.step)
    if save_id != recon.save_id or not all(
            manager.storage.exists(metadata_file(s)) for s in recon.chain[:-1]):
        return None
    return _committed_values(manager, recon, parts, pool) if manager._stale_values else recon


def _committed_values(manager: CheckpointManager, recon: Reconstruction,
                      parts: dict[str, list[Part]], pool: WorkerPool) -> Reconstruction | None:
    """``recon`` with the values a reader decodes from its step (of this rank's ``parts``), read
    again because a delta coded against it failed after changing them, now the manager's
    reference; None (a full step) if they cannot be."""
    boxes = {name: (p[0].offsets, p[0].sizes) for name, p in parts.items() if p}
    try:
        _, decoded = manager._restore_chain(manager.metadata(recon.step), boxes=boxes,
                                            workers=pool)
    except DeltackptError as exc:
        log.warning("%s: step %d, the base of the next delta, cannot be read again after a "
                    "failed save (%s); the next save is a full step", manager.path, recon.step,
                    exc)
        return None
    if not recon.values.keys() <= decoded.values.keys():
        return None
    manager._recon = dataclasses.replace(recon, values={
        name: decoded.values[name].reshape(-1) for name in recon.values})
    manager._stale_values = False
    return manager._recon


def commit(plan: SavePlan, encoder: StepEncoder, written: WrittenData,
           started: float) -> tuple[StepMetadata | None, SaveInfo]:
    """Commit the step every rank of the plan wrote (collective; ``started``: when the save
    began): rank 0 merges what they wrote into the step's metadata and commits it. Returns that
    metadata (on rank 0; None elsewhere) and the save's summary; rank 0's failure is raised on
    every rank."""
    group = plan.group
    everyone = group.gather((written, encoder.class_stats))
    meta, info, error = None, None, None
    if group.rank == 0:
        try:
            merged = merge_written([w for w, _ in everyone])
            meta = step_metadata(plan.step, plan.save_id, merged, plan.captured.tree,
                                 kind=plan.kind,
                                 base_step=plan.base.step if plan.base else None,
                                 world_size=group.world_size,
                                 seconds=time.perf_counter() - started,
                                 summary=encoder.summary([s for _, s in everyone]))
            commit_step(plan.storage, meta, present=plan.present)
            info = SaveInfo.of(meta)
        except Exception as exc:  # raised on every rank by share
            error = exc
    return meta, group.share(info, error)


def _abandon(plan: SavePlan, written: WrittenData | None) -> None:
    """Delete what a failed save wrote on this rank: the data files it wrote or, on rank 0, the
    step's directory with every rank's files where the save created it. Nothing when the step
    was committed after all (the failure came after the rename of its metadata)."""
    if committed(plan.storage, plan.step, plan.save_id):
        return
    if plan.created:
        if plan.group.rank == 0:  # every rank has ended writing: the save's failure reached it
            _remove_step_dir(plan.storage, plan.step)
        return
    for f in written.files if written is not None else ():
        with contextlib.suppress(OSError, DeltackptError):
            plan.storage.remove(f"{step_dir_name(plan.step)}/{f.name}")


def _remove_step_dir(storage: Storage, step: int) -> None:
    """Delete the directory a failed save created for ``step``, and what it holds."""
    with contextlib.suppress(OSError, DeltackptError):
        storage.remove_tree(step_dir_name(step))


def _advance(manager: CheckpointManager, plan: SavePlan, encoding: Encoding,
             meta: StepMetadata | None, info: SaveInfo,
             devices: Mapping[str, torch.device]) -> None:
    """After the commit of the plan's step: its reconstruction becomes the manager's reference
    on every rank (the running values of tensors coded on ``devices`` kept as the manager
    keeps them); rank 0 keeps the step's metadata, uploads the step from the cache, warns of
    a missed ``target_ratio``, and applies the retention policy (its failure raised on every
    rank)."""
    encoder = encoding.encoder
    encoder.learn()
    manager._recon = manager._running.placed(encoder.reconstruction(plan.step, plan.save_id),
                                             devices)
    manager._stale_values = False
    group = plan.group
    if meta is not None:  # rank 0, which committed it
        identity = manager.storage.identity(metadata_file(plan.step))
        known = manager._known
        chain = {s: known[s] for s in plan.base.chain if s in known} if plan.base else {}
        manager._known = chain if identity is None else {**chain, plan.step: (identity, meta)}
        if manager._cache is not None:
            manager._cache.upload(meta)
        _warn_target(manager, info, encoder.scale)
    if manager.keep is not None:
        error = None
        if group.rank == 0:
            try:
                manager.gc(manager.keep)
            except Exception as exc:  # raised on every rank by the check below
                error = exc
        group.check(error, f"gc after the save of step {plan.step}")


def _warn_target(manager: CheckpointManager, info: SaveInfo, scale: float) -> None:
    """Warn, once per manager, of a delta that missed ``target_ratio``: because the target
    needs errors beyond ``max_error``, or because the controller is still learning."""
    if manager._warned_target or info.kind != "delta" or info.target_ratio is None:
        return
    if info.at_max_error:
        manager._warned_target = True
        log.warning("step %d: target_ratio %g needs errors beyond max_error (%.3g times "
                    "the configured ones); deltas stay at that floor (%.1fx achieved); "
                    "SaveInfo.at_max_error and the step metadata say so for each save",
                    info.step, info.target_ratio, manager.compression.max_scale, info.ratio)
    elif info.target_met is False:
        manager._warned_target = True
        log.warning("step %d: target_ratio %g not met, achieved %.1fx (steps scaled by %.3g)",
                    info.step, info.target_ratio, info.ratio, scale)
