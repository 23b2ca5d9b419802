"""examples/deepspeed_train.py under `polyparallel launch` (torchrun): ZeRO 2 over data=2, and
DeepSpeed's pipeline engine inside ignite Engines (pipeline=2 x data=2)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("ignite")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "deepspeed_train.py"
TEST_SET = 360  # 20% of scikit-learn's 1,797 digits


def _run(nprocs, *args, limit=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "10", str(limit), sys.executable, "-m", "polyparallel.cli", "launch",
                           "--nproc-per-node", str(nprocs), str(EXAMPLE), "--epochs", "3", *args],
                          capture_output=True, text=True, env=env, timeout=limit + 30)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line.split("RESULT", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    return sorted(rows, key=lambda r: r["rank"])


def test_zero2_data2():
    rows = _run(2, "--zero", "2")
    assert [r["zero"] for r in rows] == [2, 2]
    metrics = [r["metrics"] for r in rows]
    assert metrics[0] == metrics[1] and metrics[0]["evaluated"] == TEST_SET and metrics[0]["accuracy"] > 0.85


def test_pipeline2_data2_in_ignite():
    rows = _run(4, "--pipeline", "2", "--zero", "0", "--ignite")
    assert [r["metrics"] is None for r in rows] == [True, True, False, False]  # metrics live on the last stage
    assert rows[2]["metrics"]["accuracy"] == rows[3]["metrics"]["accuracy"] > 0.85
