"""Accelerate's ``save_state`` and ``load_state`` through deltackpt (``pip install
'deltackpt[accelerate]'``): :class:`Checkpointer`; the manual's "Accelerate" page."""

from deltackpt.integrations.accelerate_state import Checkpointer, SaveStateError

__all__ = ["Checkpointer", "SaveStateError"]
