"""What the benchmark scripts share: running one measurement in a process of its own (so that
each method starts from the same memory and threads), and the bytes a save left on disk."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_child(script: str, args: list[str]) -> dict:
    """``python script --child ARGS --tmp DIR`` in a new process, with a temporary directory of
    its own: the JSON object its last line of output prints."""
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, script, "--child", *args, "--tmp", tmp],
                                capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"bench child {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def dir_bytes(path: Path) -> int:
    """The bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
