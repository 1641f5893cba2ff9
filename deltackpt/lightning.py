"""deltackpt as Lightning's checkpoint IO: ``Trainer(plugins=[deltackpt.lightning.CheckpointIO(
"runs/ckpt")])`` saves every checkpoint as a full or delta step (:mod:`deltackpt.integrations.lightning`)."""

from deltackpt.integrations.lightning import CheckpointIO, CheckpointSaveError

__all__ = ["CheckpointIO", "CheckpointSaveError"]
