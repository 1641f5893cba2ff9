"""Saves under torch.distributed: 2-4 CPU ranks on gloo, forked from the test process.

Each scenario runs on every rank; what the ranks held is written to a file
the test then compares with what a single process restores.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import helpers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import START_METHOD, free_port, rank_main, run_ranks
from torch import nn

from deltackpt import CheckpointManager, DistributedError
from deltackpt.dist.group import Group
from deltackpt.dist.shards import parts_to_write

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


class Net(nn.Module):
    """Layers whose sizes do not divide by the world size: uneven shards, some empty."""

    def __init__(self, inputs: int = 5, hidden: int = 7) -> None:
        super().__init__()
        self.inner = nn.Linear(inputs, hidden)
        self.outer = nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x))) * self.scale[0]


def _fsdp_trained(rank: int, steps: int = 2, inputs: int = 5,
                  hidden: int = 7) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(inputs, hidden)
    fully_shard(model.inner)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(4, inputs, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def train_after_save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int,
                     steps: int) -> None:
    """What a rank trains between the saves of its scenario: ``steps`` steps on inputs of 8
    features seeded by the save's ``step`` and the ``rank``."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor by universal name, gathered whole (a collective)."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()

    out = {f"model/{k}": whole(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        out.update({f"optimizer/state/{names[id(param)]}/{k}": whole(v) for k, v in state.items()})
    return out


def _save_fsdp(rank: int, world: int, path: str, expected: str) -> None:
    model, optimizer = _fsdp_trained(rank)
    with CheckpointManager(path) as mgr:
        info = mgr.save(1, model, optimizer, rng=False, extra={"epoch": 3})
    assert info.kind == "full" and info.step == 1
    full = _full_state(model, optimizer)
    if rank == 0:
        torch.save(full, expected)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_save_restores_whole_in_one_process(tmp_path: Path, world: int) -> None:
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_ranks(_save_fsdp, world, str(path), str(expected))
    ckpt = CheckpointManager(path, read_only=True).restore(1)
    want = torch.load(expected, weights_only=True)
    assert ckpt.metadata.world_size == world
    assert sorted(ckpt.tensors) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    assert ckpt.extra == {"epoch": 3}
    sharded = next(r for r in ckpt.metadata.tensors if r.name == "model/inner.weight")
    assert len(sharded.fragments) == min(world, 7)  # one shard per rank
    ranks = {ckpt.metadata.files[c.file].rank for f in sharded.fragments for c in f.chunks}
    assert ranks == set(range(world))


def _fail_on_rank_1(rank: int, world: int, path: str) -> None:
    model, optimizer = _fsdp_trained(rank)
    with CheckpointManager(path) as mgr:
        mgr.save(1, model, optimizer, rng=False)
        if rank == 1:  # a tensor this rank cannot write: a Partial DTensor
            from torch.distributed.tensor import Partial, distribute_tensor

            mesh = model.inner.weight.device_mesh
            bad = distribute_tensor(torch.ones(4), mesh, [Partial()])
            optimizer.state[model.outer.bias]["bad"] = bad
        else:
            from torch.distributed.tensor import Replicate, distribute_tensor

            mesh = model.inner.weight.device_mesh
            optimizer.state[model.outer.bias]["bad"] = distribute_tensor(torch.ones(4), mesh,
                                                                         [Replicate()])
        with pytest.raises(DistributedError, match=re.escape(
                "rank 1: ValueError: tensor 'optimizer/state/outer.bias/bad' is a DTensor with "
                "Partial")):
            mgr.save(2, model, optimizer, rng=False)
        assert mgr.steps() == [1]


def test_a_failing_rank_fails_every_rank_and_leaves_no_step(tmp_path: Path) -> None:
    run_ranks(_fail_on_rank_1, 2, str(tmp_path / "ckpt"))
    assert CheckpointManager(tmp_path / "ckpt", read_only=True).steps() == [1]
    assert not (tmp_path / "ckpt" / "step-000000000002").exists()  # the directory rank 0 made


def _delta_after_a_failed_delta(rank: int, world: int, path: str, fail: bool) -> None:
    """Steps 1 (full) and 3 saved alike; between them, with ``fail``, a delta save of step 2
    whose writes fail on rank 1 after it coded a chunk (its reference then changed)."""
    model, optimizer = _fsdp_trained(rank, inputs=8, hidden=30)
    with CheckpointManager(path, full_every=10, chunk_bytes=1024) as mgr:
        for step in (1, 2, 3):
            if step == 2 and fail:
                create = mgr.storage.create

                def failing(rel, *args, create=create, **kwargs):
                    if rank == 1 and rel.startswith("step-000000000002/"):
                        raise OSError(28, "No space left on device")
                    return create(rel, *args, **kwargs)

                mgr.storage.create = failing
                with pytest.raises(DistributedError, match="rank 1: WriteFailedError"):
                    mgr.save(step, model, optimizer, rng=False)
                mgr.storage.create = create
            elif step != 2:
                info = mgr.save(step, model, optimizer, rng=False)
                assert (info.kind, info.base_step) == (("full", None) if step == 1 else
                                                       ("delta", 1)), info
            train_after_save(model, optimizer, step, rank, 3)


def test_after_a_failed_delta_the_ranks_code_against_the_last_committed_step(
        tmp_path: Path) -> None:
    """Each rank's reference goes back to the last committed step's values of its shards: the
    next delta is the one a run without the failed save writes."""
    run_ranks(_delta_after_a_failed_delta, 2, str(tmp_path / "failed"), True)
    run_ranks(_delta_after_a_failed_delta, 2, str(tmp_path / "reference"), False)
    failed = CheckpointManager(tmp_path / "failed", read_only=True)
    reference = CheckpointManager(tmp_path / "reference", read_only=True)
    assert failed.steps() == reference.steps() == [1, 3]
    assert not (tmp_path / "failed" / "step-000000000002").exists()  # nor any rank's files
    got, want = failed.restore(3).tensors, reference.restore(3).tensors
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _differing_plain_tensor(rank: int, world: int, path: str) -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.bias.fill_(rank)  # not replicated, yet a plain tensor
    with CheckpointManager(path) as mgr, pytest.raises(
            DistributedError, match="'model/bias' is a plain tensor whose values differ"):
        mgr.save(1, model, rng=False)


def test_plain_tensors_that_differ_between_ranks_are_refused(tmp_path: Path) -> None:
    run_ranks(_differing_plain_tensor, 2, str(tmp_path / "ckpt"))
    assert CheckpointManager(tmp_path / "ckpt").steps() == []


def _gc_fails_after_the_commit(rank: int, world: int, path: str) -> None:
    """Rank 0's gc after a save fails (``keep``): the step stays committed, the failure is raised
    on every rank, and the next save is a delta on it."""
    import deltackpt.manager

    model, optimizer = _fsdp_trained(rank)
    with CheckpointManager(path, keep="last=1") as mgr:
        mgr.save(1, model, optimizer, rng=False)
        collect_garbage = deltackpt.manager.collect_garbage
        if rank == 0:
            def failing(*args, **kwargs):
                raise OSError(5, "Input/output error")

            deltackpt.manager.collect_garbage = failing
        with pytest.raises(DistributedError, match=re.escape(
                "gc after the save of step 2 failed on rank 0: OSError: [Errno 5] Input/output "
                "error")):
            mgr.save(2, model, optimizer, rng=False)
        deltackpt.manager.collect_garbage = collect_garbage
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2, deep=True) == {2: []}
        info = mgr.save(3, model, optimizer, rng=False)
        assert (info.kind, info.base_step) == ("delta", 2), info


def test_a_failed_gc_after_a_save_leaves_the_step_committed(tmp_path: Path) -> None:
    run_ranks(_gc_fails_after_the_commit, 2, str(tmp_path / "ckpt"))
    mgr = CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert mgr.steps() == [3]  # the gc after step 3 ran: step 3 rewritten full, alone kept
    assert mgr.verify(deep=True) == {3: []}


def _rank_0_keeps_what_it_committed(rank: int, world: int, path: str) -> None:
    """Rank 0 checks the base of a delta against the metadata it committed, without reading it
    (the other ranks read its save_id)."""
    import deltackpt.save.driver

    model, optimizer = _fsdp_trained(rank)
    reads = []
    read_save_id = deltackpt.save.driver.read_save_id
    deltackpt.save.driver.read_save_id = lambda *args: reads.append(args) or read_save_id(*args)
    with CheckpointManager(path) as mgr:
        mgr.save(1, model, optimizer, rng=False)
        assert mgr.save(2, model, optimizer, rng=False).kind == "delta"
    assert len(reads) == (0 if rank == 0 else 1)


def test_rank_0_reads_no_metadata_it_committed(tmp_path: Path) -> None:
    run_ranks(_rank_0_keeps_what_it_committed, 2, str(tmp_path / "ckpt"))


def test_a_single_process_is_a_group_of_one_rank(monkeypatch) -> None:
    """Its collectives return what they are given, without torch.distributed; a failure is raised
    as it is, not as a DistributedError."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    group = Group.single()
    assert (group.rank, group.world_size) == (0, 1) and not dist.is_initialized()
    assert group.gather("a") == group.all_gather("a") == ["a"]
    assert group.broadcast("a") == group.share("a", None) == "a"
    assert group.ranks_on_this_host() == 1
    group.check(None, "save of step 1")
    error = OSError(28, "No space left on device")
    for call in (lambda: group.check(error, "save of step 1"), lambda: group.share("a", error)):
        with pytest.raises(OSError) as raised:
            call()
        assert raised.value is error
    whole = torch.arange(10.0).reshape(5, 2)
    assert [(p.offsets, p.sizes) for p in parts_to_write("x", "param", whole, group)] == \
        [([0, 0], [5, 2])]


def _replicated_parts(rank: int, world: int) -> None:
    group = Group.current()
    parts = parts_to_write("x", "param", torch.arange(10.0).reshape(5, 2), group)
    lo, hi = 5 * rank // world, 5 * (rank + 1) // world
    assert [(p.offsets, p.sizes) for p in parts] == ([([lo, 0], [hi - lo, 2])] if hi > lo else [])
    assert parts_to_write("s", "param", torch.tensor(1.0), group) == [] if rank else True
    assert parts_to_write("r", "rng", torch.zeros(3), group) == [] if rank else True


def test_replicated_tensors_are_split_between_the_ranks_that_hold_them() -> None:
    run_ranks(_replicated_parts, 3)


def _threads_per_rank(rank: int, world: int, path: str) -> None:
    from deltackpt.io.pool import default_workers

    group = Group.current()
    assert group.ranks_on_this_host() == world  # counted by host name
    with CheckpointManager(path) as mgr:
        assert mgr._threads(group) == max(1, default_workers() // world)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # torchrun's count wins
    assert group.ranks_on_this_host() == 1
    with CheckpointManager(path, workers=3) as mgr:
        assert mgr._threads(group) == 3


def test_ranks_on_one_machine_share_its_cpus(tmp_path: Path) -> None:
    run_ranks(_threads_per_rank, 2, str(tmp_path / "ckpt"))


def _load_fsdp(rank: int, world: int, path: str, expected: str) -> None:
    model, optimizer = _fsdp_trained(rank, steps=1)  # other values, same layout
    with CheckpointManager(path) as mgr:
        extra = mgr.load(1, model, optimizer)
    assert extra == {"epoch": 3}
    full = _full_state(model, optimizer)
    want = torch.load(expected, weights_only=True)
    assert sorted(full) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(full[name], tensor), name
    model(torch.randn(4, 5)).sum().backward()  # training continues
    optimizer.step()
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (2, 3), (2, 1)])
def test_fsdp_step_loads_on_another_world_size(tmp_path: Path, saved: int, loaded: int) -> None:
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_ranks(_save_fsdp, saved, str(path), str(expected))
    run_ranks(_load_fsdp, loaded, str(path), str(expected))


def _plain_model_and_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_single_process_step_loads_into_fsdp_ranks(tmp_path: Path) -> None:
    model, optimizer = _plain_model_and_state()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, model, optimizer, rng=False, extra={"epoch": 3})
    torch.save(_full_state(model, optimizer), tmp_path / "expected.pt")
    run_ranks(_load_fsdp, 2, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt"))


def _tp_model(mesh, placements, weight: torch.Tensor) -> nn.Module:
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = nn.Linear(6, 5)  # 5 rows, 6 columns: uneven on 2 and 4 ranks
    with torch.no_grad():
        model.weight.copy_(weight)
    for name, p in list(model.named_parameters()):
        place = placements if p.dim() == 2 else [placements[0]] * len(placements)
        setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, place)))
    return model


def _save_rowwise(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    model = _tp_model(init_device_mesh("cpu", (world,)), [Shard(0)], torch.arange(30.0).reshape(5, 6))
    with CheckpointManager(path) as mgr:
        mgr.save(1, model, rng=False)


def _load_columnwise_2d(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    model = _tp_model(init_device_mesh("cpu", (2, world // 2)), [Replicate(), Shard(1)],
                      torch.zeros(5, 6))
    with CheckpointManager(path) as mgr:
        mgr.load(1, model, rng=False)
    assert model.weight.placements == (Replicate(), Shard(1))
    assert torch.equal(model.weight.full_tensor(), torch.arange(30.0).reshape(5, 6))


def test_row_sharded_step_loads_column_sharded_on_a_2d_mesh(tmp_path: Path) -> None:
    run_ranks(_save_rowwise, 4, str(tmp_path / "ckpt"))
    run_ranks(_load_columnwise_2d, 4, str(tmp_path / "ckpt"))


def _load_matches_restore(rank: int, world: int, path: str, steps: list[int], inputs: int = 5,
                          hidden: int = 7) -> None:
    model, optimizer = _fsdp_trained(rank, steps=1, inputs=inputs, hidden=hidden)
    with CheckpointManager(path) as mgr:
        for step in steps:
            mgr.load(step, model, optimizer)
            restored = mgr.restore(step).tensors
            full = _full_state(model, optimizer)
            for name, tensor in full.items():
                assert torch.equal(tensor, restored[name]), (step, name)
    model(torch.randn(4, inputs)).sum().backward()  # training continues
    optimizer.step()
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


def test_a_delta_step_loads_into_fsdp_ranks(tmp_path: Path) -> None:
    model, optimizer = _plain_model_and_state()
    with CheckpointManager(tmp_path / "ckpt", full_every=4) as mgr:
        mgr.save(1, model, optimizer, rng=False)
        for _ in range(3):
            model(torch.randn(4, 5)).sum().backward()
            optimizer.step()
        assert mgr.save(2, model, optimizer, rng=False).kind == "delta"
    run_ranks(_load_matches_restore, 2, str(tmp_path / "ckpt"), [2])


def test_a_box_reads_only_the_chunks_that_hold_its_rows(tmp_path: Path, monkeypatch) -> None:
    from deltackpt.io.reader import ChunkSource, read_tensors

    weight = torch.randn(64, 16)  # 64 rows of 64 bytes; 1 KB chunks hold 16 rows each
    model = nn.Module()
    model.w = nn.Parameter(weight.clone())
    with CheckpointManager(tmp_path / "ckpt", chunk_bytes=1024) as mgr:
        mgr.save(1, model, rng=False)
        meta = mgr.metadata(1)
    read = []
    stored = ChunkSource.stored
    monkeypatch.setattr(ChunkSource, "stored", lambda self, r, c: read.append(c.raw_offset)
                        or stored(self, r, c))
    for offsets, sizes, chunks in [([20, 3], [10, 5], [1024]), ([0, 0], [64, 16], [0, 1024, 2048, 3072]),
                                   ([31, 0], [2, 16], [1024, 2048]), ([63, 15], [1, 1], [3072])]:
        read.clear()
        out = read_tensors(mgr.storage, meta, boxes={"model/w": (offsets, sizes)})["model/w"]
        box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        assert torch.equal(out, weight[box])
        assert sorted(read) == chunks


def test_overlapping_fragments_are_refused() -> None:
    from deltackpt.errors import FormatError
    from deltackpt.format.metadata import Fragment, TensorRecord, check_tiling

    record = TensorRecord("w", "param", "float32", [4, 2], "w", None, None)
    record.fragments = [Fragment([0, 0], [3, 2]), Fragment([2, 0], [1, 2])]
    with pytest.raises(FormatError, match=re.escape("fragments [0, 0]+[3, 2] and [2, 0]+[1, 2] "
                                                    "overlap")):
        check_tiling(record)
    record.fragments = [Fragment([0, 0], [3, 2])]
    with pytest.raises(FormatError, match="fragments cover 6 of 8 elements"):
        check_tiling(record)
    record.fragments = [Fragment([0, 0], [3, 2]), Fragment([3, 0], [1, 2])]
    check_tiling(record)


def _save_fsdp_deltas(rank: int, world: int, path: str, expected: str) -> None:
    model, optimizer = _fsdp_trained(rank, inputs=8, hidden=30)  # shards big enough to quantize
    states = []
    with CheckpointManager(path, full_every=3) as mgr:
        for step in range(1, 4):
            info = mgr.save(step, model, optimizer, rng=False)
            assert info.kind == ("full" if step == 1 else "delta"), (step, info)
            states.append(_full_state(model, optimizer))
            train_after_save(model, optimizer, step, rank, 5)
    if rank == 0:
        torch.save(states, expected)


def record_collectives() -> list[tuple[str, bool]]:
    """From now on in this rank, the thread and whether a group of its own was given (not the
    default group) of each object collective deltackpt makes, appended to the list returned."""
    import threading

    import deltackpt.dist.group

    calls: list[tuple[str, bool]] = []

    def recording(collective):
        def recorded(*args, **kwargs):
            calls.append((threading.current_thread().name, kwargs.get("group") is not None))
            return collective(*args, **kwargs)
        return recorded

    for name in ("all_gather_object", "gather_object", "broadcast_object_list"):
        setattr(deltackpt.dist.group.dist, name, recording(getattr(dist, name)))
    return calls


def _save_fsdp_async(rank: int, world: int, path: str, expected: str) -> None:
    """Asynchronous saves of FSDP2 shards, each followed at once by training steps (whose
    collectives run on the default group while the save's run on the manager's own)."""
    model, optimizer = _fsdp_trained(rank, inputs=8, hidden=30)
    calls = record_collectives()
    states = []
    with CheckpointManager(path, full_every=3, blocking=False) as mgr:
        for step in range(1, 4):
            states.append(_full_state(model, optimizer))
            handle = mgr.save(step, model, optimizer, rng=False)
            train_after_save(model, optimizer, step, rank, 5)
            info = handle.wait()
            assert (info.kind, info.step) == ("full" if step == 1 else "delta", step), info
            assert info.snapshot_bytes > 0
    # every collective of the saves ran on their thread, on the manager's gloo group
    assert calls and all(thread.startswith("deltackpt-save") and own_group
                         for thread, own_group in calls), calls
    if rank == 0:
        torch.save(states, expected)


@pytest.mark.parametrize("save", [_save_fsdp_deltas, _save_fsdp_async])
def test_fsdp_ranks_save_deltas_of_their_shards(tmp_path: Path, save) -> None:
    """Blocking and asynchronous saves: every rank codes its shards; the steps restore whole
    in one process and load on 2 ranks (resharded)."""
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_ranks(save, 4, str(path), str(expected))
    mgr = CheckpointManager(path, read_only=True)
    saved = torch.load(expected, weights_only=True)
    for step, want in zip((1, 2, 3), saved, strict=True):
        ckpt = mgr.restore(step)
        meta = ckpt.metadata
        assert (meta.kind, meta.world_size) == ("full" if step == 1 else "delta", 4)
        bound = {c: s["max_abs_error"] for c, s in meta.stats.classes.items()} if step > 1 else {}
        for name, tensor in want.items():
            got = ckpt.tensors[name]
            if step == 1 or name.endswith("/step"):
                assert torch.equal(got, tensor), (step, name)
            else:  # within the error the step records for its tensor class
                assert (got - tensor).abs().max() <= max(bound.values()), (step, name)
        assert mgr.verify(step) == {step: []}
    delta = mgr.metadata(3)
    weight = next(r for r in delta.tensors if r.name == "model/inner.weight")
    assert len(weight.fragments) == 4 and {c.codec for f in weight.fragments for c in f.chunks} \
        == {"quant"}
    assert delta.stats.classes["weights"]["tensors"] == 4 + 3  # each rank's rows (3 of outer)
    run_ranks(_load_matches_restore, 2, str(path), [1, 2, 3], 8, 30)


def _resume_and_save(rank: int, world: int, path: str, step: int, kind: str, expected: str) -> None:
    model, optimizer = _fsdp_trained(rank, steps=1, inputs=8, hidden=30)
    with CheckpointManager(path, full_every=4) as mgr:
        mgr.load(2, model, optimizer)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):
            model(torch.randn(4, 8, generator=generator)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        info = mgr.save(step, model, optimizer, rng=False)
    assert (info.kind, info.base_step) == (kind, 2 if kind == "delta" else None), info
    full = _full_state(model, optimizer)
    if rank == 0:
        torch.save(full, expected)


def test_deltas_continue_after_a_load_in_the_saved_layout(tmp_path: Path, monkeypatch) -> None:
    """A delta step saved by 4 ranks: loading it on 2 ranks reads only the fragments that overlap
    each rank's rows; the next save is a delta on it when 4 ranks load it again (each rank kept
    its boxes' reconstruction), full when 2 ranks or one process do."""
    from deltackpt.io.reader import ChunkSource
    from deltackpt.restore.chain import restore_chain

    path = tmp_path / "ckpt"
    run_ranks(_save_fsdp_deltas, 4, str(path), str(tmp_path / "states.pt"))
    mgr = CheckpointManager(path, read_only=True)
    meta, whole = mgr.metadata(3), mgr.restore(3).tensors
    record = next(r for r in meta.tensors if r.name == "model/inner.weight")
    read = []
    stored = ChunkSource.stored
    monkeypatch.setattr(ChunkSource, "stored", lambda self, r, c: read.append((r.name, id(c)))
                        or stored(self, r, c))
    box = ([15, 0], [15, 8])  # rank 1 of 2: rows 15-29, in the fragments of ranks 1-3 (8, 8, 7, 7)
    got = restore_chain(mgr.storage, meta, boxes={record.name: box})[0][record.name]
    assert torch.equal(got, whole[record.name][15:30])
    chunks = {id(c): k for k, f in enumerate(record.fragments) for c in f.chunks}
    assert {chunks[c] for name, c in read if name == record.name and c in chunks} == {1, 2, 3}

    for world, step, kind in [(4, 4, "delta"), (2, 5, "full")]:
        expected = tmp_path / f"step{step}.pt"
        run_ranks(_resume_and_save, world, str(path), step, kind, str(expected))
        ckpt, want = mgr.restore(step), torch.load(expected, weights_only=True)
        bound = max(s["max_abs_error"] for s in (ckpt.metadata.stats.classes or {"": {
            "max_abs_error": 0.0}}).values())
        for name, tensor in want.items():
            assert (ckpt.tensors[name] - tensor).abs().max() <= bound, (step, name)
        assert (bound > 0) == (kind == "delta")
    model = Net(8, 30)  # one process writes whole tensors, not the 4 ranks' fragments: full
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(path, full_every=4) as writer:
        writer.load(2, model, optimizer)
        assert writer.save(6, model, optimizer, rng=False).kind == "full"


def _killed_mid_save(rank: int, world: int, path: str, report: str) -> None:
    import deltackpt.io.writer as writer

    model, optimizer = _fsdp_trained(rank)
    with CheckpointManager(path) as mgr:
        mgr.save(1, model, optimizer, rng=False)
        if rank == 1:  # dies while writing its data, as a preempted node does
            encode = writer._encode_and_write

            def die(job, encoder, files):
                encode(job, encoder, files)
                os._exit(3)

            writer._encode_and_write = die
        try:
            mgr.save(2, model, optimizer, rng=False)
        except Exception as exc:  # the survivor fails instead of waiting forever
            Path(report).write_text(type(exc).__name__)


def test_a_rank_killed_mid_save_leaves_earlier_steps_and_no_partial_step(tmp_path: Path) -> None:
    report = tmp_path / "rank0.txt"
    context = mp.start_processes(rank_main, args=(_killed_mid_save, 2, free_port(), (
        str(tmp_path / "ckpt"), str(report)), dict(os.environ)), nprocs=2, start_method=START_METHOD,
        join=False)
    for process in context.processes:
        process.join(timeout=120)
    assert [p.exitcode for p in context.processes] == [0, 3]
    assert report.read_text() == "DistributedError"  # rank 0 raised
    mgr = CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert mgr.steps() == [1]
    assert mgr.verify() == {1: []}


def _save_tied(rank: int, world: int, path: str, expected: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from deltackpt.app.training import SIZES, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(SIZES["tiny"])  # its output head is tied to the token embedding
    fully_shard(model)
    with CheckpointManager(path) as mgr:
        mgr.save(1, model, rng=False)
    full = _full_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 0:
        torch.save(full, expected)


def test_tied_weights_are_saved_once_by_the_ranks(tmp_path: Path) -> None:
    run_ranks(_save_tied, 2, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt"))
    ckpt = CheckpointManager(tmp_path / "ckpt", read_only=True).restore(1)
    head = next(r for r in ckpt.metadata.tensors if r.name == "model/head.weight")
    assert head.alias_of == "model/tok.weight"
    assert ckpt.tensors["model/head.weight"] is ckpt.tensors["model/tok.weight"]
    for name, tensor in torch.load(tmp_path / "expected.pt", weights_only=True).items():
        assert torch.equal(ckpt.tensors[name], tensor), name


class Renamed(nn.Module):
    """Another model: ``Net``'s layers under other names."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.outer = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.first(x))


def _load_bad_input(rank: int, world: int, path: str, case: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from deltackpt import StateMismatchError

    if case == "shapes":
        model, optimizer = _fsdp_trained(rank, steps=1, hidden=9)  # saved with hidden=7
        error, message = StateMismatchError, (r"inner\.weight: checkpoint float32\[7, 5\], "
                                              r"model float32\[9, 5\]")
    else:
        if case == "other model":
            model = Renamed()
            error, message = StateMismatchError, (r"missing from the checkpoint \(2\):\n  first"
                                                  r"\.weight\n  first\.bias\n.*not in the model "
                                                  r"\(3\):\n  inner\.bias\n  inner\.weight")
        else:  # rank 1's data file is gone; rank 0 needs the half of buffer "scale" it wrote
            model = Net()
            error, message = DistributedError, (r"load of step 1 failed on rank 0: CorruptionError:"
                                                r" step 1, tensor 'model/scale': .*/d-\w+-r00001-"
                                                r"000\.bin: data file is missing; rank 1: ")
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
    before = _full_state(model, optimizer)
    with CheckpointManager(path) as mgr, pytest.raises(error, match=message):
        mgr.load(1, model, optimizer)
    after = _full_state(model, optimizer)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was loaded


def test_bad_input_fails_on_every_rank_and_loads_nothing(tmp_path: Path) -> None:
    """A layout that cannot hold the step, a step of another model, a missing rank file."""
    path, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_ranks(_save_fsdp, 2, str(path), str(expected))
    saved = {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}
    run_ranks(_load_bad_input, 2, str(path), "shapes")
    run_ranks(_load_bad_input, 2, str(path), "other model")
    gone = list((path / "step-000000000001").glob("d-*-r00001-*.bin"))
    for data in gone:
        data.unlink()
    run_ranks(_load_bad_input, 2, str(path), "missing file")
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()} == {  # no writes
        p: t for p, t in saved.items() if p not in gone}


def _dcp_save_fsdp(rank: int, world: int, path: str, expected: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fsdp_trained(rank)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    full = _full_state(model, optimizer)
    if rank == 0:
        torch.save(full, expected)


def _dcp_load_fsdp(rank: int, world: int, path: str, expected: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _fsdp_trained(rank, steps=1)  # other values, the same layout
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    for name, tensor in torch.load(expected, weights_only=True).items():
        assert torch.equal(_full_state(model, optimizer)[name], tensor), name


def test_dcp_of_fsdp_ranks_converts_and_exports_back(tmp_path: Path) -> None:
    """dcp.save by 2 FSDP2 ranks -> deltackpt convert -> every tensor whole, bit for bit;
    that step exported as DCP -> dcp.load and set_state_dict on 3 FSDP2 ranks -> the same."""
    from deltackpt import load_universal
    from deltackpt.interop import convert, export

    source, expected = tmp_path / "dcp", tmp_path / "expected.pt"
    run_ranks(_dcp_save_fsdp, 2, str(source), str(expected))
    convert(source, tmp_path / "ckpt")
    ckpt = load_universal(tmp_path / "ckpt")
    want = torch.load(expected, weights_only=True)
    assert sorted(want) == sorted(n for n in ckpt.tensors if n.startswith(("model/", "optimizer/s")))
    for name, tensor in want.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    export(ckpt.captured(), ckpt.step, tmp_path / "exported", "dcp")
    run_ranks(_dcp_load_fsdp, 3, str(tmp_path / "exported"), str(expected))


def _write_rank(rank: int, world: int, path: str) -> None:
    dist.barrier()
    Path(path, f"rank{rank}").write_text(str(world))


def test_ranks_start_again_where_another_process_took_the_port(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """run_ranks' rendezvous port taken by another listener before rank 0 binds it (tests run in
    parallel): the ranks start again on another port and the scenario runs once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        monkeypatch.setattr(helpers, "free_port", lambda: ports.pop() if ports else free_port())
        helpers.run_ranks(_write_rank, 2, str(tmp_path))
    assert not ports
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
