"""Train a Megatron-style tensor-parallel MLP block on scikit-learn's digits with PyTorch-Ignite's
supervised trainer, parallelised by a polyparallel Strategy (data x tensor, or a pipeline).

    # torchrun through polyparallel: data=2 x tensor=2 on 4 processes
    polyparallel launch --nproc-per-node 4 examples/ignite_train.py --tensor 2
    # ignite's own launcher (idist.Parallel spawns the processes)
    python examples/ignite_train.py --idist 4 --tensor 2
    # two pipeline stages (torch.distributed.pipelining, GPipe)
    polyparallel launch --nproc-per-node 2 examples/ignite_train.py --pipeline 2

The block: embed -> LayerNorm -> fc_in (column parallel) -> GELU -> fc_out (row parallel) ->
residual -> head. The column/row pair keeps the hidden activation sharded over the tensor group
and closes with one all-reduce, so x, y and the logits are whole, replicated tensors on every
tensor rank: ignite's supervised helpers move them to ``adapter.device`` as usual.
Prints one JSON line per process (``RESULT {...}``) for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel.demo import load_digits_split


class MegatronBlock(nn.Module):
    """A transformer-style MLP block with a residual connection (Megatron's MLP half)."""

    def __init__(self, width: int, expansion: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, expansion * width)   # column parallel: output features sharded
        self.act = nn.GELU()
        self.fc_out = nn.Linear(expansion * width, width)  # row parallel: partial sums all-reduced

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc_out(self.act(self.fc_in(self.norm(h))))


def build_model(inputs: int = 64, width: int = 64, classes: int = 10, blocks: int = 2) -> nn.Sequential:
    """embed -> blocks -> head, as an nn.Sequential so a pipeline can cut it into stages."""
    torch.manual_seed(0)
    layers: list[tuple[str, nn.Module]] = [("embed", nn.Linear(inputs, width))]
    layers += [(f"block{i}", MegatronBlock(width)) for i in range(blocks)]
    layers.append(("head", nn.Linear(width, classes)))
    return nn.Sequential(OrderedDict(layers))


def megatron_plan(blocks: int = 2) -> dict[str, Any]:
    """Column-parallel ``fc_in`` and row-parallel ``fc_out`` in every block; the rest replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(blocks):
        plan[f"block{i}.fc_in"], plan[f"block{i}.fc_out"] = ColwiseParallel(), RowwiseParallel()
    return plan


def train(tensor: int = 1, pipeline: int = 1, epochs: int = 4, batch_size: int = 64) -> dict[str, Any] | None:
    """Runs in every process. Returns the evaluation metrics on ranks that hold them."""
    from ignite.engine import Events
    from ignite.metrics import Accuracy, ConfusionMatrix, Loss

    strategy = pp.Strategy(data=-1, tensor=tensor, pipeline=pipeline, timeout=60, batch_size=batch_size)
    ignite = strategy.adapt("ignite")
    x_train, y_train, x_test, y_test = load_digits_split()
    train_set = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    test_set = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))

    model = ignite.auto_model(build_model(), **({"plan": megatron_plan()} if tensor > 1 else {}))
    optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9), model)
    train_loader = ignite.auto_dataloader(train_set)  # global batch from the strategy
    eval_loader = ignite.auto_dataloader(test_set, shuffle=False, remainder="uneven")

    loss_fn = nn.functional.cross_entropy
    trainer = ignite.create_supervised_trainer(model, optimizer, loss_fn, data=train_loader)
    evaluator = ignite.create_supervised_evaluator(
        model, {"accuracy": Accuracy(), "loss": Loss(loss_fn), "confusion": ConfusionMatrix(10)}, data=eval_loader)

    @trainer.on(Events.EPOCH_COMPLETED)
    def _evaluate(engine: Any) -> None:
        evaluator.run(eval_loader)
        # Every rank of the pipeline takes the same decision from the last stage's numbers.
        metrics = ignite.broadcast_metrics(evaluator.state.metrics if ignite.holds_metrics else None)
        if "logger" in ignite.session.roles:
            print(f"epoch {engine.state.epoch}: accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f}",
                  flush=True)

    trainer.run(train_loader, max_epochs=epochs)
    if not ignite.holds_metrics:
        return None
    metrics = evaluator.state.metrics
    return {"accuracy": float(metrics["accuracy"]), "loss": float(metrics["loss"]),
            "evaluated": int(metrics["confusion"].sum()), "last_train_loss": float(trainer.state.output)}


def _report(local_rank: int, args: argparse.Namespace) -> None:
    session = pp.Strategy(data=-1, tensor=args.tensor, pipeline=args.pipeline).session()
    result = train(args.tensor, args.pipeline, args.epochs)
    line = json.dumps({"rank": session.rank, "coords": session.coords, "metrics": result})
    sys.stdout.write(f"RESULT {line}\n")  # one write: lines of concurrent processes do not interleave
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--idist", type=int, default=0, metavar="N",
                        help="spawn N processes with ignite.distributed.Parallel (gloo) instead of a launcher")
    args = parser.parse_args()
    if args.idist:
        import ignite.distributed as idist

        with idist.Parallel(backend="gloo", nproc_per_node=args.idist) as parallel:
            parallel.run(_report, args)
    else:
        _report(0, args)


if __name__ == "__main__":
    main()
