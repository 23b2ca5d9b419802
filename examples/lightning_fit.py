"""Train a LightningModule under one polyparallel Strategy: Lightning's own features (logging,
checkpoints, progress bar) unchanged, the parallel layout from the Strategy.

Lightning launches the processes (``Trainer(devices=N)``):

    python examples/lightning_fit.py --devices 2

An external launcher starts them and Lightning detects it (no second launch):

    polyparallel launch --nproc-per-node 2 examples/lightning_fit.py
    polyparallel launch --nproc-per-node 4 examples/lightning_fit.py --tensor 2      # data=2 x tensor=2
    torchrun --nproc-per-node 2 examples/lightning_fit.py --namespace pytorch_lightning

``--out DIR`` receives Lightning's CSV logs and checkpoints (``last.ckpt``); ``--resume CKPT``
continues from one. Every rank prints one ``RESULT {json}`` line at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                    help="processes on this node (default: what the external launcher started, else 1)")
parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel size (the data axis takes the rest)")
parser.add_argument("--max-epochs", type=int, default=PROBLEM.epochs)
parser.add_argument("--namespace", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"])
parser.add_argument("--out", default="lightning_fit_out", help="directory for logs and checkpoints")
parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
ARGS = parser.parse_args()
#: Started by `polyparallel launch`/torchrun (they set RANK), not by Lightning's launcher.
EXTERNAL_LAUNCH = "RANK" in os.environ

# In your own code: `import lightning.pytorch as L` (or `import pytorch_lightning as L`).
L = importlib.import_module(ARGS.namespace)
callbacks = importlib.import_module(f"{ARGS.namespace}.callbacks")
loggers = importlib.import_module(f"{ARGS.namespace}.loggers")


class DigitsModule(L.LightningModule):
    """The demo MLP (64-64-10). Nothing in it knows about parallelism."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(PROBLEM.seed)
        self.net = nn.Sequential(nn.Linear(PROBLEM.inputs, PROBLEM.hidden), nn.ReLU(),
                                 nn.Linear(PROBLEM.hidden, PROBLEM.classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        # sync_dist reduces over the data axis (tensor replicas are not counted twice).
        self.log("train_loss", loss, on_epoch=True, sync_dist=True, batch_size=len(y), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(-1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True, batch_size=len(y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=PROBLEM.lr, momentum=PROBLEM.momentum)


def main() -> None:
    strategy = pp.Strategy(data=-1, tensor=ARGS.tensor, timeout=120, seed=PROBLEM.seed)
    x_train, y_train, x_test, y_test = load_digits_split(seed=PROBLEM.seed)
    # A Lightning loader's batch size is per process: the global batch over the data axis.
    world_size = int(os.environ.get("WORLD_SIZE", ARGS.devices))  # set by any launcher; else Lightning launches
    data_size = strategy.topology.resolve(world_size).size("data")
    per_rank = PROBLEM.global_batch // data_size
    train = DataLoader(TensorDataset(torch.tensor(x_train), torch.tensor(y_train)), batch_size=per_rank, shuffle=True)
    val = DataLoader(TensorDataset(torch.tensor(x_test), torch.tensor(y_test)), batch_size=per_rank)

    lightning_strategy = strategy.adapt("lightning", namespace=ARGS.namespace)
    checkpoint = callbacks.ModelCheckpoint(dirpath=os.path.join(ARGS.out, "checkpoints"), save_last=True)
    trainer = L.Trainer(strategy=lightning_strategy, accelerator="cpu", devices=ARGS.devices,
                        max_epochs=ARGS.max_epochs, callbacks=[checkpoint],
                        logger=loggers.CSVLogger(ARGS.out, name="logs"), num_sanity_val_steps=0)
    module = DigitsModule()
    trainer.fit(module, train, val, ckpt_path=ARGS.resume)

    # One write per line: the lines of concurrent ranks cannot interleave (even with PYTHONUNBUFFERED).
    sys.stdout.write("RESULT " + json.dumps({
        "rank": trainer.global_rank, "world_size": trainer.world_size,
        "topology": repr(lightning_strategy.topology), "coords": strategy.session().coords,
        "external_launch": EXTERNAL_LAUNCH, "namespace": ARGS.namespace,
        "global_step": trainer.global_step, "epochs": trainer.current_epoch,
        "train_loss": float(trainer.callback_metrics["train_loss_epoch"]),
        "val_accuracy": float(trainer.callback_metrics["val_accuracy"]),
        "last_checkpoint": checkpoint.last_model_path,
    }) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
