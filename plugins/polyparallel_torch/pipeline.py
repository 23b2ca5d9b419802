"""Pipeline stages on ``torch.distributed.pipelining``: ``wrap_model`` on ``pipeline > 1``.

An ``nn.Sequential`` is cut into ``pipeline`` contiguous stages (:func:`split_sequential`:
balanced by parameter count, or at ``split_points=``; stages keep the original child names, so
``state_dict`` keys match the unsplit model). Each rank keeps its stage in a ``PipelineStage``
over the runtime's ``pipeline`` group and runs it with ``ScheduleGPipe``; the loss is computed on
the last stage only. Every rank calls the same ``train_step(x, y)`` with the same batch (ranks
along the pipeline axis get identical batches from ``shard_data``); the model hands the inputs to
the first stage and the targets to the last. With ``data > 1`` each rank's stage module is an
FSDP2 module over the data group, as torchtitan does, and the schedule drives it
(``PipelineStage`` turns gradient sync off for every micro-batch's backward and reduces once after
the last): at zero=2/3 sharded (units kept gathered between forward and backward,
``reshard_after_forward=False``, one reduce-scatter per step); at zero=0 replicated — HSDP over
the runtime mesh's ``("data", "tensor")`` slice, a ``(data, 1)`` mesh (``tensor`` is 1 with a
pipeline), so parameters stay whole, replicate over ``data`` and backward all-reduces their
gradients; no process group is made for it. ``strategy.sync_grads(model)`` is then a no-op (with
``GradPolicy(check_backward=True)``, an identity check); no pipeline path uses the
hand-bucketed ``sync_grads``. zero=1 with a pipeline is refused before launch:
``ZeroRedundancyOptimizer`` cannot broadcast the stage's DTensor parameters ("c10d.broadcast_ does not have a sharding strategy", torch 2.13).
Why not DDP at zero=0/1: with the ``PipelineStage`` built around the DDP module, as pipelining
expects (forward and every micro-batch's backward under ``no_sync``, ``prepare_for_backward``
before the last), DDP's reducer records each parameter once per micro-batch in its first step
and asserts on the second ("rebuilt parameter indices size is not same as original model
parameters size. Original model param size is: 4 versus rebuilt params size of: 8", 2
micro-batches, torch 2.13); ``static_graph=True`` runs but gives wrong gradients. Every send/receive is bounded by the
group's timeout (the strategy's) and a failure names the ``pipeline`` axis and the rank; each step
starts with the runtime's identity check over the pipeline group, so a stage that runs another
step (an evaluation while its peers train, another batch size) fails at once naming both sides.

``PipelineStage`` infers activation shapes on its first step and reuses them, so a batch of
another size (the short last batch of an evaluation) gets its own stage and schedule, cached by
``(batch size, training)``; all of them share the stage's parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .tensors import full_state

__all__ = ["split_sequential", "PipelineModel", "validate_pipeline", "wrap_pipeline"]


def split_sequential(model: nn.Module, num_stages: int, boundaries: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential`` into ``num_stages`` contiguous stages that keep the original
    child names (so ``state_dict`` keys match the unsplit model).

    :param boundaries: indices of the first child of stages 1..n-1; by default stages are
        balanced by parameter count (every stage gets at least one child).
    :raises TypeError: ``model`` is not an ``nn.Sequential`` (any module is accepted, and refused
        with what to do instead).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pipeline={num_stages} needs an nn.Sequential to cut into stages; received {type(model).__name__}. "
            "Express the model as nn.Sequential, or pass stages=[module_for_stage_0, ...] to auto_model."
        )
    children = list(model.named_children())
    if len(children) < num_stages:
        raise pp.TopologyError(
            f"pipeline={num_stages} needs at least {num_stages} children in the nn.Sequential; it has {len(children)}.")
    if boundaries is None:
        sizes = [sum(p.numel() for p in m.parameters()) + 1 for _, m in children]
        total, boundaries, acc = sum(sizes), [], 0
        for i, size in enumerate(sizes):
            acc += size
            stage = len(boundaries) + 1
            left = len(children) - (i + 1)
            if stage < num_stages and (acc >= total * stage / num_stages or left == num_stages - stage):
                boundaries.append(i + 1)
    boundaries = list(boundaries)
    cuts = [0, *boundaries, len(children)]
    if len(boundaries) != num_stages - 1 or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise pp.TopologyError(
            f"stage boundaries {boundaries} do not cut {len(children)} children into {num_stages} non-empty stages; "
            f"give {num_stages - 1} increasing indices between 1 and {len(children) - 1}.")
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in zip(cuts, cuts[1:])]


class PipelineModel(nn.Module):
    """This rank's stage of a pipeline-parallel model and the schedules that run it.

    All ranks of a pipeline group must call :meth:`train_step` / :meth:`eval_step` together,
    with batches of the same size (ranks that share a data coordinate get identical batches
    from ``shard_data``, so this holds under the adapter's loaders).

    :param stage: this rank's stage module (parameters and buffers of this stage only).
    :param runtime: the strategy's torch runtime (groups, device, bounded collectives).
    :param microbatches: GPipe micro-batches per step (each batch is split along dim 0).

    :param runner: the module the schedule runs, when not ``stage`` itself (a wrapper that is not
        registered here, so ``state_dict`` keys stay the stage's).
    :param data_parallel: how the stage's replicas over ``data`` reduce their gradients in
        backward: ``"fsdp"`` (FSDP2, sharded or replicated), or ``None`` (no replicas).
    """

    def __init__(self, stage: nn.Module, runtime: Any, microbatches: int = 1,
                 loss_fn: Callable[..., torch.Tensor] | None = None, runner: nn.Module | None = None,
                 data_parallel: str | None = None):
        super().__init__()
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int. Received: {microbatches!r}.")
        self.stage = stage.to(runtime.device)
        self.data_parallel = data_parallel
        self._runner = [runner if runner is not None else self.stage]  # a list: not a registered submodule
        self.runtime = runtime
        self.microbatches = microbatches
        self.stage_index = runtime.session.coords["pipeline"]
        self.num_stages = runtime.topology.size("pipeline")
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._loss_fn: Callable[..., torch.Tensor] | None = loss_fn

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it feeds the inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (outputs, loss and metrics live here)."""
        return self.stage_index == self.num_stages - 1

    def _schedule(self, batch: int, training: bool) -> Any:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        key = (batch, training)
        if key not in self._schedules:
            if batch % self.microbatches:
                raise pp.TopologyError(
                    f"a batch of {batch} samples does not split into microbatches={self.microbatches}; use a "
                    "per-rank batch size that is a multiple of it (evaluation: DataPolicy remainder='drop' or pad).")
            stage = PipelineStage(self._runner[0], self.stage_index, self.num_stages, self.runtime.device,
                                  group=self.runtime.group("pipeline"))
            loss_fn = self._loss_fn if training else None
            self._schedules[key] = ScheduleGPipe(stage, self.microbatches, loss_fn=loss_fn)
        return self._schedules[key]

    def _run(self, schedule: Any, x: torch.Tensor, y: torch.Tensor | None, losses: list | None, what: str,
             evaluate: bool) -> Any:
        args = (x,) if self.is_first else ()
        target = y if self.is_last else None
        # One identity check per step: every stage runs the same schedule on a batch of one size.
        with self.runtime.operation(what, "pipeline", f"batch {len(x)}"), self.runtime.collective(what, "pipeline"):
            if evaluate:
                return schedule.eval(*args, target=target, losses=losses)
            return schedule.step(*args, target=target, losses=losses)

    def train_step(self, x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch through every stage (GPipe). Gradients land in this
        stage's parameters. Returns the batch's mean loss on the last stage, ``None`` elsewhere.

        :param loss_fn: ``loss_fn(output, target)``; by default the one given to ``wrap_model``.
        """
        loss_fn = loss_fn or self._loss_fn
        if loss_fn is None:
            raise TypeError("train_step() needs a loss_fn (here or in wrap_model(..., loss_fn=)).")
        if self._loss_fn is not loss_fn or not any(k[1] for k in self._schedules):
            self._loss_fn = loss_fn
            self._schedules = {k: v for k, v in self._schedules.items() if not k[1]}
        self.stage.train()
        losses: list[torch.Tensor] = []
        self._run(self._schedule(len(x), True), x, y, losses, "pipeline train_step (GPipe)", evaluate=False)
        return torch.stack(losses).mean().detach() if self.is_last else None

    @torch.no_grad()
    def eval_step(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only. Returns the model's output on the last stage, ``None`` elsewhere."""
        self.stage.eval()
        return self._run(self._schedule(len(x), False), x, None, None, "pipeline eval_step (GPipe)", evaluate=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Same as :meth:`eval_step` without disabling gradients (every stage must call it)."""
        self.stage.eval()
        return self._run(self._schedule(len(x), False), x, None, None, "pipeline forward", evaluate=True)

    def gather_state(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict`` (every stage's entries), gathered on every rank of the
        pipeline group (for checks and single-file checkpoints of small models). Every rank calls
        it: with ``data > 1`` the stage's FSDP2 parameters are gathered over ``data`` first."""
        local = full_state(self.stage)
        merged: dict[str, torch.Tensor] = {}
        for part in self.runtime.all_gather_object(local, "gather pipeline state", "pipeline"):
            merged.update(part)
        return merged


def validate_pipeline(model: nn.Module, topology: pp.Topology, options: dict[str, Any]) -> None:
    """Refuse what the pipeline path cannot run, before any collective."""
    stages = topology.size("pipeline")
    if topology.size("tensor") > 1:
        raise pp.UnsupportedTopologyError(
            f"the torch runtime cannot combine pipeline={stages} with tensor={topology.size('tensor')} yet; "
            "use pipeline x data, or tensor x data."
        )
    microbatches = options.get("microbatches", stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise TypeError(f"microbatches must be a positive int. Received: {microbatches!r}.")
    loss_fn = options.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(output, target). Received: {loss_fn!r}.")
    given = options.get("stages")
    if given is not None:
        if options.get("split_points") is not None:
            raise TypeError("wrap_model() takes stages= or split_points=, not both.")
        if len(given) != stages or not all(isinstance(m, nn.Module) for m in given):
            raise pp.TopologyError(f"stages= must be {stages} modules, one per pipeline stage. Received: {given!r}.")
        return
    split_sequential(model, stages, options.get("split_points"))


def wrap_pipeline(model: nn.Module, runtime: Any, options: dict[str, Any], strategy: pp.Strategy) -> PipelineModel:
    """This rank's :class:`PipelineModel` of ``model`` (options checked by :func:`validate_pipeline`):
    the stage cut from ``model`` (or taken from ``stages=``); with ``data > 1`` an FSDP2 module over
    the data group, sharded (zero=2/3) or replicated (zero=0), its replicas starting from data rank
    0's values."""
    from .sharding import replicate_module, shard_module

    topology = runtime.topology
    stages = options.get("stages") or split_sequential(model, topology.size("pipeline"), options.get("split_points"))
    stage = stages[runtime.session.coords["pipeline"]].to(runtime.device)
    runner, data_parallel = stage, None
    if topology.size("data") > 1 and strategy.shard_policy.stage >= 2:
        runner = stage = shard_module(stage, runtime, strategy.shard_policy.stage, options, pipelined=True)
        data_parallel = "fsdp"
    elif topology.size("data") > 1:
        runner = stage = replicate_module(stage, runtime)
        data_parallel = "fsdp"
    return PipelineModel(stage, runtime, options.get("microbatches", topology.size("pipeline")),
                         options.get("loss_fn"), runner=runner, data_parallel=data_parallel)
