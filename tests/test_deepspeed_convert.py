"""Converting DeepSpeed checkpoints as ``engine.save_checkpoint`` writes them (ZeRO stage 0 to 3),
written in the test by real DeepSpeed on 2 gloo ranks, checked bit for bit against DeepSpeed's
own ``zero_to_fp32`` (weights) and ``ds_to_universal`` (moments)."""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_ranks
from torch import nn

from deltackpt import CheckpointManager
from deltackpt.errors import ConversionError
from deltackpt.interop import convert, detect_format, read_checkpoint
from deltackpt.interop.patterns import ShardingSpec

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # for the DeepSpeed classes resave unpickles
deepspeed = pytest.importorskip("deepspeed")

# each checkpoint is a DeepSpeed run on 2 ranks: a few seconds
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("only_torch_safe_globals")]
STEPS = 3
ZERO_TO_FP32 = "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint"


class Net(nn.Module):
    """Trained parameters of sizes that do not divide by 2 ranks (padding), a frozen layer and a
    buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(5, 11, bias=False)
        self.register_buffer("scale", torch.tensor([1.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.norm(self.l1(self.emb(x)))) * self.scale[0])


def batch(generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 11, (2, 4), generator=generator)


def train_and_save(rank: int, world: int, out: str, stage: int, dtype: str) -> None:
    """One rank of a DeepSpeed run: ``STEPS`` AdamW steps of :class:`Net`, then
    ``save_checkpoint(out, "global_step3")``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu",
                      LOCAL_WORLD_SIZE=str(world))
    import deepspeed.comm.torch  # the module; the attribute deepspeed.comm.torch is torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a 150 s compile, unused on gloo
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        engine.backward(engine(batch(generator)).float().logsumexp(-1).mean())
        engine.step()
    engine.save_checkpoint(out, tag=f"global_step{STEPS}")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, str], Path]:
    """``(stage, dtype) -> the checkpoint folder`` DeepSpeed wrote on 2 ranks (once per module)."""
    cache: dict[tuple[int, str], Path] = {}

    def get(stage: int, dtype: str) -> Path:
        if (stage, dtype) not in cache:
            root = tmp_path_factory.mktemp(f"zero{stage}_{dtype}")
            run_ranks(train_and_save, 2, str(root), stage, dtype)
            cache[stage, dtype] = root / f"global_step{STEPS}"
        return cache[stage, dtype]

    return get


def run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"})


def ds_to_universal(folder: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(folder), "--output_folder", str(out), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"],
                   check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return out


def same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected)


@pytest.mark.parametrize(("stage", "dtype"),
                         [(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_bit_for_bit_with_deepspeeds_own_tools(written: Callable[[int, str], Path], tmp_path: Path,
                                               stage: int, dtype: str) -> None:
    folder = written(stage, dtype)
    assert detect_format([folder]) == detect_format([folder.parent]) == "deepspeed"
    read = read_checkpoint(folder)
    assert (read.format, read.step, read.notes) == ("deepspeed", STEPS, [])
    report = convert(folder.parent, tmp_path / "out", out_format="torch")  # through its latest file
    assert (report.source_format, report.step) == ("deepspeed", STEPS)
    converted = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)

    # the weights, frozen parameters and buffers: zero_to_fp32's, bit for bit
    run_python(f"import torch; {ZERO_TO_FP32}; torch.save(get_fp32_state_dict_from_zero_checkpoint("
               f"{str(folder.parent)!r}, tag={folder.name!r}), {str(tmp_path / 'fp32.pt')!r})")
    expected = torch.load(tmp_path / "fp32.pt", weights_only=True)
    assert list(converted["model"]) == list(Net().state_dict())
    for name, value in expected.items():
        assert same(converted["model"][name], value), name
    if stage == 1:  # DeepSpeed records no frozen parameters under ZeRO-1: the module holds them
        module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        assert sorted(set(converted["model"]) - set(expected)) == ["frozen.bias", "frozen.weight"]
        assert all(same(converted["model"][n], module[n]) for n in ("frozen.bias", "frozen.weight"))
    else:
        assert sorted(expected) == sorted(converted["model"])

    # the moments: ds_to_universal's, bit for bit
    universal = ds_to_universal(folder, tmp_path / "universal") / "zero"
    group = converted["optimizer"]["param_groups"][0]
    state = {name: converted["optimizer"]["state"][i]
             for name, i in zip(group["param_names"], group["params"], strict=True)}
    trained = [n for n, p in Net().named_parameters() if p.requires_grad]
    assert group["param_names"] == trained
    for name in trained:
        for key in ("exp_avg", "exp_avg_sq"):
            value = torch.load(universal / name / f"{key}.pt", weights_only=True)
            if stage == 3:  # ds_to_universal writes ZeRO-3 moments flat, without the dict
                value = {"param": value.view(state[name][key].shape)}
            assert same(state[name][key], value["param"]), (name, key)
        assert state[name]["step"] == STEPS
    assert (group["lr"], group["weight_decay"], converted["optimizer_class"]) == (1e-2, 0.1, "AdamW")

    if stage == 3:  # its universal folder keeps even the weights flat, and the shapes elsewhere
        return
    # ds_to_universal's folder itself converts to the same state; the folders that
    # --inject_missing_state writes for frozen parameters and buffers train nothing
    convert(universal.parent, tmp_path / "from_universal", out_format="torch")
    again = torch.load(tmp_path / "from_universal" / "checkpoint.pt", weights_only=True)
    assert all(same(again["model"][n], expected[n]) for n in trained)
    group = again["optimizer"]["param_groups"][0]
    assert group["param_names"] == trained
    for name, i in zip(group["param_names"], group["params"], strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(again["optimizer"]["state"][i][key], state[name][key]), (name, key)


def test_without_zero(written: Callable[[int, str], Path]) -> None:
    """Stage 0: the optimizer's own state dict in the model states, its parameters numbered."""
    folder = written(0, "fp32")
    read = read_checkpoint(folder)
    saved = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)
    model, optimizer = read.state.model, read.state.decoded("optimizer")
    trained = [n for n, p in Net().named_parameters() if p.requires_grad]
    assert all(same(model[n], saved["module"][n]) for n in Net().state_dict())
    for index, name in enumerate(trained):
        assert all(same(optimizer["state"][name][k], saved["optimizer"]["state"][index][k])
                   for k in ("exp_avg", "exp_avg_sq", "step"))


def test_converted_restores_into_plain_adamw_and_trains_on(written: Callable[[int, str], Path],
                                                          tmp_path: Path) -> None:
    folder = written(3, "fp32")  # under bf16, frozen parameters are bf16 (as zero_to_fp32 gives them)
    subprocess.run([shutil.which("deltackpt") or "deltackpt", "convert", str(folder), "--out",
                    str(tmp_path / "ckpt")], check=True, capture_output=True)
    model = Net()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.steps() == [STEPS]
        manager.load(model=model, optimizer=optimizer)
    expected = read_checkpoint(folder).state.decoded("optimizer")
    assert optimizer.param_groups[0]["lr"] == 1e-2
    assert same(optimizer.state[model.head.weight]["exp_avg"], expected["state"]["head.weight"]["exp_avg"])
    before = model.head.weight.detach().clone()
    model(batch(torch.Generator().manual_seed(5))).logsumexp(-1).mean().backward()
    optimizer.step()
    assert torch.isfinite(model.head.weight).all() and not torch.equal(model.head.weight, before)
    assert optimizer.state[model.head.weight]["step"] == STEPS + 1


def resave(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a file DeepSpeed wrote (trusted: the test's own) as ``edit`` changes it."""
    value = torch.load(path, weights_only=False)
    edit(value)
    torch.save(value, path)


def test_bad_input_fails_clearly_and_writes_nothing(written: Callable[[int, str], Path],
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"

    def refused(folder: Path, match: str) -> None:
        with pytest.raises(ConversionError, match=match):
            convert(folder, out, source_format="deepspeed")
        assert not out.exists()

    def copy() -> Path:
        folder = tmp_path / f"c{len(list(tmp_path.iterdir()))}" / "global_step3"
        shutil.copytree(written(2, "fp32"), folder)
        return folder

    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"empty: not a DeepSpeed checkpoint \(no mp_rank_00_model_states\.pt")
    with pytest.raises(ConversionError, match=r"looked for a DCP \.metadata, a DeepSpeed zero/ folder, "
                                              r"latest_universal or latest file or mp_rank_00_model_states"):
        detect_format([tmp_path / "empty"])

    folder = copy()  # a missing rank file
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(folder, r"missing the optimizer files of data-parallel ranks zero_pp_rank_1_mp_rank_00_optim_"
                    r"states\.pt \(mp_rank_00_model_states\.pt records 2 ranks\)")

    folder = copy()  # the files of more ranks than the model states record
    shutil.copy(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    refused(folder, r"holds optimizer files of 3 data-parallel ranks, but mp_rank_00_model_states\.pt "
                    r"records 2 \(dp_world_size\)")

    folder = copy()  # param_shapes that do not fit the partitions
    resave(folder / "mp_rank_00_model_states.pt",
           lambda s: s["param_shapes"][0].update({"head.weight": torch.Size([12, 5])}))
    refused(folder, r"param group 0: the partitions of zero_pp_rank_0_mp_rank_00_optim_states\.pt, "
                    r"zero_pp_rank_1_mp_rank_00_optim_states\.pt hold 166 values, but its param_shapes "
                    r"need 171")

    folder = copy()  # partitions whose sizes disagree
    resave(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt", lambda s: s["optimizer_state_dict"].update(
        single_partition_of_fp32_groups=[s["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][:-1]]))
    refused(folder, r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: partitions of \[83\] values "
                    r"\(with padding\), but those of zero_pp_rank_0_mp_rank_00_optim_states\.pt hold \[84\]")

    for version in ("0.3.16", "1.0.0", None):  # a layout deltackpt does not know
        folder = copy()
        resave(folder / "mp_rank_00_model_states.pt", lambda s, v=version: s.update(ds_version=v))
        refused(folder, rf"mp_rank_00_model_states\.pt: written by DeepSpeed {version!r}, whose checkpoint "
                        r"layout deltackpt does not know \(it reads those of DeepSpeed 0\.10 to 0\.19\)")

    folder = copy()  # a layout key missing
    resave(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
           lambda s: s["optimizer_state_dict"].pop("single_partition_of_fp32_groups"))
    refused(folder, r"zero_pp_rank_0_mp_rank_00_optim_states\.pt: expected 'single_partition_of_fp32_groups' "
                    r"to hold a list \(the layout of DeepSpeed checkpoints\), it holds nothing")


def test_nothing_untrusted_runs_and_nothing_outside_is_read(written: Callable[[int, str], Path],
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    folder = tmp_path / "ds" / "global_step3"
    shutil.copytree(written(2, "bf16"), folder)
    optim = folder / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"

    # the DeepSpeed classes are allowed for the read only
    read_checkpoint(folder)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(optim, weights_only=True)

    # any other class is refused by name, and nothing runs
    marker = tmp_path / "pwned"

    class Crafted:
        def __reduce__(self) -> tuple:
            return os.mkdir, (str(marker),)

    resave(optim, lambda s: s.update(hook=Crafted()))
    with pytest.raises(ConversionError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt: torch\.load"
                                              r"\(weights_only=True\) refuses it, as it holds "
                                              r".*(posix|os)\.mkdir"):
        convert(folder, out)
    assert not marker.exists() and not out.exists()
    resave(folder / "mp_rank_00_model_states.pt", lambda s: s.update(args=argparse.Namespace(lr=1)))
    with pytest.raises(ConversionError, match=r"mp_rank_00_model_states\.pt: torch\.load\(weights_only"
                                              r"=True\) refuses it, as it holds argparse\.Namespace"):
        convert(folder, out)
    assert not out.exists()

    # a latest file, or a rank file, leading out of the checkpoint
    (tmp_path / "ds" / "latest").write_text("../elsewhere")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(folder / "mp_rank_00_model_states.pt", tmp_path / "elsewhere")
    with pytest.raises(ConversionError, match=r"latest names .*elsewhere, which is outside the checkpoint"):
        convert(tmp_path / "ds", out)
    clean = tmp_path / "clean" / "global_step3"
    shutil.copytree(written(2, "bf16"), clean)
    optim = clean / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.move(optim, tmp_path / "outside.pt")
    optim.symlink_to(tmp_path / "outside.pt")
    with pytest.raises(ConversionError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt, which is "
                                              r"outside the checkpoint directory"):
        convert(clean, out)
    assert not out.exists()


class TensorParallel:
    """DeepSpeed's ``mpu``: every rank one tensor-parallel rank, no data parallelism."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(list(range(dist.get_world_size())))
        self.alone = [dist.new_group([r]) for r in range(dist.get_world_size())]

    def get_model_parallel_rank(self) -> int:
        return self.dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.dist.get_world_size()

    def get_model_parallel_group(self) -> object:
        return self.group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> object:
        return self.alone[self.dist.get_rank()]


class _CopyToRanks(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: the identity, whose backward sums the
    gradient over the tensor-parallel ranks (so replicated layers before it stay equal)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad


class ColumnParallel(nn.Module):
    """A layer norm (replicated), then a linear layer whose rows and bias the ranks split, as
    Megatron's column-parallel linear layer."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        whole = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(6)
        self.col = nn.Linear(6, 8 // world)
        with torch.no_grad():
            self.col.weight.copy_(whole.weight.chunk(world)[rank])
            self.col.bias.copy_(whole.bias.chunk(world)[rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.col(_CopyToRanks.apply(self.norm(x)))


def train_tensor_parallel(rank: int, world: int, out: str, stage: int) -> None:
    """2 tensor-parallel ranks of a DeepSpeed run; each saves its parameters and moments (fp32,
    as DeepSpeed's accessors give them) beside the checkpoint."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu",
                      LOCAL_WORLD_SIZE=str(world))
    import deepspeed.comm.torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    model = ColumnParallel(rank, world)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(),
                                      mpu=TensorParallel())
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        engine.backward(engine(torch.randn(2, 6, generator=generator)).square().mean())
        engine.step()
    engine.save_checkpoint(out, tag="tp")
    torch.save({name: [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k)
                                                       for k in ("exp_avg", "exp_avg_sq")]
                for name, p in engine.module.named_parameters()}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel_ranks_merge_by_a_sharding_spec(tmp_path: Path, stage: int) -> None:
    run_ranks(train_tensor_parallel, 2, str(tmp_path), stage)
    folder = tmp_path / "tp"
    assert {p.name for p in folder.iterdir()} >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                  "zero_pp_rank_0_mp_rank_01_optim_states.pt"}
    with pytest.raises(ConversionError, match=r"holds the states of 2 tensor-parallel ranks "
                                              r"\(mp_rank_00 to mp_rank_01\): pass a sharding spec"):
        convert(folder, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    spec = ShardingSpec.from_dict({"rules": [{"pattern": "col.*", "kind": "partitioned", "dim": 0}]})
    report = convert(folder, tmp_path / "out", sharding=spec, out_format="torch")
    assert report.source_format == "deepspeed, 2 ranks merged" and report.step == STEPS
    converted = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    group = converted["optimizer"]["param_groups"][0]
    state = {n: converted["optimizer"]["state"][i]
             for n, i in zip(group["param_names"], group["params"], strict=True)}
    for name in ("col.weight", "col.bias", "norm.weight", "norm.bias"):
        whole = [torch.cat([r[name][i] for r in ranks]) if name.startswith("col") else ranks[0][name][i]
                 for i in range(3)]
        assert same(converted["model"][name], whole[0]), name
        assert same(state[name]["exp_avg"], whole[1]) and same(state[name]["exp_avg_sq"], whole[2]), name
