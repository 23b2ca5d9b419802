"""The conformance driver of the torch runtime (plain PyTorch objects through a Strategy).

Also the reference problem other torch-based plugins (Lightning, Ignite, ...) reuse: the same
MLP, data and single-process reference, so their drivers only replace the training loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel._errors import exception_summary
from polyparallel.testing import ConformanceDriver, reference_data

from .data import TopologySampler
from .sharding import make_optimizer, sharded_over_data
from .tensors import full_state, unwrap

__all__ = [
    "TorchDriver",
    "failure_text",
    "fill_states",
    "flat_params",
    "ghost_batch_reference",
    "local_states",
    "momentum_buffers",
    "reference_dataset",
    "reference_model",
    "reference_plan",
    "source_line",
    "stage_params",
]

FEATURES, HIDDEN, CLASSES, LR = 8, 16, 4, 0.1


def reference_dataset(n: int, dtype: torch.dtype = torch.float32) -> TensorDataset:
    """:func:`polyparallel.testing.reference_data` as a ``TensorDataset``."""
    xs, ys = reference_data(n, FEATURES, CLASSES)
    return TensorDataset(torch.tensor(xs, dtype=dtype), torch.tensor(ys))


def reference_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Linear-ReLU-Linear (a tensor-parallel column/row pair), BatchNorm, ReLU, Linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
        nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES),
    ).to(dtype)


def reference_plan() -> dict[str, Any]:
    """Megatron pair on the first two Linear layers; BatchNorm and head stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def momentum_buffers(optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """Momentum buffers of an SGD optimizer by parameter position, gathered to full tensors
    (a checkpoint's optimizer state compared across topologies)."""
    out = {}
    for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is not None:
            buffer = buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer
            out[str(i)] = buffer.reshape(-1).double().tolist()
    return out


def source_line(fn: Any, text: str) -> int:
    """The line number of the first line of ``fn``'s source containing ``text`` (what a trace or
    desync report names as the caller's location)."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def failure_text(fn: Any) -> str | None:
    """``"ExceptionType: message"`` of what ``fn()`` raises, or ``None``: a worker returns it so that
    every rank's outcome comes back to the test."""
    try:
        fn()
    except Exception as exc:
        return exception_summary(exc, first_line=False)
    return None


def flat_params(model: nn.Module) -> dict[str, list[float]]:
    """Full (gathered) parameters as name -> flat list of floats."""
    names = {n for n, _ in unwrap(model).named_parameters()}
    return {k: v.reshape(-1).double().tolist() for k, v in full_state(model).items() if k in names}


def plain_loop(strategy: Any, model: nn.Module, loader: Any, epochs: int) -> dict[str, Any]:
    """The plain torch loop the framework comparisons take as their reference: ``wrap_model``,
    SGD at :data:`LR`, ``sync_grads`` after each backward, ``loader.sampler.set_epoch`` each epoch.
    Returns each step's loss (this rank's micro-batch) and the final parameters (:func:`flat_params`)."""
    import torch.nn.functional as F

    model = strategy.wrap_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            strategy.sync_grads(model)
            opt.step()
            losses.append(float(loss.detach()))
    return {"losses": losses, "params": flat_params(model)}


def global_batches(n: int, global_batch: int, steps: int, seed: int) -> list[list[int]]:
    """The sample indices of each full global batch, in the epoch order of ``TopologySampler``
    (the data axis then strides each batch: replica r gets positions r, r+d, ...)."""
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < steps:
        order = TopologySampler(n, 0, 1, seed=seed).indices(epoch)
        batches += [order[i:i + global_batch] for i in range(0, n - n % global_batch, global_batch)]
        epoch += 1
    return batches[:steps]


def ghost_batch_reference(steps: int, global_batch: int, data_size: int, seed: int = 0,
                          n: int = 37) -> dict[str, list[float]]:
    """Single-process SGD on the same global batches. BatchNorm computes statistics per
    data-parallel replica (each rank's slice of the global batch, as DDP without SyncBatchNorm
    does: torch's SyncBatchNorm is CUDA-only), so the reference does the same ("ghost batches"):
    the loss is the mean over replicas of each replica's mean loss — equal to DDP's averaged
    gradients because every replica holds ``global_batch / data_size`` samples."""
    ds = reference_dataset(n)
    model = reference_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in global_batches(n, global_batch, steps, seed):
        # TopologySampler strides the epoch order: replica r gets positions r, r+d, r+2d, ...
        losses = []
        for r in range(data_size):
            idx = batch[r::data_size]
            x, y = ds.tensors[0][idx], ds.tensors[1][idx]
            losses.append(nn.functional.cross_entropy(model(x), y))
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()
    return flat_params(model)


def stage_params(model: nn.Module) -> dict[str, list[float]]:
    """The parameters this rank holds: its own stage's for a pipeline (under their names in the
    unsplit model), else the full (gathered) parameters."""
    from .pipeline import PipelineModel

    if isinstance(model, PipelineModel):
        names = {n for n, _ in model.stage.named_parameters()}  # FSDP2 over data: gathered (every rank calls)
        return {n: t.reshape(-1).double().tolist() for n, t in full_state(model.stage).items() if n in names}
    return flat_params(model)


def fill_states(module: nn.Module, rank: int) -> None:
    """Give ``module``'s BatchNorm statistics and biases values that differ between ranks."""
    with torch.no_grad():
        for name, t in local_states(module):
            if name.endswith("running_mean"):
                t.fill_(float(rank))
            elif name.endswith("running_var"):
                t.fill_(1.0 + rank)
            elif name.endswith("bias") or name.endswith("calibration"):
                t.fill_(10.0 + rank)


class TorchDriver(ConformanceDriver):
    """Plain PyTorch through ``Strategy.shard_data/wrap_model/sync_grads/reduce_metrics/sync_states``
    (data, data x tensor, and pipeline x data with ``PipelineModel.train_step``/``eval_step``), at
    any sharding stage (the optimizer from :func:`polyparallel_torch.make_optimizer`)."""

    target = "torch"
    unsupported = (pp.Topology(pipeline=2, tensor=2),)

    def _options(self, strategy: pp.Strategy) -> dict[str, Any]:
        topology = strategy.session().topology
        if topology.size("pipeline") > 1:
            # One micro-batch: BatchNorm then sees each replica's whole batch, as the reference.
            return {"microbatches": 1, "loss_fn": nn.functional.cross_entropy}
        return {"plan": reference_plan()} if topology.size("tensor") != 1 else {}

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        n = self.dataset_size
        ds = TensorDataset(torch.arange(n))
        loader = strategy.shard_data(ds, batch_size=self.global_batch, remainder="uneven", shuffle=True)
        loader.sampler.set_epoch(epoch)
        return [int(i) for (batch,) in loader for i in batch]

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        from .pipeline import PipelineModel

        ds = reference_dataset(self.dataset_size)
        loader = strategy.shard_data(ds, batch_size=self.global_batch, remainder="pad", shuffle=True)
        model = strategy.wrap_model(reference_model(strategy.seed), **self._options(strategy))
        opt = make_optimizer(strategy, model, torch.optim.SGD, lr=LR)  # ZeroRedundancyOptimizer at zero=1
        step = 0
        while step < self.steps:
            for x, y in loader:  # the sampler advances the epoch by itself
                if len(y) * strategy.session().topology.size("data") != self.global_batch:
                    continue  # a short last batch: the reference skips it too
                opt.zero_grad()
                if isinstance(model, PipelineModel):
                    model.train_step(x, y)  # every stage, the same batch (replicas of one data coordinate)
                else:
                    nn.functional.cross_entropy(model(x), y).backward()
                strategy.sync_grads(model)  # DDP, FSDP2: a documented no-op (they reduced in backward)
                opt.step()
                step += 1
                if step == self.steps:
                    break
        return stage_params(model)

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        return ghost_batch_reference(self.steps, self.global_batch, data_size, 0, self.dataset_size)

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float] | None:
        from .pipeline import PipelineModel

        ds = reference_dataset(self.dataset_size, torch.float64)
        loader = strategy.shard_data(ds, batch_size=self.global_batch, remainder="uneven", shuffle=False)
        model = strategy.wrap_model(reference_model(strategy.seed, torch.float64), **self._options(strategy)).eval()
        pipeline = isinstance(model, PipelineModel)
        total, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in loader:
                logits = model.eval_step(x) if pipeline else model(x)
                if logits is None:
                    continue  # not the last stage: the outputs live there
                total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(-1) == y).sum())
                count += len(y)
        if pipeline and not model.is_last:
            return None  # its data group (the other first-stage ranks) holds no metrics either
        return strategy.reduce_metrics({"loss": pp.Mean(total, count), "accuracy": pp.Mean(correct, count)})

    def evaluate_reference(self) -> dict[str, float]:
        x, y = reference_dataset(self.dataset_size, torch.float64).tensors
        model = reference_model(0, torch.float64).eval()
        with torch.no_grad():
            logits = model(x)
        return {"loss": float(nn.functional.cross_entropy(logits, y)),
                "accuracy": float((logits.argmax(-1) == y).double().mean())}

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        from .pipeline import PipelineModel

        module = reference_model(strategy.seed)
        if strategy.shard_policy.stage >= 2:
            # FSDP2 shards every parameter over data: they have no replicas, and sync_states leaves
            # them alone. A replicated buffer (broadcast by the default policy) shows the policy
            # still applies to what is replicated, next to BatchNorm's statistics (mean).
            module.register_buffer("calibration", torch.zeros(4))
        model = strategy.wrap_model(module, **self._options(strategy))
        inner = model.stage if isinstance(model, PipelineModel) else unwrap(model)
        fill_states(inner, strategy.session().rank)
        replicated = {n for n, t in [*inner.named_parameters(), *inner.named_buffers()] if not sharded_over_data(t)}
        before = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner) if n in replicated}
        strategy.sync_states(model)
        after = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner) if n in replicated}
        policy = strategy.state_policy
        return {n: {"action": policy.action_for(n), "before": before[n], "after": after[n]} for n in before}


def local_states(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Floating-point parameters and buffers of ``module`` (local shards of DTensors), by name."""
    out = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point():
            out.append((name, t))
    return out
