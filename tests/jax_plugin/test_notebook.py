"""``examples/notebooks/jax_fit.ipynb`` executed headlessly through a real Jupyter kernel (nbclient +
ipykernel): JAX runs on 8 CPU devices in the kernel itself (the notebook sets ``XLA_FLAGS`` before
importing jax), and ``Model.fit`` at data=4 x tensor=2 equals the same fit on one device, on 1,437
rows that do not divide over the data axis. ~15 s (a kernel and three fits) on the loaded machine."""

import json
import os

import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "notebooks")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_jax_notebook_fits_on_eight_devices_like_one():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(os.path.join(NOTEBOOKS, "jax_fit.ipynb"), as_version=4)
    # The kernel is a fresh interpreter: this process's jax (8 devices from conftest) is not shared.
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stdout")
    result = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert result["devices"] == 8 and result["mesh"] == {"pipeline": 1, "data": 4, "tensor": 2}
    assert result["kernel_spec"] == ["None", "tensor"]  # the first layer really is split over tensor
    assert result["epochs"] == 2 and result["loss_gap"] < 1e-5 and result["accuracy_gap"] < 1e-6
    assert result["evaluate_gap"] < 1e-5 and result["rows"] == 360 and result["prediction_gap"] < 1e-5
    assert "8 cpu devices; 1437 training rows" in text
