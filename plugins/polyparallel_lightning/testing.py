"""The conformance driver of the Lightning adapter, and the reference problem as a LightningModule.

The problem (MLP with BatchNorm, data set, plan, single-process references) is the torch
runtime's (:mod:`polyparallel_torch.testing`); only the training loop is Lightning's: every
method here builds a ``Trainer(strategy=strategy.adapt("lightning"))`` and lets Lightning inject
the sampler, wrap the model, log with ``sync_dist=True`` and call the strategy's hooks.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader

import polyparallel as pp
from polyparallel.testing import ConformanceDriver
from polyparallel_torch import testing as torch_testing
from polyparallel_torch.sharding import sharded_over_data

from .namespaces import ModuleMixinBase

__all__ = ["LightningDriver", "reference_module_class", "lightning_plan", "make_trainer"]


def lightning_plan() -> dict[str, Any]:
    """The torch reference plan, addressed from the LightningModule (the MLP is its ``net``)."""
    return {f"net.{path}": style for path, style in torch_testing.reference_plan().items()}


class ReferenceModuleMixin(ModuleMixinBase):
    """The reference MLP as a LightningModule: SGD, cross-entropy, ``self.log(..., sync_dist=True)``.

    :param seed: seeds the MLP's initialisation (``reference_model(seed)``).
    :param dtype: parameter dtype.
    :param lr, momentum: SGD's (momentum gives the optimizer a state to checkpoint).
    :ivar losses: this rank's training loss at each step (for loss-curve comparisons).
    :ivar seen: sample indices of each validation batch, by epoch (when the data set yields them).
    """

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, lr: float = torch_testing.LR,
                 momentum: float = 0.0):
        super().__init__()
        self.net = torch_testing.reference_model(seed, dtype)
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []
        self.seen: dict[int, list[int]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the MLP."""
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy on this rank's batch; the epoch mean is logged count-weighted."""
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Loss and accuracy (means, weighted by batch size) and the sample count (a sum)."""
        if len(batch) == 3:  # (index, x, y): record which samples this rank saw
            index, x, y = batch
            self.seen.setdefault(self.current_epoch, []).extend(int(i) for i in index)
        else:
            x, y = batch
        logits = self.net(x)
        self.log("loss", nn.functional.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        self.log("accuracy", (logits.argmax(-1) == y).to(logits.dtype).mean(), sync_dist=True, batch_size=len(y))
        self.log("samples", torch.tensor(float(len(y)), dtype=logits.dtype), reduce_fx="sum", sync_dist=True,
                 batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD at the reference learning rate."""
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


@functools.cache
def reference_module_class(namespace: str = "lightning.pytorch") -> type:
    """:class:`ReferenceModuleMixin` over the ``LightningModule`` of ``namespace`` (cached)."""
    base = importlib.import_module(namespace).LightningModule
    return type("ReferenceModule", (ReferenceModuleMixin, base), {"__module__": __name__})


def make_trainer(strategy: pp.Strategy, namespace: str = "lightning.pytorch", *, adapter: Any = None,
                 **trainer_kwargs: Any) -> Any:
    """A quiet CPU ``Trainer`` of ``namespace`` with ``strategy.adapt("lightning")`` (or ``adapter``),
    one device per launched process on this node."""
    trainer_cls = importlib.import_module(namespace).Trainer
    if adapter is None:
        plan = {"plan": lightning_plan()} if strategy.topology.size("tensor") != 1 else {}
        adapter = strategy.adapt("lightning", namespace=namespace, **plan)
    options = dict(accelerator="cpu", devices=strategy.world_size, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    options.update(trainer_kwargs)
    return trainer_cls(strategy=adapter, **options)


class _IndexedDataset(torch.utils.data.Dataset):
    """(index, x, y) triples of the reference data set: the validation step records the indices."""

    def __init__(self, n: int):
        self.base = torch_testing.reference_dataset(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return i, x, y


def _replicated_states(module: nn.Module) -> dict[str, list[float]]:
    """Floating states by name (local shards of tensor-parallel DTensors), leaving out what is
    sharded over the data axis (parameters at a sharding stage): those have no replicas, and
    ``sync_states`` leaves them alone."""
    return {name: t.detach().reshape(-1).double().tolist() for name, t in torch_testing.local_states(module)
            if not sharded_over_data(dict([*module.named_parameters(), *module.named_buffers()])[name])}


class LightningDriver(ConformanceDriver):
    """The conformance kit through ``Trainer(strategy=strategy.adapt("lightning"))``.

    :param namespace: the Lightning whose Trainer and LightningModule are used.
    """

    target = "lightning"
    unsupported = (pp.Topology(pipeline=2, data=1),)

    def __init__(self, namespace: str = "lightning.pytorch"):
        self.namespace = namespace

    def _per_rank_batch(self, strategy: pp.Strategy) -> int:
        return self.global_batch // strategy.session().topology.size("data")

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        """Validation loaders are sharded ``uneven`` by the adapter; a fit of ``epoch + 1`` epochs
        (one training batch each) validates once per epoch, with the sampler at that epoch."""
        module = reference_module_class(self.namespace)(strategy.seed)
        train = DataLoader(torch_testing.reference_dataset(self.dataset_size), batch_size=self._per_rank_batch(strategy))
        val = DataLoader(_IndexedDataset(self.dataset_size), batch_size=self._per_rank_batch(strategy), shuffle=True)
        trainer = make_trainer(strategy, self.namespace, max_epochs=epoch + 1, limit_train_batches=1)
        trainer.fit(module, train, val)
        return module.seen[epoch]

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        """:attr:`steps` SGD steps; Lightning's sampler is replaced by ``shard_data`` (pad)."""
        module = reference_module_class(self.namespace)(strategy.seed)
        loader = DataLoader(torch_testing.reference_dataset(self.dataset_size),
                            batch_size=self._per_rank_batch(strategy), shuffle=True)
        trainer = make_trainer(strategy, self.namespace, max_steps=self.steps, limit_val_batches=0)
        trainer.fit(module, loader)
        return torch_testing.flat_params(module.net)

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        """The torch runtime's single-process reference (BatchNorm per data replica)."""
        return torch_testing.ghost_batch_reference(self.steps, self.global_batch, data_size, 0, self.dataset_size)

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float] | None:
        """``trainer.validate`` in float64; the metrics are what ``self.log(sync_dist=True)`` gave."""
        module = reference_module_class(self.namespace)(strategy.seed, torch.float64)
        loader = DataLoader(torch_testing.reference_dataset(self.dataset_size, torch.float64),
                            batch_size=self._per_rank_batch(strategy))
        if strategy.shard_policy.stage == 0:
            double: dict[str, Any] = {"precision": "64-true"}
        else:
            # Lightning refuses Trainer(precision="64-true") with a ModelParallelStrategy (it lists
            # the mixed/low precisions FSDP2 is tuned for); its DoublePrecision plugin, given as a
            # plugin, runs the same float64 evaluation there.
            double = {"plugins": [importlib.import_module(f"{self.namespace}.plugins").DoublePrecision()]}
        trainer = make_trainer(strategy, self.namespace, **double)
        trainer.validate(module, loader, verbose=False)
        metrics = trainer.callback_metrics
        if int(metrics["samples"]) != self.dataset_size:  # a world reduction would count replicas twice
            raise AssertionError(f"validated {float(metrics['samples'])} samples, expected {self.dataset_size}")
        return {"loss": float(metrics["loss"]), "accuracy": float(metrics["accuracy"])}

    def evaluate_reference(self) -> dict[str, float]:
        """The torch runtime's whole-data-set metrics."""
        return torch_testing.TorchDriver().evaluate_reference()

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        """Rank-dependent states set in ``on_validation_start``; the adapter syncs them right after
        (its own ``on_validation_start``), before the first validation batch records them (whole
        tensors at a sharding stage: every rank must then hold the same logical parameter)."""
        probe = _state_probe_class(self.namespace)(strategy.seed)
        if strategy.shard_policy.stage >= 2:
            # FSDP2 shards every parameter over data: no replicas to sync. A replicated buffer
            # (broadcast by the default policy) shows the policy still applies to what is replicated.
            probe.register_buffer("calibration", torch.zeros(4))
        loader = DataLoader(torch_testing.reference_dataset(4), batch_size=2)
        trainer = make_trainer(strategy, self.namespace, limit_val_batches=1)
        trainer.validate(probe, loader, verbose=False)
        policy = strategy.state_policy
        return {name: {"action": policy.action_for(name), "before": probe.before[name], "after": probe.after[name]}
                for name in probe.before}

    def skip_collective(self, strategy: pp.Strategy, skip: bool) -> None:
        """The path of ``self.log(..., sync_dist=True)``: the Lightning strategy's ``reduce``."""
        if not skip:
            lightning_strategy = strategy.adapt("lightning", namespace=self.namespace)
            lightning_strategy.reduce(torch.tensor(1.0))


class _StateProbeMixin(ReferenceModuleMixin):
    def on_validation_start(self) -> None:
        rank = self.trainer.global_rank
        with torch.no_grad():
            # reference_model's BatchNorm (tracking running statistics) and head; no plan shards them
            bn, head = cast(nn.BatchNorm1d, self.net[3]), cast(nn.Linear, self.net[5])
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.fill_(float(rank))
            bn.running_var.fill_(1.0 + rank)
            head.bias.fill_(10.0 + rank)
            calibration = getattr(self, "calibration", None)
            if isinstance(calibration, torch.Tensor):
                calibration.fill_(10.0 + rank)
        self.before = _replicated_states(self)
        self.after: dict[str, list[float]] = {}

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        # Outside the step: under FSDP2 the step runs inside the forward, on gathered parameters.
        if not self.after:
            self.after = _replicated_states(self)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


@functools.cache
def _state_probe_class(namespace: str) -> type:
    return type("StateProbe", (_StateProbeMixin, reference_module_class(namespace)), {"__module__": __name__})
