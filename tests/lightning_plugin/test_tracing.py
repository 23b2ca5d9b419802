"""Hang and desync reports (the torch runtime's trace, ``polyparallel_torch.tracing``) under a
Lightning ``Trainer``: the collectives the adapter runs for Lightning are recorded, and a rank
that skips one, or runs another, is named by its peers with its location."""

import os
import re
import time

import pytest

import polyparallel as pp
from polyparallel_torch.testing import failure_text, source_line

pytestmark = pytest.mark.multiprocess

NS = "lightning.pytorch"


def _module_class(strategy, scenario):
    import torch

    from polyparallel_lightning.testing import reference_module_class

    base = reference_module_class(NS)

    class Probe(base):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            rank = self.trainer.global_rank
            if scenario == "desync" and batch_idx == 1:
                if rank == 0:
                    strategy.sync_states(self)  # desync: rank 0 syncs states
                else:
                    strategy.sync_grads(self)  # desync: rank 1 syncs gradients
            if scenario == "hang":
                if batch_idx == 0 or rank == 0:
                    self.trainer.strategy.reduce(torch.tensor(1.0))  # hang: both at batch 0, rank 0 at 1
                else:
                    time.sleep(strategy.timeout + 8)  # hang: rank 1 skips the reduce

    return Probe


def _worker(strategy):
    from torch.utils.data import DataLoader

    from polyparallel_lightning.testing import make_trainer
    from polyparallel_torch.testing import reference_dataset

    out = {}
    for scenario, timeout in (("desync", 30), ("hang", 6)):  # a runtime (and groups) per timeout
        s = strategy.replace(timeout=timeout)
        module = _module_class(s, scenario)(0)
        trainer = make_trainer(s, NS, max_epochs=1, limit_train_batches=3, limit_val_batches=0)
        started = time.monotonic()
        loader = DataLoader(reference_dataset(24), batch_size=4)
        out[scenario] = failure_text(lambda t=trainer, m=module, d=loader: t.fit(m, d))
        out[f"{scenario}_s"] = time.monotonic() - started
    return out


@pytest.mark.timeout(300)
def test_lightning_desync_and_hang_name_the_other_ranks_location(run):
    r0, r1 = run(_worker, pp.Strategy(data=2), 2, pp.Strategy(data=2), timeout=240)
    here = os.path.basename(__file__)
    states_at = source_line(_module_class, "desync: rank 0 syncs states")
    grads_at = source_line(_module_class, "desync: rank 1 syncs gradients")
    for r in (r0, r1):
        assert r["desync"] and "operations out of step over the 'data' axis" in r["desync"], r
        assert f"called at {here}:{states_at}" in r["desync"] or f"and {here}:{states_at}" in r["desync"], r
        assert f"{here}:{grads_at}" in r["desync"].splitlines()[0], r
        assert r["desync_s"] < 25, r
    reduce_at = source_line(_module_class, "hang: both at batch 0")
    hang = r0["hang"]
    assert hang and hang.startswith("CollectiveTimeout: reduce (self.log sync_dist=True)"), r0
    first = hang.splitlines()[0]
    # Rank 1's last collective: the backward after its reduce (DDP's gradient all-reduces are recorded).
    # Recorded, not checked (the default): the entry has no sequence number.
    assert "rank 1 has not entered any collective since DDP gradient all-reduce (" in first, hang
    assert f"all-reduce ({here}:{source_line(_worker, 'out[scenario] = failure_text')} via " in first, hang  # its fit's backward
    assert reduce_at
    assert "rank 0 waits in reduce (self.log sync_dist=True)" in first, hang
    assert f"line {source_line(_module_class, 'hang: rank 1 skips')}, in on_train_batch_end" in hang, hang  # its stack


def _log_on_rank_zero_only(checked=True, timeout=20):
    """A Lightning DDP fit in which rank 0 logs a key with ``sync_dist=True`` at every step and rank
    1 does not: rank 0's reduction meets rank 1's DDP gradient all-reduce (Lightning issue 19106)."""
    import torch
    from torch.utils.data import DataLoader

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import reference_dataset

    strategy = pp.Strategy(data=-1, timeout=timeout, grad_policy=pp.GradPolicy(check_backward=checked))

    class LogsOnRankZero(reference_module_class(NS)):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_rank == 0:
                self.log("only0", torch.tensor(1.0), sync_dist=True)  # only0: rank 0 logs
            return loss

    trainer = make_trainer(strategy, NS, max_epochs=1, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(LogsOnRankZero(0), DataLoader(reference_dataset(24), batch_size=4))


@pytest.mark.timeout(120)
def test_a_sync_dist_log_of_one_rank_against_a_checked_ddp_backward_names_both_sides_at_once():
    # Before: a raw `gloo ... Timed out waiting 20000ms for recv` raised in DDP's backward was the
    # headline, after the 20 s timeout, and the user's log line was never named.
    # GradPolicy(check_backward=True): the backward's identity check finds it at once.
    started = time.monotonic()
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_log_on_rank_zero_only, pp.Strategy(data=2, timeout=20), 2, timeout=100)
    took = time.monotonic() - started
    message = str(info.value)
    headline = message.splitlines()[0]
    assert "operations out of step over the 'data' axis" in headline, message
    # Either rank's report (both fail at once, each naming both sides).
    reduce, ddp = r"self\.log\('only0', sync_dist=True\) #\d+ on rank 0", r"DDP gradient all-reduce #\d+ on rank 1"
    assert re.search(f"{reduce} vs {ddp}|{ddp} vs {reduce}", headline), message
    assert "rank 1: DDP gradient all-reduce" in message and " gradients, " in message, message  # what it reduces
    assert "rank 0: self.log('only0', sync_dist=True)" in message, message
    # Where rank 0 logged: the user's self.log line (not Lightning's or torchmetrics' frame).
    assert f"test_tracing.py:{source_line(_log_on_rank_zero_only, 'only0: rank 0 logs')}" in headline, message
    assert "Timed out" not in headline, message
    assert took < 20 + 15, took  # the two processes' start (Lightning, torch) and the failure, not the 20 s timeout


@pytest.mark.timeout(120)
def test_a_sync_dist_log_of_one_rank_against_a_recorded_ddp_backward_names_both_sides_at_the_timeout():
    # The default (the backward recorded, not checked): rank 0's reduction and rank 1's bucket
    # all-reduce wait (over two groups, so they never pair), and the timeout's report names both
    # sides, the user's self.log line among them, whichever rank's report is the headline.
    started = time.monotonic()
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_log_on_rank_zero_only, pp.Strategy(data=2, timeout=8), 2, args=(False, 8), timeout=100)
    took = time.monotonic() - started
    message = str(info.value)
    headline = message.splitlines()[0]
    assert "CollectiveTimeout" in headline, message
    logged = source_line(_log_on_rank_zero_only, 'only0: rank 0 logs')
    assert re.search(rf"self\.log\('only0', sync_dist=True\) #\d+ \(test_tracing\.py:{logged}\b", headline), message
    assert re.search(r"rank 1 (entered|waits in|has not entered any collective since) DDP gradient all-reduce \(",
                     headline), message
    assert took < 8 + 30, took
