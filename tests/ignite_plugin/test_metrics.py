"""Ignite's built-in metrics through the adapter: equal to single-process ignite on a data set that
does not divide over the ranks (``Frequency`` included); only the engines handed to the adapter
change, and ``detach`` gives them back as ignite made them; a rank that skips a metric reduction
makes the others fail within the strategy's timeout instead of hanging."""

import re
import time

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_ignite import metrics as ignite_metrics_patch
from polyparallel_ignite.testing import float64_defaults, ignite_metrics, reference_metrics
from polyparallel_torch.testing import reference_dataset, reference_model, reference_plan

N = 37  # does not divide over 2 data ranks, nor into batches of 4
CLASSES = 4


def _comparable(metrics):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else float(v)) for k, v in metrics.items()}


class _OneSecond:
    """A clock that always reads one second: ``Frequency`` becomes a pure count."""

    def value(self):
        return 1.0


def _frequency():
    """ignite's ``Frequency`` (items per second; the items are the batch's targets) on a fixed
    clock, so its value is ``sum(items) / mean(elapsed)`` = the number of samples counted."""
    from ignite.metrics import Frequency

    class FixedClockFrequency(Frequency):
        def reset(self):
            super().reset()
            self._timer = _OneSecond()

    return FixedClockFrequency(output_transform=lambda output: len(output[1]))


# -- multi-process: data=2 x tensor=2, one launch -----------------------------------------------------------
def _metrics_worker():
    import ignite.distributed as idist
    from ignite.engine import create_supervised_evaluator
    from ignite.metrics import RunningAverage

    strategy = pp.Strategy(data=2, tensor=2, timeout=30)
    ignite = strategy.adapt("ignite")
    dataset = reference_dataset(N, torch.float64)
    loader = ignite.auto_dataloader(dataset, batch_size=8, remainder="uneven", shuffle=False)
    model = ignite.auto_model(reference_model(0, torch.float64), plan=reference_plan())
    evaluator = ignite.create_supervised_evaluator(model, ignite_metrics(CLASSES), data=loader)
    # Frequency overrides Metric.completed and runs at every iteration; attached after attach().
    _frequency().attach(evaluator, "frequency")
    # RunningAverage reduces in update() (iteration_completed): the average of the world size
    # its update sees is the size of the world it reduces over.
    RunningAverage(output_transform=lambda output: torch.tensor(float(idist.get_world_size()))).attach(
        evaluator, "world_seen")
    with float64_defaults():
        evaluator.run(loader)
        got = _comparable(evaluator.state.metrics)
        frequency, world_seen = got.pop("frequency"), got.pop("world_seen")
        # By hand, outside an engine: the same reduction through data_group_world().
        accuracy = ignite_metrics()["accuracy"]
        for x, y in loader:
            accuracy.update((model(x), y))
        with ignite_metrics_patch.data_group_world(ignite.runtime, "manual accuracy"):
            manual = accuracy.compute()
        # A plain ignite evaluator, not attached: ignite's behaviour is untouched (world-wide
        # reduction, so the tensor replicas double count — the problem this plugin fixes).
        plain = create_supervised_evaluator(model, metrics={**ignite_metrics(CLASSES), "frequency": _frequency()},
                                            device=ignite.device)
        plain.run(loader)
    return {"rank": strategy.rank, "metrics": got, "manual": manual, "shard": len(loader.sampler),
            "frequency": frequency, "world_seen": world_seen, "plain_count": int(plain.state.metrics["confusion"].sum()),
            "plain_frequency": plain.state.metrics["frequency"]}


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
        assert r["frequency"] == N, "Frequency must count every sample once, over the data group"
        assert r["world_seen"] == 2.0, "RunningAverage must reduce over the data group"
        # unattached ignite: the world double counts tensor replicas
        assert r["plain_count"] == 2 * N and r["plain_frequency"] == 2 * N


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


# -- single process: only the engines handed over change ----------------------------------------------
def _handlers(engine):
    return {event: [handler for handler, _, _ in entries] for event, entries in engine._event_handlers.items()
            if entries}  # (ignite's registry is a defaultdict: running it adds empty lists)


def test_only_attached_engines_change_and_detach_restores_them():
    from ignite.engine import Events, create_supervised_evaluator
    from ignite.metrics import Accuracy, Frequency, Metric

    classes = {cls: dict(vars(cls)) for cls in (Metric, Frequency, Accuracy)}
    ignite = pp.Strategy(data=1).adapt("ignite")
    model = reference_model(0, torch.float64)
    dataset = reference_dataset(N, torch.float64)
    loader = ignite.auto_dataloader(dataset, batch_size=8, remainder="uneven", shuffle=False)
    attached = ignite.create_supervised_evaluator(model, ignite_metrics(CLASSES), data=loader)
    late = Accuracy()
    late.attach(attached, "late")  # after attach(): wrapped when the run starts
    plain = create_supervised_evaluator(model, metrics=ignite_metrics(CLASSES))
    plain_handlers = _handlers(plain)
    with float64_defaults():
        attached.run(loader)
        plain.run(torch.utils.data.DataLoader(dataset, batch_size=8))
    want = _comparable(plain.state.metrics)
    assert _comparable(attached.state.metrics) == {**want, "late": want["accuracy"]}
    # ignite's classes are untouched: a plain use of ignite is ignite's own.
    assert {cls: dict(vars(cls)) for cls in classes} == classes
    assert _handlers(plain) == plain_handlers and not ignite_metrics_patch.is_registered(plain)
    # The attached engine's metric handlers are wrapped, and ignite's own queries still see them.
    completed = attached._event_handlers[Events.EPOCH_COMPLETED]
    assert all(hasattr(h, "_polyparallel_original") for h, _, _ in completed if hasattr(h, "_parent"))
    assert late.is_attached(attached) and ignite_metrics_patch.is_registered(attached)
    ignite.detach(attached)
    assert not ignite_metrics_patch.is_registered(attached) and late.is_attached(attached)
    assert not any(hasattr(h, "_polyparallel_original") for hs in _handlers(attached).values() for h in hs)
    assert not attached.has_event_handler(ignite_metrics_patch._wrap_metrics)
    late.detach(attached)
    assert not late.is_attached(attached)
    with float64_defaults():
        attached.run(loader)  # ignite's behaviour again ("late" is detached: its old value stays)
    assert {k: v for k, v in _comparable(attached.state.metrics).items() if k != "late"} == want


def test_closing_the_session_gives_the_engine_back():
    from ignite.engine import Engine

    strategy = pp.Strategy(data=1)
    ignite = strategy.adapt("ignite")
    engine = ignite.attach(Engine(lambda e, b: b))
    assert ignite_metrics_patch.is_registered(engine)
    strategy.session().close()
    assert not ignite_metrics_patch.is_registered(engine)


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


# -- EpochMetric on shards of different sizes ------------------------------------------------------
UNEVEN = 23  # 12 + 11 samples at data=2


def _uneven_data():
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand(UNEVEN, generator=generator, dtype=torch.float64)
    labels = (torch.rand(UNEVEN, generator=generator, dtype=torch.float64) < scores).long()
    return scores, labels


def _epoch_metric_worker():
    from ignite.engine import Engine
    from ignite.metrics import ROC_AUC, AveragePrecision

    strategy = pp.Strategy(data=2, timeout=30)
    ignite = strategy.adapt("ignite")
    scores, labels = _uneven_data()
    loader = ignite.auto_dataloader(torch.utils.data.TensorDataset(scores, labels), batch_size=8, shuffle=False,
                                    remainder="uneven")
    evaluator = ignite.attach(Engine(lambda engine, batch: batch), loader)
    ROC_AUC().attach(evaluator, "roc_auc")
    AveragePrecision().attach(evaluator, "ap")
    evaluator.run(loader)
    return {"shard": len(loader.sampler), **evaluator.state.metrics}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_epoch_metrics_gather_shards_of_different_sizes_and_equal_sklearn(run):
    """ROC_AUC / AveragePrecision (EpochMetric: every rank's predictions all-gathered) on 23
    samples at data=2: shards of 12 and 11 rows. Before the fix gloo aborted a rank ("Received
    data size doesn't match expected size")."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    scores, labels = _uneven_data()
    results = run(_epoch_metric_worker, pp.Strategy(data=2), 2, timeout=200)
    assert sorted(r["shard"] for r in results) == [11, 12]
    for r in results:
        assert r["roc_auc"] == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)
        assert r["ap"] == pytest.approx(average_precision_score(labels.numpy(), scores.numpy()), abs=1e-12)
