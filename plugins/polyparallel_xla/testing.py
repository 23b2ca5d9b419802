"""Test support for the XLA runtime: several XLA CPU devices in one process, and the
conformance drivers (the torch reference loop, and the fastai adapter's driver on XLA). Nothing here is used by the runtime itself.

**Why a shim.** On PJRT CPU (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``) the N replicas are
threads of one process, and multi-device collectives deadlock upstream (pytorch/xla issue 9089):
replica threads that reach ``torch_xla.sync()`` together each compile the same graph and get
different collective keys (``op_id``), so XLA's rendezvous never completes and XLA aborts the
process after its termination timeout (10 s, also when a peer is merely slow); buffer donation and token release block as well, and
the execution thread pool defaults to the core count. Replicas must also build identical graphs:
torch_xla folds the scalars 0 and 1 into a graph as constants, so a rank-dependent ``fill_(rank)``
would give each replica its own graph. On TPU each replica is its own process and
none of this applies. :func:`install_ordered_sync` waits for every replica thread at each sync, then lets one at a time compile and
launch its graph (the next one then finds it in the compilation cache, with the same keys), and
:data:`CPU_ENV` turns off parameter aliasing, widens the thread pool and keeps 0 and 1 as data. With both, all-reduce,
``xm.optimizer_step`` and ``MpDeviceLoader`` work at 2 and 4 CPU devices.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel_torch.testing import LR, TorchDriver, reference_dataset, reference_model

__all__ = ["CPU_ENV", "XlaDriver", "cpu_env", "install_ordered_sync", "seeded_model"]

#: Environment for N XLA CPU devices served by threads (besides ``CPU_NUM_DEVICES``).
CPU_ENV = {"PJRT_DEVICE": "CPU", "XLA_ENABLE_PARAM_ALIASING": "false", "XLA_THREAD_POOL_SIZE": "16",
           "XLA_NO_SPECIAL_SCALARS": "1"}

_lock = threading.Lock()
_installed: dict[str, Any] = {}


def cpu_env(devices: int) -> dict[str, str]:
    """:data:`CPU_ENV` with ``CPU_NUM_DEVICES=devices``."""
    return {**CPU_ENV, "CPU_NUM_DEVICES": str(devices)}


def install_ordered_sync() -> None:
    """Replace ``torch_xla.sync`` (which ``xm.mark_step`` and ``MpDeviceLoader`` call too) in *this
    process* by one that lets a single replica thread compile and launch at a time, and
    ``xm.all_reduce`` by one that syncs first. Idempotent.
    ``xm.all_reduce`` (which ``xm.optimizer_step`` calls) executes the replica's pending work
    first, in such an ordered sync, so that the collective's graph is the same in every replica.
    Only for tests on PJRT CPU devices (pytorch/xla issue 9089); call it in the launched replicas."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    with _lock:
        if "sync" in _installed:
            return
        original = torch_xla.sync
        turn = threading.Lock()
        # Every replica thread reaches each sync (the loops are alike); waiting for all of them
        # first keeps one replica's collective from waiting in XLA's rendezvous, whose 10 s
        # termination timeout aborts the process, while another is still busy on a loaded machine.
        arrive = threading.Barrier(int(os.environ.get("CPU_NUM_DEVICES", "1")), timeout=120)

        def ordered_sync(wait: bool = False, reset_scope: bool = True) -> None:
            arrive.wait()
            with turn:
                original(wait, reset_scope)

        original_all_reduce = xm.all_reduce

        def all_reduce_alone(*args: Any, **kwargs: Any) -> Any:
            # A graph holding a collective must be the same in every replica (one compilation,
            # the same keys), but a replica's pending work may differ: fastai keeps the last
            # batch's predictions alive, and an uneven shard's last batch has another shape. That
            # work is executed first, so the collective's graph holds the collective alone.
            ordered_sync()
            return original_all_reduce(*args, **kwargs)

        _installed["sync"] = original
        _installed["all_reduce"] = original_all_reduce
        torch_xla.sync = ordered_sync
        xm.all_reduce = all_reduce_alone


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
