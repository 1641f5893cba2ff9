"""Megatron-core's dist_checkpointing through deltackpt.megatron's save and load strategies, driven
by the real dist_checkpointing.save/load on gloo ranks: ShardedTensors written as boxes at their
global offsets (replicas once), ShardedObjects exact, deltas between full steps, loads at another
layout and world size, and bad input. Megatron-core calls torch.cuda.synchronize and
torch.cuda.current_device unconditionally: the ranks here patch both, as CPU workarounds of the
test only."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import chain_depths, manual_examples, run_ranks, unclosed_managers

from deltackpt import CheckpointManager, IntegrationError
from deltackpt.dist.group import Group
from deltackpt.format.state import Placement
from deltackpt.integrations.frameworks import require
from deltackpt.save.capture import capture_values
from deltackpt.save.schedule import DEFAULT_DEPTH

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")]

megatron = pytest.importorskip("deltackpt.megatron")
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402

from deltackpt.integrations import megatron as megatron_module  # noqa: E402


def _on_cpu() -> None:
    """The CPU workarounds: megatron-core synchronizes CUDA and asks for its device as it saves."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def _values(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global weight (8, 6) and bias (6,) of a save."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 6, generator=generator) + 0.01 * scale * torch.randn(8, 6, generator=generator)
    return weight, torch.arange(6.0) * scale


def _state(rank: int, world: int, scale: float, dim: int = 0) -> dict:
    """A sharded state dict: the weight sharded along ``dim``, the bias and a step counter
    replicated on every rank, a ShardedObject."""
    weight, bias = _values(scale)
    return {"weight": ShardedTensor.from_rank_offsets(
                "layer.weight", weight.chunk(world, dim)[rank].clone(), (dim, rank, world)),
            "bias": ShardedTensor.from_rank_offsets("layer.bias", bias.clone(), replica_id=rank),
            "count": ShardedTensor.from_rank_offsets("count", torch.tensor([int(scale)]),
                                                     replica_id=rank),
            "sched": ShardedObject("sched", {"lr": 0.5 / scale, "name": "cosine"}, (1,), (0,),
                                   replica_id=rank)}


def _save_three(rank: int, world: int, root: str, full_every: int = 2,
                depth: int = DEFAULT_DEPTH) -> None:
    _on_cpu()
    megatron.register()
    for iteration in (1, 2, 3):
        directory = Path(root, "megatron", f"iter_{iteration:07d}")
        directory.mkdir(parents=True, exist_ok=True)
        strategy = megatron.SaveStrategy(Path(root, "run"), full_every=full_every, depth=depth)
        dist_checkpointing.save(_state(rank, world, float(iteration)), str(directory),
                                sharded_strategy=strategy)
        assert strategy.info.step == iteration


def _load_across(rank: int, world: int, root: str) -> None:
    """Load step 3 (full) exactly and step 2 (a delta) closely, the weight sharded along the
    other dimension (or whole, on one rank), through the default strategy register() adds."""
    _on_cpu()
    megatron.register()
    for iteration, tolerance in ((3, 0.0), (2, 1e-2)):
        state = _state(rank, world, float(iteration), dim=1)
        state["weight"].data.zero_()
        with unclosed_managers() as unclosed:
            loaded = dist_checkpointing.load(state,
                                             str(Path(root, "megatron", f"iter_{iteration:07d}")))
            assert unclosed() == []
        weight, bias = _values(float(iteration))
        assert (loaded["weight"] - weight.chunk(world, 1)[rank]).abs().max() <= tolerance
        assert (loaded["bias"] - bias).abs().max() <= tolerance
        assert loaded["count"].tolist() == [iteration]
        assert loaded["sched"] == {"lr": 0.5 / iteration, "name": "cosine"}


def test_save_two_ranks_load_at_other_layouts(tmp_path: Path) -> None:
    run_ranks(_save_three, 2, str(tmp_path))
    manager = CheckpointManager(tmp_path / "run", read_only=True)
    assert manager.steps() == [1, 2, 3]
    assert [manager.info(step).kind for step in (1, 2, 3)] == ["full", "delta", "full"]
    records = {r.name: r for r in manager.metadata(3).tensors}
    assert records["model/layer.weight"].shape == [8, 6]
    assert [f.offsets for f in records["model/layer.weight"].fragments] == [[0, 0], [4, 0]]
    assert len(records["model/layer.bias"].fragments) == 1  # a replica is written once
    assert records["model/count"].role == "buffer"  # integers are stored exactly
    run_ranks(_load_across, 2, str(tmp_path))
    run_ranks(_load_across, 1, str(tmp_path))


def _placed(rank: int, world: int, root: str) -> None:
    """A general placed capture (no Megatron): rank r's rows of a tensor, saved and restored."""
    full = torch.arange(24.0).reshape(6, 4)
    captured = capture_values({"w": full[3 * rank: 3 * rank + 3].clone()})
    captured.tensors = [dataclasses.replace(t, placement=Placement((6, 4), (3 * rank, 0)))
                        for t in captured.tensors]
    manager = CheckpointManager(root)
    manager.save_captured(1, captured, group=Group.current())
    manager.close()


def test_placed_boxes_make_one_global_tensor(tmp_path: Path) -> None:
    run_ranks(_placed, 2, str(tmp_path))
    restored = CheckpointManager(tmp_path, read_only=True).restore(1)
    assert torch.equal(restored.model["w"], torch.arange(24.0).reshape(6, 4))


def test_placed_box_outside_its_tensor_is_refused() -> None:
    from deltackpt.dist.shards import parts_to_write

    with pytest.raises(ValueError, match=r"'w'.*does not lie within its global shape"):
        parts_to_write("w", "param", torch.zeros(3, 4), None, Placement((6, 4), (4, 0)))
    assert parts_to_write("w", "param", torch.zeros(3, 4), None,
                          Placement((6, 4), (3, 0), writes=False)) == []


def _load_bad(rank: int, world: int, root: str) -> None:
    _on_cpu()
    megatron.register()
    directory = str(Path(root, "megatron", "iter_0000003"))
    state = _state(rank, world, 3.0)
    state["weight"] = ShardedTensor.from_rank_offsets("layer.weight", torch.zeros(10, 6),
                                                      (0, rank, world))
    with pytest.raises(IntegrationError, match=r"'layer.weight' has the global shape \[10, 6\] "
                                               r"here and \[8, 6\] in step 3"):
        dist_checkpointing.load(state, directory)
    with pytest.raises(IntegrationError, match="holds no tensor 'other'"):
        dist_checkpointing.load({"x": ShardedTensor.from_rank_offsets("other", torch.zeros(2))},
                                directory)
    plain = CheckpointManager(Path(root, "plain"))
    plain.save(4, torch.nn.Linear(2, 2))
    plain.close()
    with pytest.raises(IntegrationError, match=r"step 4 was not saved through deltackpt\.megatron"):
        dist_checkpointing.load(_state(rank, world, 3.0), directory,
                                sharded_strategy=megatron.LoadStrategy(Path(root, "plain")))
    with pytest.raises(IntegrationError, match="saved with Megatron's 'torch_dist' strategy"):
        megatron.LoadStrategy().check_backend_compatibility("torch_dist")


def test_bad_input(tmp_path: Path) -> None:
    run_ranks(_save_three, 1, str(tmp_path), 4, 1)  # full_every=4, depth=1
    assert chain_depths(tmp_path / "run") == {1: 0, 2: 1, 3: 1}  # depth 8: step 3 on step 2
    run_ranks(_load_bad, 1, str(tmp_path))


def test_megatron_outside_tested_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.17.0" if name == "megatron-core" else real(name))
    with pytest.raises(IntegrationError, match=r"megatron-core 0\.17\.0 is installed; deltackpt is "
                                               r"tested with megatron-core 0\.16 up to"):
        require("megatron.core")


def test_no_iteration_in_directory_name(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not end in an iteration number"):
        megatron_module._iteration(tmp_path / "latest")


def _example(rank: int, world: int, root: str) -> None:
    _on_cpu()
    os.chdir(root)
    for code in manual_examples("megatron.md"):
        exec(compile(code, "docs/megatron.md", "exec"), {"__name__": "__main__"})


def test_docs_example(tmp_path: Path) -> None:
    run_ranks(_example, 2, str(tmp_path))
