"""Sharding patterns (deltackpt.interop.patterns): hand-sharded layouts merged and cut by one spec.

A small Megatron-style GPT block written for tensor parallelism (vocabulary-
parallel embedding, fused QKV with grouped-query attention, row-parallel
projections, SwiGLU's fused gate/up) checks that the slices ``split`` cuts are
the ones such a model computes with: the ranks' partial outputs, summed, equal
the whole model's output. Round trips check that merge inverts split.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, assert_state_dicts_equal
from torch import nn
from torch.nn import functional as F

from deltackpt import CheckpointManager, StateMismatchError
from deltackpt.interop.patterns import ShardingSpec, ShardRule, merge_states, split_checkpoint
from deltackpt.save.capture import capture

VOCAB, DIM, HEAD, N_Q, N_KV, FFN = 50, 16, 2, 8, 4, 24
Q, KV = N_Q * HEAD, N_KV * HEAD

SPEC = ShardingSpec.from_dict({"rules": [
    {"pattern": "embedding.weight", "kind": "partitioned", "dim": 0, "vocab_size": VOCAB,
     "pad_multiple": 1},
    {"pattern": "*.qkv.weight", "kind": "partitioned", "dim": 0, "parts": [Q, KV, KV]},
    {"pattern": "*.proj.weight", "kind": "partitioned", "dim": 1},
    {"pattern": "*.fc1.weight", "kind": "partitioned", "dim": 0, "parts": [FFN, FFN]},
    {"pattern": "*.fc2.weight", "kind": "partitioned", "dim": 1},
    {"pattern": "*.norm.weight", "kind": "averaged"},
    {"pattern": "*.fc2.bias", "kind": "replicated"},
]})


class Block(nn.Module):
    """Attention (GQA) and a SwiGLU MLP, holding the slices of rank ``tp_rank`` of ``tp_size``."""

    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM, bias=False)
        self.qkv = nn.Linear(DIM, (Q + 2 * KV) // tp_size, bias=False)
        self.proj = nn.Linear(Q // tp_size, DIM, bias=False)
        self.fc1 = nn.Linear(DIM, 2 * FFN // tp_size, bias=False)
        self.fc2 = nn.Linear(FFN // tp_size, DIM)  # its bias is added once, after the sum


class TPModel(nn.Module):
    """The part of a GPT that one tensor-parallel rank holds (``tp_size=1``: the whole model)."""

    def __init__(self, tp_size: int, tp_rank: int = 0) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        rows = SPEC.rules[0].padded_size(tp_size) if tp_size > 1 else VOCAB
        self.embedding = nn.Embedding(rows // tp_size, DIM)
        self.layers = nn.ModuleList([Block(tp_size), Block(tp_size)])

    def partial(self, tokens: torch.Tensor, x: torch.Tensor, layer: int, part: str) -> torch.Tensor:
        """This rank's share of one sublayer's output (the shares of all ranks sum to it)."""
        if part == "embedding":
            rows = self.embedding.num_embeddings
            local = tokens - self.tp_rank * rows
            inside = (local >= 0) & (local < rows)
            return self.embedding(local.clamp(0, rows - 1)) * inside[..., None]
        block = self.layers[layer]
        h = block.norm(x)
        if part == "attention":
            q, k, v = block.qkv(h).split([Q // self.tp_size, KV // self.tp_size,
                                          KV // self.tp_size], -1)
            q, k, v = (t.unflatten(-1, (-1, HEAD)).transpose(0, 1) for t in (q, k, v))
            k, v = (t.repeat_interleave(N_Q // N_KV, 0) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return block.proj(out.transpose(0, 1).flatten(-2))
        gate, up = block.fc1(h).chunk(2, -1)
        return F.linear(F.silu(gate) * up, block.fc2.weight) + block.fc2.bias / self.tp_size


def tp_forward(ranks: list[TPModel], tokens: torch.Tensor) -> torch.Tensor:
    """The model's output computed by ``ranks`` as tensor parallelism does (sum = all-reduce)."""
    x = sum(r.partial(tokens, None, 0, "embedding") for r in ranks)
    for layer in range(2):
        for part in ("attention", "mlp"):
            x = x + sum(r.partial(tokens, x, layer, part) for r in ranks)
    return x


def whole_model() -> TPModel:
    torch.manual_seed(0)
    model = TPModel(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from their 1/0 init
    return model


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_split_slices_compute_the_whole_model(tp_size: int) -> None:
    model = whole_model()
    tokens = torch.tensor([0, 7, 13, 49, 25, 48, 1, 30])
    ranks = []
    for rank in range(tp_size):
        sliced = TPModel(tp_size, rank)
        sliced.load_state_dict(SPEC.split(model.state_dict(), rank, tp_size))
        ranks.append(sliced)
    torch.testing.assert_close(tp_forward(ranks, tokens), tp_forward([model], tokens),
                               rtol=1e-5, atol=1e-5)
    merged = SPEC.merge([r.state_dict() for r in ranks])
    assert_state_dicts_equal(merged, model.state_dict(), "merged model")


def test_fused_and_padded_slices_are_laid_out_as_megatron_does() -> None:
    """Rank r holds [q_r; k_r; v_r] (each part sliced alone) and its rows of the padded vocabulary."""
    qkv = torch.arange(float(Q + 2 * KV)).unsqueeze(1).expand(-1, 3).contiguous()
    rule = SPEC.rules[1]
    for rank in range(2):
        expected = torch.cat([qkv[:Q].chunk(2)[rank], qkv[Q:Q + KV].chunk(2)[rank],
                              qkv[Q + KV:].chunk(2)[rank]])
        assert_bitwise_equal(rule.split("qkv", qkv, rank, 2), expected, f"rank {rank}")
    emb = torch.randn(VOCAB, 3)
    vocab = SPEC.rules[0]
    assert vocab.padded_size(4) == 52
    last = vocab.split("emb", emb, 3, 4)
    assert_bitwise_equal(last[:11], emb[39:])
    assert torch.count_nonzero(last[11:]) == 0  # the two padding rows
    megatron = ShardRule("emb", vocab_size=VOCAB, pad_multiple=128)
    assert megatron.padded_size(8) == 1024 and megatron.split("emb", emb, 0, 8).shape == (128, 3)


@pytest.mark.parametrize("rule, shape", [
    (ShardRule("w", "partitioned", dim=0), (12, 5)),
    (ShardRule("w", "partitioned", dim=1), (3, 8, 2)),
    (ShardRule("w", "replicated"), (7, 3)),
    (ShardRule("w", "averaged"), (7,)),
    (ShardRule("w", "partitioned", dim=0, vocab_size=50, pad_multiple=8), (50, 4)),
    (ShardRule("w", "partitioned", dim=1, vocab_size=10), (3, 10)),
    (ShardRule("w", "partitioned", dim=0, parts=(64, 16, 16)), (96, 4)),
    (ShardRule("w", "partitioned", dim=1, parts=(8, 8)), (5, 16)),
    (ShardRule("w", "partitioned", dim=0, parts=(8, 8)), (16,)),
])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_split_then_merge_is_the_identity(rule: ShardRule, shape: tuple[int, ...], tp_size: int) -> None:
    spec = ShardingSpec((rule,))
    for dtype in (torch.float32, torch.bfloat16):
        whole = {"w": torch.randn(shape).to(dtype)}
        shards = [spec.split(whole, r, tp_size) for r in range(tp_size)]
        assert_bitwise_equal(spec.merge(shards)["w"], whole["w"], f"{rule} on {tp_size} ranks")


def test_averaged_copies_are_averaged_and_replicated_ones_checked() -> None:
    spec = ShardingSpec.from_dict({"rules": [{"pattern": "ln", "kind": "averaged"}]})
    merged = spec.merge([{"ln": torch.tensor([1.0, 2.0])}, {"ln": torch.tensor([3.0, 2.0])}])
    assert_bitwise_equal(merged["ln"], torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match=r"'bias' differs between rank 0 and rank\(s\) \[2\].*no rule"):
        spec.merge([{"ln": torch.ones(1), "bias": torch.zeros(2)}] * 2
                   + [{"ln": torch.ones(1), "bias": torch.ones(2)}])
    with pytest.raises(ValueError, match="only floating-point tensors can be averaged"):
        spec.merge([{"ln": torch.ones(2, dtype=torch.int64)}] * 2)


def test_a_spec_that_matches_nothing_or_twice_is_refused() -> None:
    state = {"layers.0.qkv.weight": torch.zeros(4, 2), "layers.0.proj.weight": torch.zeros(2, 4)}
    typo = ShardingSpec((ShardRule("*.qvk.weight"), ShardRule("*.proj.weight", dim=1)))
    with pytest.raises(ValueError, match=r"rule '\*\.qvk\.weight' matches no tensor"):
        typo.split(state, 0, 2)
    twice = ShardingSpec((ShardRule("layers.*"), ShardRule("*.qkv.weight")))
    with pytest.raises(ValueError, match=r"'layers.0.qkv.weight' matches 2 rules: 'layers.\*', "
                                         r"'\*.qkv.weight'"):
        twice.merge([state, state])


@pytest.mark.parametrize("rule, shape, tp_size, message", [
    (ShardRule("w", dim=0), (10, 3), 4, r"'w': dim 0 of size 10 cannot be split into 4 equal"),
    (ShardRule("w", parts=(12, 6, 6)), (24, 3), 4, r"parts \[12, 6, 6\] cannot be split over 4 "
                                                   r"ranks \(\[6, 6\] not divisible"),
    (ShardRule("w", parts=(12, 6)), (24, 3), 2, r"parts \[12, 6\] add up to 18, but dim 0 is 24"),
    (ShardRule("w", dim=2), (4, 4), 2, r"shape \[4, 4\] has no dim 2"),
    (ShardRule("w", vocab_size=12), (10, 3), 2, "dim 0 is 10, not vocab_size 12"),
])
def test_a_layout_that_cannot_be_split_is_refused(rule: ShardRule, shape: tuple[int, ...],
                                                  tp_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingSpec((rule,)).split({"w": torch.zeros(shape)}, 0, tp_size)


def test_merge_refuses_slices_that_do_not_fit() -> None:
    spec = ShardingSpec((ShardRule("w", parts=(8, 4)),))
    with pytest.raises(ValueError, match=r"each rank should hold 6 of dim 0 .* rank 0 holds 5"):
        spec.merge([{"w": torch.zeros(5, 2)}] * 2)
    with pytest.raises(ValueError, match=r"'w' is torch.float32\[5, 2\] on rank 0 but "
                                         r"torch.float32\[5, 3\] on rank 1"):
        spec.merge([{"w": torch.zeros(5, 2)}, {"w": torch.zeros(5, 3)}])
    with pytest.raises(StateMismatchError, match=r"'b' only on rank 1 \(not rank 0\)"):
        spec.merge([{"w": torch.zeros(6, 2)}, {"w": torch.zeros(6, 2), "b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="fewer than vocab_size 20"):
        ShardingSpec((ShardRule("w", vocab_size=20),)).merge([{"w": torch.zeros(8)}] * 2)
    with pytest.raises(ValueError, match="need 0 <= tp_rank < tp_size"):
        spec.split({"w": torch.zeros(12, 2)}, 2, 2)


def test_spec_json_round_trip_and_bad_specs(tmp_path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC.as_dict()))
    assert ShardingSpec.load(path) == SPEC
    for bad, message in [
        ({"rules": [{"pattern": "w", "kind": "sliced"}]}, "kind must be one of"),
        ({"rules": [{"pattern": "w", "partition": 0}]}, r"unknown field\(s\) \['partition'\]"),
        ({"rules": [{"kind": "replicated"}]}, "needs a 'pattern'"),
        ({"rules": [{"pattern": "w", "kind": "replicated", "dim": 1}]}, "only apply to partitioned"),
        ({"rules": [{"pattern": "w", "parts": [4, 0]}]}, "parts must be positive ints"),
        ({"rules": [{"pattern": "w", "parts": [4], "vocab_size": 4}]}, "not both"),
        ({"layers": []}, r'a sharding spec is \{"rules"'),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            ShardingSpec.load(path)
    path.write_text("{rules")
    with pytest.raises(ValueError, match=r"spec\.json: not valid JSON"):
        ShardingSpec.load(path)


def test_hand_sharded_training_state_round_trips_through_a_checkpoint(tmp_path) -> None:
    """Whole model + AdamW saved, cut for 2 ranks, loaded into their hand-sharded models,
    captured there and merged again: parameters and optimizer state bit for bit."""
    model = whole_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    for _ in range(2):
        tp_forward([model], tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(2, model=model, optimizer=optimizer, rng=False)
        ckpt = mgr.restore(2)
    tp_size = 2
    states = []
    for rank in range(tp_size):
        sliced = TPModel(tp_size, rank)
        sliced_opt = torch.optim.AdamW(sliced.parameters(), lr=1e-3)
        split_checkpoint(ckpt, SPEC, rank, tp_size).load_into(sliced, sliced_opt)
        exp_avg = sliced_opt.state[sliced.layers[0].qkv.weight]["exp_avg"]
        assert exp_avg.shape == ((Q + 2 * KV) // tp_size, DIM)
        states.append(capture(sliced, sliced_opt, None, rng=False))
    merged = merge_states(states, SPEC)
    expected = capture(model, optimizer, None, rng=False)
    assert [t.name for t in merged.tensors] == [t.name for t in expected.tensors]
    for got, want in zip(merged.tensors, expected.tensors, strict=True):
        assert_bitwise_equal(got.tensor, want.tensor, got.name)
    assert merged.tree["optimizer"]["param_groups"] == expected.tree["optimizer"]["param_groups"]
    with CheckpointManager(tmp_path / "merged") as mgr:
        mgr.save_captured(2, merged)
        assert_state_dicts_equal(mgr.restore(2).model, model.state_dict(), "saved merge")


def test_the_documented_megatron_spec_parses_and_fits_megatron_names() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "PATTERNS.md").read_text()
    spec = ShardingSpec.from_dict(json.loads(doc.split("```json\n")[1].split("```")[0]))
    layer = "decoder.layers.0."
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
             *(layer + n for n in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                                   "self_attention.linear_proj.bias",
                                   "self_attention.linear_qkv.layer_norm_weight",
                                   "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight",
                                   "mlp.linear_fc2.weight"))]
    rules = spec.rules_for(names)
    assert rules[layer + "mlp.linear_fc1.weight"].parts == (11008, 11008)
    assert rules[layer + "self_attention.linear_proj.weight"].dim == 1
    assert rules[layer + "self_attention.linear_proj.bias"].kind == "replicated"
    assert rules["output_layer.weight"].padded_size(8) == 51200


def test_ranks_checkpoints_convert_into_one_universal_step(tmp_path) -> None:
    """``deltackpt convert tp0.pt tp1.pt --spec``: the ranks' torch.save files of a hand-sharded
    run merge into the whole model and optimizer state; a spec that does not fit is named."""
    from deltackpt.app.cli import main
    from deltackpt.errors import ConversionError
    from deltackpt.interop import convert

    model = whole_model()
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    tp_forward([model], torch.tensor([3, 1, 4, 1, 5])).square().mean().backward()
    optimizer.step()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(7, model=model, optimizer=optimizer, rng=False)
        ckpt = mgr.restore(7)
    files = []
    for rank in range(2):
        sliced = TPModel(2, rank)
        sliced_opt = torch.optim.AdamW(sliced.named_parameters(), lr=1e-3)
        split_checkpoint(ckpt, SPEC, rank, 2).load_into(sliced, sliced_opt)
        files.append(tmp_path / f"tp{rank}.pt")
        torch.save({"model": sliced.state_dict(), "optimizer": sliced_opt.state_dict(), "step": 7},
                   files[-1])
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC.as_dict()))
    assert main(["convert", *map(str, files), "--spec", str(spec_file), "--out",
                 str(tmp_path / "merged")]) == 0
    merged = CheckpointManager(tmp_path / "merged", read_only=True).restore(7)
    assert_state_dicts_equal(merged.model, model.state_dict(), "merged model")
    for fqn, state in merged.optimizer["state"].items():
        for key, value in state.items():
            assert_bitwise_equal(value, ckpt.optimizer["state"][fqn][key], f"{fqn}/{key}")
    typo = ShardingSpec((*SPEC.rules, ShardRule("*.qvk.weight")))
    with pytest.raises(ConversionError, match=r"tp0\.pt, .*tp1\.pt \(rank 0 first\): sharding spec "
                                              r"does not fit the state: rule '\*\.qvk\.weight' "
                                              r"matches no tensor"):
        convert(files, tmp_path / "bad", sharding=typo)
    assert not (tmp_path / "bad").exists()
