"""Whole-suite settings, applied before any test folder imports a framework.

JAX reads ``XLA_FLAGS`` once, at its first import: the JAX tests need 8 CPU devices, so the flag
is set here, before any other folder imports jax.

polyparallel's pytest plugin is enabled for this suite by ``addopts`` in ``pyproject.toml`` (it is
opt-in: see :mod:`polyparallel.testing.pytest_plugin`). This suite keeps its own short names on
top of it: ``--runslow`` (same as ``--polyparallel-slow``; ``POLYPARALLEL_SLOW=1`` works too) runs
the tests marked ``slow``, and ``multiprocess`` marks tests that start real processes.
"""

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from polyparallel.testing.pytest_plugin import MULTIPROCESS_MARKER, SLOW_MARKER  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="run the tests marked slow (this suite's name for --polyparallel-slow)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running; run with --runslow or POLYPARALLEL_SLOW=1")
    config.addinivalue_line("markers", "multiprocess: starts real processes with real collectives")
    if config.getoption("--runslow"):
        config.option.polyparallel_slow = True  # the plugin's switch: one skip rule for the suite


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This suite's ``slow``/``multiprocess`` marks are the plugin's, so its skip rule applies
    (this hook runs before the plugin's)."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(SLOW_MARKER)
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(MULTIPROCESS_MARKER)


@pytest.fixture(autouse=True)
def _clean(polyparallel_clean):
    """Every test: environment restored and polyparallel sessions closed afterwards."""
    yield


@pytest.fixture
def run(polyparallel_run):
    """``run(fn, strategy, nprocs, *args, timeout=240)``: real processes, hard time limit."""
    return polyparallel_run
