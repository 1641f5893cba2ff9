"""The public entry point: a directory of steps that you save to and restore from."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from deltackpt.directory import CheckpointDirectory, check_step
from deltackpt.dist.group import Group
from deltackpt.dist.shards import local_box, shard_like, shard_parts, sharded_targets
from deltackpt.encode.device import Encoding, RunningValues, device_coded, reconstruction_bytes
from deltackpt.encode.encoder import captured_layout
from deltackpt.encode.policy import CompressionConfig, ScaleController, as_config
from deltackpt.encode.reconstruction import Reconstruction
from deltackpt.errors import ConfigError, DeltackptError
from deltackpt.format.checks import check_bool, check_int, check_number
from deltackpt.format.metadata import (
    Box,
    StepMetadata,
    layout_of,
    metadata_file,
)
from deltackpt.format.state import CapturedState
from deltackpt.io.pool import WorkerPool, default_workers, rank_threads
from deltackpt.io.reader import chain_of
from deltackpt.io.retired import DEFAULT_GRACE, RetiredFiles
from deltackpt.io.tiering import UploadCache
from deltackpt.io.writer import DEFAULT_CHUNK_BYTES
from deltackpt.ops.retention import GCReport, KeepSteps, RetentionPolicy, collect_garbage
from deltackpt.restore.cached import restore_cached
from deltackpt.restore.consistent import ChainReads, read_consistently
from deltackpt.restore.universal import UniversalCheckpoint
from deltackpt.save.capture import capture
from deltackpt.save.driver import Saved, SaveSettings, Writer, encode_at_call, save_step
from deltackpt.save.info import SaveInfo
from deltackpt.save.queue import SaveHandle, SaveQueue
from deltackpt.save.reference import KnownMetadata, Reference, resumed
from deltackpt.save.schedule import DEFAULT_DEPTH, DEFAULT_FULL_EVERY
from deltackpt.save.target import SaveTarget

log = logging.getLogger("deltackpt")


class CheckpointManager(CheckpointDirectory):
    """Saves training state as numbered steps in one directory and restores any of them.

    >>> mgr = CheckpointManager("runs/ckpt", full_every=10)
    >>> mgr.save(100, model=model, optimizer=optimizer, extra={"epoch": 3})
    >>> mgr.load(100, model=model, optimizer=optimizer)

    Saves alternate between full (lossless) steps and delta steps coded against the
    reconstruction a reader will have, so a restored step carries the error of one delta
    however long its chain. Every save commits atomically; one manager at a time writes to a
    directory (it takes a lock at its first save, released by :meth:`close`), any number
    read. The manual's "Saving, restoring and presets" page tells the rest.

    Args:
        path: the checkpoint directory (created if missing), a ``file://`` URL, or an fsspec
            URL of a prefix on an object store (``s3://bucket/run1``).
        full_every: a full step every this many saves, deltas in between (1: every save full).
        depth: the most deltas a restore decodes after its full step: each delta is coded
            against an earlier save of its group so that none is deeper, the references as
            close as that allows (:mod:`deltackpt.save.schedule`).
        compression: ``"balanced"`` (default), ``"aggressive"``, ``"lossless"`` or a
            :class:`CompressionConfig`.
        keep: a retention policy (:class:`RetentionPolicy` or its string form,
            ``"last=5,every=100"``) applied after every save; ``None`` keeps every step.
        chunk_bytes: the most raw bytes coded as one chunk.
        workers: encoding and decoding threads (default: the usable CPUs, shared out between
            the ranks of a machine under torch.distributed).
        read_only: never create, clean up or write anything.
        storage_options: options of the file system of an fsspec ``path`` (endpoint,
            credentials); never written anywhere nor shown in errors.
        cache: a local directory each step is saved to first, then uploaded to ``path`` in
            the background; restores read it where it holds the same steps.
        cache_keep: uploaded steps the cache keeps (the newest), besides those their chains
            need.
        blocking: the default of :meth:`save`'s ``blocking``.
        max_in_flight: asynchronous saves in flight at once, each holding a host copy of the
            state (:attr:`snapshot_bytes`); a further one waits for the oldest.
        reconstruction: where the running values of tensors coded on a GPU are kept:
            ``"device"`` (default), or pinned ``"host"`` memory to spare the device's
            (:attr:`reconstruction_bytes`).
        reader_grace: seconds the data of a step that ``keep=`` (or an overwrite) deletes or
            replaces stays for the readers that read its metadata before (default 300; 0:
            deleted at once), deleted at a later save or gc; a restore that takes longer
            reads the step's changed chain again.
    """

    def __init__(self, path: str | os.PathLike[str], full_every: int = DEFAULT_FULL_EVERY, *,
                 depth: int = DEFAULT_DEPTH, compression: str | CompressionConfig = "balanced",
                 keep: str | RetentionPolicy | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: int | None = None,
                 read_only: bool = False,
                 storage_options: Mapping[str, Any] | None = None,
                 cache: str | os.PathLike[str] | None = None, cache_keep: int = 1,
                 blocking: bool = True, max_in_flight: int = 1,
                 reconstruction: str = "device", reader_grace: float = DEFAULT_GRACE) -> None:
        check_int(full_every, "full_every")
        check_int(depth, "depth")  # its schedule is computed at the first delta that needs it
        check_int(max_in_flight, "max_in_flight")
        check_int(chunk_bytes, "chunk_bytes", least=1024)
        if workers is not None:
            check_int(workers, "workers")
        check_int(cache_keep, "cache_keep", least=0)
        check_bool(read_only, "read_only")
        check_bool(blocking, "blocking")
        check_number(reader_grace, "reader_grace", least=0)
        self.full_every, self.depth = full_every, depth
        self.compression = as_config(compression)
        self.keep = RetentionPolicy.parse(keep) if keep is not None else None
        self.chunk_bytes = chunk_bytes
        self.blocking = blocking
        self.max_in_flight = max_in_flight
        self._queue: SaveQueue | None = None  # the asynchronous saves, from the first one
        self._background_group: Group | None = None  # their collectives' group
        self._rank_workers: int | None = None  # threads of each rank under torch.distributed
        self._pool: WorkerPool | None = None
        self.read_only = read_only
        self._reference = Reference()  # what the next delta is coded against
        self._running = RunningValues(reconstruction)  # where device-coded values are kept
        target = self.compression.target_ratio
        self._controller = ScaleController(target, self.compression.max_scale) \
            if target is not None else None
        self._warned_target = False
        super().__init__(path, workers=workers, create=not read_only,
                         storage_options=storage_options)
        retired = RetiredFiles(self.storage, reader_grace)  # kept for readers a while
        self._cache = UploadCache(cache, self.storage, cache_keep, retired) \
            if cache is not None and not read_only else None
        self._target = SaveTarget(self.storage, self._cache, read_only=read_only, retired=retired)
        # how this manager reads a chain: from the cache where it holds the same steps
        self._read_chain = functools.partial(restore_cached, self.storage, self._cache)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.path!r}, full_every={self.full_every}, depth={self.depth})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the saves in flight and the upload of the last step saved through a cache
        (raising their failure), release the writer lock, if this manager holds it, stop its
        threads and free its snapshot buffers. A later save takes the lock again, and a later
        save or restore starts new threads."""
        try:
            self.wait()
        finally:
            try:
                if self._cache is not None:
                    self._cache.close()
            finally:
                self._release()

    def wait(self) -> None:
        """Wait for every asynchronous save in flight. Raises :class:`BackgroundSaveError`,
        with the original error chained, for one that failed and whose failure its handle has
        not given (``handle.wait()`` or ``handle.exception()``)."""
        if self._queue is not None:
            self._queue.wait_all()
            self._queue.raise_failure()

    @property
    def snapshot_bytes(self) -> int:
        """Host memory held for the snapshots of asynchronous saves: at most ``max_in_flight``
        copies of the state, allocated by the first saves and reused by the next."""
        return self._queue.snapshots.nbytes if self._queue is not None else 0

    @property
    def reconstruction_bytes(self) -> dict[str, int]:
        """Memory of the running reconstructions the next deltas code against, by device kind
        (``{"cpu": ..., "cuda": ...}``): at most one a level of the schedule (``depth``), each
        about the size of the saved state in float32, on the device of the tensors coded there
        unless ``reconstruction="host"``, with the host bytes of the integer tensors of at most
        64 KiB a later delta patches (RNG states, FORMAT.md 3.6); a delta save whose base a later
        save needs too takes one more for the running values it writes."""
        return reconstruction_bytes(*self._reference.levels.values())

    def _release(self) -> None:
        if self._queue is not None:
            self._queue.close()
        self._target.release()
        if self._pool is not None:
            self._pool.close()

    # -- directory ---------------------------------------------------------------------

    def acquire(self) -> None:
        """Become the directory's one writer now (a save or gc does it otherwise): take the writer
        lock, held until :meth:`close`, and remove what interrupted saves left behind.

        Opening a manager never takes the lock, so readers never block a
        writer. Raises :class:`WriterLockedError` while another manager (in
        this or another process) holds it.
        """
        self._target.acquire()

    def _threads(self, group: Group | None) -> int | None:
        """Threads to encode and decode with: ``workers`` if given; under torch.distributed, the
        CPUs this process may use shared out between the ranks on its machine (one rank per
        core would otherwise run as many threads as the machine has cores)."""
        if self.workers is not None or group is None:
            return self.workers
        if self._rank_workers is None:
            self._rank_workers = rank_threads(group)
        return self._rank_workers

    def _workers(self, group: Group | None = None) -> WorkerPool:
        """The manager's thread pool, of :meth:`_threads` threads, kept from its first save or
        restore until :meth:`close`."""
        threads = self._threads(group) or default_workers()
        if self._pool is None or self._pool.workers != threads:
            if self._pool is not None:
                self._pool.close()
            self._pool = WorkerPool(threads)
        return self._pool

    # -- queries -----------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for the saves in flight (whose failures the next save, wait or close raises),
        then for the step uploading from the cache, if any: every operation but a save's
        return sees the directory with them (or raises the upload's failure). On the thread
        that runs the saves, only the upload is waited for."""
        if self._queue is not None and not self._queue.on_save_thread():
            self._queue.wait_all()
        if self._cache is not None:
            self._cache.wait()

    def steps(self) -> list[int]:
        self._settle()
        return super().steps()

    def metadata(self, step: int) -> StepMetadata:
        """The validated metadata of ``step``; that of the chain this manager last saved or
        restored is kept, and read again only when its file changed."""
        self._settle()
        step = check_step(step)
        known = self._reference.kept_metadata(self.storage, step)
        return known if known is not None else super().metadata(step)

    def resolve_step(self, step: int | None = None) -> int:
        self._settle()
        return super().resolve_step(step)

    def info(self, step: int) -> SaveInfo:
        """Kind, sizes and timing recorded for ``step``."""
        return SaveInfo.of(self.metadata(step))

    # -- save --------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, extra: Any = None, *,
             rng: bool = True, overwrite: bool = False, progress: bool = False,
             blocking: bool | None = None) -> SaveInfo | SaveHandle:
        """Save the training state as ``step``; return what was written (:class:`SaveInfo`) or,
        for an asynchronous save, its :class:`SaveHandle`.

        Args:
            step: the training step (a non-negative int).
            model: its parameters and persistent buffers, saved by FQN (tied ones once).
            optimizer: any ``torch.optim`` optimizer over ``model``'s parameters; its state is
                stored by parameter FQN.
            extra: anything else to restore exactly: JSON-able values, bytes, numpy arrays and
                tensors, nested in dicts, lists and tuples.
            rng: also save the torch (CPU and CUDA), numpy and ``random`` RNG states.
            overwrite: replace an existing step (atomically) instead of refusing.
            progress: show a progress bar.
            blocking: ``False`` returns once the state is copied into host buffers and saves it
                in the background (default: the manager's ``blocking``).

        Under torch.distributed every rank calls it: each writes the shards it holds and rank
        0 commits the step; any rank's failure raises :class:`DistributedError` on every rank
        and leaves no step. The manual's "Asynchronous saves and GPU encoding" and
        "Distributed training" pages tell the rest.
        """
        started = time.perf_counter()
        step = check_step(step)
        if self._queue is not None:
            self._queue.admit(step)
        if not (self.blocking if blocking is None else blocking):
            return self._save_async(step, lambda: capture(model, optimizer, extra, rng),
                                    overwrite=overwrite, progress=progress, started=started)
        info = self.save_captured(step, capture(model, optimizer, extra, rng),
                                  overwrite=overwrite, progress=progress)
        return dataclasses.replace(info, blocked_seconds=time.perf_counter() - started)

    def _save_async(self, step: int, capturing: Callable[[], CapturedState], *, overwrite: bool,
                    progress: bool, started: float) -> SaveHandle:
        """Capture and snapshot the state here, then plan, encode, write and commit it on the
        save thread (:mod:`deltackpt.save.queue`, :meth:`_save`). Under torch.distributed
        the save's collectives run there, on a gloo group of their own
        (:meth:`Group.background`), and whether the step may be written is decided there, by
        every rank together."""
        if self.read_only:
            raise PermissionError(f"{self.path}: this manager was opened read_only")
        group = Group.current()
        if group is not None and self._background_group is None:
            self._background_group = group.background()
        if self._queue is None:
            self._queue = SaveQueue(self.max_in_flight)
        queue = self._queue
        queue.raise_failure()
        if group is None:
            self._target.prepare(step, overwrite)  # refused at once: a step that exists, the lock
        ranks = Group.single() if group is None else self._background_group
        captured = capturing()
        devices = device_coded(captured)
        encoding, waited_encoding = self._encode_at_call(step, captured, ranks, devices)
        buffers, waited = queue.snapshots.acquire()
        try:
            queue.raise_failure()  # a save that failed while this one waited
            snapshot = buffers.take(encoding.captured if encoding is not None else captured)
        except BaseException:
            queue.snapshots.release(buffers)
            raise
        # Freed before the save thread is woken: freeing the capture's tensor views releases
        # the GIL, which a woken save thread would take and keep for up to its switch interval
        del captured
        if encoding is not None:  # what it writes: the copies, no live tensor
            encoding = dataclasses.replace(encoding, captured=snapshot.captured)
            encoding.encoder.release_state()
        blocked = time.perf_counter() - started
        waited += waited_encoding

        def run() -> SaveInfo:
            snapshot.ready()
            info = self._save(step, snapshot.captured, ranks, overwrite=overwrite,
                              progress=progress, encoding=encoding, devices=devices)
            return dataclasses.replace(info, blocked_seconds=blocked, waited_seconds=waited,
                                       snapshot_bytes=snapshot.nbytes)

        return queue.submit(step, run, buffers)

    def _encode_at_call(self, step: int, captured: CapturedState, group: Group,
                        devices: Mapping[str, torch.device]) -> tuple[Encoding | None, float]:
        """For an asynchronous save of a state with tensors coded on a device (``devices``):
        once the saves in flight ended, so that it is coded against the last committed step,
        begin its encoding at the call, on every rank of ``group``, encoding a delta's tensors
        there now (:func:`~deltackpt.save.driver.encode_at_call`). Returns the encoding (None:
        begun on the save thread, from the snapshot) and the seconds waited. (Every rank
        decides alike: a rank with no reference and no save in flight has heard of the
        failure of every save it made, as have the others, which fail together.)"""
        queue = self._queue
        if not devices or not self._settings().keeps_reference \
                or (self._reference.recon is None and not queue.in_flight()):
            return None, 0.0  # a full step: snapshotted whole
        started = time.perf_counter()
        queue.wait_all()
        queue.raise_failure()
        waited = time.perf_counter() - started
        return encode_at_call(self._writer(), step, captured, group, devices,
                              self._workers(group)), waited

    def save_captured(self, step: int, captured: CapturedState, *, overwrite: bool = False,
                      progress: bool = False, group: Group | None = None,
                      blocking: bool = True) -> SaveInfo | SaveHandle:
        """Write already captured state as ``step``, once the saves in flight ended (used by
        :meth:`save`; state merged from hand-sharded ranks, docs/PATTERNS.md; the integrations'
        state), on the ranks of ``group`` (default: the running torch.distributed group).
        ``blocking=False`` (on the running group only) snapshots it and returns the save's
        handle, as :meth:`save` does."""
        step = check_step(step)
        if not blocking:
            if group is not None:
                raise ConfigError("an asynchronous save_captured runs on the default group: "
                                  "leave group= unset")
            if self._queue is not None:
                self._queue.admit(step)
            return self._save_async(step, lambda: captured, overwrite=overwrite,
                                    progress=progress, started=time.perf_counter())
        self.wait()
        return self._save(step, captured, group or Group.current() or Group.single(),
                          overwrite=overwrite, progress=progress)

    def continue_chain(self, captured: CapturedState, group: Group | None = None) -> int | None:
        """Code the next save of ``captured`` (the state about to be saved, laid out as it will
        be) as a delta on the directory's last committed step, read back for the boxes this rank
        writes, as :meth:`load` would have left it; for a run that restarted without loading
        through this manager (the integrations). Returns that step, or None where the next
        save is full anyway: no step, one of another layout, or one as deep as ``depth`` allows
        or whose group ends. Every rank of ``group`` calls it; each decides alone, and a
        save whose ranks disagree is full."""
        if self._reference.recon is not None or not self._settings().keeps_reference:
            return None
        steps = self.steps()
        if not steps:
            return None
        group = group or Group.current() or Group.single()
        parts = shard_parts(captured, group)
        boxes = {name: (p[0].offsets, p[0].sizes) for name, p in parts.items() if p}
        pool = self._workers(group if group.world_size > 1 else None)

        def read_back(reads: _MetadataReads) -> Reconstruction | None:
            meta = reads(steps[-1])
            if layout_of(meta) != captured_layout(captured):
                return None
            chain = chain_of(self.storage, meta, reads)
            if len(chain) > self.depth \
                    or self._position(steps, chain[0].step, meta.step) + 1 >= self.full_every:
                return None
            _, recon = self._restore_chain(meta, reads, boxes=boxes, workers=pool)
            return resumed(recon, meta, boxes, captured, parts)

        recon = read_consistently(self.storage, steps[-1], read_back,
                                  functools.partial(_MetadataReads, self))
        self._resume(recon, steps)
        return None if recon is None else recon.step

    @staticmethod
    def _position(steps: list[int], full: int, step: int) -> int:
        """The position of ``step`` in the group of its full step ``full`` (saves since it), as
        far as the directory's ``steps`` tell."""
        return sum(1 for s in steps if full < s <= step)

    def _resume(self, recon: Reconstruction | None, steps: list[int] | None = None) -> None:
        """Code the next deltas against ``recon``, a step just loaded or read back."""
        position = 0 if recon is None else \
            self._position(steps or super().steps(), recon.chain[0], recon.step)
        self._reference.restart(recon, position)

    def _settings(self) -> SaveSettings:
        return SaveSettings(self.compression, self.full_every, self.chunk_bytes, self._controller,
                            self._running, self.depth)

    def _writer(self) -> Writer:
        """What the save driver reads and advances: this manager's directory, settings and
        reference, and how it reads a step back (from the cache where it holds it)."""
        return Writer(self._target, self._settings(), self._reference, self._read_chain)

    def _save(self, step: int, captured: CapturedState, group: Group, *, overwrite: bool,
              progress: bool, encoding: Encoding | None = None,
              devices: Mapping[str, torch.device] | None = None) -> SaveInfo:
        """Save ``captured`` as ``step`` through the save driver
        (:func:`~deltackpt.save.driver.save_step`, on every rank of ``group``), then, once it is
        committed: on rank 0 upload it from the cache and warn of a missed ``target_ratio``;
        apply the retention policy (its failure raised on every rank)."""
        if group.world_size > 1 and self._cache is not None:
            raise ConfigError(f"{self.path}: cache= serves single-process saves; under "
                             "torch.distributed every rank writes to the checkpoint itself")
        self._settle()
        pool = self._workers(group)  # a collective at a group's first save: before any can fail
        saved = save_step(self._writer(), step, captured, group, pool, overwrite=overwrite,
                          progress=progress, encoding=encoding, devices=devices)
        self._after_commit(saved, group)
        return saved.info

    def _after_commit(self, saved: Saved, group: Group) -> None:
        meta = saved.metadata
        if meta is not None:  # rank 0, which committed it
            if self._cache is not None:
                self._cache.upload(meta)
            self._warn_target(saved.info, meta)
        if self.keep is not None:
            error = None
            if group.rank == 0:
                try:
                    self.gc(self.keep)
                except Exception as exc:  # raised on every rank by the check below
                    error = exc
            group.check(error, f"gc after the save of step {saved.info.step}")
        elif meta is not None:
            self._purge_retired()

    def _purge_retired(self) -> None:
        """Delete the data kept for readers long enough (an overwrite's); a failure leaves it
        for a later save, and is logged."""
        try:
            self._target.retired.purge()
        except (OSError, DeltackptError) as exc:
            log.warning("%s: data kept for readers could not be deleted yet: %s", self.path, exc)

    def _warn_target(self, info: SaveInfo, meta: StepMetadata) -> None:
        """Warn, once per manager, of a delta that missed ``target_ratio``: because the target
        needs errors beyond ``max_error``, or because the controller is still learning."""
        if self._warned_target or info.kind != "delta" or info.target_ratio is None:
            return
        if info.at_max_error:
            self._warned_target = True
            log.warning("step %d: target_ratio %g needs errors beyond max_error (%.3g times "
                        "the configured ones); deltas stay at that floor (%.1fx achieved); "
                        "SaveInfo.at_max_error and the step metadata say so for each save",
                        info.step, info.target_ratio, self.compression.max_scale, info.ratio)
        elif info.target_met is False:
            self._warned_target = True
            log.warning("step %d: target_ratio %g not met, achieved %.1fx (steps scaled by %.3g)",
                        info.step, info.target_ratio, info.ratio, meta.stats.compression["scale"])

    def gc(self, keep: str | RetentionPolicy | KeepSteps | None = None, *,
           dry_run: bool = False) -> GCReport:
        """Delete the steps a retention policy does not keep (default: the manager's ``keep``).

        No kept step ever becomes unrestorable, and the directory never
        grows: a kept delta step whose chain loses a step is re-coded as a
        delta on the nearest kept step that stays as it is, with this
        manager's compression config (within that config's error of the
        values it restored to), or rewritten as a full step holding exactly
        those values where that is smaller or there is no such step (see
        :mod:`deltackpt.ops.retention`). When the step this manager codes its
        next save against is replaced, the next save is coded against its
        new version (the others it holds, where the gc left them as they were), and full
        steps still come every ``full_every`` saves.
        ``dry_run`` only reports what would be removed, replaced and freed.
        On a full disk it deletes what no kept step needs first, and where
        the replacements still do not fit it keeps the steps they need and
        reports (and logs) the bytes they need (``GCReport.needed_bytes``).
        ``keep`` as :class:`~deltackpt.KeepSteps` keeps the steps it names and, replacing none,
        those their chains need.
        """
        policy = keep if isinstance(keep, KeepSteps) else \
            RetentionPolicy.parse(keep) if keep is not None else self.keep
        if policy is None:
            raise ConfigError("gc needs a retention policy: pass keep= here or to the manager")
        if not dry_run:
            self.acquire()
        self._settle()
        recon = self._reference.recon
        report, replaced = collect_garbage(
            self, policy, settings=self._settings(),
            restore=self._read_chain,
            workers=self.workers, dry_run=dry_run, follow=recon.step if recon is not None else None,
            retired=None if dry_run else self._target.retired)
        if self._cache is not None and not dry_run:
            for step in report.removed + report.recoded + report.rewritten:
                self._cache.drop(step)  # gone from the remote, or replaced there
        if report.needed_bytes:
            log.warning("%s: gc %s", self.path, report.describe())
        if recon is not None and not dry_run:
            changed = {*report.removed, *report.recoded, *report.rewritten}
            self._reference.retain(changed, replaced, lambda step: [
                m.step for m in chain_of(self.storage, self.metadata(step))])
        return report

    # -- restore -----------------------------------------------------------------------

    def restore(self, step: int | None = None, *, progress: bool = False) -> UniversalCheckpoint:
        """Rebuild ``step`` (default: the latest) as a :class:`UniversalCheckpoint`.

        A delta step is rebuilt from the nearest full step before it and the
        deltas in between, each chunk checked; a missing or damaged link
        raises an error naming the step and what is missing.
        """
        step = self.resolve_step(step)
        return read_consistently(self.storage, step,
                                 lambda reads: self._restore(reads(step), progress, reads)[0],
                                 functools.partial(_MetadataReads, self))

    def _restore(self, meta: StepMetadata, progress: bool,
                 reads: _MetadataReads) -> tuple[UniversalCheckpoint, Reconstruction]:
        tensors, recon = self._restore_chain(meta, reads, workers=self._workers(),
                                             progress=progress)
        return UniversalCheckpoint(meta.step, tensors, meta), recon

    def _restore_chain(self, meta: StepMetadata, reads: _MetadataReads, **kwargs: Any
                       ) -> tuple[dict[str, torch.Tensor], Reconstruction]:
        """Restore ``meta``'s chain (from the cache where it holds it), reading its metadata
        through ``reads``, whose reads the manager keeps as those of its last chain."""
        restored = self._read_chain(meta, read=reads, **kwargs)
        self._reference.known = reads.read
        return restored

    def load(self, step: int | None = None, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True,
             rng: bool = True, progress: bool = False) -> Any:
        """Restore ``step`` (default: the latest) into ``model`` and ``optimizer`` in place;
        return the ``extra`` saved with it.

        ``strict`` (the default) raises :class:`StateMismatchError` listing every missing or
        unexpected name and every shape or dtype mismatch, before anything changes;
        ``strict=False`` loads what matches and warns of the rest. ``rng`` restores the saved
        RNG states. The next save is a delta on the loaded step. Under torch.distributed, or
        into DTensors (FSDP2, tensor parallel), every rank calls it and decodes only the
        chunks of its shards, whatever layout and world size saved the step.
        """
        group = Group.current()
        step = self.resolve_step(step)
        pool = self._workers(group)  # a collective at a group's first load: before any can fail
        meta, boxes = None, {}

        def restore(reads: _MetadataReads) -> tuple[UniversalCheckpoint, Reconstruction | None]:
            nonlocal meta, boxes
            meta = reads(step)
            targets = sharded_targets(meta.tensors, model)
            boxes = {name: local_box(target) for name, target in targets.items()}
            if group is None and not targets:
                return self._restore(meta, progress, reads)
            return self._restore_shards(meta, targets, boxes, pool, progress, reads)

        ckpt, recon = read_consistently(self.storage, step, restore,
                                        functools.partial(_MetadataReads, self), group)
        rng = rng and group is None  # the saved RNG states are rank 0's
        report = ckpt.load_into(model, optimizer, strict=strict, rng=rng, copy=False)
        if not report.ok:
            warnings.warn(f"step {ckpt.step} loaded partially:\n{report.describe()}", stacklevel=2)
        if not self.read_only:  # the loaded tensors went to the optimizer: keep our own copies
            self._resume(_resumed(recon, meta, boxes, group, model, optimizer, report.extra))
        return report.extra

    def _restore_shards(self, meta: StepMetadata, targets: dict[str, torch.Tensor],
                        boxes: dict[str, Box], pool: WorkerPool, progress: bool,
                        reads: _MetadataReads) -> tuple[UniversalCheckpoint, Reconstruction | None]:
        """Step ``meta`` with every tensor named in ``targets`` as a DTensor laid out like its
        target, holding this rank's shard ``boxes[name]``, and the reconstruction of those
        boxes."""
        tensors, recon = self._restore_chain(meta, reads, boxes=boxes, workers=pool,
                                             progress=progress)
        for name, target in targets.items():
            tensors[name] = shard_like(target, tensors[name])
        return UniversalCheckpoint(meta.step, tensors, meta), recon


class _MetadataReads(ChainReads):
    """Reads step metadata through a manager (:meth:`CheckpointManager.metadata`), recording
    each step's with the identity its file had before the read (``read``), for the manager
    to keep as those of its last chain."""

    def __init__(self, manager: CheckpointManager) -> None:
        super().__init__(manager.storage, manager.metadata)
        self.read: KnownMetadata = {}

    def __call__(self, step: int) -> StepMetadata:
        identity = self.storage.identity(metadata_file(step))
        meta = super().__call__(step)
        if identity is not None:
            self.read[step] = identity, meta
        return meta


def _resumed(recon: Reconstruction, meta: StepMetadata, boxes: dict[str, Box], group: Group | None,
             model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
             extra: Any) -> Reconstruction | None:
    """The reconstruction the next save codes against after loading step ``meta`` into
    ``model``, ``optimizer`` and ``extra`` (:func:`~deltackpt.save.reference.resumed`)."""
    captured = capture(model, optimizer, extra, rng=meta.state.get("rng") is not None)
    return resumed(recon, meta, boxes, captured, shard_parts(captured, group))


def load_universal(path: str | os.PathLike[str], step: int | None = None) -> UniversalCheckpoint:
    """Read a step (default: the latest) of the checkpoint directory at ``path``."""
    with CheckpointManager(path, read_only=True) as mgr:  # its threads stop on return
        return mgr.restore(step)
