"""The notebooks run end to end (shortened through environment variables), so they never rot.

The kernel runs in a temporary directory, outside the repository, as a notebook opened from
anywhere would."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints once its own checks have passed.
DONE = {"quickstart": ["resumed losses equal", "resumed from delta step"], "fidelity": ["fidelity checked"]}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           fidelity_cache: Path) -> None:
    """Every cell of the notebook runs without error (its own asserts included). The fidelity
    notebook's matrix takes the cells tests/test_fidelity.py ran from the session's cache."""
    monkeypatch.setenv("DELTACKPT_NOTEBOOK_STEPS", "12")
    monkeypatch.setenv("DELTACKPT_NOTEBOOK_SIZE", "tiny")
    monkeypatch.setenv("DELTACKPT_FIDELITY_CACHE", str(fidelity_cache))
    monkeypatch.delenv("DELTACKPT_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    for done in DONE[path.stem]:
        assert done in outputs
    if path.stem == "quickstart":  # it saves a full step, then shows delta steps
        kinds = [line.split(",")[1].strip() for line in outputs.splitlines() if line.startswith("step ")
                 and "stored" in line]
        assert kinds[0] == "full" and "delta" in kinds[1:], kinds
