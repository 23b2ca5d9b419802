"""Multi-process JAX: processes joined by jax.distributed on 127.0.0.1 (gloo collectives).

The conformance contract across processes (data=2 on two processes, with a skipped collective;
data=4 on two processes of two devices) runs through the shared kit in ``test_conformance.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import polyparallel as pp
from polyparallel_jax.launch import launch_processes


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_failing_process_raises_launch_error_naming_it():
    # Topology(data="two") raises TopologyError in every process, after jax.distributed joined.
    with pytest.raises(pp.LaunchError, match=r"JAX process [01] of 2 failed(.|\n)*TopologyError"):
        launch_processes(pp.Topology, 2, kwargs={"data": "two"}, timeout=90)
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


def test_a_trace_dir_is_refused_before_any_process(jax_strategy, tmp_path):
    # The JAX runtime records no collectives: trace_dir= would be silently ignored.
    with pytest.raises(TypeError, match=r"the 'jax' runtime does not record its collectives"):
        pp.launch(pp.Topology, jax_strategy(data=2), 2, trace_dir=tmp_path / "trace")
    assert not (tmp_path / "trace").exists()
