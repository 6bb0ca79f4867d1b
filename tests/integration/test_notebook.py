"""notebooks/explore_strategies.ipynb runs top to bottom on a tiny configuration and shows every strategy.

The notebook's kernel is a separate process that starts its own local Ray (address="local"), so it
does not matter whether this pytest session already runs one (the `ray_cluster` fixture).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

pytestmark = pytest.mark.integration  # real processes (torch.distributed ranks / a Jupyter kernel)

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "explore_strategies.ipynb"
RUNS = ("bsp", "bsp-ps", "ssp", "async", "ssp+straggler", "async+straggler")


def kernel_manager() -> KernelManager:
    """A "python3" kernel on this interpreter, whatever kernelspecs the machine has installed.

    With no kernel directories to search, jupyter_client falls back to ipykernel's native spec,
    whose command is this interpreter (sys.executable): no `ipykernel install` step needed."""
    return KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))


def text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def tagged(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    return cell


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert "parameters" in nb.cells[0].metadata.get("tags", [])
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)


def execute(tmp_path):
    """The notebook, executed in a fresh kernel (CellExecutionError on the first failing cell)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = kernel_manager()
    assert km.kernel_spec.argv[0] == sys.executable
    try:
        NotebookClient(
            nb, km=km, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        if km.has_kernel:  # nbclient leaves a kernel it was handed running
            km.shutdown_kernel(now=True)
    return nb


def check_outputs(nb) -> None:
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    table = text_of(tagged(nb, "comparison"))
    for label in RUNS:
        assert label in table, (label, table)
    for strategy in ("bsp", "ssp", "async"):
        assert strategy in table
    bound = text_of(tagged(nb, "ssp-bound"))  # the cell asserts the bound on every row
    assert "ssp: max lead 1 <= s = 1" in bound and "ssp+straggler: max lead 1 <= s = 1" in bound, bound
    equal = text_of(tagged(nb, "bsp-equal"))
    assert "max |θ_bsp − θ_bsp-ps| = " in equal, equal
    assert float(equal.split(" = ")[1].split()[0]) <= 1e-5, equal  # BSP: same θ on either transport
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 4  # accuracy and loss, per-worker step time, staleness, SSP clock lead


def test_notebook_trains_then_rereads_its_runs(tmp_path, monkeypatch):
    # The kernel inherits this environment: one epoch per run, runs under tmp_path.
    monkeypatch.setenv("DISTRAIN_NB_EPOCHS", "1")
    monkeypatch.setenv("DISTRAIN_NB_WORKERS", "2")
    monkeypatch.setenv("DISTRAIN_NB_OUT_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("DISTRAIN_NB_RUN_DIRS", raising=False)
    check_outputs(execute(tmp_path))
    run_dirs = sorted((tmp_path / "runs").glob("explore-*/*/summary.json"))
    assert sorted(p.parent.name for p in run_dirs) == sorted(label.replace("+", "-") for label in RUNS)

    # Given RUN_DIRS, the notebook trains nothing and shows the same runs.
    monkeypatch.setenv("DISTRAIN_NB_RUN_DIRS", os.pathsep.join(str(p.parent) for p in run_dirs))
    monkeypatch.setenv("DISTRAIN_NB_OUT_DIR", str(tmp_path / "unused"))
    check_outputs(execute(tmp_path))
    assert not (tmp_path / "unused").exists()
