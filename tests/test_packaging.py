"""The wheel holds every module of the source tree: a package left out of it gives an installed
``deltackpt`` command that fails at import (``deltackpt.interop`` once was). ``.ci/run`` also
installs the wheel into a fresh environment and runs ``.ci/wheel_smoke.py`` there; this test
catches a missing module in seconds. The wheel also carries the license and the project's
metadata that an index shows."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each source directory's modules are installed.
INSTALLED_AS = {"deltackpt": "deltackpt"}
_BUILD = "import sys; from setuptools.build_meta import build_wheel; print(build_wheel(sys.argv[1]))"


def source_modules() -> set[str]:
    """Every module of the source tree, by the path it must have in the wheel."""
    return {f"{installed}/{path.relative_to(ROOT / source).as_posix()}"
            for source, installed in INSTALLED_AS.items() for path in (ROOT / source).rglob("*.py")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the source tree (once for this module's tests)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for source in INSTALLED_AS:
        shutil.copytree(ROOT / source, src / source, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "dist" / proc.stdout.split()[-1]


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    """The text of the wheel's ``*.dist-info/<name>``."""
    return next(wheel.read(n).decode() for n in wheel.namelist()
                if n.split("/")[0].endswith(".dist-info") and n.split("/", 1)[1] == name)


def test_wheel_holds_every_module(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        entry_points = _dist_info(whl, "entry_points.txt")
    assert {n for n in names if n.endswith(".py")} == source_modules()
    assert "deltackpt = deltackpt.app.cli:main" in entry_points


def test_wheel_carries_the_license(wheel: Path) -> None:
    """The Apache-2.0 text ships in the wheel, and its metadata names the license and the file."""
    with zipfile.ZipFile(wheel) as whl:
        metadata = email.message_from_string(_dist_info(whl, "METADATA"))
        license_text = _dist_info(whl, "licenses/LICENSE")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in license_text


def test_wheel_names_the_project_urls(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        metadata = email.message_from_string(_dist_info(whl, "METADATA"))
    assert metadata.get_all("Project-URL") == [
        "Homepage, https://github.com/deltackpt/deltackpt",
        "Documentation, https://deltackpt.readthedocs.io",
        "Source, https://github.com/deltackpt/deltackpt",
        "Issues, https://github.com/deltackpt/deltackpt/issues",
    ]
