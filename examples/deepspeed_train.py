"""Train an MLP on scikit-learn's digits with DeepSpeed, its ZeRO stage, batch sizes and process
groups given by a polyparallel Strategy; optionally a DeepSpeed pipeline, and optionally inside
an ignite Engine.

    # ZeRO-2 over 2 data-parallel processes
    polyparallel launch --nproc-per-node 2 examples/deepspeed_train.py --zero 2
    # DeepSpeed's pipeline engine: pipeline=2 x data=2 (ZeRO 0 or 1), a plain loop or ignite
    polyparallel launch --nproc-per-node 4 examples/deepspeed_train.py --pipeline 2 --zero 1
    polyparallel launch --nproc-per-node 4 examples/deepspeed_train.py --pipeline 2 --zero 0 --ignite

The same Strategy drives plain torch, Lightning and Ignite: only ``adapt("deepspeed", ...)``
is DeepSpeed-specific. Data comes from ``strategy.shard_data``, metrics are reduced with
``strategy.reduce_metrics`` over the data group. Prints one JSON line per process
(``RESULT {...}``) for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split


def build_model() -> nn.Sequential:
    """An MLP as an nn.Sequential, so that a pipeline can partition it into stages."""
    p = PROBLEM
    torch.manual_seed(p.seed)
    return nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.hidden), nn.ReLU(),
                         nn.Linear(p.hidden, p.classes))


def train_loop(strategy: pp.Strategy, engine: Any, loader: Any, epochs: int) -> float:
    """A plain loop: ``engine(x)``/``backward``/``step``, or ``train_batch`` for a pipeline."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    pipeline = isinstance(engine, PipelineEngine)
    total, count = 0.0, 0
    for _ in range(epochs):
        total, count = 0.0, 0
        for x, y in loader:  # the sampler advances the epoch by itself
            if pipeline:  # one optimizer step: the batch cut into gradient_accumulation_steps micro-batches
                steps = engine.gradient_accumulation_steps()
                loss = engine.train_batch(iter(list(zip(x.chunk(steps), y.chunk(steps)))))
            else:
                loss = nn.functional.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
            total, count = total + float(loss) * len(y), count + len(y)
    return strategy.reduce_metrics({"final_loss": pp.Mean(total, count)})["final_loss"]


def evaluate_loop(strategy: pp.Strategy, engine: Any, loader: Any) -> dict[str, float] | None:
    """Accuracy over every test sample once (``remainder="uneven"``), reduced over the data group."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    pipeline = isinstance(engine, PipelineEngine)
    correct, count = 0, 0
    engine.eval()
    with torch.no_grad():
        for x, y in loader:
            if pipeline:
                _, logits = engine.eval_batch(iter([(x, y)]), return_logits=True, bcast_loss=False, num_micro_batches=1)
                if not engine.is_last_stage():
                    continue
            else:
                logits = engine(x)
            correct, count = correct + int((logits.argmax(-1) == y).sum()), count + len(y)
    if "metrics" not in strategy.session().roles:
        return None  # a first pipeline stage: the outputs live on the last one
    counting = strategy.replace(metric_policy=pp.MetricPolicy(ops={"evaluated": "sum"}))
    return counting.reduce_metrics({"accuracy": pp.Mean(correct, count), "evaluated": count})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero", type=int, default=2, help="ZeRO stage 0-3 (0/1 with a pipeline)")
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps (Strategy(accumulate=))")
    parser.add_argument("--epochs", type=int, default=PROBLEM.epochs)
    parser.add_argument("--ignite", action="store_true", help="train and evaluate inside ignite Engines")
    args = parser.parse_args(argv)
    p = PROBLEM
    strategy = pp.Strategy(data=-1, pipeline=args.pipeline, zero=args.zero, batch_size=p.global_batch, seed=p.seed,
                           accumulate=args.accumulation, timeout=120)
    strategy.check("deepspeed")  # refused here, before any process group: what DeepSpeed cannot run
    if args.ignite:
        strategy.check("ignite")
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    train = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    model = build_model()
    engine = strategy.adapt("deepspeed", model=model,
                            optimizer=torch.optim.SGD(model.parameters(), lr=p.lr, momentum=p.momentum),
                            loss_fn=nn.functional.cross_entropy,  # used by the pipeline's last stage
                            config={"steps_per_print": 10_000})
    loader = strategy.shard_data(train, remainder="pad")
    test_loader = strategy.shard_data(test, remainder="uneven", shuffle=False)
    metrics: dict[str, Any] | None
    if args.ignite:
        from ignite.metrics import Accuracy

        ignite = strategy.adapt("ignite")
        trainer = ignite.create_supervised_trainer(engine, None, nn.functional.cross_entropy, data=loader)
        trainer.run(loader, max_epochs=args.epochs)
        evaluator = ignite.create_supervised_evaluator(engine, {"accuracy": Accuracy()}, data=test_loader)
        evaluator.run(test_loader)
        metrics = {"accuracy": float(evaluator.state.metrics["accuracy"]), "last_loss": trainer.state.output} \
            if ignite.holds_metrics else None
    else:
        final_loss = train_loop(strategy, engine, loader, args.epochs)
        metrics = evaluate_loop(strategy, engine, test_loader)
        if metrics is not None:
            metrics["final_loss"] = final_loss
    session = strategy.session()
    row = {"rank": session.rank, "coords": session.coords, "zero": engine.zero_optimization_stage(), "metrics": metrics}
    print("RESULT " + json.dumps(row), flush=True)
    if metrics is not None and session.coords["data"] == 0:
        print(f"zero={args.zero} pipeline={args.pipeline}: accuracy {metrics['accuracy']:.4f}", file=sys.stderr)
    return row


if __name__ == "__main__":
    main()
