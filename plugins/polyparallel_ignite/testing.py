"""The conformance driver of the Ignite plugin: the torch reference problem trained and evaluated
by ignite ``Engine``s built through ``strategy.adapt("ignite")``.

Reuses :mod:`polyparallel_torch.testing` (model, data, tensor plan, single-process reference),
so only the loop differs: ignite's supervised trainer and evaluator, ignite's metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import polyparallel as pp
from polyparallel.testing import ConformanceDriver
from polyparallel_torch.testing import (
    LR,
    fill_states,
    ghost_batch_reference,
    local_states,
    reference_dataset,
    reference_model,
    reference_plan,
    stage_params,
)

__all__ = ["IgniteDriver", "float64_defaults", "ignite_metrics", "reference_metrics"]


@contextlib.contextmanager
def float64_defaults() -> Iterator[None]:
    """Ignite's ``Loss`` accumulates in a tensor of the default dtype (float32): evaluate in
    float64 so that a check compares reductions, not float32 rounding of different sums."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def ignite_metrics(classes: int | None = None) -> dict[str, Any]:
    """The ignite metrics the checks compare (``confusion`` when ``classes`` is given)."""
    from ignite.metrics import Accuracy, ConfusionMatrix, Loss, Precision

    out: dict[str, Any] = {"loss": Loss(nn.functional.cross_entropy), "accuracy": Accuracy()}
    if classes:
        out["precision"] = Precision(average=True)
        out["confusion"] = ConfusionMatrix(num_classes=classes)
    return out


def reference_metrics(model: nn.Module, dataset: Any, metrics: dict[str, Any], batch_size: int = 8) -> dict[str, Any]:
    """Single-process ignite evaluation of ``model`` on the whole ``dataset`` (no adapter)."""
    from ignite.engine import create_supervised_evaluator

    with float64_defaults():
        evaluator = create_supervised_evaluator(model, metrics=metrics)
        evaluator.run(DataLoader(dataset, batch_size=batch_size, shuffle=False))
    return dict(evaluator.state.metrics)


def _options(strategy: pp.Strategy) -> dict[str, Any]:
    return {"plan": reference_plan()} if strategy.topology.size("tensor") != 1 else {}


def _inner(model: nn.Module) -> nn.Module:
    from polyparallel_torch.pipeline import PipelineModel
    from polyparallel_torch.tensors import unwrap

    return model.stage if isinstance(model, PipelineModel) else unwrap(model)


class IgniteDriver(ConformanceDriver):
    """Ignite engines through ``strategy.adapt("ignite")`` (data, data x tensor, pipeline x data;
    every loader comes from ``auto_dataloader``, i.e. ``strategy.shard_data``), at any sharding
    stage the torch runtime runs (``auto_model`` and ``auto_optim`` build it)."""

    target = "ignite"
    # Every axis alone is supported; the capabilities exclude pipeline x tensor.
    unsupported = (pp.Topology(tensor=2, pipeline=2),)

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        from ignite.engine import Engine, Events

        ignite = strategy.adapt("ignite")
        loader = ignite.auto_dataloader(TensorDataset(torch.arange(self.dataset_size)), batch_size=self.global_batch,
                                        remainder="uneven", shuffle=True)
        seen: list[int] = []
        engine = ignite.attach(Engine(lambda e, batch: batch[0].tolist()), data=loader)
        # The sampler's epoch follows engine.state.epoch: keep what the last epoch saw.
        engine.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.clear())
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.extend(e.state.output))
        engine.run(loader, max_epochs=epoch + 1)
        return seen

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        ignite = strategy.adapt("ignite")
        data_size = strategy.session().topology.size("data")
        # Full batches only (drop_last), as the reference's global batches.
        template = DataLoader(reference_dataset(self.dataset_size), batch_size=self.global_batch // data_size,
                              drop_last=True)
        loader = ignite.auto_dataloader(template, batch_size=self.global_batch, remainder="pad", shuffle=True)
        model = ignite.auto_model(reference_model(strategy.seed), **_options(strategy))
        optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=LR), model)
        trainer = ignite.create_supervised_trainer(model, optimizer, nn.functional.cross_entropy, data=loader)
        trainer.run(loader, max_iters=self.steps)
        return stage_params(model)  # a pipeline stage: its own stage's parameters

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        return ghost_batch_reference(self.steps, self.global_batch, data_size, 0, self.dataset_size)

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float] | None:
        ignite = strategy.adapt("ignite")
        dataset = reference_dataset(self.dataset_size, torch.float64)
        loader = ignite.auto_dataloader(dataset, batch_size=self.global_batch, remainder="uneven", shuffle=False)
        model = ignite.auto_model(reference_model(strategy.seed, torch.float64), **_options(strategy))
        evaluator = ignite.create_supervised_evaluator(model, ignite_metrics(), data=loader)
        with float64_defaults():
            evaluator.run(loader)
        return dict(evaluator.state.metrics) if ignite.holds_metrics else None

    def evaluate_reference(self) -> dict[str, float]:
        dataset = reference_dataset(self.dataset_size, torch.float64)
        return reference_metrics(reference_model(0, torch.float64), dataset, ignite_metrics())

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        ignite = strategy.adapt("ignite")
        module = reference_model(strategy.seed)
        sharded: Any = lambda t: False  # noqa: E731
        if strategy.shard_policy.stage >= 2:
            from polyparallel_torch.sharding import sharded_over_data

            # FSDP2 shards every parameter over data: they have no replicas, and sync_states leaves
            # them alone. A replicated buffer shows the policy still applies to what is replicated.
            module.register_buffer("calibration", torch.zeros(4))
            sharded = sharded_over_data
        inner = _inner(ignite.auto_model(module, **_options(strategy)))
        fill_states(inner, strategy.session().rank)
        replicated = {n for n, t in [*inner.named_parameters(), *inner.named_buffers()] if not sharded(t)}
        before = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner) if n in replicated}
        strategy.sync_states(inner)
        after = {n: t.detach().reshape(-1).double().tolist() for n, t in local_states(inner) if n in replicated}
        policy = strategy.state_policy
        return {n: {"action": policy.action_for(n), "before": before[n], "after": after[n]} for n in before}

    def skip_collective(self, strategy: pp.Strategy, skip: bool) -> None:
        """The skipping rank runs the same evaluator (forward passes and their tensor/pipeline
        collectives included) but attaches no metric, so it never joins the metric reduction."""
        ignite = strategy.adapt("ignite")
        dataset = reference_dataset(self.dataset_size)
        loader = ignite.auto_dataloader(dataset, batch_size=self.global_batch, remainder="uneven", shuffle=False)
        model = ignite.auto_model(reference_model(strategy.seed), **_options(strategy))
        evaluator = ignite.create_supervised_evaluator(model, {} if skip else ignite_metrics(), data=loader)
        evaluator.run(loader)

