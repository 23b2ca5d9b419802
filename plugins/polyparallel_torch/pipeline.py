"""Pipeline stages for ``wrap_model`` on ``pipeline > 1``, on ``torch.distributed.pipelining``.

An ``nn.Sequential`` is cut into ``pipeline`` contiguous stages (balanced by parameter count, or
at ``split_points=``); each rank builds its stage as a ``PipelineStage`` over its pipeline group
and runs a ``ScheduleGPipe`` of ``microbatches`` micro-batches. Every rank calls the same
``model.step(x, y)`` with the same batch (ranks along the pipeline axis get identical batches
from ``shard_data``); the wrapper hands the inputs to the first stage and the targets to the
last. Data parallelism over the data axis is ``strategy.sync_grads(model)`` after each step
(bucketed all-reduce of the stage's gradients over the data group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import TorchRuntime

__all__ = ["PipelineModel", "split_sequential", "validate_pipeline"]


def split_sequential(model: nn.Sequential, stages: int, split_points: list[int] | None = None) -> list[tuple[int, int]]:
    """Child-index ranges ``[(start, end), ...]`` of each stage.

    Without ``split_points``, contiguous ranges are balanced greedily by parameter count, every
    stage getting at least one child.
    """
    n = len(model)
    if split_points is not None:
        points = list(split_points)
        if len(points) != stages - 1 or points != sorted(set(points)) or not all(0 < p < n for p in points):
            raise pp.TopologyError(
                f"split_points must be {stages - 1} increasing child indices in (0, {n}) for pipeline={stages}. "
                f"Received: {split_points!r}."
            )
        bounds = [0, *points, n]
        return list(zip(bounds[:-1], bounds[1:]))
    sizes = [sum(p.numel() for p in child.parameters()) + 1 for child in model]
    target = sum(sizes) / stages
    ranges, start, acc = [], 0, 0.0
    for i, size in enumerate(sizes):
        acc += size
        remaining_children, remaining_stages = n - i - 1, stages - len(ranges) - 1
        if len(ranges) < stages - 1 and (acc >= target or remaining_children == remaining_stages):
            ranges.append((start, i + 1))
            start, acc = i + 1, 0.0
    ranges.append((start, n))
    return ranges


def validate_pipeline(model: nn.Module, topology: pp.Topology, options: dict[str, Any]) -> None:
    """Refuse what the pipeline path cannot run, before any collective."""
    stages = topology.size("pipeline")
    if topology.size("tensor") > 1:
        raise pp.UnsupportedTopologyError(
            f"the torch runtime cannot combine pipeline={stages} with tensor={topology.size('tensor')} yet; "
            "use pipeline x data, or tensor x data."
        )
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"pipeline={stages} needs an nn.Sequential to cut into stages; received {type(model).__name__}.")
    if len(model) < stages:
        raise pp.TopologyError(f"an nn.Sequential of {len(model)} layers cannot fill pipeline={stages} stages.")
    if options.get("loss_fn") is None or not callable(options["loss_fn"]):
        raise TypeError("pipeline>1 needs wrap_model(model, loss_fn=callable(output, target)): the last stage "
                        "computes the loss inside the pipeline schedule.")
    microbatches = options.get("microbatches", stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise TypeError(f"microbatches must be a positive int. Received: {microbatches!r}.")
    split_sequential(model, stages, options.get("split_points"))


class PipelineModel(nn.Module):
    """This rank's pipeline stage plus its schedule.

    :ivar module: the stage's ``nn.Sequential`` (its ``parameters()`` are what the optimizer gets).
    :ivar is_first, is_last: whether this rank holds the first / last stage (the last holds loss
        and outputs: the ``loss`` and ``metrics`` roles).
    """

    def __init__(self, model: nn.Sequential, rt: TorchRuntime, loss_fn: Callable[..., torch.Tensor],
                 microbatches: int, split_points: list[int] | None = None):
        super().__init__()
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        stages = rt.topology.size("pipeline")
        index = rt.session.coords["pipeline"]
        start, end = split_sequential(model, stages, split_points)[index]
        self.module = nn.Sequential(*list(model.children())[start:end]).to(rt.device)
        self.stage_index, self.num_stages, self.microbatches = index, stages, microbatches
        self.is_first, self.is_last = index == 0, index == stages - 1
        self._rt = rt
        self._stage = PipelineStage(self.module, index, stages, rt.device, group=rt.group("pipeline"))
        self._schedule = ScheduleGPipe(self._stage, n_microbatches=microbatches, loss_fn=loss_fn)
        # Forward-only runs without targets need a schedule that computes no loss.
        self._eval_schedule = ScheduleGPipe(self._stage, n_microbatches=microbatches)

    def _run(self, run: Callable[..., Any], x: Any, target: Any, losses: list[torch.Tensor] | None) -> Any:
        if len(x) % self.microbatches:
            raise pp.TopologyError(
                f"a pipeline batch of {len(x)} samples does not split into {self.microbatches} micro-batches; "
                "use a per-rank batch size that is a multiple of microbatches (and remainder='drop')."
            )
        args = (x,) if self.is_first else ()
        kwargs = {"target": target, "losses": losses} if self.is_last and target is not None else {}
        with self._rt.collective("pipeline schedule", "pipeline"):
            return run(*args, **kwargs)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch through all stages. Returns the batch's mean loss
        on the last stage, ``None`` on the others. Gradients are left in ``.grad`` (call
        ``strategy.sync_grads(model)`` then the optimizer)."""
        losses: list[torch.Tensor] = []
        self._run(self._schedule.step, x, target, losses)
        return torch.stack(losses).mean().detach() if self.is_last else None

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only (evaluation): the model's outputs on the last stage, ``None`` elsewhere."""
        with torch.no_grad():
            if target is None:
                return self._run(self._eval_schedule.eval, x, None, None)
            return self._run(self._schedule.eval, x, target, [])
