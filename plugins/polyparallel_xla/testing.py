"""Test support for the XLA runtime: the conformance drivers (the torch reference loop, and the
fastai adapter's driver on XLA), and, re-exported from :mod:`polyparallel_xla.cpu` (which the
runtime applies itself when ``polyparallel.launch`` starts replicas on PJRT CPU), the settings
for several XLA CPU devices in one process.

Why the settings are needed: :mod:`polyparallel_xla.cpu` (pytorch/xla issue 9089). Replicas must also
build identical graphs: torch_xla folds the scalars 0 and 1 into a graph as constants, so a
rank-dependent ``fill_(rank)`` would give each replica its own graph.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel_torch.testing import LR, TorchDriver, reference_dataset, reference_model

from .cpu import CPU_ENV, cpu_env, install_ordered_sync

__all__ = ["CPU_ENV", "XlaDriver", "cpu_env", "install_ordered_sync", "seeded_model"]

_rng = threading.Lock()


def seeded_model(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """:func:`~polyparallel_torch.testing.reference_model`, built by one replica thread at a time:
    replica threads share torch's CPU random generator, so seeding and drawing must not interleave."""
    with _rng:
        return reference_model(seed, dtype)


class XlaDriver(TorchDriver):
    """The torch runtime's reference problem through the XLA runtime: ``shard_data`` gives an
    ``MpDeviceLoader`` of device batches, the model lives on the XLA device, gradients are
    averaged by ``sync_grads`` (XLA all-reduce over the data group), steps end with
    ``torch_xla.sync()``. BatchNorm statistics are per replica (as under DDP), so the reference
    is the torch driver's ghost-batch one."""

    target = "xla"
    unsupported = (pp.Topology(data=2, tensor=2),)
    startup_seconds = 90.0

    def bind(self, strategy: pp.Strategy) -> pp.Strategy:
        install_ordered_sync()
        return strategy

    def _options(self, strategy: pp.Strategy) -> dict[str, Any]:
        return {}

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        loader = strategy.shard_data(TensorDataset(torch.arange(self.dataset_size)), batch_size=self.global_batch,
                                     remainder="uneven", shuffle=True)
        loader.sampler.set_epoch(epoch)
        return [int(i) for (batch,) in loader for i in batch.cpu()]

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        import torch_xla

        ds = reference_dataset(self.dataset_size)
        loader = strategy.shard_data(ds, batch_size=self.global_batch, remainder="pad", shuffle=True)
        model = strategy.wrap_model(seeded_model(strategy.seed))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        data_size = strategy.session().topology.size("data")
        step = 0
        while step < self.steps:
            for x, y in loader:
                if len(y) * data_size != self.global_batch:
                    continue
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                strategy.sync_grads(model)
                opt.step()
                torch_xla.sync()
                step += 1
                if step == self.steps:
                    break
        return {n: p.detach().cpu().reshape(-1).double().tolist() for n, p in model.named_parameters()}

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float] | None:
        ds = reference_dataset(self.dataset_size, torch.float64)
        loader = strategy.shard_data(ds, batch_size=self.global_batch, remainder="uneven", shuffle=False)
        model = strategy.wrap_model(seeded_model(strategy.seed, torch.float64)).eval()
        total, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in loader:
                logits = model(x).cpu()
                y = y.cpu()
                total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(-1) == y).sum())
                count += len(y)
        return strategy.reduce_metrics({"loss": pp.Mean(total, count), "accuracy": pp.Mean(correct, count)})

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        from polyparallel_torch.testing import fill_states, local_states

        model = strategy.wrap_model(seeded_model(strategy.seed))
        fill_states(model, strategy.session().rank)
        before = {n: t.detach().cpu().reshape(-1).double().tolist() for n, t in local_states(model)}
        strategy.sync_states(model)
        after = {n: t.detach().cpu().reshape(-1).double().tolist() for n, t in local_states(model)}
        policy = strategy.state_policy
        return {n: {"action": policy.action_for(n), "before": before[n], "after": after[n]} for n in before}
