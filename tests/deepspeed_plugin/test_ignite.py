"""A DeepSpeed engine inside an ignite Engine, through strategy.adapt("ignite"): pipeline=2 x
data=2 on 4 processes (DeepSpeed's PipelineModule and train_batch), metrics on the last stage
reduced over the data group. Parameters and metrics equal a single-process run."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("ignite")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel_ignite.testing import float64_defaults, ignite_metrics, reference_metrics  # noqa: E402
from polyparallel_torch.testing import LR, ghost_batch_reference, reference_dataset, reference_model  # noqa: E402

N, GLOBAL_BATCH, STEPS = 37, 8, 4


def _engine(strategy, dtype=torch.float32):
    model = reference_model(strategy.seed, dtype)
    return strategy.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                          loss_fn=nn.functional.cross_entropy)


def _train_and_evaluate(strategy):
    from ignite.engine import Events

    ignite = strategy.adapt("ignite")
    data = strategy.session().topology.size("data")
    template = DataLoader(reference_dataset(N), batch_size=GLOBAL_BATCH // data, drop_last=True)
    loader = ignite.auto_dataloader(template, batch_size=GLOBAL_BATCH, remainder="pad", shuffle=True)
    engine = _engine(strategy)
    trainer = ignite.create_supervised_trainer(engine, None, nn.functional.cross_entropy, data=loader)
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.run(loader, max_iters=STEPS)
    params = {n: p.detach().reshape(-1).double().tolist() for n, p in engine.module.named_parameters()}

    dataset = reference_dataset(N, torch.float64)
    eval_loader = ignite.auto_dataloader(dataset, batch_size=GLOBAL_BATCH, remainder="uneven", shuffle=False)
    evaluator = ignite.create_supervised_evaluator(_engine(strategy, torch.float64), ignite_metrics(), data=eval_loader)
    with float64_defaults():
        evaluator.run(eval_loader)
    return {"params": params, "losses": losses, "holds_metrics": ignite.holds_metrics,
            "metrics": dict(evaluator.state.metrics)}


def _close(got, want, tol):
    assert len(got) == len(want) and all(abs(g - w) <= tol * max(1.0, abs(w)) for g, w in zip(got, want)), (got, want)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_pipeline2_data2_in_an_ignite_engine(run):
    strategy = pp.Strategy(pipeline=2, data=2, batch_size=GLOBAL_BATCH, timeout=60)
    results = run(_train_and_evaluate, strategy, 4, strategy, timeout=380)
    reference = ghost_batch_reference(STEPS, GLOBAL_BATCH, 2, 0, N)
    for stage in (0, 1):  # each stage holds its own layers, equal on both data replicas
        ranks = strategy.topology.resolve(4).ranks_with_role("metrics") if stage else [0, 1]
        for rank in ranks:
            assert set(results[rank]["params"]) < set(reference)
            for name, values in results[rank]["params"].items():
                _close(values, reference[name], 1e-5)
    covered = set(results[0]["params"]) | set(results[2]["params"])
    assert covered == set(reference)
    # DeepSpeed broadcasts the pipeline's loss: every stage reports it, replicas of a data coordinate agree.
    assert all(len(r["losses"]) == STEPS for r in results)
    assert results[0]["losses"] == results[2]["losses"] and results[1]["losses"] == results[3]["losses"]
    expected = reference_metrics(reference_model(0, torch.float64), reference_dataset(N, torch.float64), ignite_metrics())
    for r in results:
        if r["holds_metrics"]:  # the last stage: reduced over its data group, every sample once
            for name in ("loss", "accuracy"):
                _close([r["metrics"][name]], [expected[name]], 1e-9)
        else:
            assert r["metrics"] == {}
    assert [r["holds_metrics"] for r in results] == [False, False, True, True]
