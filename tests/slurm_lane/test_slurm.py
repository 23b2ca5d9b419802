"""A real SLURM (tools/test-slurm.sh starts it): srun and sbatch jobs equal `polyparallel launch`
(plain torch, and the Lightning and Ignite adapters)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(os.environ.get("POLYPARALLEL_SLURM_LANE") != "1" or not os.environ.get("SLURM_CONF"),
                                 reason="the SLURM lane: bash tools/test-slurm.sh")]

HERE = Path(__file__).resolve().parent
TORCH = HERE / "train_torch.py"
LIGHTNING = HERE / "train_lightning.py"
IGNITE = HERE / "train_ignite.py"


def _rows(command, limit=150):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["timeout", "-k", "10", str(limit), *command], capture_output=True, text=True, env=env,
                          timeout=limit + 30)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", done.stdout)]
    return sorted(rows, key=lambda r: r["rank"])


def _launch(nproc, *args):
    return _rows([sys.executable, "-m", "polyparallel.cli", "launch", "--nproc-per-node", str(nproc), *args])


def _same(a, b):
    assert [r["rank"] for r in a] == [r["rank"] for r in b]
    for x, y in zip(a, b):
        assert len(x["losses"]) == len(y["losses"]) > 0
        assert all(abs(p - q) <= 1e-6 for p, q in zip(x["losses"], y["losses"])), (x, y)
        assert abs(x["params"] - y["params"]) <= 1e-6, (x, y)


@pytest.mark.timeout(200)
def test_srun_four_tasks_equal_polyparallel_launch():
    got = _rows(["srun", "-n", "4", sys.executable, str(TORCH), "2"])  # data=2 x tensor=2
    assert [(r["rank"], r["world"], r["slurm"]) for r in got] == [(i, 4, str(i)) for i in range(4)]
    _same(got, _launch(4, str(TORCH), "2"))


def _sbatch_two_tasks(tmp_path, script_path):
    """An ``sbatch --wait`` job of 2 tasks on one node (``srun`` in the batch script): its rows."""
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --output={out}\n"
                      f"srun {sys.executable} {script_path}\n")
    done = subprocess.run(["sbatch", "--wait", str(script)], capture_output=True, text=True, timeout=180)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text
    got = sorted((json.loads(m) for m in re.findall(r"RESULT (\{.*\})", text)), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["slurm"]) for r in got] == [(0, 2, "0"), (1, 2, "1")], text[-3000:]
    return got


@pytest.mark.timeout(200)
def test_sbatch_two_tasks_equal_polyparallel_launch(tmp_path):
    _same(_sbatch_two_tasks(tmp_path, TORCH), _launch(2, str(TORCH)))


@pytest.mark.timeout(200)
def test_lightning_sbatch_two_tasks_equal_polyparallel_launch(tmp_path):
    pytest.importorskip("lightning")
    got = _sbatch_two_tasks(tmp_path, LIGHTNING)
    # The adapter's cluster environment, not Lightning's SLURMEnvironment (which it picks on its own under srun).
    assert "SLURMEnvironment" not in {r["environment"] for r in got}, got
    _same(got, _launch(2, str(LIGHTNING)))


@pytest.mark.timeout(200)
def test_ignite_sbatch_two_tasks_equal_polyparallel_launch(tmp_path):
    pytest.importorskip("ignite")
    _same(_sbatch_two_tasks(tmp_path, IGNITE), _launch(2, str(IGNITE)))


@pytest.mark.timeout(200)
def test_one_launcher_per_node_under_srun():
    got = _rows(["srun", "-n", "1", sys.executable, "-m", "polyparallel.cli", "launch", "--nproc-per-node", "2",
                 str(TORCH)])
    assert [(r["rank"], r["world"]) for r in got] == [(0, 2), (1, 2)]
    _same(got, _launch(2, str(TORCH)))


@pytest.mark.timeout(120)
def test_contradicting_ranks_are_refused_before_any_collective():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    # --kill-on-bad-exit: task 1's refusal ends the step (task 0's ranks agree, so without it task 0
    # would wait for its peer until the rendezvous timeout).
    done = subprocess.run(["srun", "--kill-on-bad-exit=1", "-n", "2", sys.executable, str(TORCH)], capture_output=True,
                          text=True, env=env, timeout=100)
    assert done.returncode != 0
    assert "two launchers disagree on its rank" in done.stderr
