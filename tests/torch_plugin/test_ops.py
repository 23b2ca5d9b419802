"""sync_grads, reduce_metrics and sync_states on real gloo process groups."""

import math

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch import no_sync

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _grad_worker():
    s = pp.Strategy(data=2, timeout=20, grad_policy=pp.GradPolicy(bucket_mb=0.0001))  # ~100-byte buckets
    rank = s.rank
    torch.manual_seed(0)
    x_all, y_all = torch.randn(8, 6), torch.randn(8, 1)
    x, y = x_all[rank * 4:(rank + 1) * 4], y_all[rank * 4:(rank + 1) * 4]
    out = {}
    # 1. a bare module: bucketed all-reduce equals the full-batch gradient
    torch.manual_seed(1)
    bare = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    reference = [p.detach().clone() for p in bare.parameters()]
    nn.functional.mse_loss(bare(x), y).backward()
    s.sync_grads(bare)
    out["bare"] = [p.grad.clone() for p in bare.parameters()]
    # 2. a list of gradient tensors works the same
    grads = [torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank)]
    s.sync_grads(grads)
    out["list"] = [g.clone() for g in grads]
    # 3. DDP: sync_grads is a no-op that answers; no_sync accumulates locally
    torch.manual_seed(1)
    ddp = s.wrap_model(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1)))
    with no_sync(ddp):
        nn.functional.mse_loss(ddp(x[:2]), y[:2]).backward()
    nn.functional.mse_loss(ddp(x[2:]), y[2:]).backward()
    assert s.sync_grads(ddp) is ddp
    out["ddp_accumulated"] = [p.grad.clone() for p in ddp.parameters()]
    return out, reference, x_all, y_all


def test_sync_grads_bucketed_ddp_and_no_sync(run):
    results = run(_grad_worker, pp.Strategy(data=2), 2)
    (out0, reference, x_all, y_all), (out1, _, _, _) = results
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    nn.functional.mse_loss(model(x_all), y_all).backward()
    want = [p.grad for p in model.parameters()]
    for got in (out0["bare"], out1["bare"]):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert [g.tolist() for g in out0["list"]] == [[0.5] * 3, [[1.0, 1.0], [1.0, 1.0]]]
    # accumulation: sum over two micro-batches of per-micro-batch means, averaged over ranks
    model.zero_grad()
    for r in range(2):
        xs, ys = x_all[r * 4:(r + 1) * 4], y_all[r * 4:(r + 1) * 4]
        (nn.functional.mse_loss(model(xs[:2]), ys[:2]) / 2).backward()
        (nn.functional.mse_loss(model(xs[2:]), ys[2:]) / 2).backward()
    for got in (out0["ddp_accumulated"], out1["ddp_accumulated"]):
        for g, w in zip(got, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _metric_worker():
    s = pp.Strategy(data=2, timeout=20, metric_policy=pp.MetricPolicy("mean", {"worst": "max", "best": "min",
                                                                                  "samples": "sum"}))
    rank = s.rank
    counts = [3, 5][rank]
    totals = [3 * 1.0, 5 * 2.0][rank]  # a mean of 1.0 over 3 samples, of 2.0 over 5 samples
    got = s.reduce_metrics({
        "loss": pp.Mean(totals, counts),
        "plain": float(rank),
        "worst": 10.0 + rank, "best": 10.0 + rank, "samples": counts,
        "vector": torch.tensor([1.0, 2.0]) * (rank + 1),
        "empty_shard": pp.Mean(0.0, 0),
    })
    mismatch = None
    try:  # rank 1 passes another name: an error naming the ranks, not a hang or a wrong number
        s.reduce_metrics({"loss": 1.0} if rank == 0 else {"accuracy": 1.0})
    except pp.CollectiveError as exc:
        mismatch = str(exc)
    return got, mismatch


def test_reduce_metrics_count_weighted_with_ops(run):
    for got, mismatch in run(_metric_worker, pp.Strategy(data=2), 2):
        assert got["loss"] == pytest.approx(13.0 / 8)  # not (1.0 + 2.0) / 2
        assert got["plain"] == 0.5 and got["worst"] == 11.0 and got["best"] == 10.0 and got["samples"] == 8.0
        assert got["vector"].tolist() == [1.5, 3.0]
        assert math.isnan(got["empty_shard"])
        # both sides named, on every rank: the first reduction was #1 of the data axis
        assert "reduce_metrics #2 (loss:mean[1]) on rank 0" in mismatch, mismatch
        assert "reduce_metrics #2 (accuracy:mean[1]) on rank 1" in mismatch, mismatch


def _states_worker():
    s = pp.Strategy(data=2, timeout=20, state_policy={"0.bias": "local"})
    rank = s.rank
    torch.manual_seed(rank)  # replicas start different on purpose
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))
        model[1].running_var.fill_(1.0 + 2 * rank)
    before_bias = model[0].bias.clone()
    s.sync_states(model)
    states = {"w": model[0].weight.clone(), "bias": model[0].bias.clone(), "before_bias": before_bias,
              "mean": model[1].running_mean.clone(), "var": model[1].running_var.clone(),
              "count": int(model[1].num_batches_tracked)}
    mapping = {"ema": torch.tensor([float(rank)]), "rng_state": torch.tensor([7.0 + rank])}
    s.sync_states(mapping)
    states["ema"], states["rng"] = float(mapping["ema"]), float(mapping["rng_state"])
    return states


def test_sync_states_follows_policy(run):
    r0, r1 = run(_states_worker, pp.Strategy(data=2), 2)
    assert torch.equal(r0["w"], r1["w"])  # broadcast from data rank 0
    assert torch.equal(r0["bias"], r0["before_bias"]) and not torch.equal(r0["bias"], r1["bias"])  # local
    assert r0["mean"].tolist() == r1["mean"].tolist() == [0.5, 0.5]  # mean
    assert r0["var"].tolist() == [2.0, 2.0]
    assert r0["ema"] == r1["ema"] == 0.0  # unmatched name: default broadcast
    assert (r0["rng"], r1["rng"]) == (7.0, 8.0)  # *rng*: local
