"""Fixtures shared by test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The models are tiny: one intra-op thread is much faster on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def fidelity_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's cache of fidelity matrix cells (bench/fidelity.py's ``run_matrix(cache=)``):
    tests/test_fidelity.py's runs, found there by the fidelity notebook's."""
    return tmp_path_factory.mktemp("fidelity-cache")


@pytest.fixture
def only_torch_safe_globals() -> Iterator[None]:
    """No classes other packages allowlisted for weights-only loads (megatron-core adds
    argparse.Namespace and others when imported, for the whole process): the tests of what
    deltackpt's readers refuse see torch's own allowlist, as a process without those packages."""
    foreign = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(foreign)
