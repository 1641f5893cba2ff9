"""A step as a Hugging Face model folder, which ``AutoModelForCausalLM.from_pretrained`` loads.

The step's model weights are named as the config's model names them: the FQNs of the
training model, less the segments its wrappers add (``torch.compile``'s ``_orig_mod``,
FSDP's and activation checkpointing's wrapped modules, DDP's leading ``module``). They are
loaded into that model built on the meta device (no weights are allocated twice), checked
name by name, and written by the model's own ``save_pretrained``: ``model.safetensors``, or
shards and ``model.safetensors.index.json`` above ``max_shard_size``, with ``config.json``;
the tokenizer's files are copied beside them when given. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import IntegrationError
from deltackpt.integrations.frameworks import require
from deltackpt.interop.files import prepare_out
from deltackpt.interop.layouts import names_text
from deltackpt.manager import CheckpointManager

# Module names wrappers insert into FQNs; DDP's "module" only leads them.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# What a Hugging Face tokenizer folder holds (AutoTokenizer reads these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class HFExport:
    """What :func:`export_hf` wrote: the folder, the step, and its files."""

    out: Path
    step: int
    files: list[Path]


def hf_names(fqns: list[str]) -> dict[str, str]:
    """The Hugging Face name of each training FQN (wrapper segments dropped); raises
    :class:`IntegrationError` when two FQNs would get one name."""
    names: dict[str, str] = {}
    for fqn in fqns:
        parts = [p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS]
        if len(parts) > 1 and parts[0] == "module":
            parts = parts[1:]
        name = ".".join(parts)
        if name in names.values():
            other = next(f for f, n in names.items() if n == name)
            raise IntegrationError(f"{fqn!r} and {other!r} are both {name!r} once the wrappers' "
                                   "names are dropped")
        names[fqn] = name
    return names


def export_hf(path: str | os.PathLike[str], out: str | os.PathLike[str],
              config: str | os.PathLike[str], *, step: int | None = None,
              tokenizer: str | os.PathLike[str] | None = None,
              max_shard_size: int | str = "5GB", overwrite: bool = False,
              storage_options: Mapping[str, Any] | None = None) -> HFExport:
    """Write step ``step`` (default: the latest) of the checkpoint at ``path`` to ``out`` as a
    Hugging Face model folder of the model ``config`` (a folder holding its ``config.json``)
    describes, with ``tokenizer``'s files (a folder) when given.

    Raises :class:`IntegrationError` listing the names the step lacks and those the model does
    not have, before anything is written; ``out`` must be empty unless ``overwrite``.
    """
    transformers = require("transformers")
    with CheckpointManager(path, read_only=True, storage_options=storage_options) as manager:
        target = prepare_out(Path(out), [] if "://" in manager.path else [Path(manager.path)],
                             overwrite)
        ckpt = manager.restore(step)
    names = hf_names(list(ckpt.model))
    weights = {names[fqn]: tensor for fqn, tensor in ckpt.model.items()}
    try:
        model_config = transformers.AutoConfig.from_pretrained(config, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise IntegrationError(f"{config}: not a Hugging Face config folder ({exc})") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config)
    _load(model, weights, ckpt.step, config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, max_shard_size=max_shard_size)
    if tokenizer is not None:
        _copy_tokenizer(Path(tokenizer), target)
    return HFExport(target, ckpt.step, sorted(p for p in target.iterdir() if p.is_file()))


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor], step: int,
          config: str | os.PathLike[str]) -> None:
    """Put ``weights`` into ``model`` (built on the meta device) in place, or raise naming what
    does not match; tied weights need their first name only."""
    try:
        result = model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as exc:  # shapes that differ
        raise IntegrationError(f"the weights of step {step} do not fit the model of {config}: "
                               f"{exc}") from None
    model.tie_weights()
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing or result.unexpected_keys:
        found = [f"{len(missing)} missing from step {step}: {names_text(missing)}"] if missing \
            else []
        if result.unexpected_keys:
            found.append(f"{len(result.unexpected_keys)} the model does not have: "
                         f"{names_text(sorted(result.unexpected_keys))}")
        raise IntegrationError(f"the weights of step {step} do not fit the model of {config}: "
                               + "; ".join(found))


def _copy_tokenizer(source: Path, out: Path) -> None:
    """Copy the tokenizer files of folder ``source`` (regular files only) into ``out``."""
    found = [source / n for n in TOKENIZER_FILES
             if (source / n).is_file() and not (source / n).is_symlink()]
    if not found:
        raise IntegrationError(f"{source} holds no tokenizer file ({', '.join(TOKENIZER_FILES)})")
    for file in found:
        shutil.copyfile(file, out / file.name)
