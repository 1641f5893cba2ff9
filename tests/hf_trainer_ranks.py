"""Two ranks (torchrun, gloo) training tests/test_hf_trainer.py's tiny GPT-2 with deltackpt's Trainer
under DDP: the run that goes through, the same run saved every 2 steps (step 2 full, 4 and 6
deltas), and a run resumed from step 2; rank 0 prints "resumed as went through" when the three end
with the very same weights and step 2 holds both ranks' RNG states.

``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/hf_trainer_ranks.py DIR``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from test_hf_trainer import Tokens, _args, _model

from deltackpt import CheckpointManager
from deltackpt.transformers import Trainer


def _train(cls: type, out: Path, resume: str | None = None, **kwargs: object) -> dict:
    checkpoint = {"checkpoint": kwargs.pop("checkpoint")} if "checkpoint" in kwargs else {}
    trainer = cls(_model(), _args(out, max_steps=6, ddp_backend="gloo", **kwargs),
                  train_dataset=Tokens(), **checkpoint)
    assert trainer.args.world_size == 2
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model.state_dict()


def main(root: Path) -> None:
    through = _train(transformers.Trainer, root / "hf", save_strategy="no")
    saved = _train(Trainer, root / "ours", checkpoint=str(root / "ours" / "ckpt"))
    manager = CheckpointManager(root / "ours" / "ckpt", read_only=True)
    resumed = _train(Trainer, root / "resumed", resume=str(root / "ours" / "ckpt" / "step-000000000002"))
    rank = torch.distributed.get_rank()
    for name, tensor in through.items():
        assert torch.equal(saved[name], tensor) and torch.equal(resumed[name], tensor), (rank, name)
    assert len(manager.restore(2).extra["rng"]) == 2
    if rank == 0:
        print("resumed as went through")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
