"""Shared helpers of the Ignite plugin tests. Multi-process tests launch real gloo processes
through ``polyparallel.launch`` with a hard time limit; scenarios are grouped per launch, since
a launch costs a few seconds of process start-up on a 2-core machine."""

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("ignite")

import polyparallel as pp  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(polyparallel_clean, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    yield


@pytest.fixture
def run():
    """``run(fn, strategy, nprocs, *args)``: launch ``fn(*args)`` on ``nprocs`` processes with a
    hard time limit; results by rank."""

    def launch(fn, strategy, nprocs, *args, timeout=180):
        return pp.launch(fn, strategy, nprocs, args=args, timeout=timeout)

    return launch
