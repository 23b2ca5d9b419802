"""The plugin module: cheap import, capabilities, dispatch ownership, discovery by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import polyparallel as pp


def test_importing_the_plugin_imports_no_jax():
    code = "import polyparallel_jax.plugin, polyparallel_jax, sys; print('jax' in sys.modules, 'flax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


def test_capabilities_and_adapters(plugin_manager):
    caps = plugin_manager.capabilities()
    assert caps["jax"].axes == frozenset({"data", "tensor"})
    assert {"jax", "elegy"} <= set(plugin_manager.adapters())


def test_not_owned_objects_fall_through(jax_strategy):
    strategy = jax_strategy(data=8)
    with pytest.raises(pp.NoPluginError):
        strategy.reduce_metrics({"loss": 1.0})  # plain numbers are left to other runtimes
    with pytest.raises(pp.NoPluginError):
        strategy.shard_data(object())


def test_outside_shard_map_grads_and_states_are_global_values(jax_strategy):
    import jax.numpy as jnp

    strategy = jax_strategy(data=8)
    grads = {"w": jnp.ones((3,))}
    assert strategy.sync_grads(grads) is grads  # GSPMD already reduced a global loss's gradient
    assert float(strategy.reduce_metrics({"m": pp.Mean(jnp.asarray(6.0), jnp.asarray(3.0))})["m"]) == 2.0


def test_discovered_through_polyparallel_plugins_env(monkeypatch):
    monkeypatch.setenv("POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("POLYPARALLEL_PLUGINS", "polyparallel_jax.plugin")
    pm = pp.PluginManager()
    assert "jax" in pm.capabilities()
    data = pp.Strategy(data=-1, batch_size=16, plugin_manager=pm).shard_data(np.arange(40.0))
    assert data.runtime.data_size == 8 and len(data) == 3


@pytest.mark.parametrize("torch_first", [True, False], ids=["torch-registered-first", "jax-registered-first"])
def test_jax_launch_hook_runs_before_the_torch_launcher(monkeypatch, torch_first):
    # The torch plugin's launch accepts every strategy, so a JAX strategy reaches the JAX
    # launcher only if its hook is called first, whatever the registration order.
    import types

    import polyparallel_jax.launch
    import polyparallel_jax.plugin
    import polyparallel_torch.plugin

    pm = pp.PluginManager(autoload=False)
    plugins = [(polyparallel_torch.plugin, "torch"), (polyparallel_jax.plugin, "jax")]
    for module, name in plugins if torch_first else plugins[::-1]:
        pm.register(module, name=name)
    impls = pm.hook.polyparallel_launch.get_hookimpls()
    assert impls[-1].plugin is polyparallel_jax.plugin  # pluggy calls the last one first
    calls = []

    def torch_launch(*args, **kwargs):
        raise AssertionError("the torch launcher was called for a JAX strategy")

    monkeypatch.setitem(sys.modules, "polyparallel_torch.launch", types.SimpleNamespace(launch_function=torch_launch))
    monkeypatch.setattr(polyparallel_jax.launch, "launch_processes",
                        lambda fn, nprocs, **kwargs: calls.append((fn, nprocs)) or ["jax"] * nprocs)
    strategy = pp.Strategy(data=2, runtime="jax", plugin_manager=pm)
    assert pp.launch(print, strategy, nprocs=2) == ["jax", "jax"]
    assert calls == [(print, 2)]
