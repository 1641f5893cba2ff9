"""deltackpt as DeepSpeed's checkpoint engine: after ``deltackpt.deepspeed.install(engine)``,
``engine.save_checkpoint(dir)`` saves full or delta steps and ``engine.load_checkpoint(dir)``
loads them at any data-parallel degree (:mod:`deltackpt.integrations.deepspeed`)."""

from deltackpt.integrations.deepspeed import DeltaCheckpointEngine, install

__all__ = ["DeltaCheckpointEngine", "install"]
