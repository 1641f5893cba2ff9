"""The threads that encode and decode chunks."""

from __future__ import annotations

import os


def default_workers() -> int:
    """Threads for encoding and decoding: one per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
