"""``plugins/polyparallel_torch/plugin.py``: the torch runtime's routing (its declaration: test_capabilities.py).

The core calls the torch hooks only for sessions (and launches) whose runtime is torch; the hooks
carry no guard of their own. The world below is two processes without ``MASTER_ADDR``: a torch
hook that answered another runtime's strategy would try to make a process group and fail on that
(the bug measured with ``backend="jax"`` strategies).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import polyparallel as pp
import polyparallel_torch.plugin as torch_plugin


class OtherRuntime:
    """A second runtime that owns nothing: what is left to it stays unanswered."""

    @pp.hookimpl
    def polyparallel_capabilities(self):
        return pp.Capabilities("other", axes={"data", "tensor", "pipeline"})


@pytest.fixture
def pm(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    manager = pp.PluginManager(autoload=False)
    manager.register(torch_plugin, name="torch")
    manager.register(OtherRuntime(), name="other")
    yield manager
    manager.close_sessions()


def test_no_torch_hook_answers_for_another_runtime(pm):
    strategy = pp.Strategy(data=2, runtime="other", plugin_manager=pm)
    model = nn.Linear(2, 2)
    data = TensorDataset(torch.zeros(4, 2))
    subjects = {"shard_data": DataLoader(data, batch_size=2), "wrap_model": model, "sync_grads": model,
                "sync_states": {"bn.running_mean": torch.zeros(2)}}
    for operation, subject in subjects.items():
        with pytest.raises(pp.NoPluginError, match=rf"handles {operation} for an object of type \S+( holding values of type torch\.\S+)? on the "
                                                   r"'other' runtime\..* torch objects belong to the 'torch' runtime, "
                                                   r"but this strategy runs on 'other': use Strategy\(runtime='torch'\)"):
            getattr(strategy, operation)(subject)
    with pytest.raises(pp.NoPluginError, match=r"for metrics with values of type builtins\.float on the 'other' "
                                               r"runtime"):
        strategy.reduce_metrics({"loss": 1.0})  # plain numbers: not torch's either, on another runtime
    assert strategy.session().runtime == "other"


class LaunchingRuntime(OtherRuntime):
    @pp.hookimpl
    def polyparallel_launch(self, fn, nprocs):
        return [f"other ran {fn.__name__}"] * nprocs


def test_the_core_asks_the_torch_plugin_only_for_torch(pm):
    assert pm.served_runtimes()["torch"] == {"torch"}
    pm.register(LaunchingRuntime(), name="launching-other")
    # Another runtime's launch reaches its plugin; the torch launcher (which would spawn) is never asked.
    assert pp.launch(repr, pp.Strategy(data=2, runtime="other", plugin_manager=pm), nprocs=2) == ["other ran repr"] * 2


def test_on_the_torch_runtime_the_hooks_answer(pm, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no process group needed
    strategy = pp.Strategy(data=1, runtime="torch", plugin_manager=pm)
    assert strategy.reduce_metrics({"loss": pp.Mean(6.0, 3)}) == {"loss": 2.0}
    model = nn.Linear(2, 2)
    assert strategy.sync_grads(model) is not None
