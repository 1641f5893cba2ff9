"""Progress bars for long operations (tqdm on stderr, off unless asked for)."""

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
