"""Elements that are exactly zero restore as exactly zero (FORMAT.md 3.2, *Zeros*, since 2.4).

A dithered step restores a zero as a fraction of a step; an optimizer state that is zero says
no gradient has reached the element, and Adam's update from a first moment of a fraction of a
step over ``eps`` is about a learning rate a step. Quant chunks list such elements in a bitmap
before their symbols, and writer and readers set them to zero.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from helpers import Positions, edit_metadata, step_dir, train_positions
from torch import nn

from deltackpt import CheckpointManager, CompressionConfig
from deltackpt.codecs.quant import (
    STAT_LOST_ZEROS,
    Scale,
    apply_quant_streams,
    decode_quant,
    encode_quant,
    quant_stream,
)
from deltackpt.errors import CorruptionError, FormatError


def _values(n: int, seed: int, zeros: float) -> np.ndarray:
    """``n`` float32 values of either sign, a fraction ``zeros`` of them +0.0 or -0.0."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.01).astype(np.float32)
    pick = rng.random(n)
    x[pick < zeros / 2] = 0.0
    x[(pick >= zeros / 2) & (pick < zeros)] = -0.0
    return x


# (ordinal, with a prediction, dithered, scaled): the codings deltackpt's writers use
CODINGS = {"weights": (False, True, True, False), "first_moment": (False, False, True, False),
           "scaled": (False, False, True, True), "second_moment": (True, True, True, False),
           "undithered": (False, True, False, False)}


@pytest.mark.parametrize("coding", CODINGS)
def test_zeros_restore_exactly_and_alike_in_a_chunk_and_a_chain(coding: str) -> None:
    """Three steps of one chunk, the second holding zeros: the writer's running values keep
    every zero (and nothing else changes), the chunk counts and lists what the kernels did not
    zero, and a reader gets the same bits decoding each step or all in one pass."""
    ordinal, with_pred, dithered, scaled = CODINGS[coding]
    n, step = 5000, (1 << 16 if ordinal else 2.0**-8)
    values = [np.abs(_values(n, s, z)) if ordinal else _values(n, s, z)
              for s, z in ((0, 0.0), (1, 0.3), (2, 0.0))]
    scale = Scale("v", np.full(n, 1e-4, np.float32), float(np.float32(1e-8))) if scaled else None
    running = np.abs(_values(n, 9, 0.0)) if ordinal else _values(n, 9, 0.0)
    chunks, states = [], [running.copy()]
    for i, x in enumerate(values):
        recon = running.copy() if with_pred else np.empty(n, np.float32)
        chunk, stats = encode_quant(x, recon if with_pred else None, recon, ordinal=ordinal,
                                    step=step, block=256, dither=17 + i if dithered else None,
                                    scale=scale)
        assert chunk is not None
        lost = int(stats[:, STAT_LOST_ZEROS].sum())
        assert chunk.params.get("zeros") == (lost or None)
        assert not recon[x == 0].any()
        chunks.append(chunk)
        running = recon
        states.append(recon.copy())
    assert "zeros" in chunks[1].params or not dithered  # undithered: zeros code as zeros
    assert "zeros" not in chunks[0].params and "zeros" not in chunks[2].params
    if not with_pred:
        for chunk, state in zip(chunks, states[1:], strict=True):
            out = np.empty(n, np.float32)
            decode_quant(memoryview(chunk.parts[0]), chunk.params, None, out, 0,
                         None if scale is None else scale.values)
            np.testing.assert_array_equal(out.view(np.uint32), state.view(np.uint32))
        return
    chained = states[0].copy()
    apply_quant_streams([quant_stream(memoryview(c.parts[0]), c.params, n) for c in chunks],
                        chained, 0)
    np.testing.assert_array_equal(chained.view(np.uint32), states[-1].view(np.uint32))
    one_by_one = states[0].copy()
    for chunk in chunks:
        decode_quant(memoryview(chunk.parts[0]), chunk.params, one_by_one, one_by_one, 0)
    np.testing.assert_array_equal(one_by_one.view(np.uint32), states[-1].view(np.uint32))


def _chunk_with_zeros() -> tuple[bytes, dict, int]:
    n = 1003
    x = _values(n, 3, 0.2)
    recon = np.empty(n, np.float32)
    chunk, _ = encode_quant(x, None, recon, ordinal=False, step=2.0**-8, block=256, dither=5)
    assert chunk.params["zeros"] > 0
    stream = quant_stream(memoryview(chunk.parts[0]), chunk.params, n)  # coded by rANS
    raw = np.packbits(stream.zeros, bitorder="little").tobytes() + stream.data.tobytes()
    return raw, {k: v for k, v in chunk.params.items() if k != "rans_bins"}, n  # one zstd frame


def _frame(raw: bytes | bytearray) -> memoryview:
    return memoryview(zstandard.ZstdCompressor().compress(bytes(raw)))


def test_damaged_bitmaps_and_params_are_refused() -> None:
    """A bitmap whose count is not the params', with bits past the chunk's elements, or cut
    short is a CorruptionError naming it; a ``zeros`` that is not a positive count is a
    FormatError."""
    raw, params, n = _chunk_with_zeros()
    quant_stream(_frame(raw), params, n)  # intact: decodes
    with pytest.raises(CorruptionError, match=rf"bitmap of zeros holds {params['zeros']} of "
                                              rf"its {n} elements .* params say "):
        quant_stream(_frame(raw), {**params, "zeros": params["zeros"] + 1}, n)
    past = bytearray(raw)
    past[n // 8] |= 0x80  # element 1007 of 1003
    with pytest.raises(CorruptionError, match=r"and 1 past them"):
        quant_stream(_frame(past), {**params, "zeros": params["zeros"] + 1}, n)
    with pytest.raises(CorruptionError, match=r"short of its 126-byte bitmap of zeros"):
        quant_stream(_frame(raw[:100]), params, n)
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(FormatError, match=r"quant params .* are invalid"):
            quant_stream(_frame(raw), {**params, "zeros": bad}, n)


@pytest.mark.parametrize("preset", ["balanced", "aggressive"])
def test_rows_no_input_used_stay_put_after_a_resume(tmp_path: Path, preset: str) -> None:
    """AdamW: the position embeddings past the training sequences have moments of exactly zero,
    which every delta restores as zero (the chunks that dither them list them); a run resumed
    from the last delta moves those rows as the exact run does (by weight decay alone: 0.4% of
    the tensor's root mean square in 10 steps). Restored as fractions of a step, they moved
    them 45-65 times that."""
    torch.manual_seed(0)
    model = Positions()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "ckpt", full_every=100,
                           compression=CompressionConfig.preset(preset)) as mgr:
        for step in range(4):
            train_positions(model, optimizer, 3, step)
            mgr.save(step, model, optimizer)
        for step in (1, 2, 3):
            state = mgr.restore(step).tensors
            for key in ("exp_avg", "exp_avg_sq"):
                name = f"optimizer/state/position.weight/{key}"
                assert not state[name][32:].any() and state[name][:32].all(), (step, key)
                listed = sum(c.params.get("zeros", 0) for c in mgr.metadata(step).tensor(
                    name).fragments[0].chunks)
                # exp_avg is coded anew every save; exp_avg_sq on the grid of the first delta,
                # where its zeros stay zeros
                assert listed > 0 if key == "exp_avg" or step == 1 else listed == 0, (step, key)
        resumed = Positions()
        again = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        mgr.load(3, resumed, again)
    before = model.position.weight.detach()[32:].clone()
    restored = resumed.position.weight.detach()[32:].clone()
    train_positions(model, optimizer, 10, 99)
    train_positions(resumed, again, 10, 99)
    rms = float(model.position.weight.detach().pow(2).mean().sqrt())
    moved = (model.position.weight.detach()[32:] - before).abs().max() / rms
    moved_resumed = (resumed.position.weight.detach()[32:] - restored).abs().max() / rms
    assert 0 < moved < 0.01 and abs(moved_resumed - moved) < 0.1 * moved, (moved, moved_resumed)


def test_zeros_in_older_metadata_are_refused(tmp_path: Path) -> None:
    """A step that says format 2.3 cannot hold ``zeros``: refused when read, naming the tensor
    and both versions, as a 2.3 reader would refuse the param."""
    torch.manual_seed(0)
    model = Positions()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "ckpt", full_every=100) as mgr:
        for step in range(2):
            train_positions(model, optimizer, 3, step)
            mgr.save(step, model, optimizer)
    def as_format_2_3(obj: dict) -> None:  # and without 2.5's dither_groups and 2.8's
        obj.update(format_version="2.3")     # bit_planes, refused first
        for chunk in (c for t in obj["tensors"] for f in t["fragments"] for c in f["chunks"]):
            chunk.get("params", {}).pop("dither_groups", None)
            chunk.get("params", {}).pop("bit_planes", None)

    edit_metadata(step_dir(tmp_path / "ckpt", 1) / "metadata.json", as_format_2_3)
    with pytest.raises(FormatError, match=r"step-000000000001/metadata.json: tensor '\S+/exp_avg"
                                          r"\w*': a chunk's 'zeros' is of format 2\.4, this "
                                          r"step's format_version is 2\.3"):
        CheckpointManager(tmp_path / "ckpt", read_only=True).restore(1)


def test_pruned_weights_keep_their_sparsity(tmp_path: Path) -> None:
    """Weights pruned to zero (a fixed mask on the weights and their gradients) stay exactly
    zero through every delta, as they do in the run: a restored model is as sparse as the saved
    one, where dithered steps alone would restore every pruned weight as a fraction of a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    keep = torch.rand(64, 64) < 0.3
    with torch.no_grad():
        model[0].weight.mul_(keep)
    model[0].weight.register_hook(lambda grad: grad * keep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "ckpt", full_every=100) as mgr:
        for step in range(4):
            for _ in range(3):
                x = torch.randn(32, 64)
                loss = (model(x) - x[:, :8]).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            assert bool((model[0].weight[~keep] == 0).all())
            mgr.save(step, model, optimizer)
        for step in (1, 2, 3):
            weight = mgr.restore(step).tensors["model/0.weight"]
            assert not weight[~keep].any() and weight[keep].all(), step
        assert any("zeros" in c.params for c in mgr.metadata(1).tensor(
            "model/0.weight").fragments[0].chunks)
