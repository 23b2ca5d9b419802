"""`polyparallel demo` (the README's main job) through the torch entry, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_demo_torch_entry_trains_digits_on_two_processes():
    proc = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-m", "polyparallel.cli", "demo", "--only", "torch", "--json"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["framework"].startswith("pytorch") and "data=2" in row["topology"]
    assert row["accuracy"] > 0.9 and row["final_loss"] < 0.3 and row["step_time_ms"] > 0


def test_demo_unknown_entry_is_refused():
    proc = subprocess.run([sys.executable, "-m", "polyparallel.cli", "demo", "--only", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown demo entries ['nope']" in proc.stderr


def test_demo_torch_zero3_entry_trains_digits_with_fsdp2():
    proc = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-m", "polyparallel.cli", "demo", "--only", "torch-zero3",
         "--json"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert "zero=3 (FSDP2)" in row["framework"] and "data=2" in row["topology"]
    assert row["accuracy"] > 0.9 and row["final_loss"] < 0.3 and row["step_time_ms"] > 0
