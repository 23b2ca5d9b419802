"""wrap_model for torch: options and plans are validated before any process group exists."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import polyparallel as pp
from polyparallel_torch.model import default_plan


def _strategy(monkeypatch, **sizes):
    # Rank 0 of a 2-process world that was never started: any collective would hang, so an error
    # raised here proves it came before one.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return pp.Strategy(**sizes, timeout=5)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))


def test_default_plan_pairs_column_and_row_layers():
    plan = default_plan(mlp())
    assert list(plan) == ["0", "2"]
    assert isinstance(plan["0"], ColwiseParallel) and isinstance(plan["2"], RowwiseParallel)


def test_default_plan_refuses_models_it_cannot_shard():
    with pytest.raises(TypeError, match="only for nn.Sequential"):
        default_plan(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="BatchNorm1d"):
        default_plan(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))


def test_plan_naming_a_missing_submodule(monkeypatch):
    s = _strategy(monkeypatch, data=1, tensor=2)
    with pytest.raises(pp.TopologyError, match="submodule 'encoder.fc'.*Submodules: 0, 1, 2"):
        s.wrap_model(mlp(), plan={"encoder.fc": ColwiseParallel()})


def test_plan_splitting_features_unevenly(monkeypatch):
    s = _strategy(monkeypatch, data=1, tensor=2)
    model = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 2))
    with pytest.raises(pp.TopologyError, match="7 features is not a multiple of 2"):
        s.wrap_model(model)


def test_tensor_with_pipeline_is_refused_and_declared(monkeypatch):
    s = _strategy(monkeypatch, data=1, pipeline=2, tensor=1).replace(tensor=2, data=-1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot combine pipeline=2 with tensor=2"):
        s.wrap_model(mlp(), loss_fn=nn.functional.cross_entropy)
    with pytest.raises(pp.UnsupportedTopologyError, match="'torch'.*cannot combine pipeline=2 with tensor=2"):
        s.check("torch")


def test_unknown_options_and_unknown_types(monkeypatch):
    s = _strategy(monkeypatch, data=2)
    with pytest.raises(pp.PluginError, match="unknown options"):
        s.wrap_model(mlp(), sharding="full")
    with pytest.raises(pp.NoPluginError, match="wrap_model .*builtins.dict"):
        s.wrap_model({"weights": [1, 2]})


def test_world_size_one_needs_no_process_group():
    model = mlp()
    s = pp.Strategy(data=1)
    wrapped = s.wrap_model(model)
    assert wrapped is model and not torch.distributed.is_initialized()
    assert s.sync_grads(wrapped) is wrapped
    assert s.reduce_metrics({"loss": pp.Mean(3.0, 2), "acc": torch.tensor(0.5)})["loss"] == 1.5


def test_metric_of_a_type_nobody_handles():
    with pytest.raises(pp.NoPluginError, match="reduce_metrics"):
        pp.Strategy(data=1).reduce_metrics({"loss": object()})  # a str is refused earlier, as a TypeError
