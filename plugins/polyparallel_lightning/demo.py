"""The Lightning entry of ``polyparallel demo``: the digits MLP as a LightningModule, trained by a
``Trainer(strategy=strategy.adapt("lightning"))`` in processes started by ``polyparallel.launch``."""

from __future__ import annotations

import functools
import importlib
import statistics
import time
from typing import Any

import polyparallel as pp
from polyparallel.demo import PROBLEM, load_digits_split
from polyparallel_torch.demo import step_loss_metrics, with_step_losses

from .namespaces import ModuleMixinBase

__all__ = ["run_demo", "train_digits", "digits_module_class"]


class DigitsModuleMixin(ModuleMixinBase):
    """The demo MLP (64-64-10, SGD with momentum); times each training step on this rank."""

    def __init__(self) -> None:
        import torch
        from torch import nn

        super().__init__()
        p = PROBLEM
        torch.manual_seed(p.seed)
        self.net = nn.Sequential(nn.Linear(p.inputs, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.classes))
        self.step_times: list[float] = []
        self.step_sums: list[float] = []  # this rank's loss x samples of every step, and the samples
        self.step_counts: list[int] = []
        self._started = 0.0

    def forward(self, x: Any) -> Any:
        """Logits."""
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Cross-entropy; the epoch mean is logged count-weighted over the data axis."""
        from torch import nn

        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(y))
        self.step_sums.append(loss.item() * len(y))
        self.step_counts.append(len(y))
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Accuracy, weighted by batch size (the adapter shards test data unevenly: each sample once)."""
        x, y = batch
        correct = (self.net(x).argmax(-1) == y).float().mean()
        self.log("accuracy", correct, sync_dist=True, batch_size=len(y))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start the step clock."""
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop the step clock (forward, backward, gradient sync and optimizer step)."""
        self.step_times.append(time.perf_counter() - self._started)

    def configure_optimizers(self) -> Any:
        """SGD with the demo problem's learning rate and momentum."""
        import torch

        return torch.optim.SGD(self.parameters(), lr=PROBLEM.lr, momentum=PROBLEM.momentum)


@functools.cache
def digits_module_class(namespace: str = "lightning.pytorch") -> type:
    """:class:`DigitsModuleMixin` over the ``LightningModule`` of ``namespace`` (cached)."""
    base = importlib.import_module(namespace).LightningModule
    return type("DigitsModule", (DigitsModuleMixin, base), {"__module__": __name__})


def train_digits(strategy: pp.Strategy, namespace: str = "lightning.pytorch") -> dict[str, Any]:
    """Runs in every launched process: fit, test, and reduce the step time over the data axis."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    p = PROBLEM
    x_train, y_train, x_test, y_test = load_digits_split(seed=p.seed)
    per_rank = p.global_batch // strategy.session().topology.size("data")
    train = DataLoader(TensorDataset(torch.tensor(x_train), torch.tensor(y_train)), batch_size=per_rank, shuffle=True)
    test = DataLoader(TensorDataset(torch.tensor(x_test), torch.tensor(y_test)), batch_size=per_rank)
    module = digits_module_class(namespace)()
    trainer = importlib.import_module(namespace).Trainer(
        strategy=strategy.adapt("lightning", namespace=namespace), accelerator="cpu", devices=strategy.world_size,
        max_epochs=p.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, train)
    final_loss = float(trainer.callback_metrics["train_loss"])
    trainer.test(module, test, verbose=False)
    accuracy = float(trainer.callback_metrics["accuracy"])
    reduced = strategy.reduce_metrics({"step_time_ms": 1000 * statistics.median(module.step_times),
                                       **step_loss_metrics(module.step_sums, module.step_counts)})
    return with_step_losses({"final_loss": final_loss, "accuracy": accuracy, **reduced}, p.epochs)


def run_demo(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """``polyparallel demo`` entry: launch ``nprocs`` processes, return the logger rank's row."""
    from .namespaces import resolve_namespace

    try:
        namespace = resolve_namespace().pytorch
    except ValueError:  # both imported: the demo builds its module and Trainer itself, either works
        namespace = "lightning.pytorch"
    results = pp.launch(train_digits, strategy, nprocs, args=(strategy, namespace), runtime="lightning", timeout=600)
    topology = strategy.topology.resolve(nprocs)
    row = results[topology.ranks_with_role("logger")[0]]
    return {"framework": f"lightning ({namespace})", "topology": repr(topology), **row}
