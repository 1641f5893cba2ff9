"""The restore chain (deltackpt.restore.chain) against a plain reader that decodes every step in turn.

The chain restores a chunk range through all its deltas in one pass and checks only the last
step's ``raw_xxh3``. These tests hold it, bit for bit, to FORMAT.md 5.1 read literally: decode
the full step, then every chunk of every delta in order, keeping float32 running values. They
cover what the one-pass path must get right besides the plain case: bf16 tensors, chunks stored
exactly in the middle of the chain, block sizes or chunk sizes that change along it, and damage
that only decoding reveals, which must still name the step, tensor and file.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers import edit_metadata, step_dir
from torch import nn

from deltackpt import CheckpointManager, CompressionConfig, CorruptionError, Quantizer
from deltackpt.codecs.lossless import zstd_compress
from deltackpt.codecs.quant import decode_quant, quant_stream, scale_source, zstd_decompress_bounded
from deltackpt.format.dtypes import dtype_bytes, float32_values
from deltackpt.format.metadata import Chunk, StepMetadata
from deltackpt.io.reader import ChunkSource, read_metadata
from deltackpt.io.storage import open_storage
from deltackpt.restore.chain import restore_chain

WEIGHT = "model/0.weight"  # 64 x 32 float32: 8 chunks of 1 KiB


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dtype)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    first = model[0]
    x = torch.randn(16, first.in_features, dtype=first.weight.dtype)
    loss = (model(x).float() - x[:, :1].float().sin()).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


# Steps fine enough that every class codes symbols of several widths (the presets' weights step,
# 16 learning rates, leaves this toy model's weights all-zero blocks).
FINE = CompressionConfig(weights=Quantizer(step=0.25), first_moment=Quantizer(step=0.5, pred="zero"),
                         second_moment=Quantizer(step=0.25, domain="ordinal"))


def _manager(root: Path, chunk_bytes: int = 1024) -> CheckpointManager:
    return CheckpointManager(root, full_every=100, chunk_bytes=chunk_bytes, compression=FINE)


def _save_chain(root: Path, steps: range, dtype: torch.dtype = torch.float32,
                between=None) -> None:
    """A full step and deltas (AdamW: linear, zero-predicted and ordinal chunks), calling
    ``between(step, model, manager)`` before each save."""
    model = _model(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _manager(root) as mgr:
        for step in steps:
            _train(model, optimizer)
            if between is not None:
                between(step, model, mgr)
            mgr.save(step, model, optimizer, rng=False)


def _reference(root: Path, step: int) -> tuple[dict[str, bytes], dict[str, np.ndarray]]:
    """Raw bytes and float32 running values of every stored tensor of ``step``: its full step
    decoded, then every chunk of every delta of its chain in order."""
    storage = open_storage(root)
    chain = [read_metadata(storage, step)]
    while chain[-1].base_step is not None:
        chain.append(read_metadata(storage, chain[-1].base_step))
    raw: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for meta in reversed(chain):
        source = ChunkSource(storage, meta)
        for record in meta.tensors:
            if record.alias_of is not None:
                continue
            (fragment,) = record.fragments
            out = raw.setdefault(record.name, np.zeros(record.nbytes, np.uint8))
            lossy = record.dtype in ("float32", "bfloat16", "float16")
            itemsize = record.nbytes // max(record.numel, 1)
            for chunk in fragment.chunks:
                lo, hi = chunk.raw_offset, chunk.raw_offset + chunk.raw_length
                if chunk.codec == "quant":
                    state = values[record.name][lo // itemsize : hi // itemsize]
                    decode_quant(source.stored(record, chunk), chunk.params, state, state,
                                 lo // itemsize)
                    out[lo:hi] = dtype_bytes(state, record.dtype)
                    source.check_raw(record, chunk, out[lo:hi])
                else:
                    source.decode(record, chunk, out[lo:hi])
                    if lossy:
                        values.setdefault(record.name, np.zeros(record.numel, np.float32))
                        values[record.name][lo // itemsize : hi // itemsize] = \
                            float32_values(out[lo:hi].copy(), record.dtype)
        source.close()
    return {name: a.tobytes() for name, a in raw.items()}, values


def _assert_restores_like_reference(root: Path, steps: tuple[int, ...]) -> None:
    storage = open_storage(root)
    for step in steps:
        tensors, recon = restore_chain(storage, read_metadata(storage, step))
        raw, values = _reference(root, step)
        assert sorted(raw) == sorted(n for n, t in tensors.items()
                                     if read_metadata(storage, step).tensor(n).alias_of is None)
        for name, expected in raw.items():
            actual = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert actual == expected, f"step {step}, {name}: bytes differ"
        assert sorted(recon.values) == sorted(values), step
        for name, expected in values.items():
            assert recon.values[name].view(np.uint32).tobytes() == \
                expected.view(np.uint32).tobytes(), f"step {step}, {name}: running values differ"


def _chunks(meta: StepMetadata, name: str) -> list[Chunk]:
    return meta.tensor(name).fragments[0].chunks


def _widths(root: Path, step: int) -> dict[tuple[str, str], set[int]]:
    """The block widths of every quant chunk of ``step``, by (domain, pred)."""
    storage = open_storage(root)
    meta = read_metadata(storage, step)
    source = ChunkSource(storage, meta)
    out: dict[tuple[str, str], set[int]] = {}
    for record in meta.tensors:
        for chunk in record.fragments[0].chunks if record.fragments else ():
            if chunk.codec == "quant":
                n = chunk.raw_length * record.numel // record.nbytes
                stream = quant_stream(source.stored(record, chunk), chunk.params, n)
                widths = stream.data[: -(-n // stream.block)]
                out.setdefault((chunk.params["domain"], chunk.params["pred"]), set()).update(
                    widths.tolist())
    source.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_restores_like_step_by_step(tmp_path: Path, dtype: torch.dtype) -> None:
    """Steps of a 6-delta chain: bytes and running values equal the reference's."""
    root = tmp_path / "ckpt"
    _save_chain(root, range(7), dtype)
    meta = read_metadata(open_storage(root), 6)
    assert meta.kind == "delta" and len(_chunks(meta, WEIGHT)) == (8 if dtype == torch.float32 else 4)
    widths = _widths(root, 6)
    assert sorted(widths) == [("linear", "base"), ("linear", "zero"), ("ordinal", "base")]
    assert all(max(w) >= 2 for w in widths.values()), widths
    _assert_restores_like_reference(root, (1, 3, 6))


def test_exact_chunk_in_the_middle_restarts_its_range(tmp_path: Path) -> None:
    """A NaN saved at step 2 makes that chunk exact at steps 2 and 3 (a NaN base cannot predict);
    step 4 codes against it again. Restores start that range over from step 3."""
    root = tmp_path / "ckpt"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _manager(root) as mgr:
        for step in range(6):
            _train(model, optimizer)
            weight = model[0].weight
            kept = weight[0, 0].item()
            with torch.no_grad():
                weight[0, 0] = float("nan") if step == 2 else kept
            mgr.save(step, model, optimizer, rng=False)
            with torch.no_grad():
                weight[0, 0] = kept
    storage = open_storage(root)
    codecs = [[c.codec for c in _chunks(read_metadata(storage, s), WEIGHT)[:2]] for s in range(6)]
    assert codecs[2][0] != "quant" and codecs[3][0] != "quant", codecs
    assert codecs[2][1] == codecs[4][0] == codecs[5][0] == "quant", codecs
    _assert_restores_like_reference(root, (2, 3, 5))


def test_block_size_changing_along_the_chain(tmp_path: Path) -> None:
    """Steps coded with another block size: each run of one block size is one pass."""
    root = tmp_path / "ckpt"

    def reblock(step: int, _: nn.Module, mgr: CheckpointManager) -> None:
        mgr.compression = dataclasses.replace(mgr.compression, block=64 if step % 3 else 1024)

    _save_chain(root, range(7), between=reblock)
    storage = open_storage(root)
    blocks = {c.params["block"] for s in range(1, 7) for c in _chunks(read_metadata(storage, s), WEIGHT)
              if c.codec == "quant"}
    assert blocks == {64, 1024}
    _assert_restores_like_reference(root, (1, 4, 6))


def test_chunk_size_changing_along_the_chain(tmp_path: Path) -> None:
    """A manager with another chunk_bytes continues the chain: the chunk ranges no longer line
    up, and those tensors are restored one step after another."""
    root = tmp_path / "ckpt"
    _save_chain(root, range(3))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _manager(root, chunk_bytes=3072) as mgr:
        mgr.load(2, model, optimizer, rng=False)
        for step in range(3, 6):
            _train(model, optimizer)
            assert mgr.save(step, model, optimizer, rng=False).kind == "delta"
    storage = open_storage(root)
    bounds = [[c.raw_length for c in _chunks(read_metadata(storage, s), WEIGHT)] for s in (2, 5)]
    assert bounds == [[1024] * 8, [3072, 3072, 2048]]
    _assert_restores_like_reference(root, (2, 3, 5))


# -- damage only decoding reveals ---------------------------------------------------------------

def _replace_stream(root: Path, step: int, index: int, mangle) -> Path:
    """Replace chunk ``index`` of WEIGHT in ``step`` by a zstd frame of ``mangle(stream)``, written
    at the end of its data file with its checksum updated: the stored bytes check out."""
    storage = open_storage(root)
    meta = read_metadata(storage, step)
    chunk = _chunks(meta, WEIGHT)[index]
    assert chunk.codec == "quant"
    path = step_dir(root, step) / meta.files[chunk.file].name
    data = path.read_bytes()
    stored = memoryview(data)[chunk.offset : chunk.offset + chunk.length]
    stream = np.frombuffer(zstd_decompress_bounded(stored, 1 << 20), np.uint8).copy()
    frame = zstd_compress(mangle(stream))
    path.write_bytes(data + frame)
    chunk.offset, chunk.length, chunk.xxh3 = len(data), len(frame), xxhash.xxh3_64_hexdigest(frame)
    meta.files[chunk.file].size = len(data) + len(frame)
    (step_dir(root, step) / "metadata.json").write_text(meta.to_json())
    return path


def test_full_step_in_several_fragments_is_read_before_the_deltas(tmp_path: Path) -> None:
    """A full step may store a tensor as several boxes (as ranks of a sharded save will): the
    chain reads it whole first, then applies the deltas, with the same result."""
    root = tmp_path / "ckpt"
    _save_chain(root, range(4))
    storage = open_storage(root)
    before = {s: restore_chain(storage, read_metadata(storage, s)) for s in (1, 3)}
    def split(meta: dict) -> None:
        (record,) = [t for t in meta["tensors"] if t["name"] == WEIGHT]
        chunks = record["fragments"][0]["chunks"]
        assert len(chunks) == 8  # 8 rows each: rows 0-31 and 32-63 are 4 chunks each
        for chunk in chunks[4:]:
            chunk["raw_offset"] -= 4 * 1024
        record["fragments"] = [{"offsets": [0, 0], "sizes": [32, 32], "chunks": chunks[:4]},
                               {"offsets": [32, 0], "sizes": [32, 32], "chunks": chunks[4:]}]

    edit_metadata(step_dir(root, 0) / "metadata.json", split)
    assert len(read_metadata(storage, 0).tensor(WEIGHT).fragments) == 2
    for step, (tensors, recon) in before.items():
        again, recon_again = restore_chain(storage, read_metadata(storage, step))
        for name, tensor in tensors.items():
            assert again[name].numpy().tobytes() == tensor.numpy().tobytes(), name
        for name, values in recon.values.items():
            assert recon_again.values[name].tobytes() == values.tobytes(), name


def test_undecodable_stream_in_the_middle_is_named(tmp_path: Path) -> None:
    """A stream whose widths do not match its length, at step 2 of 4: restoring any later step
    names step 2, the tensor and the file."""
    root = tmp_path / "ckpt"
    _save_chain(root, range(5))
    path = _replace_stream(root, 2, 1, lambda s: s[:-1])
    mgr = CheckpointManager(root, read_only=True)
    for step in (2, 3, 4):
        with pytest.raises(CorruptionError, match=r"step 2, tensor 'model/0\.weight'") as info:
            mgr.restore(step)
        assert str(path) in str(info.value) and "does not decode" in str(info.value)
    mgr.restore(1)


def test_wrong_symbols_in_the_middle_fail_the_final_check(tmp_path: Path) -> None:
    """A well-formed stream of other symbols at step 2 (checksum updated to match): decoding
    succeeds, and the last step's raw_xxh3 catches the wrong result, naming that step."""
    root = tmp_path / "ckpt"
    _save_chain(root, range(5))
    _replace_stream(root, 2, 1, lambda s: np.zeros(1, np.uint8))  # its one block all zeros
    mgr = CheckpointManager(root, read_only=True)
    for step in (2, 4):
        with pytest.raises(CorruptionError,
                           match=rf"step {step}, tensor 'model/0\.weight'.*do not match"):
            mgr.restore(step)
    assert mgr.verify(4, deep=True)[4]


# -- boxes of tensors stored whole ----------------------------------------------------------------


def _balanced_chain(root: Path) -> None:
    """The default preset: weights dithered, exp_avg scaled by exp_avg_sq (decoded after it)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, full_every=100, chunk_bytes=1024) as mgr:
        for step in range(4):
            _train(model, optimizer)
            mgr.save(step, model, optimizer, rng=False)


@pytest.mark.parametrize("chain", ["fine", "balanced", "chunk size changing"])
def test_a_box_of_a_tensor_stored_whole_is_rebuilt_from_its_chunks_only(
        tmp_path: Path, monkeypatch, chain: str) -> None:
    """restore_chain(boxes=) on a chain saved by one process: the box of each tensor (and its
    running values) equals the whole restore's, and only the chunks holding it are read."""
    root = tmp_path / "ckpt"
    if chain == "balanced":
        _balanced_chain(root)
    elif chain == "fine":
        _save_chain(root, range(4))
    else:
        test_chunk_size_changing_along_the_chain(tmp_path)
    storage = open_storage(root)
    meta = read_metadata(storage, max(CheckpointManager(root, read_only=True).steps()))
    assert meta.kind == "delta"
    if chain == "balanced":
        assert any(scale_source(c.params) for c in _chunks(meta, "optimizer/state/0.weight/exp_avg")
                   if c.codec == "quant")  # decoded as derived tasks, after exp_avg_sq
    whole, recon = restore_chain(storage, meta)
    names = [WEIGHT, "optimizer/state/0.weight/exp_avg", "optimizer/state/0.weight/exp_avg_sq"]
    read = []
    stored = ChunkSource.stored
    monkeypatch.setattr(ChunkSource, "stored", lambda self, r, c: read.append(
        (r.name, c.raw_offset)) or stored(self, r, c))
    for offsets, sizes in [([20, 0], [10, 32]), ([0, 5], [64, 2]), ([63, 31], [1, 1]),
                           ([0, 0], [64, 32])]:
        read.clear()
        tensors, boxed = restore_chain(storage, meta, boxes={n: (offsets, sizes) for n in names})
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        for name in names:
            assert torch.equal(tensors[name], whole[name][index]), (offsets, name)
            expected = recon.values[name].reshape(64, 32)[index].reshape(-1)
            assert boxed.values[name].view(np.uint32).tobytes() == \
                expected.view(np.uint32).tobytes(), (offsets, name)
        if (offsets, sizes) == ([20, 0], [10, 32]) and chain != "chunk size changing":
            # rows 20-29 are bytes 2560-3840: the chunks at 2048 and 3072 of every step
            assert {(n, o) for n, o in read if n in names} == {(n, o) for n in names
                                                                for o in (2048, 3072)}


def test_unchanged_chunk_after_quant_ones_restores_the_step_before(tmp_path: Path) -> None:
    """An ``unchanged`` chunk (FORMAT.md 3.5) on a bfloat16 tensor whose chain codes it lossily
    below: its bytes are those the base step restores (the running values of the quant chunks
    before it, rounded), checked against its ``raw_xxh3``. deltackpt's writer stores no such
    chunk (tensors with running values are coded lossily), another writer may."""
    fixture = Path(__file__).parent / "fixtures" / "format-2.6" / "ckpt"
    root = tmp_path / "ckpt"
    shutil.copytree(fixture, root)
    name = "model/5.weight"
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.metadata(4).base_step == 3
        before = mgr.restore(3).tensors[name]
    digest = xxhash.xxh3_64_hexdigest(before.contiguous().view(torch.uint8).numpy())

    def unchanged(meta: dict) -> None:
        record = next(t for t in meta["tensors"] if t["name"] == name)
        (chunk,) = record["fragments"][0]["chunks"]
        chunk.update(codec="unchanged", length=0, params={}, raw_xxh3=digest,
                     xxh3=xxhash.xxh3_64_hexdigest(b""))

    edit_metadata(step_dir(root, 4) / "metadata.json", unchanged)
    with CheckpointManager(root, read_only=True) as mgr:
        assert torch.equal(mgr.restore(4).tensors[name].view(torch.int16),
                           before.view(torch.int16))
        assert not mgr.verify(4, deep=True)[4]
