"""The fastai entry of ``polyparallel demo``: a fastai ``Learner`` with the strategy's callback
(data axis), on the shared digits problem."""

from __future__ import annotations

import statistics
import time
from typing import Any

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split
from polyparallel_torch.demo import step_loss_metrics, with_step_losses

__all__ = ["run_demo", "train_digits"]


def train_digits(strategy: pp.Strategy) -> dict[str, Any] | None:
    """Runs in every launched process. Returns the row on ranks with the ``logger`` role."""
    import functools

    import torch
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.metrics import accuracy
    from fastai.optimizer import SGD
    from torch import nn
    from torch.utils.data import TensorDataset

    p = PROBLEM
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    train = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    # Per-rank loaders; the strategy's global batch (p.global_batch) decides the per-rank size.
    # drop_last=False: every sample each epoch (the tail padded to a full shard), as the other rows.
    dls = DataLoaders.from_dsets(train, test, bs=p.global_batch, shuffle=True, drop_last=False, device="cpu",
                                 num_workers=0)
    torch.manual_seed(p.seed)
    model = nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.classes))
    step_times: list[float] = []
    epoch_loss = [0.0, 0]  # this rank's training loss x samples, samples, in the current epoch
    step_sums: list[float] = []  # the same for every step
    step_counts: list[int] = []

    class StepTimer(Callback):
        """Step times, and the epoch's mean training loss as the other rows report it (fastai's
        recorder shows a smoothed loss, an exponential average over steps)."""

        def before_epoch(self) -> None:
            epoch_loss[:] = [0.0, 0]

        def before_batch(self) -> None:
            self.start = time.perf_counter()

        def after_batch(self) -> None:
            if self.training:
                step_times.append(time.perf_counter() - self.start)
                n = len(self.yb[0])
                loss = float(self.loss.detach())  # the value, without torch's warning about a tensor that needs grad
                epoch_loss[0] += loss * n
                epoch_loss[1] += n
                step_sums.append(loss * n)
                step_counts.append(n)

    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=functools.partial(SGD, mom=p.momentum),
                    lr=p.lr, metrics=[accuracy], cbs=[strategy.adapt("fastai"), StepTimer()])
    learn.remove_cb(ProgressCallback)  # the demo prints one table, not progress bars
    with learn.no_logging():
        learn.fit(p.epochs)
    _, _, acc = learn.recorder.values[-1]  # the global accuracy (the callback reduces fastai's metrics)
    reduced = with_step_losses(strategy.reduce_metrics({"final_loss": pp.Mean(*epoch_loss),
                                                        **step_loss_metrics(step_sums, step_counts)}), p.epochs)
    if "logger" not in strategy.session().roles:
        return None
    return {"final_loss": float(reduced["final_loss"]), "accuracy": float(acc),
            "step_time_ms": 1000 * statistics.median(step_times), "losses": reduced["losses"], "epochs": p.epochs}


def run_demo(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry: launch ``nprocs`` processes, return the table row."""
    topology = strategy.topology.resolve(nprocs)
    strategy = strategy if strategy.data_policy.batch_size else strategy.replace(batch_size=PROBLEM.global_batch)
    results = pp.launch(train_digits, strategy, nprocs, args=(strategy,), runtime="fastai", timeout=600)
    row = results[topology.ranks_with_role("logger")[0]]
    return {"framework": "fastai (Learner + callback)", "topology": repr(topology), **row}
