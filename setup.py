"""Which packages the distribution holds, found rather than listed (pyproject.toml has the rest).

Every package under ``deltackpt/`` is found by discovery, so a new one cannot be left out of
the wheel. The Numba kernels live in ``kernels/`` at the repository root and install as
``deltackpt.kernels``: a renamed directory, which pyproject.toml's package discovery cannot
express.
"""

from setuptools import find_packages, setup

KERNELS = "deltackpt.kernels"

setup(
    packages=[*find_packages(include=["deltackpt", "deltackpt.*"]),
              KERNELS, *(f"{KERNELS}.{name}" for name in find_packages("kernels"))],
    package_dir={KERNELS: "kernels"},
)
