"""Whole-suite settings, applied before any test folder imports a framework.

JAX reads ``XLA_FLAGS`` once, at its first import: the JAX tests need 8 CPU devices, so the flag
is set here, before any other folder (or a plugin loaded through an entry point) imports jax.
"""

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(polyparallel_clean):
    """Every test: environment restored and polyparallel sessions closed afterwards."""
    yield


@pytest.fixture
def run(polyparallel_run):
    """``run(fn, strategy, nprocs, *args, timeout=240)``: real processes, hard time limit."""
    return polyparallel_run
