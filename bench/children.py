"""What the benchmark scripts share: running one measurement in a process of its own (so that
each method starts from the same memory and threads), the driver of the benches that compare
ways of saving one training run, and the bytes a save left on disk."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from deltackpt.app.training import SIZES


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


def compare_methods(script: str, description: str, methods: list[str],
                    measure: Callable[[str, str, int, int, Path], dict], *,
                    every: int = 10) -> tuple[argparse.Namespace, dict[str, dict]] | None:
    """The driver of a bench that trains a TinyGPT (``--size``) saving ``--saves`` times,
    ``--every`` training steps apart, by each of ``methods`` (``--methods`` picks some): in
    the child process ``measure(method, size, saves, every, tmp)``, whose JSON it prints
    (returning None); in the parent, each method's result, by method, with the options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", default="small", choices=sorted(SIZES),
                        help="the TinyGPT trained [%(default)s]")
    parser.add_argument("--saves", type=int, default=10, help="saves per method [%(default)s]")
    parser.add_argument("--every", type=int, default=every,
                        help="training steps between saves [%(default)s]")
    parser.add_argument("--methods", default=",".join(methods), help="[%(default)s]")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, size, saves, steps = args.child
        print(json.dumps(measure(method, size, int(saves), int(steps), Path(args.tmp))))
        return None
    return args, {m: run_child(script, [m, args.size, str(args.saves), str(args.every)])
                  for m in args.methods.split(",")}
