"""Hang and desync reports (the torch runtime's trace, ``polyparallel_torch.tracing``) under Ignite:
the metric reductions the adapter runs for Ignite are recorded, and a rank that skips one, or runs
another operation, is named by its peers with its location."""

import os
import time

import pytest

import polyparallel as pp
from polyparallel_torch.testing import failure_text, source_line

pytestmark = pytest.mark.multiprocess


def _worker(strategy):
    from ignite.engine import Events

    from polyparallel_ignite.testing import ignite_metrics
    from polyparallel_torch.testing import reference_dataset, reference_model

    out = {}
    # desync: one rank syncs states where the other syncs gradients (a runtime per timeout)
    s = strategy.replace(timeout=30)
    ignite = s.adapt("ignite")
    rank = s.rank
    loader = ignite.auto_dataloader(reference_dataset(16), batch_size=8, remainder="uneven", shuffle=False)
    model = reference_model(0)  # bare: a DDP model's sync_grads is a no-op (DDP reduced in backward)
    evaluator = ignite.create_supervised_evaluator(model, {}, data=loader)

    @evaluator.on(Events.ITERATION_COMPLETED(once=1))
    def _out_of_step(engine):
        if rank == 0:
            s.sync_states(model)  # desync: rank 0 syncs states
        else:
            s.sync_grads(model)  # desync: rank 1 syncs gradients

    started = time.monotonic()
    out["desync"] = failure_text(lambda: evaluator.run(loader))
    out["desync_s"] = time.monotonic() - started
    # hang: rank 1 attaches no metric, so it never joins the metric reduction at the epoch's end
    s = strategy.replace(timeout=6)
    ignite = s.adapt("ignite")
    loader = ignite.auto_dataloader(reference_dataset(16), batch_size=8, remainder="uneven", shuffle=False)
    model = ignite.auto_model(reference_model(0))
    evaluator = ignite.create_supervised_evaluator(model, ignite_metrics() if rank == 0 else {}, data=loader)
    out["hang"] = failure_text(lambda: evaluator.run(loader))  # hang: the evaluator runs
    if rank == 1:
        time.sleep(s.timeout + 8)  # hang: rank 1 does something else
    return out


@pytest.mark.timeout(240)
def test_ignite_desync_and_hang_name_the_other_ranks_location(run):
    r0, r1 = run(_worker, pp.Strategy(data=2), 2, pp.Strategy(data=2), timeout=200)
    here = os.path.basename(__file__)
    for r in (r0, r1):
        assert r["desync"] and "operations out of step over the 'data' axis" in r["desync"], r
        first = r["desync"].splitlines()[0]
        assert f"{here}:{source_line(_worker, 'desync: rank 0 syncs')}" in first, r
        assert f"{here}:{source_line(_worker, 'desync: rank 1 syncs')}" in first, r
        assert r["desync_s"] < 25, r
    hang = r0["hang"]
    assert hang and hang.startswith("CollectiveTimeout: ignite metric"), r0
    first = hang.splitlines()[0]
    # rank 1's last collective was the model's parameter broadcast (auto_model); now it sleeps
    assert "rank 1 has not entered any collective since" in first, hang
    assert "rank 0 waits in ignite metric" in first and f"({here}:{source_line(_worker, 'hang: the evaluator')} via" in first, hang
    assert f"line {source_line(_worker, 'hang: rank 1 does something else')}, in _worker" in hang, hang
    assert r1["hang"] is None
