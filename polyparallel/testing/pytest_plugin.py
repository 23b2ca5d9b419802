"""pytest plugin for polyparallel and its plugins' test suites (entry point ``pytest11``).

Adds ``--runslow`` (or ``POLYPARALLEL_SLOW=1``) for tests marked ``slow``, registers the
``multiprocess`` marker, and two fixtures: ``polyparallel_clean`` (environment variables restored
and every polyparallel session closed after the test) and ``polyparallel_run`` (launch a function
on N real processes with a hard time limit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: long-running; run with --runslow or POLYPARALLEL_SLOW=1")
    config.addinivalue_line("markers", "multiprocess: starts real processes with real collectives")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if config.getoption("--runslow") or os.environ.get("POLYPARALLEL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or POLYPARALLEL_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def polyparallel_clean() -> Iterator[None]:
    """Restore ``os.environ`` and close every session of the default plugin manager afterwards."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        from polyparallel import get_plugin_manager

        get_plugin_manager().close_sessions()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def polyparallel_run() -> Any:
    """``polyparallel_run(fn, strategy, nprocs, *args, timeout=240)``: run ``fn(*args)`` on
    ``nprocs`` processes through :func:`polyparallel.launch`; results by rank. The time limit
    makes a hang fail this test instead of the whole run."""
    from polyparallel import launch

    def run(fn: Any, strategy: Any, nprocs: int, *args: Any, timeout: float = 240) -> list[Any]:
        return launch(fn, strategy, nprocs, args=args, timeout=timeout)

    return run
