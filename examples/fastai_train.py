"""Train a fastai Learner on scikit-learn's digits over the data axis, the per-process factory way
fastai users launch on several devices: ``train`` builds the DataLoaders, the model and the
Learner inside each process, and returns what the parent prints.

    python examples/fastai_train.py                  # data=2 on 2 CPU processes (gloo)
    python examples/fastai_train.py --nprocs 4 --epochs 5

The metrics fastai prints (valid loss, accuracy, RocAuc, F1Score) are the global values over the
data group, equal to a single-process run with the same global batch; ``learn.save`` writes once.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from typing import Any

import polyparallel as pp
from polyparallel.demo import load_digits_split


def train(strategy: pp.Strategy, epochs: int, workdir: str) -> dict[str, Any]:
    """Runs in every process; returns picklable results (the recorder's table, where it saved)."""
    import torch
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.metrics import F1Score, RocAuc, accuracy
    from fastai.optimizer import SGD
    from torch import nn
    from torch.utils.data import TensorDataset

    x_train, y_train, x_test, y_test = load_digits_split()
    train_ds = TensorDataset(torch.tensor(x_train), torch.tensor(y_train))
    valid_ds = TensorDataset(torch.tensor(x_test), torch.tensor(y_test))
    # bs is ignored: the Strategy's batch_size is the global batch (each data rank takes its share).
    dls = DataLoaders.from_dsets(train_ds, valid_ds, bs=64, shuffle=True, drop_last=True, num_workers=0, device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=functools.partial(SGD, mom=0.9), lr=0.05,
                    metrics=[accuracy, RocAuc(), F1Score(average="macro")], path=workdir,
                    cbs=strategy.adapt("fastai"))
    if "logger" not in strategy.session().roles:
        learn.logger = lambda *args, **kwargs: None  # one rank prints the table (the values are global everywhere)
    learn.fit(epochs)
    saved = learn.save("digits")  # collective: written once, by the checkpoint rank
    return {"rank": strategy.session().rank, "metric_names": list(learn.recorder.metric_names[1:-1]),
            "values": [list(map(float, v)) for v in learn.recorder.values], "saved": str(saved)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch size")
    args = parser.parse_args()
    strategy = pp.Strategy(data=-1, batch_size=args.batch_size, timeout=120, seed=0)
    with tempfile.TemporaryDirectory() as workdir:
        results = pp.launch(train, strategy, args.nprocs, args=(strategy, args.epochs, workdir), runtime="fastai",
                            timeout=900)
    # Every rank reports the same (global) values.
    assert all(r["values"] == results[0]["values"] for r in results)
    print("RESULT " + json.dumps({k: results[0][k] for k in ("metric_names", "values")}))


if __name__ == "__main__":
    main()
