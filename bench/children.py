"""What the benchmark scripts share: running one measurement in a process of its own (so that
each method starts from the same memory and threads), the driver of the benches that compare
ways of saving one training run, and the bytes a save left on disk."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

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


def run_two_ranks(rank_main: Callable, args: argparse.Namespace, root: str) -> dict:
    """``rank_main(rank, 2, port, args, root, out)`` on 2 spawned processes (gloo rendezvous on
    a free loopback ``port``); what the ranks put in the shared dict ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(rank_main, args=(2, port, args, root, out), nprocs=2, start_method="spawn")
        return dict(out)


def print_saves(results: dict[str, tuple[list[float], list[int], list[str]]], baseline: str,
                width: int = 20) -> None:
    """Per method (``(seconds, bytes, kinds)`` of each save): the bytes a save adds (mean; full
    steps and deltas apart) and its seconds (median without the first), with their ratios to
    ``baseline``'s."""
    print(f"{'method':<{width}} {'MB/save':>9} {'full MB':>9} {'delta MB':>9} {'s/save':>8}")
    base_bytes = statistics.mean(results[baseline][1])
    base_seconds = statistics.median(results[baseline][0][1:])
    for method, (seconds, sizes, kinds) in results.items():
        full = [b for b, k in zip(sizes, kinds, strict=True) if k == "full"]
        delta = [b for b, k in zip(sizes, kinds, strict=True) if k == "delta"]
        mean, wait = statistics.mean(sizes), statistics.median(seconds[1:])
        print(f"{method:<{width}} {mean / 1e6:9.2f} {statistics.mean(full) / 1e6:9.2f} "
              f"{(statistics.mean(delta) / 1e6 if delta else 0):9.2f} {wait:8.3f}"
              + ("" if method == baseline else
                 f"   {base_bytes / mean:.1f}x smaller, {wait / base_seconds:.2f}x the time"))
