"""The wheel holds every module of the source tree: a package left out of it gives an installed
``deltackpt`` command that fails at import (``deltackpt.interop`` once was). ``.ci/run`` also
installs the wheel into a fresh environment and runs ``.ci/wheel_smoke.py`` there; this test
catches a missing module in seconds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each source directory's modules are installed.
INSTALLED_AS = {"deltackpt": "deltackpt"}
_BUILD = "import sys; from setuptools.build_meta import build_wheel; print(build_wheel(sys.argv[1]))"


def source_modules() -> set[str]:
    """Every module of the source tree, by the path it must have in the wheel."""
    return {f"{installed}/{path.relative_to(ROOT / source).as_posix()}"
            for source, installed in INSTALLED_AS.items() for path in (ROOT / source).rglob("*.py")}


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for source in INSTALLED_AS:
        shutil.copytree(ROOT / source, src / source, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(tmp_path / "dist" / proc.stdout.split()[-1]) as wheel:
        names = wheel.namelist()
        entry_points = next(wheel.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert {n for n in names if n.endswith(".py")} == source_modules()
    assert "deltackpt = deltackpt.app.cli:main" in entry_points
