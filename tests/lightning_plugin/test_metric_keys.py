"""``self.log(sync_dist=True)`` keys are part of the identity check: two ranks syncing different
keys of the same shape fail at once naming both keys (both Lightning namespaces, the per-step and
the epoch-end reductions), and the reduction is attributed to the user's ``self.log`` line, not to
torchmetrics' ``metric.py`` (Lightning's logged values are torchmetrics metrics)."""

import os
import time

import pytest

import polyparallel as pp
from polyparallel_torch.testing import failure_text, source_line

pytestmark = pytest.mark.multiprocess


def _module_class(namespace, scenario):
    from torch import nn

    from polyparallel_lightning.testing import reference_module_class

    class Keys(reference_module_class(namespace)):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            rank = self.trainer.global_rank
            if scenario == "same":
                self.log("same_key", loss, on_step=True, on_epoch=False, sync_dist=True)  # same: every rank
            elif scenario == "step":
                self.log(f"step_key_{rank}", loss, on_step=True, on_epoch=False, sync_dist=True)  # step: per rank
            else:
                self.log(f"epoch_key_{rank}", loss, on_step=False, on_epoch=True, sync_dist=True)  # epoch: per rank
            return loss

    return Keys


def _worker(strategy):
    from torch.utils.data import DataLoader

    from polyparallel import _trace
    from polyparallel_lightning.testing import make_trainer
    from polyparallel_torch.testing import reference_dataset

    out = {}
    runs = (("same", "lightning.pytorch", 30), ("step", "lightning.pytorch", 31), ("epoch", "pytorch_lightning", 32))
    for scenario, namespace, timeout in runs:  # a runtime per timeout: a failed one is broken
        s = strategy.replace(timeout=timeout)
        trainer = make_trainer(s, namespace, max_epochs=1, limit_train_batches=2, limit_val_batches=0)
        started = time.monotonic()
        loader = DataLoader(reference_dataset(16), batch_size=4)
        module = _module_class(namespace, scenario)(0)
        out[scenario] = failure_text(lambda t=trainer, m=module, d=loader: t.fit(m, d))
        out[f"{scenario}_s"] = time.monotonic() - started
        if scenario == "same":
            out["entries"] = [(e.operation, e.user, e.state) for e in _trace.get_recorder().entries
                              if e.operation.startswith("self.log(")]
    return out


@pytest.mark.timeout(300)
def test_different_logged_keys_fail_at_once_naming_both_and_the_users_line(run):
    r0, r1 = run(_worker, pp.Strategy(data=2), 2, pp.Strategy(data=2), timeout=240)
    here = os.path.basename(__file__)
    for r in (r0, r1):
        assert r["same"] is None, r
        same_at = source_line(_module_class, "same: every rank")
        assert r["entries"] and all(
            op == "self.log('same_key', sync_dist=True)" and state == "done" and user and
            os.path.basename(user[0]) == here and user[1] == same_at for op, user, state in r["entries"]), r
        for scenario, mark in (("step", "step: per rank"), ("epoch", "epoch: per rank")):
            text = r[scenario]
            assert text and "operations out of step over the 'data' axis" in text, (scenario, r)
            first = text.splitlines()[0]
            assert f"self.log('{scenario}_key_0', sync_dist=True)" in first, first
            assert f"self.log('{scenario}_key_1', sync_dist=True)" in first, first
            assert r[f"{scenario}_s"] < 25, r  # the identity check, not the timeout
            if scenario == "step":
                assert f"{here}:{source_line(_module_class, mark)}" in first and "metric.py" not in first, first
