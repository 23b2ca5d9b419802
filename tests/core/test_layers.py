"""The layer rules of ``pyproject.toml`` (``[tool.importlinter]``), checked by import-linter.

``tools/test.sh`` runs ``lint-imports`` itself; this test runs the same contracts inside pytest
(so ``pytest tests/core`` alone catches an import that breaks a layer or closes a cycle) and
checks that every package of the tree is covered, so a new plugin cannot escape the rules.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the rules are checked on the CI's Python

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["name"]: c for c in CONFIG["contracts"]}


def packages() -> set[str]:
    """Every top-level package of the project: the core, the built-in plugins, the example plugin."""
    found = {"polyparallel"} | {p.name for p in (REPO / "plugins").iterdir() if (p / "__init__.py").exists()}
    found |= {p.name for p in (REPO / "examples/third_party_plugin/src").iterdir() if (p / "__init__.py").exists()}
    return found


def test_every_package_is_under_the_layer_rules():
    assert set(CONFIG["root_packages"]) == packages()
    assert set(CONTRACTS["No import cycle inside any package"]["ancestors"]) == packages()
    plugins = packages() - {"polyparallel"}
    assert set(CONTRACTS["The core imports no plugin"]["forbidden_modules"]) == plugins
    runtimes = set(CONTRACTS["Runtimes import no framework adapter"]["source_modules"])
    adapters = set(CONTRACTS["Runtimes import no framework adapter"]["forbidden_modules"])
    independent = set(CONTRACTS[next(n for n in CONTRACTS if n.startswith("Adapters import no other adapter"))]["modules"])
    assert runtimes | independent == plugins and not runtimes & independent
    assert adapters == independent - {"polyparallel_records"}  # the example plugin is nobody's dependency
    assert CONFIG["exclude_type_checking_imports"] is True  # annotation-only imports never run


@pytest.mark.skipif(shutil.which("lint-imports") is None and not (Path(sys.executable).parent / "lint-imports").exists(),
                    reason="import-linter is not installed (pip install 'polyparallel[test]')")
def test_the_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    run = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    report = run.stdout[run.stdout.find("Contracts"):] + run.stderr
    assert run.returncode == 0, report
    assert "BROKEN" not in run.stdout and f"{len(CONTRACTS)} kept, 0 broken" in run.stdout, report
