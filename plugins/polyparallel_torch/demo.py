"""The torch entries of ``polyparallel demo``: a plain PyTorch loop driven by the Strategy, as given
(``torch``: DDP) and at sharding stage 3 (``torch-zero3``: FSDP2 over the data axis)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split

__all__ = ["run_demo", "run_demo_zero3", "step_loss_metrics", "train_digits", "with_step_losses"]


def train_digits(strategy: pp.Strategy) -> dict[str, Any]:
    """Runs in every launched process: shard, wrap, train, evaluate, reduce."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    p = PROBLEM
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    train = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    torch.manual_seed(p.seed)
    model = nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.classes))
    plan = None
    if strategy.topology.size("tensor") != 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = strategy.wrap_model(model, **({"plan": plan} if plan else {}))
    loader = strategy.shard_data(train, batch_size=p.global_batch, remainder="pad")
    from .sharding import make_optimizer

    opt = make_optimizer(strategy, model, torch.optim.SGD, lr=p.lr, momentum=p.momentum)
    step_times, last = [], pp.Mean(0.0, 0)
    step_sums: list[float] = []  # this rank's loss x samples of every step, and the samples
    step_counts: list[int] = []
    for _ in range(p.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            strategy.sync_grads(model)
            opt.step()
            step_times.append(time.perf_counter() - start)
            step_sums.append(loss.item() * len(y))
            step_counts.append(len(y))
            total += step_sums[-1]
            count += len(y)
        last = pp.Mean(total, count)
    eval_loader = strategy.shard_data(test, batch_size=p.global_batch, remainder="uneven", shuffle=False)
    correct, seen = 0, 0
    model.eval()
    with torch.no_grad():
        for x, y in eval_loader:
            correct += int((model(x).argmax(-1) == y).sum())
            seen += len(y)
    metrics = strategy.reduce_metrics({"final_loss": last, "accuracy": pp.Mean(correct, seen),
                                       "step_time_ms": 1000 * statistics.median(step_times),
                                       **step_loss_metrics(step_sums, step_counts)})
    return with_step_losses(metrics, p.epochs)


def step_loss_metrics(sums: list[float], counts: list[int]) -> dict[str, Any]:
    """The per-step loss sums and sample counts as two metrics for ``reduce_metrics`` (averaged over
    the data axis: their ratio is the global mean loss of each step, whatever the shards' sizes)."""
    import torch

    return {"step_loss_sums": torch.tensor(sums, dtype=torch.float64),
            "step_loss_counts": torch.tensor(counts, dtype=torch.float64)}


def with_step_losses(metrics: dict[str, Any], epochs: int) -> dict[str, Any]:
    """``metrics`` with the reduced sums and counts replaced by the demo row's ``losses`` (the global
    loss of every step) and ``epochs`` (how many epochs they span)."""
    sums, counts = metrics.pop("step_loss_sums"), metrics.pop("step_loss_counts")
    return {**metrics, "losses": (sums / counts).tolist(), "epochs": epochs}


def run_demo(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry: launch ``nprocs`` processes, return the table row."""
    results = pp.launch(train_digits, strategy, nprocs, args=(strategy,), runtime="torch", timeout=600)
    row = results[strategy.topology.resolve(nprocs).ranks_with_role("logger")[0]]
    stage = strategy.shard_policy.stage
    framework = "pytorch (plain loop)" + (f", zero={stage} (FSDP2)" if stage >= 2 else f", zero={stage}" if stage else "")
    return {"framework": framework, "topology": repr(strategy.topology.resolve(nprocs)), **row}


def run_demo_zero3(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry ``torch-zero3``: the same loop at sharding stage 3 (FSDP2)."""
    return run_demo(strategy.replace(zero=3), nprocs)
