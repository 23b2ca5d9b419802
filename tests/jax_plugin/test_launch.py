"""Multi-process JAX: 2 processes joined by jax.distributed on 127.0.0.1 (gloo collectives)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import polyparallel as pp
from polyparallel_jax import conformance
from polyparallel_jax.launch import launch_processes


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_conformance_data2_across_two_processes_and_skipped_collective_fails():
    reports = launch_processes(conformance.multiprocess_suite, 2, args=(dict(data=2), True),
                               devices_per_process=1, timeout=180)
    assert [r["process"] for r in reports] == [0, 1]
    for report in reports:
        assert report["training"] < 1e-5 and report["grads"] < 1e-5
        assert report["metrics"]["across_processes"] == pytest.approx(report["metrics"]["expected"], abs=1e-5)
        assert sum(report["shards"]["shard_sizes"]) == 203
    message = reports[0]["timeout"]
    assert "reduce_metrics" in message and "'data'" in message and "rank 0" in message
    assert reports[1]["timeout"] is None


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fit_on_two_processes_of_two_devices_matches_single_device():
    reports = launch_processes(conformance.multiprocess_suite, 2, args=(dict(data=-1),), devices_per_process=2,
                               timeout=240)
    assert all(r["topology"] == "Topology(pipeline=1, data=4, tensor=1)" for r in reports)
    assert all(r["training"] < 1e-5 for r in reports)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_failing_process_raises_launch_error_naming_it():
    with pytest.raises(pp.LaunchError, match=r"JAX process [01] of 2 failed"):
        launch_processes(conformance.check_unsupported_topology, 2, args=("not a plugin manager",), timeout=90)


def _chatty(megabytes):
    """Print more than a pipe buffer holds (64 KiB), then return."""
    import sys

    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        sys.stdout.write(line)
    sys.stdout.flush()
    return megabytes


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_process_printing_megabytes_is_not_blocked(monkeypatch):
    # Old code: output went to a pipe read only after exit, so the process blocked once it was full
    # and the launch ended as "did not finish".
    tests = str(Path(__file__).parents[1])  # the processes import _chatty as jax_plugin.test_launch
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
    assert launch_processes(_chatty, 2, args=(2,), timeout=90) == [2, 2]
