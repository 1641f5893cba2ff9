"""Save -> restore/load through CheckpointManager is exact: tensors, optimizers, RNG, extra, names."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    ALL_DTYPES,
    assert_bitwise_equal,
    assert_same_value,
    assert_state_dicts_equal,
    files_under,
    random_tensor,
)
from torch import nn

import deltackpt
from deltackpt import CheckpointManager
from deltackpt.format.dtypes import BY_NAME
from deltackpt.format.metadata import FORMAT_VERSION

CHUNK = 4096


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def mgr(ckpt_dir: Path) -> Iterator[CheckpointManager]:
    manager = CheckpointManager(ckpt_dir, chunk_bytes=CHUNK)
    yield manager
    manager.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Buffers(nn.Module):
    """A module whose state is exactly the given buffers."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def _fresh_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same names, shapes and dtypes, other contents."""
    return {name: random_tensor(t.dtype, tuple(t.shape), seed=999) for name, t in state.items()}


# -- dtypes and shapes ----------------------------------------------------------------------------

def test_every_dtype_as_buffers_and_extra(mgr: CheckpointManager) -> None:
    """Every on-disk dtype round-trips bit-exactly as a model buffer and as an ``extra`` tensor."""
    buffers, extra = {}, {}
    for i, dtype in enumerate(ALL_DTYPES):
        name = _dtype_name(dtype)
        buffers[f"b_{name}"] = random_tensor(dtype, (37,), seed=i)                 # odd size, < 1 chunk
        buffers[f"big_{name}"] = random_tensor(dtype, (3, 1500), seed=100 + i)     # several chunks
        extra[name] = random_tensor(dtype, (5, 7), seed=200 + i)
    model = Buffers(buffers)
    mgr.save(0, model=model, extra={"tensors": extra}, rng=False)

    meta = mgr.metadata(0)
    for record in meta.tensors:
        if record.name.startswith("model/"):
            assert record.dtype == _dtype_name(buffers[record.fqn].dtype)
            assert record.role == "buffer"
    assert {r.dtype for r in meta.tensors} == set(BY_NAME)
    big = meta.tensor("model/big_float64")
    assert len(big.fragments[0].chunks) == math.ceil(3 * 1500 * 8 / CHUNK)

    ckpt = mgr.restore(0)
    assert_state_dicts_equal(ckpt.model, buffers, "restored model")
    restored_extra = ckpt.extra
    assert_state_dicts_equal(restored_extra["tensors"], extra, "restored extra")

    fresh = Buffers(_fresh_like(buffers))
    mgr.load(0, model=fresh)
    assert_state_dicts_equal(dict(fresh.named_buffers()), buffers, "loaded buffers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64,
                                   torch.float8_e5m2, torch.uint16])
def test_zero_dim_and_empty_tensors(mgr: CheckpointManager, dtype: torch.dtype) -> None:
    """0-d tensors and empty tensors of shapes (0,), (3, 0) and (0, 4, 2) keep dtype, shape and value."""
    state = {
        "scalar": random_tensor(dtype, (), seed=1),
        "empty": torch.empty((0,), dtype=dtype),
        "empty2d": torch.empty((3, 0), dtype=dtype),
        "empty3d": torch.empty((0, 4, 2), dtype=dtype),
    }
    model = Buffers(state)
    mgr.save(3, model=model, extra={"scalar": state["scalar"].clone(), "empty": state["empty2d"].clone()},
             rng=False)
    meta = mgr.metadata(3)
    assert meta.tensor("model/scalar").shape == []
    assert meta.tensor("model/empty2d").shape == [3, 0]
    for name in ("model/empty", "model/empty2d", "model/empty3d", "extra/empty"):
        fragments = meta.tensor(name).fragments
        assert len(fragments) == 1 and fragments[0].chunks == []
    ckpt = mgr.restore(3)
    assert_state_dicts_equal(ckpt.model, state)
    assert_bitwise_equal(ckpt.extra["scalar"], state["scalar"], "extra scalar")
    assert_bitwise_equal(ckpt.extra["empty"], state["empty2d"], "extra empty")
    fresh = Buffers({k: torch.zeros(v.shape).to(dtype) for k, v in state.items()})
    mgr.load(3, model=fresh)
    assert_state_dicts_equal(dict(fresh.named_buffers()), state)


def test_non_contiguous_inputs(mgr: CheckpointManager) -> None:
    """Transposed, step-sliced, expanded, offset and conjugated views are stored as their values."""
    base = torch.arange(60 * 70, dtype=torch.float32).reshape(60, 70) / 7
    cbase = torch.randn(40, 30, dtype=torch.complex64)
    views = {
        "transposed": base.t(),
        "stepped": base[::3, 1::4],
        "negative_offset_slice": base[5:50:7, -20:],
        "expanded": torch.arange(5, dtype=torch.int32).expand(4, 5),
        "permuted3d": torch.randn(4, 5, 6).permute(2, 0, 1),
        "conj": cbase.conj(),
        "conj_t": cbase.t().conj(),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    assert not any(v.is_contiguous() for k, v in views.items() if k not in ("channels_last", "conj"))
    assert views["conj"].is_conj()
    before = {k: v.clone() for k, v in views.items()}
    model = Buffers({"transposed": views["transposed"], "stepped": views["stepped"]})
    mgr.save(1, model=model, extra=views, rng=False)
    for name, view in views.items():  # the inputs are not modified
        assert_bitwise_equal(view, before[name], name)
    ckpt = mgr.restore(1)
    for name, view in views.items():
        restored = ckpt.extra[name]
        assert restored.is_contiguous()
        assert not restored.is_conj()
        assert_bitwise_equal(restored, view.resolve_conj().contiguous(), name)
    assert_bitwise_equal(ckpt.model["transposed"], base.t().contiguous())
    assert_bitwise_equal(ckpt.model["stepped"], base[::3, 1::4].contiguous())


SPECIAL_BITS = {
    torch.float32: ("<u4", [0x7FC12345, 0xFFA00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000,
                            0x00000001, 0x7FFFFFFF, 0x3F800000]),
    torch.float64: ("<u8", [0x7FF8000000000001, 0xFFF4000000000ABC, 0x7FF0000000000001, 0x7FF0000000000000,
                            0xFFF0000000000000, 0x8000000000000000, 0x0000000000000001]),
    torch.float16: ("<u2", [0x7E01, 0xFD55, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0001]),
    torch.bfloat16: ("<u2", [0x7FC1, 0xFF81, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001]),
}


@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=_dtype_name)
def test_nan_payloads_inf_and_negative_zero_are_exact(mgr: CheckpointManager, dtype: torch.dtype) -> None:
    """NaNs (quiet and signalling, with payloads and sign), infinities, -0.0 and denormals keep their bits."""
    word, patterns = SPECIAL_BITS[dtype]
    bits = np.resize(np.array(patterns, dtype=word), 3 * 2000)  # spans several chunks
    values = torch.from_numpy(bits.view(np.uint8).copy()).view(dtype).reshape(3, 2000)
    model = nn.Module()
    model.w = nn.Parameter(values.clone(), requires_grad=False)
    mgr.save(0, model=model, extra={"x": values.clone(), "scalar": values[0, 0].clone()}, rng=False)
    ckpt = mgr.restore(0)
    assert_bitwise_equal(ckpt.model["w"], values, "param")
    assert_bitwise_equal(ckpt.extra["x"], values, "extra")
    assert_bitwise_equal(ckpt.extra["scalar"], values[0, 0], "extra scalar")
    fresh = nn.Module()
    fresh.w = nn.Parameter(torch.zeros(3, 2000, dtype=dtype), requires_grad=False)
    mgr.load(0, model=fresh)
    assert_bitwise_equal(fresh.w.data, values, "loaded param")


def test_large_tensor_spans_many_chunks(mgr: CheckpointManager) -> None:
    """A tensor many times chunk_bytes is cut into chunks of at most chunk_bytes that tile it exactly."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 257, generator=gen) * 0.02          # 205,600 bytes: 51 chunks
    ints = torch.randint(-5, 5, (33_333,), generator=gen, dtype=torch.int16)  # odd byte count
    model = Buffers({"weight": weight, "ints": ints})
    mgr.save(7, model=model, rng=False)
    meta = mgr.metadata(7)
    for name, tensor in (("model/weight", weight), ("model/ints", ints)):
        chunks = meta.tensor(name).fragments[0].chunks
        assert len(chunks) == math.ceil(tensor.numel() * tensor.element_size() / CHUNK)
        expected_offset = 0
        for chunk in chunks:
            assert chunk.raw_offset == expected_offset
            assert 0 < chunk.raw_length <= CHUNK and chunk.raw_length % tensor.element_size() == 0
            expected_offset += chunk.raw_length
        assert expected_offset == tensor.numel() * tensor.element_size()
    assert meta.stats.raw_bytes == weight.numel() * 4 + ints.numel() * 2
    assert_state_dicts_equal(mgr.restore(7).model, {"weight": weight, "ints": ints})


# -- tied weights -----------------------------------------------------------------------------------

class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding's weight."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.tok(idx))))


def _lm_step(model: TiedLM, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 13, (4, 5), generator=gen)
    target = torch.randint(0, 13, (4, 5), generator=gen)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(idx).reshape(-1, 13), target.reshape(-1))
    loss.backward()
    opt.step()
    return loss.detach()


def test_tied_weights_stored_once_and_restored_tied(mgr: CheckpointManager) -> None:
    """A tied embedding/head is stored once (one alias record) and comes back tied, values equal."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for s in range(3):
        _lm_step(model, opt, s)
    info = mgr.save(3, model=model, optimizer=opt, rng=False)

    meta = mgr.metadata(3)
    tok, head = meta.tensor("model/tok.weight"), meta.tensor("model/head.weight")
    assert [tok.alias_of, head.alias_of] == [None, "model/tok.weight"]
    assert head.fragments == [] and tok.fragments != []
    assert sum(1 for r in meta.tensors if r.alias_of is not None) == 1
    stored_once = sum(r.nbytes for r in meta.tensors if r.alias_of is None)
    assert info.raw_bytes == meta.stats.raw_bytes == stored_once
    assert "optimizer/state/head.weight/exp_avg" not in {r.name for r in meta.tensors}

    ckpt = mgr.restore(3)
    assert ckpt.model["head.weight"] is ckpt.model["tok.weight"]
    assert_bitwise_equal(ckpt.model["tok.weight"], model.tok.weight.detach())

    torch.manual_seed(1)
    fresh = TiedLM()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    mgr.load(3, model=fresh, optimizer=fresh_opt)
    assert fresh.head.weight is fresh.tok.weight
    assert_state_dicts_equal(fresh.state_dict(), model.state_dict(), "loaded tied model")
    for s in range(3, 6):  # and training continues identically, tie intact
        assert_bitwise_equal(_lm_step(fresh, fresh_opt, s), _lm_step(model, opt, s), f"loss {s}")
    assert fresh.head.weight is fresh.tok.weight
    assert_state_dicts_equal(fresh.state_dict(), model.state_dict(), "trained tied model")


# -- optimizers -------------------------------------------------------------------------------------

def _small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    x, y = _batch(step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _assert_optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer,
                                   names_a: dict[int, str], names_b: dict[int, str]) -> None:
    """Per-parameter-name state equality (bitwise) and equal hyperparameters per parameter."""
    state_a = {names_a[id(p)]: s for p, s in a.state.items()}
    state_b = {names_b[id(p)]: s for p, s in b.state.items()}
    assert sorted(state_a) == sorted(state_b)
    for name, values in state_a.items():
        assert sorted(values) == sorted(state_b[name]), name
        for key, value in values.items():
            assert_same_value(state_b[name][key], value, f"state[{name!r}][{key!r}]")

    def hyper(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict]:
        return {names[id(p)]: {k: v for k, v in g.items() if k not in ("params", "param_names")}
                for g in opt.param_groups for p in g["params"]}

    assert hyper(a, names_a) == hyper(b, names_b)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "SGD-plain": lambda p: torch.optim.SGD(p, lr=0.05),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "RMSprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_resume_is_bitwise_identical(mgr: CheckpointManager, name: str) -> None:
    """Train, save, load into a fresh model and optimizer, train on: losses and weights stay identical."""
    make = OPTIMIZERS[name]
    model = _small_model(0)
    opt = make(model.parameters())
    for s in range(3):
        _train_step(model, opt, s)
    mgr.save(3, model=model, optimizer=opt, rng=False)
    if name == "SGD-plain":
        assert opt.state_dict()["state"] == {}
        assert mgr.restore(3).optimizer["state"] == {}

    restored = _small_model(99)
    restored_opt = make(restored.parameters())
    mgr.load(3, model=restored, optimizer=restored_opt)
    assert_state_dicts_equal(restored.state_dict(), model.state_dict(), "loaded model")
    _assert_optimizer_states_equal(opt, restored_opt, _names(model), _names(restored))

    for s in range(3, 7):
        loss, restored_loss = _train_step(model, opt, s), _train_step(restored, restored_opt, s)
        assert_bitwise_equal(restored_loss, loss, f"loss at step {s}")
    assert_state_dicts_equal(restored.state_dict(), model.state_dict(), "model after training on")
    _assert_optimizer_states_equal(opt, restored_opt, _names(model), _names(restored))


def test_lbfgs_state_with_lists_floats_and_ints(mgr: CheckpointManager) -> None:
    """LBFGS state (ints, floats, lists of tensors) round-trips and training resumes bitwise."""
    def closure_for(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> Callable[[], torch.Tensor]:
        x, y = _batch(step)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        return closure

    model = _small_model(0).eval()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=4)
    for s in range(3):
        opt.step(closure_for(model, opt, s))
    (state,) = opt.state.values()
    assert isinstance(state["old_dirs"], list) and state["old_dirs"]
    assert isinstance(state["n_iter"], int) and isinstance(state["prev_loss"], float)
    mgr.save(3, model=model, optimizer=opt, rng=False)

    restored = _small_model(9).eval()
    restored_opt = torch.optim.LBFGS(restored.parameters(), lr=0.5, history_size=3, max_iter=4)
    mgr.load(3, model=restored, optimizer=restored_opt)
    _assert_optimizer_states_equal(opt, restored_opt, _names(model), _names(restored))
    for s in range(3, 6):
        loss = opt.step(closure_for(model, opt, s))
        restored_loss = restored_opt.step(closure_for(restored, restored_opt, s))
        assert_bitwise_equal(restored_loss.detach(), loss.detach(), f"loss {s}")
    assert_state_dicts_equal(restored.state_dict(), model.state_dict())


def test_tensor_valued_learning_rate(mgr: CheckpointManager) -> None:
    """A tensor hyperparameter is stored as ``optimizer/param_groups/<i>/<key>`` and restored as a tensor."""
    model = _small_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    for s in range(2):
        _train_step(model, opt, s)
    mgr.save(2, model=model, optimizer=opt, rng=False)
    records = {r.name: r for r in mgr.metadata(2).tensors}
    assert records["optimizer/param_groups/0/lr"].role == "optimizer"
    restored = _small_model(1)
    restored_opt = torch.optim.Adam(restored.parameters(), lr=torch.tensor(0.5), foreach=False)
    mgr.load(2, model=restored, optimizer=restored_opt)
    assert_bitwise_equal(restored_opt.param_groups[0]["lr"], torch.tensor(0.01), "lr")
    for s in range(2, 4):
        assert_bitwise_equal(_train_step(restored, restored_opt, s), _train_step(model, opt, s))


def test_optimizer_without_any_step(mgr: CheckpointManager) -> None:
    """An optimizer that never stepped saves empty state and loads into one that did, emptying it."""
    model = _small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    mgr.save(0, model=model, optimizer=opt, rng=False)
    saved = mgr.restore(0).optimizer
    assert saved["class"] == "AdamW"
    assert saved["state"] == {}
    assert [g["params"] for g in saved["param_groups"]] == [[n for n, _ in model.named_parameters()]]

    other = _small_model(1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    _train_step(other, other_opt, 0)
    assert len(other_opt.state) > 0
    mgr.load(0, model=other, optimizer=other_opt)
    assert len(other_opt.state) == 0
    assert other_opt.param_groups[0]["lr"] == 0.02
    for s in range(3):
        assert_bitwise_equal(_train_step(other, other_opt, s), _train_step(model, opt, s), f"loss {s}")
    assert_state_dicts_equal(other.state_dict(), model.state_dict())


def test_load_into_reversed_param_order(mgr: CheckpointManager) -> None:
    """State follows parameter names when the new optimizer lists its parameters in reverse order
    (also when it was built from named_parameters)."""
    model = _small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for s in range(2):
        _train_step(model, opt, s)
    mgr.save(2, model=model, optimizer=opt, rng=False)

    named = _small_model(6)  # an optimizer built from named_parameters (groups carry param_names)
    named_opt = torch.optim.AdamW(list(reversed(list(named.named_parameters()))), lr=0.3)
    mgr.load(2, model=named, optimizer=named_opt)
    _assert_optimizer_states_equal(opt, named_opt, _names(model), _names(named))
    names_reversed = [n for n, _ in reversed(list(named.named_parameters()))]
    assert named_opt.param_groups[0]["param_names"] == names_reversed

    restored = _small_model(5)
    restored_opt = torch.optim.AdamW(list(reversed(list(restored.parameters()))), lr=0.3)
    mgr.load(2, model=restored, optimizer=restored_opt)
    _assert_optimizer_states_equal(opt, restored_opt, _names(model), _names(restored))
    for s in range(2, 5):
        loss = _train_step(model, opt, s)
        assert_bitwise_equal(_train_step(restored, restored_opt, s), loss)
        assert_bitwise_equal(_train_step(named, named_opt, s), loss)
    assert_state_dicts_equal(restored.state_dict(), model.state_dict())
    assert_state_dicts_equal(named.state_dict(), model.state_dict())


def _split_groups(model: nn.Module, weight_lr: float, bias_lr: float, weight_wd: float,
                  bias_wd: float) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights, "lr": weight_lr, "weight_decay": weight_wd},
                              {"params": biases, "lr": bias_lr, "weight_decay": bias_wd}])


def test_two_groups_into_one_group(mgr: CheckpointManager) -> None:
    """Saved with 2 groups, loaded into 1: state follows names; hyperparameters the groups agree on
    are taken from the checkpoint, one they disagree on keeps its current value and is reported
    (strict mode refuses it and changes nothing)."""
    model = _small_model(0)
    opt = _split_groups(model, 0.01, 0.01, 0.1, 0.0)
    for s in range(2):
        _train_step(model, opt, s)
    mgr.save(2, model=model, optimizer=opt, rng=False)

    target = _small_model(3)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5, weight_decay=0.7, betas=(0.5, 0.6))
    before_model = {k: v.clone() for k, v in target.state_dict().items()}
    before_groups = [dict(g) for g in target_opt.param_groups]
    with pytest.raises(deltackpt.StateMismatchError, match="weight_decay"):
        mgr.load(2, model=target, optimizer=target_opt)
    assert_state_dicts_equal(target.state_dict(), before_model, "model after refused load")
    assert target_opt.param_groups == before_groups and len(target_opt.state) == 0

    report = mgr.restore(2).load_into(target, target_opt, strict=False)
    assert report.missing == [] and report.unexpected == [] and report.mismatched == []
    assert len(report.optimizer) == 1 and "'weight_decay'" in report.optimizer[0]
    assert not report.ok
    (group,) = target_opt.param_groups
    assert group["lr"] == 0.01
    assert group["betas"] == (0.9, 0.999)
    assert group["weight_decay"] == 0.7
    _assert_state_by_name(opt, model, target_opt, target)


def test_one_group_into_two_groups(mgr: CheckpointManager) -> None:
    """Saved with 1 group, loaded into 2: both groups take the saved hyperparameters, training matches."""
    model = _small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    for s in range(2):
        _train_step(model, opt, s)
    mgr.save(2, model=model, optimizer=opt, rng=False)

    target = _small_model(4)
    target_opt = _split_groups(target, 0.3, 0.4, 0.0, 0.2)
    report = mgr.restore(2).load_into(target, target_opt)  # strict: nothing to report
    assert report.ok
    assert [(g["lr"], g["weight_decay"]) for g in target_opt.param_groups] == [(0.01, 0.05)] * 2
    _assert_state_by_name(opt, model, target_opt, target)
    for s in range(2, 5):
        assert_bitwise_equal(_train_step(target, target_opt, s), _train_step(model, opt, s))
    assert_state_dicts_equal(target.state_dict(), model.state_dict())


def _assert_state_by_name(opt: torch.optim.Optimizer, model: nn.Module,
                          other_opt: torch.optim.Optimizer, other: nn.Module) -> None:
    names, other_names = _names(model), _names(other)
    state = {names[id(p)]: s for p, s in opt.state.items()}
    other_state = {other_names[id(p)]: s for p, s in other_opt.state.items()}
    assert sorted(state) == sorted(other_state)
    for name, values in state.items():
        for key, value in values.items():
            assert_same_value(other_state[name][key], value, f"{name}/{key}")


# -- schedulers and RNG -----------------------------------------------------------------------------

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]] = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler_state_via_extra(mgr: CheckpointManager, name: str) -> None:
    """A scheduler's state_dict saved in ``extra`` resumes the very same lr sequence and weights."""
    model = _small_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = SCHEDULERS[name](opt)
    for s in range(5):
        _train_step(model, opt, s)
        sched.step()
    saved_state = sched.state_dict()
    mgr.save(5, model=model, optimizer=opt, extra={"scheduler": saved_state}, rng=False)

    restored = _small_model(8)
    restored_opt = torch.optim.SGD(restored.parameters(), lr=0.05, momentum=0.9)
    restored_sched = SCHEDULERS[name](restored_opt)
    extra = mgr.load(5, model=restored, optimizer=restored_opt)
    assert_same_value(extra["scheduler"], saved_state, "scheduler state")
    restored_sched.load_state_dict(extra["scheduler"])

    lrs, restored_lrs = [], []
    for s in range(5, 12):
        assert_bitwise_equal(_train_step(restored, restored_opt, s), _train_step(model, opt, s))
        sched.step()
        restored_sched.step()
        lrs.append(sched.get_last_lr())
        restored_lrs.append(restored_sched.get_last_lr())
    assert restored_lrs == lrs
    assert len(set(map(tuple, lrs))) > 1 or name == "StepLR"
    assert_state_dicts_equal(restored.state_dict(), model.state_dict())


def _draws() -> tuple[list[float], list[float], list[float]]:
    return (torch.rand(5).tolist(), np.random.rand(5).tolist(), [random.random() for _ in range(5)])


def test_rng_states_restored(mgr: CheckpointManager) -> None:
    """load restores torch, numpy and ``random`` states; rng=False leaves them untouched."""
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    np.random.randn()  # leave numpy with a cached gaussian
    mgr.save(0, model=_small_model(0))
    after_save = _draws()
    _draws()
    mgr.load(0)
    assert _draws() == after_save

    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    mgr.load(0, rng=False)
    mgr.restore(0).load_into(rng=False)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert_same_value(np.random.get_state(), states[1], "numpy state")
    assert random.getstate() == states[2]

    report = mgr.restore(0).load_into()
    assert report.ok
    assert _draws() == after_save


def test_save_without_rng_does_not_touch_rng_on_load(mgr: CheckpointManager) -> None:
    """A step saved with rng=False has no RNG state, and loading it leaves the RNGs alone."""
    mgr.save(0, extra={"k": 1}, rng=False)
    meta = mgr.metadata(0)
    assert meta.state["rng"] is None
    assert not [r for r in meta.tensors if r.role == "rng"]
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    assert mgr.load(0) == {"k": 1}
    assert torch.equal(torch.rand(3), expected)


# -- extra ------------------------------------------------------------------------------------------

def _rich_extra() -> dict:
    return {
        "nested": {"a": {"b": [1, 2, {"c": None}], "d": "text"}},
        "tuple": (1, "two", (3.0, None), ()),
        "list_of_tuples": [(1, 2), (3,)],
        "int_keys": {1: "one", -3: (2,), 2**70: [3]},
        "mixed_keys": {"s": 1, 5: 2, (1, "x"): 3, None: 4, 2.5: 5, False: 6},
        "dollar_keys": {"$tensor": "not a tensor", "$x": 1},
        "tag_lookalike": {"$float": "nan"},
        "none": None,
        "bools": [True, False],
        "big": 2**200,
        "neg_big": -(2**70),
        "floats": [0.1, -0.0, 1e308, 5e-324, math.nan, math.inf, -math.inf, 1 / 3],
        "bytes": b"\x00\xff\x10 binary",
        "empty_bytes": b"",
        "unicode": "ünïcødé ✓ 日本",
        "empties": [{}, [], ()],
        "np_array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "np_float_array": np.linspace(-1, 1, 9, dtype=np.float32),
        "np_bool_array": np.array([True, False, True]),
        "np_scalars": [np.float32(1.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
                       np.float16(math.nan), np.int64(-(2**63)), np.float32(-0.0)],
        "tensors": [torch.arange(3), {"deep": (torch.ones(2, 2, dtype=torch.bfloat16),)}],
        "tensor_0d": torch.tensor(3.5, dtype=torch.float64),
    }


def test_extra_round_trips_exactly_with_types(mgr: CheckpointManager) -> None:
    """Nested containers, tuples, int keys, None, bools, big ints, special floats, bytes, numpy arrays
    and scalars, and tensors nested in lists come back equal and of the same types."""
    extra = _rich_extra()
    mgr.save(0, extra=extra, rng=False)
    assert_same_value(mgr.restore(0).extra, _rich_extra(), "extra")
    assert_same_value(mgr.load(0), _rich_extra(), "extra via load")


def test_extra_numpy_zero_dim_array(mgr: CheckpointManager) -> None:
    """A 0-d numpy array in ``extra`` comes back 0-d (shape ()), not as a 1-element vector."""
    extra = {"zero_d": np.array(2.5), "zero_d_int": np.array(7, dtype=np.int32)}
    mgr.save(0, extra=extra, rng=False)
    restored = mgr.restore(0).extra
    assert restored["zero_d"].shape == () and restored["zero_d_int"].shape == ()
    assert_same_value(restored, extra, "extra")


def test_extra_numpy_float64_scalar(mgr: CheckpointManager) -> None:
    """numpy float64 scalars stay numpy float64 (FORMAT.md 2.5: numpy scalar -> $npscalar)."""
    extra = {"loss": np.float64(2.25), "nan": np.float64(math.nan), "list": [np.float64(-0.0)]}
    mgr.save(0, extra=extra, rng=False)
    assert_same_value(mgr.restore(0).extra, extra, "extra")


def test_extra_tensors_under_int_and_str_keys(mgr: CheckpointManager) -> None:
    """A dict holding tensors under the int key 1 and the str key "1" round-trips (names stay unique)."""
    extra = {"cache": {1: torch.ones(2), "1": torch.zeros(3)}}
    mgr.save(0, extra=extra, rng=False)
    assert_same_value(mgr.restore(0).extra, extra, "extra")


@pytest.mark.parametrize(("extra", "path"), [
    ({"cfg": {"fn": lambda x: x}}, "extra['cfg']['fn']"),
    ({"items": [1, {2, 3}]}, "extra['items']['1']"),
    ({"obj": object()}, "extra['obj']"),
])
def test_unsupported_extra_raises_type_error_naming_the_path(mgr: CheckpointManager, ckpt_dir: Path,
                                                              extra: dict, path: str) -> None:
    """An object that cannot be stored raises TypeError naming its path, and nothing is written."""
    with pytest.raises(TypeError, match=re.escape(path)):
        mgr.save(0, extra=extra)
    assert mgr.steps() == []
    assert not list(ckpt_dir.glob("step-*"))


# -- names --------------------------------------------------------------------------------------------

ODD_NAMES = ["a/b", "a~1b", "~", "~0", "/", "//lead", "trail/", " space ", "ünï", "日本語", "x" * 200]


class OddNames(nn.Module):
    """Parameters, buffers and a submodule whose names contain '/', '~', spaces and unicode.

    (torch forbids '.' in module, parameter and buffer names: '..' is tested through ``extra`` keys.)
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i, name in enumerate(ODD_NAMES):
            self.register_parameter(name, nn.Parameter(torch.randn(i + 1, generator=gen)))
        self.register_buffer("buf/ x~", torch.arange(4))
        sub = nn.Module()
        sub.register_parameter("w//etc~1", nn.Parameter(torch.randn(3, generator=gen)))
        self.add_module("sub/~", sub)
        self.add_module("~home", nn.Linear(2, 2))


def test_odd_names_round_trip_and_stay_inside(tmp_path: Path) -> None:
    """Names with '/', '..', '~', spaces and unicode round-trip, and no file is created outside the
    checkpoint directory; data file names never contain tensor names."""
    outside_before = files_under(tmp_path)
    ckpt_dir = tmp_path / "ckpt"
    model = OddNames(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()
    extra = {"..": torch.ones(2), "../../escape": torch.zeros(1), "/abs/path": torch.arange(2),
             "~user": {"..": torch.ones(1)}, "a/b": 1, "a~1b": 2}
    with CheckpointManager(ckpt_dir, chunk_bytes=CHUNK) as mgr:
        mgr.save(1, model=model, optimizer=opt, extra=extra, rng=False)
        ckpt = mgr.restore(1)
        names = [r.name for r in mgr.metadata(1).tensors]

    created = files_under(tmp_path) - outside_before
    assert all(p == "ckpt" or p.startswith("ckpt/") for p in created), created
    allowed = re.compile(r"ckpt(/deltackpt\.json|/\.writer\.lock|/step-000000000001"
                         r"(/metadata\.json|/d-[0-9a-f]+-r[0-9]+-[0-9]+\.bin)?)?")
    assert all(allowed.fullmatch(p) for p in created), sorted(created)

    assert len(set(names)) == len(names)
    assert "model/a~1b" in names and "model/a~01b" in names and "model/~0" in names
    assert_state_dicts_equal(ckpt.model, model.state_dict(), "restored model")
    assert_same_value(ckpt.extra, extra, "extra")
    assert sorted(ckpt.optimizer["state"]) == sorted(n for n, _ in model.named_parameters())

    fresh = OddNames(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    with CheckpointManager(ckpt_dir, read_only=True) as reader:
        reader.load(1, model=fresh, optimizer=fresh_opt)
    assert_state_dicts_equal(fresh.state_dict(), model.state_dict(), "loaded model")
    _assert_optimizer_states_equal(opt, fresh_opt, _names(model), _names(fresh))


def test_model_tensor_names_follow_the_spec(mgr: CheckpointManager) -> None:
    """Model tensors are named ``model/<fqn>`` with '~' and '/' escaped as in JSON Pointer."""
    model = OddNames(0)
    mgr.save(0, model=model, rng=True)
    meta = mgr.metadata(0)
    model_records = [r for r in meta.tensors if r.role in ("param", "buffer")]
    expected = [("model/" + fqn.replace("~", "~0").replace("/", "~1"), fqn)
                for fqn in model.state_dict()]
    assert [(r.name, r.fqn) for r in model_records] == expected
    assert {r.role for r in meta.tensors} == {"param", "buffer", "rng"}


def test_optimizer_tensor_names_follow_the_spec(mgr: CheckpointManager) -> None:
    """Optimizer state tensors are ``optimizer/state/<fqn>/<state_key>`` with the fqn escaped."""
    model = OddNames(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    mgr.save(0, model=model, optimizer=opt, rng=False)
    records = [r for r in mgr.metadata(0).tensors if r.role == "optimizer"]
    expected = [(f"optimizer/state/{fqn.replace('~', '~0').replace('/', '~1')}/{key}", fqn, key)
                for fqn, _ in model.named_parameters() for key in ("step", "exp_avg", "exp_avg_sq")]
    assert sorted((r.name, r.fqn, r.state_key) for r in records) == sorted(expected)


def test_rng_tensor_names_follow_the_spec(mgr: CheckpointManager) -> None:
    """RNG state tensors are named ``rng/torch``, ``rng/numpy/1`` and ``rng/python/1`` (FORMAT.md
    2.3), role ``rng``."""
    mgr.save(0, rng=True)
    records = mgr.metadata(0).tensors
    assert {r.role for r in records} == {"rng"}
    assert sorted(r.name for r in records) == ["rng/numpy/1", "rng/python/1", "rng/torch"]


def test_metadata_describes_the_step(mgr: CheckpointManager, ckpt_dir: Path) -> None:
    """metadata.json has the fields of FORMAT.md 2 with consistent values: files, sizes, stats, ids."""
    model = nn.Linear(300, 20)
    info = mgr.save(5, model=model, extra={"note": "hi"}, rng=False)
    meta = mgr.metadata(5)
    obj = json.loads((ckpt_dir / "step-000000000005" / "metadata.json").read_text())
    assert obj["format"] == "deltackpt" and obj["format_version"] == FORMAT_VERSION
    assert (meta.step, meta.kind, meta.base_step, meta.world_size) == (5, "full", None, 1)
    assert meta.library_version == deltackpt.__version__
    assert re.fullmatch(r"[0-9a-f]+", meta.save_id)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\+00:00|Z)", meta.created)
    for file in meta.files:
        assert re.fullmatch(rf"d-{meta.save_id}-r[0-9]+-[0-9]+\.bin", file.name)
        assert (ckpt_dir / "step-000000000005" / file.name).stat().st_size == file.size
    assert meta.stats.raw_bytes == (300 * 20 + 20) * 4 == info.raw_bytes
    assert meta.stats.stored_bytes == sum(f.size for f in meta.files) == info.stored_bytes
    assert info.ratio == info.raw_bytes / info.stored_bytes
    assert meta.state == {"optimizer": None, "rng": None, "extra": {"note": "hi"}}
    chunks = [c for r in meta.tensors for f in r.fragments for c in f.chunks]
    assert sum(c.length for c in chunks) == meta.stats.stored_bytes
    for index, file in enumerate(meta.files):  # the chunks tile each data file: no gaps, no overlaps
        position = 0
        for chunk in sorted((c for c in chunks if c.file == index), key=lambda c: c.offset):
            assert chunk.offset == position
            position += chunk.length
        assert position == file.size


# -- universal checkpoint ---------------------------------------------------------------------------

def test_save_universal_then_load_universal(mgr: CheckpointManager, tmp_path: Path) -> None:
    """save_universal writes a standalone directory that load_universal reads back identically."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
    for s in range(2):
        _lm_step(model, opt, s)
    extra = {"epoch": 3, "sched": (1, 2.5), "t": torch.randn(700)}
    mgr.save(12, model=model, optimizer=opt, extra=extra)
    ckpt = mgr.restore(12)

    info = ckpt.save_universal(tmp_path / "universal")
    assert info.step == 12
    universal = deltackpt.load_universal(tmp_path / "universal")
    assert isinstance(universal, deltackpt.UniversalCheckpoint)
    assert universal.step == 12
    assert list(universal.tensors) == list(ckpt.tensors)
    assert_state_dicts_equal(universal.tensors, ckpt.tensors, "universal tensors")
    assert universal.model["head.weight"] is universal.model["tok.weight"]
    assert_same_value(universal.extra, ckpt.extra, "extra")
    assert_same_value(universal.extra, extra, "extra vs original")
    assert_same_value(universal.optimizer, ckpt.optimizer, "optimizer")
    assert_same_value(universal.rng, ckpt.rng, "rng")
    assert deltackpt.load_universal(tmp_path / "universal", 12).step == 12
    with pytest.raises(deltackpt.StepExistsError):
        ckpt.save_universal(tmp_path / "universal")
    ckpt.save_universal(tmp_path / "universal", overwrite=True)

    torch.manual_seed(5)
    fresh = TiedLM()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01, amsgrad=True)
    report = universal.load_into(fresh, fresh_opt, rng=False)
    assert report.ok
    assert_same_value(report.extra, extra, "report.extra")
    assert fresh.head.weight is fresh.tok.weight
    for s in range(2, 4):
        assert_bitwise_equal(_lm_step(fresh, fresh_opt, s), _lm_step(model, opt, s))


def test_restore_defaults_to_latest_and_steps_are_sorted(mgr: CheckpointManager) -> None:
    """steps() is ascending, latest_step() the highest, restore() without a step the latest."""
    assert mgr.steps() == [] and mgr.latest_step() is None
    for step in (10, 2, 1000000000000, 7):
        mgr.save(step, extra={"step": step}, rng=False)
    assert mgr.steps() == [2, 7, 10, 1000000000000]
    assert mgr.latest_step() == 1000000000000
    assert mgr.restore().extra == {"step": 1000000000000}
    assert mgr.restore(7).extra == {"step": 7}
    assert mgr.load() == {"step": 1000000000000}
    info = mgr.info(7)
    assert (info.step, info.kind, info.base_step) == (7, "full", None)
