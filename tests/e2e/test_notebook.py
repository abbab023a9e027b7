"""The quickstart notebook runs top to bottom on a temporary lakehouse."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from engine.lakehouse.catalog.session import REPO_ROOT

pytestmark = pytest.mark.integration


def execute(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run ``notebooks/<name>`` top to bottom on a new lakehouse; its cells' outputs."""
    monkeypatch.setenv("DELAYQ_LAKEHOUSE", str(tmp_path / "lakehouse"))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    path = REPO_ROOT / "notebooks" / name
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )  # fmt: skip
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs


def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = execute("quickstart.ipynb", tmp_path, monkeypatch)
    assert any("image/png" in o.get("data", {}) for o in outputs), "the lateness plot is drawn"


def test_operations_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = execute("operations.ipynb", tmp_path, monkeypatch)
    plots = [o for o in outputs if "image/png" in o.get("data", {})]
    # lateness histogram and percentiles, pending and forecast, throughput, lag, quarantine
    assert len(plots) == 6, len(plots)
    text = "".join(o.get("text", "") for o in outputs)
    assert "rows in 2 topic tables; lateness p50" in text, text
