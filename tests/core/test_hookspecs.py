"""``polyparallel/hookspecs.py``: a meta-test of the plugin contract.

It fails when a hook is added without documentation (parameters, return meaning, firstresult
behaviour) or without a test that names it somewhere under ``tests/``.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

import pytest

import polyparallel as pp
from polyparallel import hookspecs

TESTS = Path(__file__).resolve().parents[1]

SPECS = {name: fn for name, fn in vars(hookspecs).items() if hasattr(fn, "polyparallel_spec")}
FIVE_OPERATIONS = ("shard_data", "wrap_model", "sync_grads", "reduce_metrics", "sync_states")


def is_firstresult(fn) -> bool:
    return bool(fn.polyparallel_spec.get("firstresult"))


def test_the_contract_is_there():
    assert len(SPECS) >= 10
    for operation in FIVE_OPERATIONS:
        assert is_firstresult(SPECS[f"polyparallel_{operation}"]), operation
    for registry in ("polyparallel_register_adapters", "polyparallel_capabilities", "polyparallel_session_start"):
        assert not is_firstresult(SPECS[registry]), registry


def test_every_public_function_of_the_module_is_a_spec():
    stray = [name for name, obj in vars(hookspecs).items()
             if name.startswith("polyparallel_") and inspect.isfunction(obj) and name not in SPECS]
    assert stray == [], f"functions that look like hooks but are not marked @hookspec: {stray}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_named_and_registered(name):
    assert name.startswith("polyparallel_")
    assert getattr(pp.PluginManager(autoload=False).hook, name).has_spec()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_documented(name):
    fn = SPECS[name]
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name} has no docstring"
    assert ":return:" in doc, f"{name}'s docstring does not say what its return value means (:return:)"
    for parameter in inspect.signature(fn).parameters:
        assert f":param {parameter}:" in doc, f"{name}'s docstring does not document {parameter!r} (:param {parameter}:)"
    if is_firstresult(fn):
        assert "Stops at first non-None result" in doc, f"{name} is firstresult but its docstring does not say so"


@functools.cache
def _test_sources() -> dict[Path, str]:
    this = Path(__file__).resolve()
    return {path: path.read_text(encoding="utf-8") for path in TESTS.rglob("*.py") if path.resolve() != this}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_tested(name):
    sources = _test_sources()
    users = [path.relative_to(TESTS) for path, text in sources.items() if re.search(rf"\b{name}\b", text)]
    assert users, f"no test under {TESTS} names {name}: add one for the new hook"
