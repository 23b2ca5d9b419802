"""Fixtures for the core's tests: a clean environment, a hermetic plugin manager, fake
installed distributions (as pluggy's own tests do), and a runner for subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import polyparallel as pp
from polyparallel import _manager

#: Variables read by the core (and by the launchers it mimics); a test never sees leftovers.
ENV_KNOBS = (
    "POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD",
    "POLYPARALLEL_PLUGINS",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
)


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start every test without the core's knobs and restore ``os.environ`` afterwards, even
    when the code under test writes it directly. Also forget the process's default plugin
    manager so no test sees another test's plugins or sessions."""
    for name in ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_manager, "_default", None)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def manager() -> Iterator[pp.PluginManager]:
    """A plugin manager that loads no entry point: only what a test registers."""
    pm = pp.PluginManager(autoload=False)
    yield pm
    pm.close_sessions()


# -- fake installed distributions -------------------------------------------------------------


class FakeEntryPoint:
    """What ``importlib.metadata`` yields for ``[project.entry-points.polyparallel]``."""

    def __init__(self, name: str, load: Callable[[], Any], group: str = "polyparallel"):
        self.name, self.group, self.value = name, group, f"fake_{name}_module"
        self._load = load
        self.loads = 0

    def load(self) -> Any:
        self.loads += 1
        return self._load()


class FakeDistribution:
    def __init__(self, name: str, version: str, entry_points: Sequence[FakeEntryPoint]):
        self.metadata = {"Name": name}
        self.version = version
        self.entry_points = tuple(entry_points)


class FakeInstall:
    """Replaces the installed distributions; counts how often they are scanned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.distributions: list[FakeDistribution] = []
        self.scans = 0
        monkeypatch.setattr(_manager.importlib.metadata, "distributions", self._distributions)

    def _distributions(self) -> Iterator[FakeDistribution]:
        self.scans += 1
        return iter(list(self.distributions))

    def add(self, name: str, plugin_or_loader: Any, *, dist: str | None = None, version: str = "1.0",
            group: str = "polyparallel") -> FakeEntryPoint:
        """Install a distribution with one entry point. ``plugin_or_loader`` is the plugin object,
        or an exception instance its import raises."""
        def load() -> Any:
            if isinstance(plugin_or_loader, BaseException):
                raise plugin_or_loader
            return plugin_or_loader
        ep = FakeEntryPoint(name, load, group)
        self.distributions.append(FakeDistribution(dist or f"{name}-dist", version, [ep]))
        return ep


@pytest.fixture
def fake_install(monkeypatch: pytest.MonkeyPatch) -> FakeInstall:
    """Fake installed distributions: only those a test adds exist."""
    return FakeInstall(monkeypatch)


# -- subprocesses -----------------------------------------------------------------------------


class PythonRunner:
    """Runs ``python ARGS`` in a fresh interpreter of this venv, from a temporary directory (not
    the repository, so the installed package is what gets imported), with a clean environment."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.executable = sys.executable

    def env(self, **overrides: str) -> dict[str, str]:
        """The current environment without the core's knobs, plus ``overrides``."""
        env = {k: v for k, v in os.environ.items() if k not in ENV_KNOBS}
        env["OMP_NUM_THREADS"] = "1"
        env.update(overrides)
        return env

    def __call__(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        return self.command(self.executable, *args, timeout=timeout, **env)

    def command(self, *argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """Run any program (a console script of the venv) the same way."""
        return subprocess.run(list(argv), cwd=self.cwd, env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout)

    def script(self, code: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``code`` (a small program); fails the test with its stderr if it fails."""
        result = self("-c", code, **env)
        assert result.returncode == 0, f"subprocess failed ({result.returncode}):\n{result.stderr}"
        return result


@pytest.fixture
def python(tmp_path: Path) -> PythonRunner:
    """Run this venv's Python in a subprocess: ``python("-m", "polyparallel.cli", "plan", ...)``."""
    return PythonRunner(tmp_path)
