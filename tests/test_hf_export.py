"""Export to a Hugging Face model folder (deltackpt.integrations.hf_export, ``deltackpt export``):
``from_pretrained`` loads a step's weights exactly, for a tiny GPT-2 and a tiny Llama trained a few
steps on synthetic tokens, from a full step and from a delta; wrapper names are mapped, and
names or shapes that do not fit are an error listing them. No download: configs are built here."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import manual_examples  # noqa: E402

from deltackpt import CheckpointManager, IntegrationError  # noqa: E402
from deltackpt.app.cli import main  # noqa: E402
from deltackpt.integrations.hf_export import export_hf, hf_names  # noqa: E402

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                            n_positions=32),
    "llama": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=2,
                                              num_key_value_heads=1, vocab_size=96,
                                              max_position_embeddings=32),
}


class Compiled(torch.nn.Module):
    """Names its model's FQNs as torch.compile's wrapper does (``_orig_mod.``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = model


def _trained(kind: str, root: Path, wrap: bool = False) -> Path:
    """A checkpoint of ``kind`` trained 6 AdamW steps on synthetic tokens in ``root/ckpt``
    (step 1 full, 2 a delta); returns the config folder."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (4, 16))
    saved = Compiled(model) if wrap else model
    with CheckpointManager(root / "ckpt", full_every=10) as mgr:
        for step in (1, 2):
            for _ in range(3):
                optimizer.zero_grad()
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
            mgr.save(step, saved, optimizer)
    config.save_pretrained(root / "config")
    return root / "config"


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_from_pretrained_loads_the_steps_weights_exactly(tmp_path: Path, kind: str) -> None:
    config = _trained(kind, tmp_path)
    reader = CheckpointManager(tmp_path / "ckpt", read_only=True)
    for step in (1, 2):
        assert reader.info(step).kind == ("full" if step == 1 else "delta")
        written = export_hf(tmp_path / "ckpt", tmp_path / f"hf{step}", config, step=step)
        assert written.step == step
        assert {p.name for p in written.files} >= {"config.json", "model.safetensors"}
        expected = reader.restore(step).model
        loaded = _loaded(tmp_path / f"hf{step}")
        assert loaded.keys() >= expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name
        for name in loaded.keys() - expected.keys():  # tied to a saved weight
            assert any(torch.equal(loaded[name], t) for t in expected.values()), name


def test_wrapper_names_are_mapped_and_shards_are_indexed(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    config = _trained("llama", tmp_path, wrap=True)
    reader = CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert all(name.startswith("_orig_mod.") for name in reader.restore(2).model)
    assert main(["export", str(tmp_path / "ckpt"), "--hf-config", str(config), "--out",
                 str(tmp_path / "hf"), "--max-shard-size", "40KB", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["step"] == 2 and document["format"] == "huggingface"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    loaded = _loaded(tmp_path / "hf")
    for name, tensor in reader.restore(2).model.items():
        assert torch.equal(loaded[name.removeprefix("_orig_mod.")], tensor)


def test_names_that_do_not_fit_are_listed_before_anything_is_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture
                                                                     ) -> None:
    _trained("gpt2", tmp_path)
    other = tmp_path / "three-layers"
    transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96,
                            n_positions=32).save_pretrained(other)
    with pytest.raises(IntegrationError, match=r"missing from step 2: transformer\.h\.2\."):
        export_hf(tmp_path / "ckpt", tmp_path / "out", other)
    llama = tmp_path / "llama"
    CONFIGS["llama"]().save_pretrained(llama)
    with pytest.raises(IntegrationError, match=r"the model does not have: transformer\."):
        export_hf(tmp_path / "ckpt", tmp_path / "out", llama)
    wide = tmp_path / "wide"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96,
                            n_positions=32).save_pretrained(wide)
    with pytest.raises(IntegrationError, match="size mismatch"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", wide)
    assert not (tmp_path / "out").exists()
    assert main(["export", str(tmp_path / "ckpt"), "--hf-config", str(llama), "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not fit the model of" in err[0]


def test_tokenizer_files_are_copied_and_out_is_refused_when_not_empty(tmp_path: Path) -> None:
    config = _trained("gpt2", tmp_path)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (tokenizer / "vocab.json").write_text('{"a": 0}')
    (tokenizer / "notes.txt").write_text("not a tokenizer file")
    written = export_hf(tmp_path / "ckpt", tmp_path / "hf", config, tokenizer=tokenizer)
    names = {p.name for p in written.files}
    assert {"tokenizer_config.json", "vocab.json"} <= names and "notes.txt" not in names
    with pytest.raises(ValueError, match="is not empty"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", config)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", config, overwrite=True)
    with pytest.raises(IntegrationError, match="holds no tokenizer file"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf2", config, tokenizer=tmp_path / "config")


def test_hf_names_drop_wrappers_and_refuse_collisions() -> None:
    assert hf_names(["module._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.w",
                     "_orig_mod.lm_head.weight", "module"]) == {
        "module._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.w":
            "model.layers.0.w",
        "_orig_mod.lm_head.weight": "lm_head.weight", "module": "module"}
    with pytest.raises(IntegrationError, match=r"are both 'lm_head\.weight'"):
        hf_names(["lm_head.weight", "_orig_mod.lm_head.weight"])


def test_an_untested_transformers_version_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "4.40.1" if name == "transformers" else real(name))
    with pytest.raises(IntegrationError, match=r"transformers 4\.40\.1 is installed; deltackpt is "
                                               r"tested with transformers 5\.17 up to"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path)

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(IntegrationError, match=r"pip install 'deltackpt\[transformers\]'"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path)


def test_the_manuals_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = manual_examples("huggingface.md")
    assert len(example) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(example[0], "docs/huggingface.md", "exec"), {})
    assert (tmp_path / "runs" / "tiny-llama-hf" / "model.safetensors").is_file()
