"""What people see of long operations: progress bars (tqdm on stderr, off unless asked for)
and byte counts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tqdm import tqdm


@contextlib.contextmanager
def progress_bar(total_bytes: int, description: str, enabled: bool) -> Iterator[tqdm]:
    """A byte-counting bar; a silent one when ``enabled`` is false."""
    with tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True,
              unit_divisor=1024, disable=not enabled, leave=False) as bar:
        yield bar


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``7.0 KiB``, ``12.3 MiB`` (powers of 1024)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1023.95 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
