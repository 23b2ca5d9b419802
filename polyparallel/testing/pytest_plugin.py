"""pytest plugin for the test suites of polyparallel plugins. Opt-in: nothing is loaded into a
pytest run unless the project asks for it, so installing polyparallel changes no other
project's tests. Enable it with ``-p polyparallel.testing.pytest_plugin`` (on the command line or
in ``addopts``) or ``pytest_plugins = ["polyparallel.testing.pytest_plugin"]`` in the root
``conftest.py``.

Everything it adds carries the ``polyparallel`` prefix, so a project that enables it keeps its
own ``--runslow`` option and ``slow`` marker:

- ``--polyparallel-slow`` (or ``POLYPARALLEL_SLOW=1``) runs the tests marked
  ``polyparallel_slow``, which are skipped otherwise;
- the ``polyparallel_multiprocess`` marker (tests that start real processes with real
  collectives; :class:`~polyparallel.testing.ConformanceSuite` carries it);
- two fixtures: ``polyparallel_clean`` (environment variables restored and every polyparallel
  session closed after the test) and ``polyparallel_run`` (launch a function on N real processes
  with a hard time limit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["MULTIPROCESS_MARKER", "SLOW_ENV", "SLOW_MARKER", "slow_enabled"]

#: The environment variable that runs ``polyparallel_slow`` tests (``POLYPARALLEL_SLOW=1``).
SLOW_ENV = "POLYPARALLEL_SLOW"
#: Tests marked with this are skipped unless ``--polyparallel-slow`` or ``POLYPARALLEL_SLOW=1``.
SLOW_MARKER = "polyparallel_slow"
#: Tests that start real processes with real collectives.
MULTIPROCESS_MARKER = "polyparallel_multiprocess"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("polyparallel")
    group.addoption("--polyparallel-slow", action="store_true", default=False, dest="polyparallel_slow",
                    help=f"run the tests marked {SLOW_MARKER} (or set {SLOW_ENV}=1)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{SLOW_MARKER}: long-running; run with --polyparallel-slow or {SLOW_ENV}=1")
    config.addinivalue_line("markers", f"{MULTIPROCESS_MARKER}: starts real processes with real collectives")


def slow_enabled(config: pytest.Config) -> bool:
    """Whether this run includes the ``polyparallel_slow`` tests (``--polyparallel-slow`` or
    ``POLYPARALLEL_SLOW=1``). A project's ``conftest.py`` can set ``config.option.polyparallel_slow``
    in ``pytest_configure`` to map an option of its own onto it."""
    return bool(config.getoption("polyparallel_slow", default=False)) or os.environ.get(SLOW_ENV) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if slow_enabled(config):
        return
    skip = pytest.mark.skip(reason=f"{SLOW_MARKER}: run with --polyparallel-slow or {SLOW_ENV}=1")
    for item in items:
        # The marker only: a test or class merely *named* like it is not skipped.
        if item.get_closest_marker(SLOW_MARKER) is not None:
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
