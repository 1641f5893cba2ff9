"""The frameworks the integrations drive, and the versions of each that deltackpt is tested with."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from types import ModuleType

from deltackpt.errors import IntegrationError

# module: (extra, lowest tested version, first version not tested)
TESTED = {
    "transformers": ("transformers", (5, 17), (6, 0)),
    "accelerate": ("accelerate", (1, 15), (2, 0)),
    "lightning": ("lightning", (2, 6), (2, 7)),
    "torchtitan": ("torchtitan", (0, 3), (0, 4)),
    "deepspeed": ("deepspeed", (0, 19), (0, 20)),
    "megatron.core": ("megatron", (0, 16), (0, 17)),
}
# the distributions whose name is not their module's
DISTRIBUTIONS = {"megatron.core": "megatron-core"}


def _release(version: str) -> tuple[int, int]:
    """The major and minor release of ``version`` (``"5.17.0.dev0"`` -> (5, 17))."""
    numbers = re.findall(r"\d+", version)[:2]
    return (int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0) if numbers else (0, 0)



def require(module: str) -> ModuleType:
    """Import ``module`` after checking that its distribution is installed in a version deltackpt
    is tested with; raises :class:`IntegrationError` naming the extra to install, or both
    versions."""
    extra, lowest, beyond = TESTED[module]
    package = DISTRIBUTIONS.get(module, module)
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise IntegrationError(f"this needs {package}: pip install 'deltackpt[{extra}]'") from None
    if not lowest <= _release(version) < beyond:
        raise IntegrationError(
            f"{package} {version} is installed; deltackpt is tested with {package} "
            f"{lowest[0]}.{lowest[1]} up to (not including) {beyond[0]}.{beyond[1]}")
    return importlib.import_module(module)
