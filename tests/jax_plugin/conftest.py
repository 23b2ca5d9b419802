"""JAX tests: 8 forced CPU devices, the JAX plugin registered explicitly (``slow`` tests are
skipped by the root conftest's rule, as everywhere in the suite).

XLA_FLAGS must be set before jax is first imported, so this conftest sets it at import time
(pytest imports conftests before the test modules).
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

import polyparallel as pp  # noqa: E402
import polyparallel_jax.plugin  # noqa: E402

if jax.device_count() < 8:  # jax was imported before this conftest (another test folder)
    pytest.skip(f"JAX tests need 8 CPU devices; jax was initialised with {jax.device_count()}. "
                "Run tests/jax_plugin in its own pytest process.", allow_module_level=True)


@pytest.fixture(scope="session")
def plugin_manager() -> pp.PluginManager:
    """A plugin manager with only the JAX plugin (works before the entry point is installed)."""
    pm = pp.PluginManager(autoload=False)
    pm.register(polyparallel_jax.plugin, name="jax")
    return pm


@pytest.fixture
def jax_strategy(plugin_manager: pp.PluginManager):
    """``jax_strategy(data=8)`` -> a JAX strategy on the test plugin manager."""
    def make(**kwargs):
        return pp.Strategy(**kwargs, runtime="jax", plugin_manager=plugin_manager)
    return make


TOPOLOGIES = [dict(data=8), dict(data=4, tensor=2)]
