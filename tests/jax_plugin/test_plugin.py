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
    monkeypatch.setitem(sys.modules, "polyparallel_torch.launchers.multiprocess", types.SimpleNamespace(
        launch_function=lambda fn, strategy, nprocs, *rest, **options: calls.append(("torch", nprocs)) or ["torch"] * nprocs))
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


def test_strategy_save_and_load_a_module_with_its_optimizer_and_loader(jax_strategy, tmp_path):
    # A plain loop's objects: an NNX module placed by wrap_model, an nnx.Optimizer, a ShardedArrays.
    import jax
    import optax
    from flax import nnx

    from polyparallel_jax.conformance import small_mlp

    def objects(strategy, seed):
        module = small_mlp(seed=seed)
        strategy.wrap_model(module)
        return module, nnx.Optimizer(module, optax.adam(1e-2), wrt=nnx.Param)

    written_at = jax_strategy(data=4, tensor=2, batch_size=16)
    module, optimizer = objects(written_at, 0)
    loader = written_at.shard_data(np.zeros((64, 12), np.float32))
    next(loader.batches(0))
    grads = jax.tree.map(lambda p: p * 0 + 1, nnx.state(module, nnx.Param))
    optimizer.update(module, grads)  # Adam moments and step no longer zero
    path = written_at.save(str(tmp_path / "ckpt"), model=module, optimizer=optimizer, loader=loader, lr=0.5)
    assert pp._checkpoints.read_marker(path)["runtime"] == "jax"

    read_at = jax_strategy(data=8, batch_size=16)
    other, other_optimizer = objects(read_at, 3)
    other_loader = read_at.shard_data(np.zeros((64, 12), np.float32))
    progress = read_at.load(path, model=other, optimizer=other_optimizer, loader=other_loader)
    assert progress == {"epoch": 0, "step": 1, "global_step": 1, "lr": 0.5}
    for a, b in zip(jax.tree.leaves((nnx.state(module), nnx.state(optimizer))),
                    jax.tree.leaves((nnx.state(other), nnx.state(other_optimizer)))):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    for leaf in jax.tree.leaves(nnx.state(other, nnx.Param)):  # each array kept the reading placement
        assert dict(leaf.sharding.mesh.shape)["data"] == 8
    assert len(list(other_loader.batches(0))) == len(other_loader) - 1  # continues after the saved batch
    with pytest.raises(pp.CheckpointError, match="optimizer= must be a flax.nnx.Optimizer.*GradientTransformation"):
        read_at.save(str(tmp_path / "ckpt"), model=other, optimizer=optax.adam(1e-2))


def test_the_core_asks_the_jax_hooks_only_on_the_jax_runtime(plugin_manager):
    # The hooks carry no session.runtime guard: the core leaves the JAX plugin out of every other
    # runtime's calls (checkpoints, launch and process_info included).
    served = plugin_manager.served_runtimes()
    assert served["jax"] == {"jax"}
    for hook in ("polyparallel_save_checkpoint", "polyparallel_load_checkpoint", "polyparallel_launch",
                 "polyparallel_process_info", "polyparallel_reduce_metrics"):
        on_torch = {impl.plugin_name for impl in plugin_manager._routed_caller(hook, "torch").get_hookimpls()}
        on_jax = {impl.plugin_name for impl in plugin_manager._routed_caller(hook, "jax").get_hookimpls()}
        assert "jax" not in on_torch and "jax" in on_jax, hook
