"""Both ways to start a run, with the example script: Lightning's own launcher
(``Trainer(devices=2)``, ``lightning.pytorch``), then ``polyparallel launch`` (torchrun,
``pytorch_lightning``) resuming from the first run's checkpoint: Lightning detects the external
launcher and starts no process of its own."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_fit.py"


def _results(command, cwd, limit=170):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(["timeout", "-k", "10", str(limit), *command], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=limit + 30)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def test_lightning_launcher_then_polyparallel_launch_resumes_across_namespaces(tmp_path):
    first = _results([sys.executable, str(EXAMPLE), "--devices", "2", "--max-epochs", "1",
                      "--out", str(tmp_path / "first")], tmp_path)
    assert [r["rank"] for r in first] == [0, 1], "Lightning's launcher must start exactly one more process"
    for r in first:
        assert r["world_size"] == 2 and not r["external_launch"] and r["namespace"] == "lightning.pytorch"
        assert r["topology"] == "Topology(pipeline=1, data=2, tensor=1)"
        assert r["global_step"] == 23  # 1437 samples / 64 a global step, padded
    assert [r["coords"]["data"] for r in first] == [0, 1]
    assert first[0]["train_loss"] == first[1]["train_loss"], "sync_dist gave ranks different epoch losses"
    checkpoints = sorted(os.listdir(tmp_path / "first" / "checkpoints"))
    assert checkpoints == ["epoch=0-step=23.ckpt", "last.ckpt"]
    with open(tmp_path / "first" / "logs" / "version_0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("train_loss_epoch")]
    assert float(logged[-1]["train_loss_epoch"]) == pytest.approx(first[0]["train_loss"], rel=1e-6)

    second = _results([sys.executable, "-m", "polyparallel.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE),
                       "--namespace", "pytorch_lightning", "--max-epochs", "2", "--out", str(tmp_path / "second"),
                       "--resume", str(tmp_path / "first" / "checkpoints" / "last.ckpt")], tmp_path)
    assert [r["rank"] for r in second] == [0, 1], "Lightning must not launch again under torchrun"
    for r in second:
        assert r["external_launch"] and r["world_size"] == 2 and r["namespace"] == "pytorch_lightning"
        assert r["global_step"] == 46 and r["epochs"] == 2, "the run did not resume from epoch 1"
        assert r["train_loss"] < first[0]["train_loss"]
    assert sorted(os.listdir(tmp_path / "second" / "checkpoints")) == ["epoch=1-step=46.ckpt", "last.ckpt"]
