"""The DeepSpeed entry of ``polyparallel demo``: the demo MLP trained by a DeepSpeed engine at
ZeRO stage 2 (the Strategy's topology with ``zero=2``; ZeRO 1 with a pipeline, which DeepSpeed
cannot combine with stage 2), in a plain loop."""

from __future__ import annotations

import statistics
import time
from typing import Any

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split
from polyparallel_torch.demo import step_loss_metrics, with_step_losses

__all__ = ["DEMO_STAGE", "demo_strategy", "run_demo", "train_digits"]

#: The ZeRO stage the demo shows: optimizer state and gradients sharded over the data axis.
DEMO_STAGE = 2


def demo_strategy(strategy: pp.Strategy) -> pp.Strategy:
    """The demo's strategy at ZeRO 2 (1 with a pipeline) and the demo's global batch."""
    stage = 1 if strategy.topology.size("pipeline") != 1 else DEMO_STAGE
    return strategy.replace(zero=stage, batch_size=PROBLEM.global_batch)


def train_digits(strategy: pp.Strategy) -> dict[str, Any] | None:
    """Runs in every launched process. Returns the metrics on ranks that hold them, else ``None``."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    p = PROBLEM
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    train = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    torch.manual_seed(p.seed)
    model = nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.classes))
    engine = strategy.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=p.lr,
                                                                                momentum=p.momentum),
                            loss_fn=nn.functional.cross_entropy, config={"steps_per_print": 1_000_000})
    pipeline = strategy.topology.size("pipeline") != 1
    loader = strategy.shard_data(train, remainder="pad")
    step_times, last = [], pp.Mean(0.0, 0)
    step_sums: list[float] = []  # this rank's loss x samples of every step, and the samples
    step_counts: list[int] = []
    for _ in range(p.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            start = time.perf_counter()
            if pipeline:
                loss = engine.train_batch(iter([(x, y)]))
            else:
                loss = nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
            step_times.append(time.perf_counter() - start)
            step_sums.append(loss.item() * len(y))
            step_counts.append(len(y))
            total += step_sums[-1]
            count += len(y)
        last = pp.Mean(total, count)
    eval_loader = strategy.shard_data(test, remainder="uneven", shuffle=False)
    correct, seen = 0, 0
    engine.eval()
    with torch.no_grad():
        for x, y in eval_loader:
            if pipeline:
                _, logits = engine.eval_batch(iter([(x, y)]), return_logits=True, bcast_loss=False, num_micro_batches=1)
                if not engine.is_last_stage():
                    continue
            else:
                logits = engine(x)
            correct += int((logits.argmax(-1) == y).sum())
            seen += len(y)
    if "metrics" not in strategy.session().roles:
        return None
    return with_step_losses(strategy.reduce_metrics({"final_loss": last, "accuracy": pp.Mean(correct, seen),
                                                     "step_time_ms": 1000 * statistics.median(step_times),
                                                     **step_loss_metrics(step_sums, step_counts)}), p.epochs)


def run_demo(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry: launch ``nprocs`` processes, return the table row."""
    strategy = demo_strategy(strategy)
    topology = strategy.topology.resolve(nprocs)
    strategy.check("deepspeed", nprocs)  # before any process starts
    results = pp.launch(train_digits, strategy, nprocs, args=(strategy,), timeout=600)
    row = results[topology.ranks_with_role("logger")[0]]
    return {"framework": f"deepspeed (ZeRO {strategy.shard_policy.stage}, engine)", "topology": repr(topology),
            **(row or {})}
