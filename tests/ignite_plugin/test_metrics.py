"""Ignite's built-in metrics through the adapter: equal to single-process ignite on a data set that
does not divide over the ranks; the patch is narrow and reversible; a rank that skips a metric
reduction makes the others fail within the strategy's timeout instead of hanging."""

import re
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel_ignite import metrics as ignite_metrics_patch
from polyparallel_ignite.testing import float64_defaults, ignite_metrics, reference_metrics
from polyparallel_torch.testing import reference_dataset, reference_model, reference_plan

N = 37  # does not divide over 2 data ranks, nor into batches of 4
CLASSES = 4


def _comparable(metrics):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else float(v)) for k, v in metrics.items()}


# -- multi-process: data=2 x tensor=2, one launch -----------------------------------------------------------
def _metrics_worker():
    from ignite.engine import create_supervised_evaluator

    strategy = pp.Strategy(data=2, tensor=2, timeout=30)
    ignite = strategy.adapt("ignite")
    dataset = reference_dataset(N, torch.float64)
    loader = ignite.auto_dataloader(dataset, batch_size=8, remainder="uneven", shuffle=False)
    model = ignite.auto_model(reference_model(0, torch.float64), plan=reference_plan())
    evaluator = ignite.create_supervised_evaluator(model, ignite_metrics(CLASSES), data=loader)
    with float64_defaults():
        evaluator.run(loader)
        got = _comparable(evaluator.state.metrics)
        # By hand, outside an engine: the same reduction through data_group_world().
        accuracy = ignite_metrics()["accuracy"]
        for x, y in loader:
            accuracy.update((model(x), y))
        with ignite_metrics_patch.data_group_world(ignite.runtime, "manual accuracy"):
            manual = accuracy.compute()
        # A plain ignite evaluator, not attached: ignite's behaviour is untouched (world-wide
        # reduction, so the tensor replicas double count — the problem this plugin fixes).
        plain = create_supervised_evaluator(model, metrics=ignite_metrics(CLASSES), device=ignite.device)
        plain.run(loader)
    return {"rank": strategy.rank, "metrics": got, "manual": manual, "shard": len(loader.sampler),
            "plain_count": int(plain.state.metrics["confusion"].sum())}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_builtin_metrics_equal_single_process_on_uneven_data(run):
    reference = _comparable(reference_metrics(reference_model(0, torch.float64), reference_dataset(N, torch.float64),
                                              ignite_metrics(CLASSES)))
    results = run(_metrics_worker, pp.Strategy(data=2, tensor=2), 4, timeout=200)
    assert sorted(r["shard"] for r in results) == [18, 18, 19, 19]  # uneven shards, each sample once
    for r in results:
        got = r["metrics"]
        assert set(got) == set(reference)
        # Counts are integers: exact. Loss sums float64 values in another order: to 1e-12.
        assert got["confusion"] == reference["confusion"], r["rank"]
        assert sum(map(sum, got["confusion"])) == N
        assert got["accuracy"] == reference["accuracy"] and got["precision"] == reference["precision"]
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-12)
        assert r["manual"] == reference["accuracy"]
        assert r["plain_count"] == 2 * N  # unattached ignite: the world double counts tensor replicas


# -- fail fast ---------------------------------------------------------------------------------------
def _skip_worker(timeout):
    strategy = pp.Strategy(data=2, timeout=timeout)
    ignite = strategy.adapt("ignite")
    rank = strategy.rank
    dataset = reference_dataset(N)
    loader = ignite.auto_dataloader(dataset, batch_size=8, remainder="uneven", shuffle=False)
    model = ignite.auto_model(reference_model(0))
    skipper = rank == 1
    evaluator = ignite.create_supervised_evaluator(model, {} if skipper else ignite_metrics(), data=loader)
    start = time.monotonic()
    try:
        evaluator.run(loader)
        if skipper:
            # Busy elsewhere past the peer's timeout, then the next collective of the group.
            time.sleep(timeout + 1)
            start = time.monotonic()
            ignite.barrier("data")
    except pp.CollectiveError as exc:
        return {"rank": rank, "outcome": type(exc).__name__, "message": str(exc), "axis": exc.axis,
                "error_rank": exc.rank, "operation": exc.operation, "elapsed": time.monotonic() - start}
    return {"rank": rank, "outcome": "completed", "elapsed": time.monotonic() - start}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_skipping_a_metric_reduction_makes_every_rank_fail_fast(run):
    timeout = 3.0
    start = time.monotonic()
    waiter, skipper = run(_skip_worker, pp.Strategy(data=2), 2, timeout, timeout=90)
    assert time.monotonic() - start < 60
    assert waiter["outcome"] == "CollectiveTimeout", waiter
    assert waiter["elapsed"] < timeout + 5
    assert waiter["axis"] == "data" and waiter["error_rank"] == 0
    named = re.search(r"ignite metric '(\w+)' \((\w+)\.compute\)", waiter["message"])
    metrics = ignite_metrics()
    assert named and named.group(1) in metrics and type(metrics[named.group(1)]).__name__ == named.group(2)
    assert "rank 0" in waiter["message"] and "'data' axis" in waiter["message"]
    assert skipper["outcome"] in ("CollectiveError", "CollectiveTimeout"), skipper
    assert skipper["elapsed"] < timeout + 5 and skipper["axis"] == "data" and "rank 1" in skipper["message"]


# -- single process: the patch ---------------------------------------------------------------------------
def test_patch_is_reversible_and_leaves_other_engines_alone():
    from ignite.engine import create_supervised_evaluator
    from ignite.metrics import Metric

    original = Metric.__dict__["completed"]
    ignite_metrics_patch.uninstall()
    assert not ignite_metrics_patch.installed() and Metric.__dict__["completed"] is original
    ignite = pp.Strategy(data=1).adapt("ignite")  # installs
    assert ignite_metrics_patch.installed() and Metric.__dict__["completed"] is not original
    model = reference_model(0, torch.float64)
    dataset = reference_dataset(N, torch.float64)
    loader = ignite.auto_dataloader(dataset, batch_size=8, remainder="uneven", shuffle=False)
    attached = ignite.create_supervised_evaluator(model, ignite_metrics(CLASSES), data=loader)
    plain = create_supervised_evaluator(model, metrics=ignite_metrics(CLASSES))
    assert ignite_metrics_patch.is_registered(attached) and not ignite_metrics_patch.is_registered(plain)
    with float64_defaults():
        attached.run(loader)
        plain.run(torch.utils.data.DataLoader(dataset, batch_size=8))
    want = _comparable(plain.state.metrics)
    assert _comparable(attached.state.metrics) == want
    ignite_metrics_patch.uninstall()
    assert Metric.__dict__["completed"] is original
    with float64_defaults():
        attached.run(loader)  # still bound to the wrapper: behaves as ignite once unregistered
    assert _comparable(attached.state.metrics) == want
    ignite_metrics_patch.install()


def test_data_group_model_is_the_world_of_one_process():
    import ignite.distributed as idist

    from ignite.distributed import utils as idist_utils

    ignite = pp.Strategy(data=1).adapt("ignite")
    previous = idist_utils._model
    with ignite_metrics_patch.data_group_world(ignite.runtime) as model:
        # idist's calls now go to our model (ignite's own serial model would answer the same
        # numbers at world size 1, so the swap itself is what is checked)
        assert idist_utils._model is model and isinstance(model, ignite_metrics_patch.DataGroupModel)
        assert idist.get_world_size() == 1 and idist.get_rank() == 0 and idist.device() == ignite.device
        assert idist.all_reduce(3.0) == 3.0 and idist.all_gather(torch.tensor(2)).tolist() == [2]
    assert idist_utils._model is previous


def test_train_single_process_matches_plain_ignite():
    """World size 1: the adapter is the identity around ignite's own trainer."""
    from ignite.engine import create_supervised_trainer

    ignite = pp.Strategy(data=1, batch_size=8).adapt("ignite")
    dataset = reference_dataset(N)
    loader = ignite.auto_dataloader(dataset, shuffle=False)
    ours = ignite.auto_model(reference_model(0))
    opt = ignite.auto_optim(torch.optim.SGD(ours.parameters(), lr=0.1), ours)
    ignite.create_supervised_trainer(ours, opt, nn.functional.cross_entropy, data=loader).run(loader, max_epochs=2)
    plain = reference_model(0)
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    create_supervised_trainer(plain, popt, nn.functional.cross_entropy).run(
        torch.utils.data.DataLoader(dataset, batch_size=8), max_epochs=2)
    for a, b in zip(ours.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
