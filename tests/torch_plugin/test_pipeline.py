"""Pipeline stages (torch.distributed.pipelining) through wrap_model, against one process."""

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.pipeline import split_sequential
from polyparallel_torch.testing import reference_model, stage_params

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
        loss = model.train_step(x, y)
        strategy.sync_grads(model)
        opt.step()
        losses.append(None if loss is None else float(loss))
    outputs = model(x_all[:per * data][d::data][:per])
    return {"coords": strategy.session().coords, "losses": losses,
            "stage": type(model.stage).__name__, "params": stage_params(model),
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
        losses.append(loss.item())
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
        # data=2: each stage replicated by FSDP2 over data (HSDP, shard dim of 1), not sync_grads
        assert r["stage"] == ("FSDPSequential" if data > 1 else "Sequential")
        for name, value in r["params"].items():  # stages keep the unsplit model's names
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64).reshape(ref_params[name].shape),
                                       ref_params[name].double(), rtol=1e-5, atol=1e-6)


def test_split_keeps_names_and_balances_parameters():
    model = reference_model(0)
    stages = split_sequential(model, 2)
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1", "2"], ["3", "4", "5"]]
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()
    assert [list(dict(s.named_children())) for s in split_sequential(model, 3, [1, 4])] == [["0"], ["1", "2", "3"],
                                                                                        ["4", "5"]]
    assert len(split_sequential(nn.Sequential(*[nn.ReLU() for _ in range(4)]), 4)) == 4


def test_split_errors_name_the_problem():
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        split_sequential(nn.Linear(2, 2), 2)
    with pytest.raises(pp.TopologyError, match="at least 3 children"):
        split_sequential(nn.Sequential(nn.ReLU(), nn.ReLU()), 3)
    with pytest.raises(pp.TopologyError, match=r"boundaries \[3, 2\]"):
        split_sequential(reference_model(0), 3, [3, 2])


def test_pipeline_bad_inputs_refused_before_any_collective(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = pp.Strategy(pipeline=2, data=1, timeout=5)
    with pytest.raises(pp.PluginError, match="loss_fn must be callable"):
        s.wrap_model(_model(), loss_fn="cross_entropy")
    with pytest.raises(pp.PluginError, match="needs an nn.Sequential"):
        s.wrap_model(nn.Linear(2, 2), loss_fn=nn.functional.mse_loss)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot combine pipeline=2 with tensor=2"):
        pp.Strategy(pipeline=2, tensor=2).check("torch")
