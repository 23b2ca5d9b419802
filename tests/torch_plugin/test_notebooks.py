"""The notebooks under ``examples/notebooks/``, executed headlessly through a real Jupyter kernel
(nbclient + ipykernel), as a user runs them: ``train`` is defined in a cell, ``pp.launch`` forks
its processes from the kernel, and the results come back to the notebook.

Each notebook's last cell prints one ``RESULT {json}`` line, asserted on here: the 2-process run
equals the same run in one process (same seed, same global batch, on 1,437 samples, which no
global batch divides). A kernel and two launches each: 40-60 s on a loaded 2-core machine, so the
torch notebook runs in the default suite and the fastai one with ``--runslow``; the faster check of
the same path is ``test_launch_interactive.py`` (``python -``).
"""

import json
import os

import pytest

# The torch notebook runs in the default suite (one real kernel, ~40 s); the fastai one is slow.
pytestmark = [pytest.mark.multiprocess]

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "notebooks")


def _execute(name):
    """Run the notebook in a fresh kernel; its outputs, and the ``RESULT`` it printed."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    # The kernel runs this interpreter (ipykernel's own kernel spec) with this environment.
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stdout")
    line = next(line for line in text.splitlines() if line.startswith("RESULT "))
    return text, json.loads(line[len("RESULT "):])


@pytest.mark.timeout(600)
def test_the_torch_notebook_trains_on_two_processes_like_one():
    text, result = _execute("torch_launch.ipynb")
    assert result["ranks"] == [0, 1] and result["ranks_agree"]
    assert result["steps"] == result["single_steps"] == 44  # 2 epochs of 22 full global batches of 64
    assert result["max_gap"] < 1e-5
    assert result["accuracy"] == pytest.approx(result["single_accuracy"], abs=1e-9) and result["accuracy"] > 0.8
    assert "44 steps, last loss" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_fastai_notebook_fits_learners_on_two_processes_like_one():
    pytest.importorskip("fastai")
    text, result = _execute("fastai_launch.ipynb")
    assert result["ranks"] == [0, 1] and result["ranks_agree"]
    assert result["names"] == ["train_loss", "valid_loss", "accuracy"] and result["epochs"] == 2
    assert result["max_gap"] < 1e-5  # the recorder's values at data=2 equal a single process's
    assert result["saved_exists"] and result["saved_same"]
    assert "'accuracy': " in text and "saved: " in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_lightning_notebook_fits_trainers_on_two_processes_like_one():
    pytest.importorskip("lightning")
    text, result = _execute("lightning_launch.ipynb")
    assert result["ranks"] == [0, 1] and result["world_sizes"] == [2, 2] and result["ranks_agree"]
    assert result["steps"] == result["single_steps"] == 44  # 2 epochs of 22 full global batches of 64
    assert result["max_gap"] < 1e-5  # the parameters at data=2 equal a single process's
    assert result["val_accuracy"] == pytest.approx(result["single_val_accuracy"], abs=1e-6)
    assert result["rows"] == result["single_rows"] == 360 and result["prediction_gap"] < 1e-5  # every row once, in order
    assert "44 steps, train loss" in text and "360 rows predicted" in text
