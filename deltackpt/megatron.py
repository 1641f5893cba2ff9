"""deltackpt as Megatron-core's ``dist_checkpointing`` strategies: ``dist_checkpointing.save(
sharded_state_dict, ckpt_dir, sharded_strategy=deltackpt.megatron.SaveStrategy("runs/ckpt"))``
saves full or delta steps; after ``deltackpt.megatron.register()``, ``dist_checkpointing.load``
reads them back at any layout (:mod:`deltackpt.integrations.megatron`)."""

from deltackpt.integrations.megatron import LoadStrategy, SaveStrategy, register

__all__ = ["LoadStrategy", "SaveStrategy", "register"]
