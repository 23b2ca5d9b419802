"""examples/ignite_train.py (Megatron tensor parallel, pipeline) under both launchers:
`polyparallel launch` (torchrun) and ignite's own `idist.Parallel`."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ignite_train.py"
TEST_SET = 360  # 20% of scikit-learn's 1,797 digits


def _run(args, limit=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "10", str(limit), *args], capture_output=True, text=True, env=env,
                          timeout=limit + 30)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line.split("RESULT", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    return sorted(rows, key=lambda r: r["rank"]), proc.stdout


def test_megatron_data2_tensor2_under_polyparallel_launch():
    rows, out = _run([sys.executable, "-m", "polyparallel.cli", "launch", "--nproc-per-node", "4", str(EXAMPLE),
                      "--tensor", "2", "--epochs", "3"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    metrics = [r["metrics"] for r in rows]
    # Reduced over the data group only: each test sample counted once, not once per tensor replica.
    assert all(m["evaluated"] == TEST_SET for m in metrics)
    assert all(m["accuracy"] == metrics[0]["accuracy"] and m["loss"] == metrics[0]["loss"] for m in metrics)
    assert metrics[0]["accuracy"] > 0.85
    # Tensor replicas see the same batches and hold the same (replicated) loss; data ranks differ.
    assert metrics[0]["last_train_loss"] == metrics[1]["last_train_loss"]
    assert metrics[2]["last_train_loss"] == metrics[3]["last_train_loss"]
    assert out.count("epoch 3: accuracy") == 1  # the logger rank only


def test_pipeline2_under_idist_parallel():
    rows, out = _run([sys.executable, str(EXAMPLE), "--idist", "2", "--pipeline", "2", "--epochs", "3"])
    assert [r["coords"]["pipeline"] for r in rows] == [0, 1]
    first, last = rows[0]["metrics"], rows[1]["metrics"]
    assert first is None  # stage 0 holds no outputs: it computes no metric and waits for nobody
    assert last["evaluated"] == TEST_SET and last["accuracy"] > 0.85
    assert "epoch 3: accuracy" in out
