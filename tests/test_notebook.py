"""The quickstart notebook executes from top to bottom (on CPU: offloading inactive, and it says so)."""

import sys
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def cell_text(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", []))


def test_quickstart_notebook_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Appended to the in-memory copy only: proves the kernel runs this interpreter (and so this environment).
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # kernel "python3": jupyter_client launches specs whose command is "python" with sys.executable.
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()

    assert cell_text(notebook.cells[-1]).strip() == sys.executable
    text = "\n".join(cell_text(cell) for cell in notebook.cells)
    assert "bitwise identical: True" in text
    if torch.cuda.is_available():
        assert "activation offloading over" in text and "peak GPU memory" in text
    else:
        assert "offloading will be inactive" in text and "offloading was inactive" in text
