"""Which run a checkpoint belongs to, as the integrations see it: a framework that saves into a
directory holding another run's steps would mix two runs in one chain and, under retention,
delete the other run's steps, so its first save refuses unless the run resumed from one of
those steps or was told to continue them."""

from __future__ import annotations

from deltackpt.errors import OtherRunError
from deltackpt.manager import CheckpointManager


def check_same_run(manager: CheckpointManager, *, continue_run: bool, resumed: bool) -> None:
    """Before an integration's first save through ``manager``: raise :class:`OtherRunError`
    when its directory holds committed steps and this run neither ``resumed`` from one of them
    nor was told to ``continue_run`` after them."""
    if continue_run or resumed:
        return
    steps = manager.steps()
    if steps:
        held = f"step {steps[0]}" if len(steps) == 1 else \
            f"{len(steps)} steps ({steps[0]} to {steps[-1]})"
        raise OtherRunError(
            f"{manager.path} already holds {held} of another run: resume from one of them, "
            "pass continue_run=True to save after them, or save into an empty directory")
