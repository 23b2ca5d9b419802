"""The fastai plugin's registration, its refusals of bad input (before any process or collective
starts), the Learner left as fastai made it, and every plugin importing together."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel_fastai.testing import make_learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data(n: int = 11) -> TensorDataset:
    torch.manual_seed(0)
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def test_registered_with_capabilities() -> None:
    adapters = pp.get_plugin_manager().adapters()
    caps = adapters["fastai"].capabilities
    assert caps.axes == {"data"} and caps.runtimes == {"torch", "xla"}
    assert adapters["fastai"].plugin == "fastai"


@pytest.mark.parametrize("sizes", [{"data": 1, "tensor": 2}, {"data": 2, "pipeline": 2}])
def test_unsupported_topology_refused_before_launch(sizes: dict[str, int]) -> None:
    strategy = pp.Strategy(**sizes)
    with pytest.raises(pp.UnsupportedTopologyError, match="'fastai'"):
        strategy.adapt("fastai")
    with pytest.raises(pp.UnsupportedTopologyError):
        pp.launch(print, strategy, strategy.topology.world_size, runtime="fastai", timeout=30)


def test_adapt_options_refused() -> None:
    with pytest.raises(TypeError, match="takes no options"):
        pp.Strategy(data=1).adapt("fastai", batch_size=8)


def test_batch_size_not_dividing_refused_before_launch() -> None:
    with pytest.raises(pp.TopologyError, match="does not divide over data=2"):
        pp.launch(print, pp.Strategy(data=-1, batch_size=7), 2, runtime="fastai", timeout=30)
    with pytest.raises(pp.TopologyError, match="does not divide"):
        pp.Strategy(data=2, batch_size=7)


def test_unpicklable_factory_refused_before_launch() -> None:
    def train(strategy: pp.Strategy) -> None:  # nested: pickle cannot name it
        raise AssertionError("never runs")

    with pytest.raises(TypeError, match="must be picklable"):
        pp.launch(train, pp.Strategy(data=2), 2, args=(pp.Strategy(data=2),), runtime="fastai", timeout=30)
    with pytest.raises(TypeError, match="must be picklable"):
        pp.launch(print, pp.Strategy(data=2), 2, args=(lambda: None,), timeout=30)


class _Counter:
    """Counts the operations dispatched (hook wrappers around the five operations)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @pp.hookimpl(wrapper=True)
    def polyparallel_wrap_model(self) -> Any:
        self.calls.append("wrap_model")
        return (yield)

    @pp.hookimpl(wrapper=True)
    def polyparallel_sync_states(self) -> Any:
        self.calls.append("sync_states")
        return (yield)

    @pp.hookimpl(wrapper=True)
    def polyparallel_reduce_metrics(self) -> Any:
        self.calls.append("reduce_metrics")
        return (yield)


def test_unsupported_metric_refused_before_any_operation(polyparallel_clean: Any) -> None:
    from fastai.learner import Metric

    class Median(Metric):  # a metric whose state the adapter cannot combine
        def reset(self) -> None:
            self.values: list[float] = []

        def accumulate(self, learn: Any) -> None:
            self.values.append(float(learn.loss))

        @property
        def value(self) -> float:
            return sorted(self.values)[len(self.values) // 2]

    counter = _Counter()
    pm = pp.get_plugin_manager()
    pm.register(counter, name="fastai-test-counter")
    try:
        strategy = pp.Strategy(data=1, timeout=10)
        learn = make_learner(_data(), _data(), nn.Linear(4, 2), 4, cbs=[strategy.adapt("fastai")], metrics=[Median()])
        with pytest.raises(TypeError, match=r"cannot make the metric 'median' \(Median\) global"):
            learn.validate()
    finally:
        pm.unregister(counter)
    assert counter.calls == []
    assert isinstance(learn.model, nn.Linear)


def test_learner_is_left_as_fastai_made_it(polyparallel_clean: Any) -> None:
    """While attached, learn.save/load are the callback's; removed, the Learner's own again, and
    its loaders, model and recorder are the user's objects throughout."""
    from fastai.learner import AvgSmoothLoss, Learner

    strategy = pp.Strategy(data=1, timeout=10, batch_size=4)
    cb = strategy.adapt("fastai")
    learn = make_learner(_data(), _data(), nn.Linear(4, 2), 4)
    train, valid, model, smooth = learn.dls.train, learn.dls.valid, learn.model, learn.recorder.smooth_loss
    with cb.distrib_ctx(learn):
        assert learn.save == cb.save and learn.load == cb.load
        learn.fit(1)
        assert learn.model is model and learn.dls.train is train and learn.dls.valid is valid
        assert learn.recorder.smooth_loss is smooth and type(smooth) is AvgSmoothLoss
    assert "save" not in learn.__dict__ and "load" not in learn.__dict__
    assert learn.save.__func__ is Learner.save and cb not in learn.cbs
    learn.fit(1)  # plain fastai again
    assert learn.model is model


def test_every_plugin_imports_together() -> None:
    """The environment `pip install 'polyparallel[all]'` (tools/env.sh) builds: every plugin and
    its framework import in one fresh interpreter (fastai's torchvision once broke
    `import pytorch_lightning` there)."""
    import importlib.util

    missing = [m for m in ("pytorch_lightning", "lightning", "ignite", "jax", "flax") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not the [all] environment: {missing} not installed")
    code = (
        "import importlib.metadata as md, importlib\n"
        "eps = [ep for ep in md.entry_points(group='polyparallel')]\n"
        "names = sorted(ep.name for ep in eps)\n"
        "for ep in eps: ep.load()\n"
        "import pytorch_lightning, lightning.pytorch, ignite.engine, jax, flax\n"
        "import fastai.basics, fastai.tabular.all, fastai.text.all, fastai.metrics\n"
        "import polyparallel as pp\n"
        "print(names, sorted(pp.get_plugin_manager().adapters()))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "plugins"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("torch", "lightning", "ignite", "fastai", "jax"):
        assert f"'{name}'" in proc.stdout, proc.stdout
