"""Converting DeepSpeed checkpoints as ``engine.save_checkpoint`` writes them (ZeRO stage 0 to 3),
written in the test by real DeepSpeed on 2 gloo ranks, checked bit for bit against DeepSpeed's
own ``zero_to_fp32`` (weights) and ``ds_to_universal`` (moments)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import run_ranks
from torch import nn

from deltackpt.interop import convert, detect_format, read_checkpoint

deepspeed = pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow  # each checkpoint is a DeepSpeed run on 2 ranks: a few seconds
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
