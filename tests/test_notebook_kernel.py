"""The notebook magics in a real Jupyter kernel (ipykernel, driven by nbclient as
``jupyter nbconvert --execute`` drives it): the report is shown under the cell as the HTML
page with the text beside it, a kept loss is named with its cell and line, and cells that end
with a tensor are named as the notebook's output history.

Skips where nbclient or ipykernel is missing (the ``test`` extra installs both).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("plotly", reason="the HTML report needs plotly (memsentry[html])")
nbformat = pytest.importorskip("nbformat", reason="the kernel test needs nbformat")
nbclient = pytest.importorskip("nbclient", reason="the kernel test needs nbclient")
pytest.importorskip("ipykernel", reason="the kernel test needs ipykernel")

from test_notebook import LEAKY as TEXT_LEAKY  # noqa: E402
from test_notebook import SETUP  # noqa: E402

#: The notebook the shell tests run, here without ``--text``: a kernel shows the page.
LEAKY = TEXT_LEAKY.replace("%%memsentry --text", "%%memsentry")


def _execute(cells: list[str]) -> list[list[dict[str, Any]]]:
    """Run ``cells`` as a notebook in a fresh kernel; each cell's outputs."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    return [cell.outputs for cell in notebook.cells]


def _shown(outputs: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [output["data"] for output in outputs if output["output_type"] == "display_data"]


@pytest.fixture(scope="module")
def outputs() -> list[list[dict[str, Any]]]:
    history = ["model(torch.randn(16, 32))"] * 8  # each result kept in Out[n]
    return _execute(["%load_ext memsentry", SETUP, LEAKY, "%memsentry start --text",
                     *history, "%memsentry stop", "%memsentry_report --text"])


def test_a_kept_loss_is_shown_under_its_cell_as_the_page(
        outputs: list[list[dict[str, Any]]]) -> None:
    (report,) = _shown(outputs[2])
    assert "<html" not in report["text/html"][:200].lower()  # a fragment inside the notebook
    assert "tensor-accumulation" in report["text/html"]
    text = report["text/plain"]
    assert "LEAK  tensor-accumulation: `losses` (a global of the notebook, In[3]:8)" in text
    assert "carry an autograd graph" in " ".join(text.split())


def test_cells_ending_with_a_tensor_are_the_output_history(
        outputs: list[list[dict[str, Any]]]) -> None:
    stop = len(outputs) - 2
    (report,) = _shown(outputs[stop])
    assert list(report) == ["text/plain"]  # --text: no page
    text = report["text/plain"]
    assert "LEAK  tensor-accumulation: `Out` (a global of the notebook)" in text
    assert "IPython's output history" in " ".join(text.split())  # the report folds lines
    (again,) = _shown(outputs[stop + 1])
    assert again["text/plain"] == text
    assert not [o for cell in outputs for o in cell if o["output_type"] == "error"]
