"""The pytest plugin is opt-in and namespaced: installing polyparallel changes no other project's
test run, and a project that enables the plugin keeps its own ``--runslow`` and ``slow`` marker.

Each check runs pytest for real, in a subprocess of this environment (the one polyparallel is
installed in), on a scratch project or on this suite.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: pytest's documented example ("Control skipping of tests according to command line option").
RUNSLOW_CONFTEST = '''
import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="run slow tests"
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: mark test as slow to run")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        # --runslow given in cli: do not skip slow tests
        return
    skip_slow = pytest.mark.skip(reason="need --runslow option to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
'''

SCRATCH_TESTS = '''
import pytest


def test_func_fast():
    pass


@pytest.mark.slow
def test_func_slow():
    pass
'''

#: Tests of a project that enabled the plugin: its markers and fixtures.
PLUGIN_TESTS = '''
import os

import pytest


@pytest.mark.polyparallel_slow
def test_polyparallel_slow():
    pass


@pytest.mark.polyparallel_multiprocess
def test_marked_multiprocess():
    pass


def test_clean_env_writes(polyparallel_clean):
    os.environ["SCRATCH_LEFTOVER"] = "1"


def test_clean_env_restored():
    assert "SCRATCH_LEFTOVER" not in os.environ
'''

#: Variables that would change how a pytest subprocess starts, whatever the test asks for.
PYTEST_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "POLYPARALLEL_SLOW")


def _outcomes(result) -> dict[str, int]:
    """``{"passed": 1, "skipped": 1}`` from pytest's summary line; fails with the output if the
    run did not get as far as running tests."""
    output = result.stdout + result.stderr
    assert result.returncode in (0, 5), f"pytest exited with {result.returncode}:\n{output}"
    summary = output.strip().splitlines()[-1]
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)}


@pytest.fixture
def pytest_run(python, monkeypatch):
    """``pytest_run(*args, env={...})``: ``python -m pytest ARGS`` in the scratch directory."""
    for name in PYTEST_ENV:
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, **env: str):
        return python("-m", "pytest", "-p", "no:cacheprovider", "-rs", *args, timeout=120, **env)

    return run


def _scratch_project(path: Path, **files: str) -> None:
    (path / "pytest.ini").write_text("[pytest]\n")  # the project's own rootdir and settings
    (path / "conftest.py").write_text(RUNSLOW_CONFTEST)
    for name, text in files.items():
        (path / f"{name}.py").write_text(textwrap.dedent(text))


def test_no_pytest11_entry_point_is_installed():
    """Without one, pytest loads nothing of polyparallel unless a project asks for it."""
    ours = [f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group="pytest11")
            if ep.value.split(".")[0] == "polyparallel"]
    assert ours == [], f"polyparallel is installed with a pytest11 entry point: {ours}; reinstall it"


def test_a_project_with_its_own_runslow_runs_as_without_polyparallel(python, pytest_run):
    _scratch_project(python.cwd, test_scratch=SCRATCH_TESTS)
    plain = pytest_run()
    assert "need --runslow option to run" in plain.stdout, plain.stdout
    assert _outcomes(plain) == {"passed": 1, "skipped": 1}
    assert _outcomes(pytest_run("--runslow")) == {"passed": 2}
    # polyparallel's variable is not a switch of this project, nor is its option an option here.
    assert _outcomes(pytest_run(POLYPARALLEL_SLOW="1")) == {"passed": 1, "skipped": 1}
    unknown = pytest_run("--polyparallel-slow")
    assert unknown.returncode == 4 and "unrecognized arguments: --polyparallel-slow" in unknown.stderr, unknown.stderr


def test_an_opted_in_project_keeps_its_runslow_and_gets_namespaced_additions(python, pytest_run):
    _scratch_project(python.cwd, test_scratch=SCRATCH_TESTS, test_plugin=PLUGIN_TESTS)
    plugin = ("-p", "polyparallel.testing.pytest_plugin")
    # Its own option and marker, untouched; the plugin's marker is skipped by the plugin's rule.
    default = pytest_run(*plugin)
    assert _outcomes(default) == {"passed": 4, "skipped": 2}
    assert "need --runslow option to run" in default.stdout
    assert "polyparallel_slow: run with --polyparallel-slow or POLYPARALLEL_SLOW=1" in default.stdout
    assert _outcomes(pytest_run(*plugin, "--runslow")) == {"passed": 5, "skipped": 1}
    assert _outcomes(pytest_run(*plugin, "--polyparallel-slow")) == {"passed": 5, "skipped": 1}
    assert _outcomes(pytest_run(*plugin, POLYPARALLEL_SLOW="1")) == {"passed": 5, "skipped": 1}
    assert _outcomes(pytest_run(*plugin, "--runslow", "--polyparallel-slow")) == {"passed": 6}
    # The markers are registered: strict marker checking accepts them.
    assert _outcomes(pytest_run(*plugin, "--strict-markers", "test_plugin.py")) == {"passed": 3, "skipped": 1}
    # Enabled from the root conftest instead of the command line: the same.
    conftest = python.cwd / "conftest.py"
    conftest.write_text('pytest_plugins = ["polyparallel.testing.pytest_plugin"]\n' + RUNSLOW_CONFTEST)
    assert _outcomes(pytest_run()) == {"passed": 4, "skipped": 2}


@pytest.mark.slow
def test_marked_slow(request):
    """Run by the test below only: it runs only when the suite was asked for slow tests."""
    config = request.config
    assert config.getoption("--runslow") or config.getoption("polyparallel_slow") or os.environ["POLYPARALLEL_SLOW"] == "1"


def test_this_suite_runs_slow_tests_with_runslow_or_the_variable(python, pytest_run):
    """This suite's ``--runslow`` (tools/test.sh --runslow) maps onto the plugin's switch."""
    python.cwd = ROOT  # this repository: its pyproject's addopts and tests/conftest.py
    target = f"{Path(__file__).relative_to(ROOT)}::test_marked_slow"
    assert _outcomes(pytest_run(target)) == {"skipped": 1}
    assert _outcomes(pytest_run(target, "--runslow")) == {"passed": 1}
    assert _outcomes(pytest_run(target, POLYPARALLEL_SLOW="1")) == {"passed": 1}
    assert _outcomes(pytest_run(target, "--polyparallel-slow")) == {"passed": 1}
