"""The Ignite entry of ``polyparallel demo``: ignite's supervised trainer and evaluator driven by
the Strategy (data, data x tensor, or pipeline)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split
from polyparallel_torch.demo import step_loss_metrics, with_step_losses

__all__ = ["run_demo", "train_digits"]


def train_digits(strategy: pp.Strategy) -> dict[str, Any] | None:
    """Runs in every launched process. Returns the metrics on ranks that hold them, else ``None``."""
    import torch
    from ignite.engine import Events
    from ignite.metrics import Accuracy
    from torch import nn
    from torch.utils.data import TensorDataset

    p = PROBLEM
    ignite = strategy.adapt("ignite")
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    train = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    torch.manual_seed(p.seed)
    model = nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.classes))
    options: dict[str, Any] = {}
    if strategy.topology.size("tensor") != 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        options["plan"] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = ignite.auto_model(model, **options)
    optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=p.lr, momentum=p.momentum), model)
    loader = ignite.auto_dataloader(train, batch_size=p.global_batch, remainder="pad")
    trainer = ignite.create_supervised_trainer(model, optimizer, nn.functional.cross_entropy, data=loader)

    step_times: list[float] = []
    epoch_loss = {"total": 0.0, "count": 0}
    step_sums: list[float] = []  # this rank's loss x samples of every step, and the samples
    step_counts: list[int] = []

    @trainer.on(Events.ITERATION_STARTED)
    def _start(engine: Any) -> None:
        engine.state.step_start = time.perf_counter()

    @trainer.on(Events.ITERATION_COMPLETED)
    def _stop(engine: Any) -> None:
        step_times.append(time.perf_counter() - engine.state.step_start)
        if engine.state.output is not None:  # None on pipeline stages without the loss
            n = len(engine.state.batch[1])
            epoch_loss["total"] += engine.state.output * n
            epoch_loss["count"] += n
            step_sums.append(engine.state.output * n)
            step_counts.append(n)

    @trainer.on(Events.EPOCH_STARTED)
    def _reset(engine: Any) -> None:
        epoch_loss.update(total=0.0, count=0)

    trainer.run(loader, max_epochs=p.epochs)
    eval_loader = ignite.auto_dataloader(test, batch_size=p.global_batch, remainder="uneven", shuffle=False)
    evaluator = ignite.create_supervised_evaluator(model, {"accuracy": Accuracy()}, data=eval_loader)
    evaluator.run(eval_loader)
    if not ignite.holds_metrics:
        return None
    row = ignite.reduce_metrics({"final_loss": pp.Mean(epoch_loss["total"], epoch_loss["count"]),
                                 "step_time_ms": 1000 * statistics.median(step_times),
                                 **step_loss_metrics(step_sums, step_counts)})
    return {**with_step_losses(row, p.epochs), "accuracy": float(evaluator.state.metrics["accuracy"])}


def run_demo(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry: launch ``nprocs`` processes, return the table row."""
    topology = strategy.topology.resolve(nprocs)
    results = pp.launch(train_digits, strategy, nprocs, args=(strategy,), runtime="ignite", timeout=600)
    row = results[topology.ranks_with_role("logger")[0]]
    return {"framework": "pytorch-ignite (supervised trainer)", "topology": repr(topology), **row}
