"""The driver of a save after its snapshot: plan, encode and write, commit, on every rank.

:mod:`deltackpt.save` tells the whole path of a save; :func:`save_step`
runs it from the plan on, in one way for a single process and for the ranks
of a torch.distributed run: a single process is a group of one rank
(:meth:`Group.single`), whose collectives return what they are given and
whose failures are raised as they are. Every rank calls it for the same
step, on the caller's thread for a blocking save, on the save thread for an
asynchronous one. It receives the :class:`Writer` (where it writes, how it
codes, the :class:`~deltackpt.save.reference.Reference` it advances) and
calls nothing above this package:

1. **plan** (:func:`plan_save`). The input is the rank's layout, the boxes
   of each tensor it writes (:func:`~deltackpt.dist.shards.shard_parts`; a
   single process writes every tensor whole). Against it each rank chooses
   its base, the reference's reconstruction of the committed step its
   schedule names (:mod:`deltackpt.save.schedule`), if a delta may be coded
   against it (:func:`delta_base`); the ranks must agree
   on one base, else the step is full. Rank 0 takes the writer lock, checks
   that the step may be written (:meth:`~deltackpt.save.target.SaveTarget.prepare`),
   creates its directory and names the save (``save_id``): every rank writes
   under that name. A failure on any rank is raised on every rank, before
   anything is written.
2. **encode and write**. Each rank codes its boxes with a
   :class:`~deltackpt.encode.encoder.StepEncoder` (full: lossless; delta:
   quantized against the base, into running values that are what a reader
   decodes: the base's, changed in place, or values of its own where a
   later save codes against the base's too) and writes them into data files of its own, on the
   writer's threads (:func:`~deltackpt.io.writer.write_data`). A failure on
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
   reconstruction is held where the schedule codes a later save against it.
   A delta on its base's last use changes the base's values from the start
   of its encoding, which marks them stale until its commit: after such a
   delta failed, the next delta reads them again from their step (what a
   reader decodes) first.

What follows the commit (an upload from a cache, retention) is the
manager's, once the driver has returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deltackpt.dist.group import Group
from deltackpt.dist.shards import Part, check_same_state, local_parts, shard_parts
from deltackpt.encode.device import Encoding, RunningValues, begin_encoding, device_coded
from deltackpt.encode.encoder import StepEncoder, captured_layout
from deltackpt.encode.policy import CompressionConfig, ScaleController
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import DeltackptError
from deltackpt.format.metadata import StepMetadata, metadata_file, step_dir_name
from deltackpt.format.state import CapturedState
from deltackpt.io.pool import WorkerPool
from deltackpt.io.reader import read_save_id
from deltackpt.io.retired import RetiredFiles
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
from deltackpt.save.info import SaveInfo
from deltackpt.save.reference import Reference
from deltackpt.save.schedule import DEFAULT_DEPTH, Schedule, schedule
from deltackpt.save.target import SaveTarget

log = logging.getLogger("deltackpt")

ChainRestore = Callable[..., tuple[dict[str, torch.Tensor], Reconstruction]]
"""Restores a committed step from its metadata, as :func:`deltackpt.restore.chain.restore_chain`
does from a storage (``boxes=``, ``workers=``, ...): a step's tensors and its reconstruction."""


@dataclass(frozen=True)
class SaveSettings:
    """How a writer codes its saves: the compression config, a full step every ``full_every``
    saves, restored through at most ``depth`` deltas, at most ``chunk_bytes`` raw bytes a chunk,
    the ``target_ratio`` controller (which learns from each save) and where the running values
    of device-coded tensors are kept."""

    config: CompressionConfig
    full_every: int
    chunk_bytes: int
    controller: ScaleController | None = None
    running: RunningValues = field(default_factory=RunningValues)
    depth: int = DEFAULT_DEPTH

    @property
    def keeps_reference(self) -> bool:
        """Whether a save keeps its reconstruction for a next delta to be coded against."""
        return self.config.deltas and self.full_every > 1

    @property
    def schedule(self) -> Schedule:
        """Which step each save between two full steps is coded against."""
        return schedule(self.full_every, self.depth)


@dataclass(frozen=True)
class Writer:
    """Everything a save reads besides the state it saves: where it writes (``target``), how it
    codes (``settings``), the reference its delta is coded against and its commit advances,
    and how a committed step is read back when its values went stale after a failed delta
    (``restore``; None: such a delta is a full step instead)."""

    target: SaveTarget
    settings: SaveSettings
    reference: Reference
    restore: ChainRestore | None = None


@dataclass(frozen=True)
class Saved:
    """What a save committed: its summary and, on the rank that committed it, its metadata."""

    info: SaveInfo
    metadata: StepMetadata | None


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
    # Where the commit keeps a replaced version's data for readers: None in a cache, whose
    # upload does it on the checkpoint (io.tiering).
    retired: RetiredFiles | None = None

    @property
    def kind(self) -> str:
        """``"delta"`` or ``"full"``."""
        return "full" if self.base is None else "delta"


def save_step(writer: Writer, step: int, captured: CapturedState, group: Group,
              pool: WorkerPool, *, overwrite: bool, progress: bool,
              encoding: Encoding | None = None,
              devices: Mapping[str, torch.device] | None = None) -> Saved:
    """Plan, encode, write and commit ``captured`` as ``step`` on every rank of ``group``, with
    ``pool``'s threads, then advance ``writer``'s reference to it (see the module doc). Any
    rank's failure is raised on every rank and leaves no step.

    ``encoding``: begun at the call (:func:`encode_at_call`), whose base the plan takes;
    ``devices``: the tensors coded on a device of the state at the call (``captured`` may be
    its host copies), whose running values are kept there (default: those of ``captured``)."""
    started = time.perf_counter()
    if devices is None:
        devices = device_coded(captured)
    plan = plan_save(writer, step, captured, group, overwrite=overwrite, pool=pool,
                     encoding=encoding)
    written, error = None, None
    try:
        try:
            if encoding is None:
                encoding = begin(writer, captured, plan.base, plan.parts, devices)
            encoding.ready()
            encoder = encoding.encoder
            parts = plan.parts if encoding.captured is captured else \
                shard_parts(encoding.captured, group)  # of the tensors encoded: meta tensors
            written = write_data(plan.storage, step, plan.save_id, encoding.captured, parts=parts,
                                 rank=group.rank, encoder=encoder, coded_last=encoder.coded_last,
                                 chunk_bytes=writer.settings.chunk_bytes, workers=pool,
                                 progress=progress and group.rank == 0,
                                 sync_dirs=("",) if plan.created else ())
        except Exception as exc:  # raised on every rank by the check below
            error = exc
        group.check(error, f"save of step {step}")
        meta, info = commit(plan, encoder, written, started)
    except BaseException:
        _abandon(plan, written)  # the reference still is the last committed step's
        raise
    encoder.learn()
    recon = writer.settings.running.placed(encoder.reconstruction(step, plan.save_id), devices)
    writer.reference.advance(recon, encoding.base, writer.settings.schedule,
                             writer.target.storage, meta)
    return Saved(info, meta)


def encode_at_call(writer: Writer, step: int, captured: CapturedState, group: Group,
                   devices: Mapping[str, torch.device], pool: WorkerPool) -> Encoding:
    """Begin a save of ``captured`` as ``step`` at its call, once no save is in flight, on
    every rank of ``group`` (collective, on the caller's thread; for several ranks the
    manager's own gloo group): the state checked across ranks, the rank's layout, the base
    every rank agrees on, and for a delta the tensors coded on ``devices`` encoded there now
    (:mod:`deltackpt.encode.device`). The state the encoding's writer writes is then
    snapshotted, and :func:`save_step` goes on from there on the save thread. Any rank's
    failure is raised on every rank."""
    check_same_state(captured, group, at_call=True)  # the first collective: see its doc
    parts = shard_parts(captured, group)
    what = f"save of step {step}"
    base = agreed_base(group.together(what, lambda: delta_base(writer, step, captured, parts,
                                                               pool)), group)
    return group.together(what, lambda: begin(writer, captured, base, parts, devices))


def begin(writer: Writer, captured: CapturedState, base: Reconstruction | None,
          parts: dict[str, list[Part]], devices: Mapping[str, torch.device]) -> Encoding:
    """:func:`~deltackpt.encode.device.begin_encoding` with ``writer``'s settings. A delta
    writes running values of its own where a later save is coded against its base's too; on
    their last use it changes them in place from here on: until its step commits, they count
    as stale, so that a save that fails at any stage leaves them to be read again from their
    committed step by the next delta."""
    settings = writer.settings
    in_place = base is not None and not writer.reference.needed_after(base, settings.schedule)
    if in_place:
        writer.reference.stale = base.step
    return begin_encoding(captured, base, parts, devices, config=settings.config,
                          controller=settings.controller, keep=settings.keeps_reference,
                          in_place=in_place, chunk_bytes=settings.chunk_bytes,
                          running=settings.running)


def plan_save(writer: Writer, step: int, captured: CapturedState, group: Group, *,
              overwrite: bool, pool: WorkerPool, encoding: Encoding | None = None) -> SavePlan:
    """Plan this rank's part of saving ``captured`` as ``step`` (collective): its layout, the
    base every rank agreed on (``encoding``'s, where it was begun at the call, which checked
    the state) and, from rank 0, the step's directory and the save's name. Any rank's failure
    is raised on every rank, and leaves nothing written."""
    if encoding is None:
        check_same_state(captured, group)
    storage = writer.target.writes_to
    step_dir = step_dir_name(step)
    parts: dict[str, list[Part]] = {}
    base, save_id, created, present, error = None, None, False, None, None
    try:
        if group.rank == 0:
            present = writer.target.prepare(step, overwrite)
        parts = shard_parts(captured, group)
        base = encoding.base if encoding is not None else \
            delta_base(writer, step, captured, parts, pool)
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
    retired = writer.target.retired if storage is writer.target.storage else None
    return SavePlan(step, captured, group, storage, parts, base, save_id, created, present,
                    retired)


def agreed_base(base: Reconstruction | None, group: Group) -> Reconstruction | None:
    """``base`` where every rank of ``group`` chose the same step as its base (collective):
    every rank codes against one step, or none."""
    bases = group.all_gather(None if base is None else (base.step, base.save_id))
    return None if None in bases or len(set(bases)) > 1 else base


def delta_base(writer: Writer, step: int, captured: CapturedState,
               parts: dict[str, list[Part]], pool: WorkerPool) -> Reconstruction | None:
    """The reconstruction this rank codes ``step`` against, or None when it must be a full step:
    the one the reference's schedule names (:meth:`Reference.base`), while deltas are due,
    ``step`` comes after the last one saved, the rank's layout (``parts``) is the one it was
    kept in, and its step is still the one it came from, with its chain below. Values that a
    failed delta changed are read again from its step first."""
    reference, settings = writer.reference, writer.settings
    recon = reference.base(settings.schedule) if settings.keeps_reference else None
    if (recon is None or step <= reference.last
            or recon.layout != captured_layout(captured, local_parts(parts))):
        return None
    storage = writer.target.storage
    known = writer.reference.kept_metadata(storage, recon.step)  # the very file written or read
    save_id = known.save_id if known is not None else read_save_id(storage, recon.step)
    if save_id != recon.save_id or not all(
            storage.exists(metadata_file(s)) for s in recon.chain[:-1]):
        return None
    return _committed_values(writer, recon, parts, pool) if reference.stale == recon.step \
        else recon


def _committed_values(writer: Writer, recon: Reconstruction, parts: dict[str, list[Part]],
                      pool: WorkerPool) -> Reconstruction | None:
    """``recon`` with the values a reader decodes from its step (of this rank's ``parts``), read
    again because a delta coded against it failed after changing them, now the reference;
    None (a full step) if they cannot be."""
    if writer.restore is None:
        return None
    storage = writer.target.storage
    boxes = {name: (p[0].offsets, p[0].sizes) for name, p in parts.items() if p}
    try:
        _, decoded = writer.restore(writer.reference.metadata(storage, recon.step), boxes=boxes,
                                    workers=pool)
    except DeltackptError as exc:
        log.warning("%s: step %d, the base of the next delta, cannot be read again after a "
                    "failed save (%s); the next save is a full step", storage.url, recon.step,
                    exc)
        return None
    if not recon.values.keys() <= decoded.values.keys():
        return None
    refreshed = dataclasses.replace(recon, values={
        name: decoded.values[name].reshape(-1) for name in recon.values})
    writer.reference.refresh(refreshed)
    return refreshed


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
            commit_step(plan.storage, meta, present=plan.present, retired=plan.retired)
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
