"""deltackpt's Trainer beside the Hugging Face Trainer's own checkpointing, on the same training run
(issue 28, item 8).

``python bench/transformers_bench.py`` (CPU; ``--size small --saves 10 --steps 20`` by default)
trains a GPT-2 from a config built here (bytes as tokens, no download) with the Trainer's AdamW
and linear schedule on real text (the demo's corpus: Python's sources), seeded alike for every
method, saving every ``--steps`` optimizer steps, each method in a process of its own:

* ``trainer``: ``transformers.Trainer``, a ``checkpoint-N`` folder per save (safetensors model,
  ``torch.save`` of the optimizer, scheduler and RNG states, ``trainer_state.json``);
* ``deltackpt``: ``deltackpt.transformers.Trainer`` (``full_every=10``, ``balanced``: a full step,
  then deltas);
* ``deltackpt-async``: the same with ``blocking=False`` (each save waits for the one before).

It prints, per method: the bytes of a save on disk (mean over the saves kept; for deltackpt the
full steps and the deltas apart), the bytes the process wrote per save (``wchar``: with
``--limit``, i.e. ``save_total_limit``, what retention rewrote too), the seconds the training
loop waits per save (the time inside ``_save_checkpoint``: median without the first save, and
the first), the seconds ``train()`` took in all (asynchronous saves committed), and the final
training loss (the same for every method: saving changes nothing in the run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from children import dir_bytes

METHODS = ["trainer", "deltackpt", "deltackpt-async"]
SIZES = {  # GPT-2 configs: layers, width, heads, context
    "small": (4, 128, 4, 128),
    "medium": (6, 256, 8, 128),
}


def _written() -> int:
    """Bytes this process has passed to write(2) so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _run(method: str, size: str, saves: int, steps: int, limit: int | None, out: Path) -> dict:
    """Train with ``method``'s checkpointing; what each save wrote and how long it stalled."""
    import transformers

    from deltackpt import CheckpointManager
    from deltackpt.app.training import load_corpus
    from deltackpt.transformers import Trainer

    layers, width, heads, context = SIZES[size]
    tokens = load_corpus().long()
    windows = tokens[: len(tokens) // context * context].view(-1, context)

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(windows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": windows[i], "labels": windows[i]}

    base = transformers.Trainer if method == "trainer" else Trainer
    waits: list[float] = []

    class Timed(base):
        def _save_checkpoint(self, model, trial) -> None:
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            waits.append(time.perf_counter() - started)

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, n_positions=context, vocab_size=256,
        bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=saves * steps, save_steps=steps, logging_steps=steps,
        per_device_train_batch_size=8, learning_rate=1e-3, warmup_steps=steps, use_cpu=True,
        report_to=[], disable_tqdm=True, seed=0, save_total_limit=limit)
    options = {} if method == "trainer" else {"checkpoint": CheckpointManager(
        out / "deltackpt", full_every=10, blocking=method != "deltackpt-async")}
    trainer = Timed(model, args, train_dataset=Windows(), **options)
    started, written = time.perf_counter(), _written()
    trainer.train()
    seconds, written = time.perf_counter() - started, _written() - written
    if method == "trainer":
        saved = {int(p.name.split("-")[1]): ("full", dir_bytes(p)) for p in out.glob("checkpoint-*")}
    else:
        manager = trainer.checkpoint_manager
        saved = {s: (manager.info(s).kind, dir_bytes(out / "deltackpt" / f"step-{s:012d}"))
                 for s in manager.steps()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = sum(p.numel() for p in model.parameters())
    return {"method": method, "saved": sorted(saved.items()), "waits": waits, "seconds": seconds,
            "loss": losses[-1], "params": params, "written": written / len(waits)}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps between saves")
    parser.add_argument("--limit", type=int, help="save_total_limit (default: every save kept)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one method, print its JSON
    options = parser.parse_args()
    if options.one:
        with tempfile.TemporaryDirectory() as out:
            result = _run(options.one, options.size, options.saves, options.steps, options.limit,
                          Path(out))
        print(json.dumps(result))
        return
    results = {}
    for method in options.methods.split(","):
        command = [sys.executable, __file__, "--one", method, "--size", options.size,
                   "--saves", str(options.saves), "--steps", str(options.steps),
                   *(["--limit", str(options.limit)] if options.limit else [])]
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        if done.returncode != 0:
            sys.exit(f"{method} failed:\n{done.stderr[-3000:]}")
        results[method] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("trainer")
    print(f"GPT-2 {options.size} ({next(iter(results.values()))['params']:,} parameters), "
          f"{options.saves} saves every {options.steps} steps"
          + (f", save_total_limit={options.limit}" if options.limit else ""))
    print("| method | bytes of a save on disk | vs the Trainer | bytes written per save | vs the Trainer "
          "| training waits per save (median; first) | vs the Trainer | train() | final loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, r in results.items():
        sizes = [b for _, (_, b) in r["saved"]]
        mean = statistics.mean(sizes)
        full = [b for _, (k, b) in r["saved"] if k == "full"]
        deltas = [b for _, (k, b) in r["saved"] if k == "delta"]
        what = _mib(mean) if not deltas else \
            f"{_mib(mean)} (full {_mib(statistics.mean(full))}, deltas {_mib(statistics.mean(deltas))})"
        wait = statistics.median(r["waits"][1:])
        rows = [method, what]
        if base is not None:
            rows.append(f"{statistics.mean(b for _, (_, b) in base['saved']) / mean:.1f}x smaller")
        rows.append(_mib(r["written"]))
        if base is not None:
            rows.append(f"{base['written'] / r['written']:.1f}x fewer")
        rows.append(f"{wait:.3f} s; {r['waits'][0]:.3f} s")
        if base is not None:
            rows.append(f"{wait / statistics.median(base['waits'][1:]):.2f}x")
        rows += [f"{r['seconds']:.1f} s", f"{r['loss']:.4f}"]
        print("| " + " | ".join(rows) + " |")


if __name__ == "__main__":
    main()
