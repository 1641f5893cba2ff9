"""Running a test module's Triton kernels on a machine without CUDA: in Triton's interpreter.

Triton chooses the interpreter when a kernel (its own library's included)
is defined, so ``TRITON_INTERPRET=1`` must be set while triton and the kernel modules
(``deltackpt.kernels.gpu_*``) are first imported (:func:`import_kernels`)
and while the module's tests run (Triton reads it again then: the
:func:`interpreter` fixture, which a module imports to use). Where another
module imported triton before without it (bitsandbytes does, so in the
whole suite), the module runs in a fresh process instead
(:func:`only_in_a_fresh_process`). The interpreter is slow: tensors are small.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER_ONLY = pytest.mark.skipif(DEVICE == "cuda", reason="DELTACKPT_KERNELS=triton routes "
                                      "host arrays through the interpreter, not the GPU")


def can_run_here() -> bool:
    """Whether a module importing this now can run its kernels in this process: on a GPU, or
    where triton is not imported yet, or was imported with the interpreter."""
    gpu_quant = sys.modules.get("deltackpt.kernels.gpu_quant")
    return DEVICE == "cuda" or "triton" not in sys.modules \
        or os.environ.get("TRITON_INTERPRET") == "1" \
        or (gpu_quant is not None and gpu_quant.interpreted())


def import_kernels(name: str, here: bool) -> ModuleType:
    """``deltackpt.kernels.<name>`` (a Triton kernel module), interpreted on a machine without
    CUDA where the module that imports it runs ``here`` (:func:`can_run_here`)."""
    if not here or DEVICE == "cuda":
        return importlib.import_module(f"deltackpt.kernels.{name}")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(f"deltackpt.kernels.{name}")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.fixture(autouse=True, scope="module")
def interpreter() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while a module's tests run on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        if DEVICE == "cpu":
            patch.setenv("TRITON_INTERPRET", "1")
        yield


def only_in_a_fresh_process(module: dict[str, Any], path: str) -> None:
    """Replace the tests of a module (its globals, ``module``; its file, ``path``) that cannot
    run here by one that runs the file in a fresh process, with the interpreter."""
    for name in [name for name in module if name.startswith("test_")]:
        del module[name]
    module["test_in_a_fresh_process"] = _fresh_process_test(path)


def _fresh_process_test(path: str) -> Callable[[], None]:
    def test_in_a_fresh_process() -> None:
        """triton was imported without its interpreter before this module: run this file in a
        fresh process, where it is imported with it."""
        done = subprocess.run(
            [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"],
            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(path).parents[1],
            capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]

    return test_in_a_fresh_process
