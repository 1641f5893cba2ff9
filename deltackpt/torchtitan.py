"""torchtitan's ``CheckpointManager`` saving deltackpt steps: configure
``deltackpt.torchtitan.CheckpointManager.Config`` where torchtitan's checkpoint config goes
(:mod:`deltackpt.integrations.torchtitan`)."""

from deltackpt.integrations.torchtitan import CheckpointManager

__all__ = ["CheckpointManager"]
