"""The quickstart notebook executes from top to bottom, with a figure and statistics, wherever Jupyter starts it.

Without a GPU the notebook runs the engine's CPU test mode, so its statistics and figure are real there too.
"""

import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def figure_count(cell: nbformat.NotebookNode) -> int:
    return sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))


def cell_text(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", []))


# The kernel's working directory depends on how the notebook is opened (its folder, an editor's workspace root, ...):
# the notebook must find the examples' helpers from inside and outside the clone.
@pytest.mark.parametrize("kernel_cwd", ["notebooks", "outside the repository"])
def test_quickstart_notebook_executes(kernel_cwd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ipykernel renders figures as image/png outputs (its inline backend) only when MPLBACKEND is unset.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Appended to the in-memory copy only: proves the kernel runs this interpreter (and so this environment).
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    working_directory = NOTEBOOK.parent if kernel_cwd == "notebooks" else tmp_path
    # kernel "python3": jupyter_client launches specs whose command is "python" with sys.executable.
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(working_directory)}}
    )
    client.execute()

    assert cell_text(notebook.cells[-1]).strip() == sys.executable
    text = "\n".join(cell_text(cell) for cell in notebook.cells)
    assert "bitwise identical: True" in text
    cells_with_figures = [cell for cell in notebook.cells if figure_count(cell)]
    # The first figure is the statistics', drawn below their printed summary.
    assert cells_with_figures and "activation offloading over" in cell_text(cells_with_figures[0])
    if torch.cuda.is_available():
        assert "peak GPU memory" in text
        assert sum(map(figure_count, notebook.cells)) == 2  # the statistics, and GPU memory over one step
    else:
        assert sum(map(figure_count, notebook.cells)) == 1
