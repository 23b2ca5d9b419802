"""Pipeline stages (torch.distributed.pipelining) through wrap_model, against one process."""

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.pipeline import split_sequential

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)


def _pipeline_worker(data, steps):
    strategy = pp.Strategy(pipeline=2, data=data, timeout=30)
    x_all, y_all = _data()
    model = strategy.wrap_model(_model(), loss_fn=nn.functional.cross_entropy, microbatches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d, per = strategy.session().coords["data"], 8 // data
    losses = []
    for step in range(steps):
        batch = slice(step * 8, (step + 1) * 8)
        x, y = x_all[batch][d::data], y_all[batch][d::data]  # what shard_data would hand this replica
        opt.zero_grad()
        loss = model.step(x, y)
        strategy.sync_grads(model)
        opt.step()
        losses.append(None if loss is None else float(loss))
    outputs = model(x_all[:per * data][d::data][:per])
    return {"coords": strategy.session().coords, "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "start": split_sequential(_model(), 2)[strategy.session().coords["pipeline"]][0],
            "outputs": None if outputs is None else outputs.detach()}


def _reference(steps):
    x_all, y_all = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = x_all[step * 8:(step + 1) * 8], y_all[step * 8:(step + 1) * 8]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return model, losses


@pytest.mark.parametrize("data", [1, 2])
def test_pipeline_training_matches_one_process(run, data):
    results = run(_pipeline_worker, pp.Strategy(pipeline=2, data=data), 2 * data, data, 3)
    model, ref_losses = _reference(3)
    ref_params = dict(model.named_parameters())
    for r in results:
        last = r["coords"]["pipeline"] == 1
        if last and data == 1:
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert (r["outputs"] is not None) == last
        for name, value in r["params"].items():
            layer, leaf = name.split(".")
            torch.testing.assert_close(value, ref_params[f"{int(layer) + r['start']}.{leaf}"], rtol=1e-5, atol=1e-6)


def test_split_sequential_balances_and_validates():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2), nn.ReLU())
    assert split_sequential(model, 2) == [(0, 1), (1, 4)]
    assert split_sequential(model, 2, [2]) == [(0, 2), (2, 4)]
    with pytest.raises(pp.TopologyError, match="split_points"):
        split_sequential(model, 2, [0])


def test_pipeline_bad_inputs_refused_before_any_collective(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = pp.Strategy(pipeline=2, data=1, timeout=5)
    with pytest.raises(pp.PluginError, match="loss_fn"):
        s.wrap_model(_model())
    with pytest.raises(pp.PluginError, match="needs an nn.Sequential"):
        s.wrap_model(nn.Linear(2, 2), loss_fn=nn.functional.mse_loss)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot combine pipeline=2 with tensor=2"):
        pp.Strategy(pipeline=2, tensor=2).check("torch")
