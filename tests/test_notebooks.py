"""The notebooks in ``notebooks/`` run from top to bottom without an error.

Each notebook is executed with nbclient in a fresh kernel, with the repository root as the
working directory (the notebooks read ``examples/`` and ``results/`` by relative path), a
timeout per cell, and fails the test on the first cell that raises (the notebooks assert the
claims their text makes, so a changed result fails here too).  The notebooks are committed
without outputs; a test checks that as well.  Skipped, with the reason, when nbformat, nbclient,
matplotlib or a Python kernel is missing (``pip install -e '.[test]'`` installs them).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: the notebooks issue 11 (item 4) asks for (gpu_replay replays only when a GPU is present)
EXPECTED = {"race_window.ipynb", "race_probability.ipynb", "gpu_replay.ipynb", "incident.ipynb"}
CELL_TIMEOUT_S = 120
KERNEL = "python3"


def test_the_notebooks_are_there():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


def _kernel_or_skip() -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        pytest.skip(f"no Jupyter kernel named {KERNEL!r} (pip install ipykernel)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")
    _kernel_or_skip()
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(ROOT)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell raised:\n{e}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
