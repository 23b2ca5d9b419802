"""Multi-process JAX: processes joined by jax.distributed on 127.0.0.1 (gloo collectives).

The conformance contract across processes (data=2 on two processes, with a skipped collective;
data=4 on two processes of two devices) runs through the shared kit in ``test_conformance.py``.
``launch(trace_dir=)``: every process writes its host-side collectives (the trace).
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


def _reduce(skip: bool):
    """Two reduce_metrics of process-local numbers (gathered across the processes); with
    ``skip``, process 1 leaves after the first."""
    import jax

    from polyparallel_jax.conformance import plugin_manager

    strategy = pp.Strategy(data=2, timeout=5, runtime="jax", plugin_manager=plugin_manager())
    first = strategy.reduce_metrics({"loss": pp.Mean(float(jax.process_index()), 1)})  # first: every process
    if skip and jax.process_index() == 1:
        return first
    return strategy.reduce_metrics({"loss": pp.Mean(2.0, 1)})  # second: process 1 skips it when told


def _tests_on_path(monkeypatch):
    tests = str(Path(__file__).parents[1])  # the processes import the functions as jax_plugin.test_launch
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_launch_trace_dir_writes_every_processs_host_collectives(monkeypatch, tmp_path):
    from polyparallel import _trace_report
    from polyparallel_jax.conformance import plugin_manager

    _tests_on_path(monkeypatch)
    strategy = pp.Strategy(data=2, runtime="jax", plugin_manager=plugin_manager())
    assert pp.launch(_reduce, strategy, 2, args=(False,), trace_dir=tmp_path, timeout=120) == [{"loss": 2.0}] * 2
    traces = _trace_report.read_dir(str(tmp_path))
    assert sorted(traces) == [0, 1] and {t["header"]["world_size"] for t in traces.values()} == {2}
    for trace in traces.values():
        assert trace["header"]["reason"] == "exit" and trace["header"]["failure"] is None
        ops = [(e["operation"], e["axis"], e["state"]) for e in trace["entries"]]
        assert ops == [("reduce_metrics", "data", "done")] * 2, ops
        assert all(e["user"].endswith(f"test_launch.py:{_line('first: every process')}") for e in trace["entries"][:1])
        assert "array(s): float32[]" in trace["entries"][0]["detail"]
    header, rows = _trace_report.timeline(traces)
    assert header[-2:] == ["rank 0", "rank 1"] and len(rows) == 2 and not any(row[0] for row in rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_process_that_skips_a_collective_times_out_and_its_trace_shows_where(monkeypatch, tmp_path):
    from polyparallel import _trace_report
    from polyparallel_jax.conformance import plugin_manager

    _tests_on_path(monkeypatch)
    strategy = pp.Strategy(data=2, runtime="jax", plugin_manager=plugin_manager())
    with pytest.raises(pp.LaunchError, match=r"JAX process 0 of 2 failed(.|\n)*CollectiveTimeout: reduce_metrics over "
                                             r"axis 'data' timed out after 5 s"):
        pp.launch(_reduce, strategy, 2, args=(True,), trace_dir=tmp_path, timeout=120)
    traces = _trace_report.read_dir(str(tmp_path))
    assert traces[0]["header"]["failure"].startswith("reduce_metrics over axis 'data' timed out after 5 s")
    assert [e["state"] for e in traces[0]["entries"]] == ["done", "failed"]
    assert traces[0]["entries"][-1]["error"] == "timed out after 5 s"
    assert traces[0]["entries"][-1]["user"].endswith(f"test_launch.py:{_line('second: process 1 skips')}")
    assert [e["state"] for e in traces[1]["entries"]] == ["done"]
    _, rows = _trace_report.timeline(traces)
    assert rows[-1][0] == "!" and "[failed]" in rows[-1][4] and rows[-1][5] == "-", rows  # process 1 never came


def _different_metrics(case: str):
    """Process 0 reduces ``loss``, process 1 ``acc`` (``keys``) or ``loss`` of another shape
    (``shapes``), after a first reduce_metrics every process makes alike; returns what each raised."""
    import jax
    import jax.numpy as jnp

    from polyparallel_jax.conformance import plugin_manager

    strategy = pp.Strategy(data=2, timeout=60, runtime="jax", plugin_manager=plugin_manager())
    strategy.reduce_metrics({"loss": pp.Mean(1.0, 1)})
    mine = float(jax.process_index())
    try:
        if jax.process_index() == 0:
            strategy.reduce_metrics({"loss": mine})  # process 0: loss
        elif case == "keys":
            strategy.reduce_metrics({"acc": mine})  # process 1: acc
        else:
            strategy.reduce_metrics({"loss": jnp.full(3, mine)})  # process 1: loss[3]
    except pp.CollectiveError as exc:
        after = strategy.reduce_metrics({"loss": pp.Mean(mine, 1)})  # the processes are still in step
        return {"error": str(exc), "after": float(after["loss"])}
    return {"error": None}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["keys", "shapes"])
def test_processes_reducing_different_metrics_fail_at_once_naming_both(monkeypatch, case):
    # Before: process_allgather paired {"loss"} with {"acc"} by position and both returned the
    # mean of the two (0.5) under different names; the shapes case failed (or hung) inside XLA.
    import time

    from polyparallel_jax.conformance import plugin_manager

    _tests_on_path(monkeypatch)
    strategy = pp.Strategy(data=2, runtime="jax", plugin_manager=plugin_manager())
    started = time.monotonic()
    results = pp.launch(_different_metrics, strategy, 2, args=(case,), timeout=150)
    assert time.monotonic() - started < 50, "at once, not after the strategy's timeout of 60 s"
    theirs = "acc:mean[]" if case == "keys" else "loss:mean[3]"
    at0, at1 = _line("process 0: loss"), _line("process 1: acc" if case == "keys" else "process 1: loss[3]")
    for process, result in enumerate(results):
        error = result["error"]
        assert error is not None, results
        first = error.splitlines()[0]
        assert first.startswith(f"reduce_metrics over the 'data' axis refused on rank {process} (JAX process "
                                f"{process} of 2): the processes reduce different metrics"), error
        assert (f"{{loss:mean[]}} on process 0 vs {{{theirs}}} on process 1 (called at test_launch.py:{at0} and "
                f"test_launch.py:{at1})") in first, error
        assert "no value was exchanged" in error, error
        assert result["after"] == 0.5, results


def _different_states():
    """Process 0 synchronises ``bn.running_mean``, process 1 ``bn.running_var`` (both ``mean`` by
    the default rules, the same shape), after a first sync_states every process makes alike;
    returns what each raised and a later sync_states' result."""
    import jax
    import jax.numpy as jnp

    from polyparallel_jax.conformance import plugin_manager

    strategy = pp.Strategy(data=2, timeout=60, runtime="jax", plugin_manager=plugin_manager())
    strategy.sync_states({"bn": {"running_mean": jnp.ones(3)}})
    mine = jnp.full(3, float(jax.process_index()))
    try:
        if jax.process_index() == 0:
            strategy.sync_states({"bn": {"running_mean": mine}})  # process 0: running_mean
        else:
            strategy.sync_states({"bn": {"running_var": mine}})  # process 1: running_var
    except pp.CollectiveError as exc:
        after = strategy.sync_states({"bn": {"running_mean": mine}})  # the processes are still in step
        return {"error": str(exc), "after": [float(v) for v in after["bn"]["running_mean"]]}
    return {"error": None}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_processes_synchronising_different_states_fail_at_once_naming_both(monkeypatch):
    # Before: process_allgather paired running_mean with running_var by position and both
    # processes returned the mean of the two (0.5) under different names.
    import time

    from polyparallel_jax.conformance import plugin_manager

    _tests_on_path(monkeypatch)
    strategy = pp.Strategy(data=2, runtime="jax", plugin_manager=plugin_manager())
    started = time.monotonic()
    results = pp.launch(_different_states, strategy, 2, timeout=150)
    assert time.monotonic() - started < 50, "at once, not after the strategy's timeout of 60 s"
    at0, at1 = _line("process 0: running_mean"), _line("process 1: running_var")
    for process, result in enumerate(results):
        error = result["error"]
        assert error is not None, results
        first = error.splitlines()[0]
        assert first.startswith(f"sync_states over the 'data' axis refused on rank {process} (JAX process "
                                f"{process} of 2): the processes synchronise different states"), error
        assert (f"{{bn.running_mean:mean[3]float32}} on process 0 vs {{bn.running_var:mean[3]float32}} on process 1 "
                f"(called at test_launch.py:{at0} and test_launch.py:{at1})") in first, error
        assert "no value was exchanged" in error, error
        assert result["after"] == [0.5, 0.5, 0.5], results


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line(" not in line)


@pytest.mark.timeout(120)
def test_a_function_of_a_notebook_or_python_stdin_is_refused_before_any_process(tmp_path):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import polyparallel as pp

        def train():
            return 1

        try:
            pp.launch(train, pp.Strategy(data=-1, runtime="jax"), nprocs=2)
        except pp.LaunchError as exc:
            print("REFUSED", exc)
    """)
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=100,
                          cwd=str(tmp_path))
    assert "REFUSED launch(): train is defined in an interactive __main__" in done.stdout, done.stderr[-2000:]
    assert "the 'jax' runtime starts fresh interpreters (JAX cannot be forked" in done.stdout
    assert "Put the function (and what it uses) in a file" in done.stdout
