"""The plugin module: cheap import, capabilities, dispatch ownership, discovery by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import polyparallel as pp
import polyparallel_jax.plugin


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
        strategy.shard_data(object())
    with pytest.raises(pp.NoPluginError):
        strategy.sync_grads([1.0, 2.0])


def test_plain_metrics_of_a_jax_strategy_reduce_on_jax():
    # Measured before: with torch and JAX installed, a JAX strategy's plain numbers went to the
    # torch runtime, which failed on MASTER_ADDR. Now the strategy's runtime decides.
    import polyparallel_torch.plugin

    pm = pp.PluginManager(autoload=False)
    pm.register(polyparallel_torch.plugin, name="torch")
    pm.register(polyparallel_jax.plugin, name="jax")
    strategy = pp.Strategy(data=8, runtime="jax", plugin_manager=pm)
    assert strategy.session().runtime == "jax" and strategy.world_size == 8  # devices, not processes
    assert strategy.reduce_metrics({"loss": 1.0, "acc": pp.Mean(6.0, 3)}) == {"loss": 1.0, "acc": 2.0}


def test_the_jax_hooks_answer_only_on_the_jax_runtime():
    import jax.numpy as jnp

    import polyparallel_torch.plugin

    pm = pp.PluginManager(autoload=False)
    pm.register(polyparallel_jax.plugin, name="jax")
    pm.register(polyparallel_torch.plugin, name="torch")
    on_torch = pp.Strategy(data=1, runtime="torch", plugin_manager=pm)
    assert on_torch.session().world_size == 1  # process_info: JAX did not count its devices
    wrong_runtime = r"on the 'torch' runtime.*jax(lib)? objects belong to the 'jax' runtime, but this strategy runs on " \
                    r"'torch': use Strategy\(runtime='jax'\)"
    with pytest.raises(pp.NoPluginError, match=r"for an object of type numpy\.ndarray on the 'torch' runtime"):
        on_torch.shard_data(np.arange(8.0))
    for operation in ("sync_grads", "sync_states"):
        with pytest.raises(pp.NoPluginError, match=wrong_runtime):
            getattr(on_torch, operation)(jnp.ones(3))
    with pytest.raises(pp.NoPluginError, match=r"metrics with values of type jax.*" + wrong_runtime):
        on_torch.reduce_metrics({"loss": jnp.asarray(1.0)})


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
def test_each_launcher_answers_only_for_its_runtime(monkeypatch, torch_first):
    # Whatever the registration (and so call) order, the strategy's runtime picks the launcher.
    import types

    import polyparallel_jax.launch
    import polyparallel_torch.plugin

    pm = pp.PluginManager(autoload=False)
    plugins = [(polyparallel_torch.plugin, "torch"), (polyparallel_jax.plugin, "jax")]
    for module, name in plugins if torch_first else plugins[::-1]:
        pm.register(module, name=name)
    calls = []
    monkeypatch.setitem(sys.modules, "polyparallel_torch.launch", types.SimpleNamespace(
        launch_function=lambda fn, strategy, nprocs, *rest: calls.append(("torch", nprocs)) or ["torch"] * nprocs))
    monkeypatch.setattr(polyparallel_jax.launch, "launch_processes",
                        lambda fn, nprocs, **kwargs: calls.append(("jax", nprocs)) or ["jax"] * nprocs)
    assert pp.launch(print, pp.Strategy(data=2, runtime="jax", plugin_manager=pm), nprocs=2) == ["jax", "jax"]
    assert pp.launch(print, pp.Strategy(data=2, runtime="torch", plugin_manager=pm), nprocs=2) == ["torch", "torch"]
    # The automatic choice: the only runtime whose framework is imported; with both, torch (priority).
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert pp.launch(print, pp.Strategy(data=2, plugin_manager=pm), nprocs=2) == ["jax", "jax"]
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    pm.register(types.SimpleNamespace(), name="any-change")  # a change of plugins: chosen again
    assert pp.launch(print, pp.Strategy(data=2, plugin_manager=pm), nprocs=2) == ["torch", "torch"]
    assert calls == [("jax", 2), ("torch", 2), ("jax", 2), ("torch", 2)]
