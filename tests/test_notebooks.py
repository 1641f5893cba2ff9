"""The notebooks run end to end (shortened through environment variables), so they never rot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints once its own checks have passed.
DONE = {"quickstart": "resumed losses equal", "fidelity": "fidelity checked"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell of the notebook runs without error (its own asserts included)."""
    monkeypatch.setenv("DELTACKPT_NOTEBOOK_STEPS", "12")
    monkeypatch.setenv("DELTACKPT_NOTEBOOK_SIZE", "tiny")
    monkeypatch.setenv("DELTACKPT_REPO", str(path.parent.parent))
    monkeypatch.chdir(tmp_path)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    assert DONE[path.stem] in outputs
