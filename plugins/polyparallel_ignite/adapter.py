"""The Ignite adapter: ``strategy.adapt("ignite")``.

It replaces ``ignite.distributed``'s flat-world helpers with the strategy's topology:

==============================  ===================================================================
ignite                          :class:`IgniteAdapter`
==============================  ===================================================================
``idist.auto_dataloader``       :meth:`~IgniteAdapter.auto_dataloader`: shards over the *data* axis,
                                the batch size is the global one, replicas get identical batches
``idist.auto_model``            :meth:`~IgniteAdapter.auto_model`: DDP over the data group, DTensor
                                tensor parallel, pipeline stages; never DataParallel
``idist.auto_optim``            :meth:`~IgniteAdapter.auto_optim`: averages gradients over the data
                                group before each ``step()`` where no DDP did
metrics (``sync_all_reduce``)   :meth:`~IgniteAdapter.attach`: metrics of the engine reduce over the
                                data group, bounded by the strategy's timeout (that engine only;
                                :meth:`~IgniteAdapter.detach` undoes it)
``Checkpoint`` / ``load_objects`` :meth:`~IgniteAdapter.checkpoint` / :meth:`~IgniteAdapter.load_checkpoint`:
                                ``strategy.save``/``strategy.load`` (one DCP directory that reshards;
                                the engine's epoch/iteration and the loader's position resume exactly)
==============================  ===================================================================

plus :meth:`~IgniteAdapter.create_supervised_trainer` / ``create_supervised_evaluator``, which
call ignite's factories with the right device and attach (and run pipelines when
``pipeline > 1``). Works inside ``polyparallel.launch``, ``polyparallel launch``/torchrun and
``idist.Parallel`` (the runtime adopts an already initialised default group).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from . import metrics as _metrics
from . import precision as _precision
from . import surface as _surface

__all__ = ["IgniteAdapter", "full_output"]


def full_output(y_pred: Any) -> Any:
    """A tensor-parallel output made whole: a ``DTensor`` (e.g. a column-parallel head with
    ``use_local_output=False``) is gathered to a plain tensor; anything else is returned as is."""
    return y_pred.full_tensor() if hasattr(y_pred, "full_tensor") else y_pred


def _set_epoch(engine: Any, sampler: Any) -> None:
    """``EPOCH_STARTED`` handler of :meth:`IgniteAdapter.attach`: epochs count from 0 in samplers."""
    sampler.set_epoch(engine.state.epoch - 1)


def _unregister(engine_ref: weakref.ref[Any]) -> None:
    engine = engine_ref()
    if engine is not None:
        _metrics.unregister_engine(engine)


class IgniteAdapter:
    """A :class:`polyparallel.Strategy` made Ignite-native. Build it with ``strategy.adapt("ignite")``.

    :param strategy: the strategy.
    :param microbatches: GPipe micro-batches per step when ``pipeline > 1``. 1 by default, so
        that evaluation batches of any size (the short last batch of an uneven shard) run.
    """

    def __init__(self, strategy: pp.Strategy, *, microbatches: int = 1):
        # pipeline x tensor is refused before this, by the capabilities' `excludes` (adapt()).
        self.strategy = strategy
        self.microbatches = microbatches

    def __repr__(self) -> str:
        return f"<IgniteAdapter {self.strategy!r}>"

    # -- where this process stands ------------------------------------------------------------------
    @property
    def session(self) -> pp.Session:
        """This process's :class:`polyparallel.Session` (rank, coordinates, roles)."""
        return self.strategy.session()

    @property
    def runtime(self) -> Any:
        """The torch runtime (process groups, DeviceMesh), made on first use."""
        from polyparallel_torch.runtime import get_runtime

        return get_runtime(self.session)

    @property
    def device(self) -> torch.device:
        """The device batches and models of this rank live on (give it to ignite's ``device=``)."""
        return self.runtime.device

    @property
    def holds_metrics(self) -> bool:
        """Whether this rank holds model outputs (the last pipeline stage): only these compute
        losses and metrics."""
        return "metrics" in self.session.roles

    # -- data, model, optimizer -------------------------------------------------------------------------
    def auto_dataloader(self, data: Any, *, batch_size: int | None = None, shuffle: bool | None = None,
                        remainder: str | None = None) -> Any:
        """A ``DataLoader`` over this rank's data shard (``strategy.shard_data``).

        :param data: a ``Dataset`` or a ``DataLoader`` (its workers and collate function are kept).
        :param batch_size: the *global* batch size (summed over data ranks), unlike
            ``idist.auto_dataloader`` which divides by the world size.
        :param shuffle, remainder: override the strategy's data policy (evaluation:
            ``shuffle=False, remainder="uneven"`` gives every sample exactly once).
        """
        overrides = {k: v for k, v in (("batch_size", batch_size), ("shuffle", shuffle), ("remainder", remainder))
                     if v is not None}
        return self.strategy.shard_data(data, **overrides)

    def auto_model(self, model: nn.Module, *, stages: Sequence[nn.Module] | None = None,
                   boundaries: Sequence[int] | None = None, **options: Any) -> nn.Module:
        """Parallelise ``model`` over the topology.

        - ``pipeline > 1``: a :class:`~polyparallel_torch.pipeline.PipelineModel` holding this
          rank's stage (``model`` an ``nn.Sequential`` cut at ``boundaries``, or ``stages=`` one
          module per stage); the model passed is not moved, only this rank's stage is.
        - otherwise ``strategy.wrap_model(model, **options)`` (``plan=`` for tensor parallel).
        """
        if self.strategy.topology.size("pipeline") == 1:
            if stages is not None or boundaries is not None:
                raise TypeError("auto_model(stages=/boundaries=) only applies with pipeline > 1; "
                                f"the topology is {self.session.topology!r}.")
            # Strategy(precision=)'s param_dtype, before the wrapper is built over the parameters.
            _precision.cast_params(model, self.strategy.precision)
            # DDP keeps its own bucketing (small first bucket) unless GradPolicy.bucket_mb is set. The
            # adapter's step applies Strategy(precision=) (.precision): not the runtime's hooks too.
            options.setdefault("precision", None)
            return self.strategy.wrap_model(model, **options)
        if options:
            raise TypeError(f"auto_model() with pipeline > 1 takes stages= or boundaries=; received {sorted(options)}.")
        # The runtime's pipeline path: the stage, its schedules, replicas broadcast over data.
        given = {"stages": stages, "split_points": boundaries}
        return self.strategy.wrap_model(model, microbatches=self.microbatches,
                                        **{k: v for k, v in given.items() if v is not None})

    def auto_optim(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` average gradients over the data group first, where the model's
        wrapper did not (tensor parallel with data > 1; pipelines). A no-op for DDP and data=1.

        The hook is ``optimizer.register_step_pre_hook``, so any ignite trainer — including
        ``gradient_accumulation_steps`` — syncs exactly once per step.

        Sharding stages (``Strategy(zero=)``, as the torch runtime runs them): at ``zero=1`` (with
        ``data > 1``) the optimizer is rebuilt as torch's ``ZeroRedundancyOptimizer`` over the data
        group, with the same class, defaults and parameter groups (call this before the first
        step: an optimizer that holds state is refused); at ``zero=2``/``3`` the model from
        :meth:`auto_model` is an FSDP2 module that reduce-scatters gradients in backward, and the
        optimizer steps its shards as given.

        :param model: the model returned by :meth:`auto_model` (default: the optimizer's
            parameters are synced as a list of tensors; at ``zero=2``/``3`` nothing is synced).
        """
        from polyparallel_torch.tensors import is_ddp

        stage = self.strategy.shard_policy.stage
        if self.session.topology.size("data") == 1:
            return optimizer
        if stage == 1:
            optimizer = self._zero_redundancy(optimizer)
        if (model is not None and is_ddp(model)) or (model is None and stage >= 2):
            return optimizer  # reduced in backward (DDP; FSDP2, whose parameters are shards over data)
        strategy = self.strategy

        def sync_before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if model is not None:
                strategy.sync_grads(model)
            else:
                strategy.sync_grads([p.grad for group in opt.param_groups for p in group["params"]])

        optimizer.register_step_pre_hook(sync_before_step)
        return optimizer

    def _zero_redundancy(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` as torch's ``ZeroRedundancyOptimizer`` over the data group (stage 1)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        if optimizer.state:
            raise TypeError(
                f"auto_optim() at sharding stage zero=1 rebuilds the optimizer as ZeroRedundancyOptimizer, but this "
                f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s), which would "
                "be lost. Call auto_optim() on a fresh optimizer, before the first step (load a checkpoint after)."
            )
        self.runtime.ensure_usable("auto_optim", "data")
        # Each group keeps its own options; the class's defaults fill what a group does not set.
        groups = [dict(group) for group in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                       process_group=self.runtime.group("data"), **optimizer.defaults)

    # -- engines ----------------------------------------------------------------------------------
    def attach(self, engine: Any, data: Any = None) -> Any:
        """Attach the strategy to an ignite ``Engine`` (a trainer or an evaluator):

        - its metrics (attached before or after this call) reduce over the data group only
          (count-weighted: ignite's metrics reduce sums and counts), bounded by the strategy's
          timeout. Only this engine changes: ignite itself, other engines and plain
          ``metric.compute()`` calls are left as ignite made them;
        - ``data`` (a loader from :meth:`auto_dataloader`): its sampler's epoch follows
          ``engine.state.epoch``, so shuffling is deterministic from ``(seed, epoch)``, also on resume.

        Undone by :meth:`detach`, or when the strategy's session closes.

        :return: ``engine``.
        """
        from ignite.engine import Events

        # Before any collective: a refused step, metric or handler (polyparallel_ignite.surface);
        # again when the run starts, for those attached after this call.
        _surface.check_engine(engine, self.strategy)
        if not engine.has_event_handler(_surface.check_engine, Events.STARTED):
            engine.add_event_handler(Events.STARTED, _surface.check_engine, self.strategy)
        _metrics.register_engine(engine, self.runtime)
        # The session's end undoes it too: the runtime's groups are gone with it (weakly held).
        engine_ref = weakref.ref(engine)
        self.session.add_finalizer(lambda: _unregister(engine_ref))
        sampler = getattr(data, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            engine.add_event_handler(Events.EPOCH_STARTED, _set_epoch, sampler)
        return engine

    def detach(self, engine: Any) -> Any:
        """Undo :meth:`attach`: the engine's metrics reduce as ignite's own (over ``idist``'s
        world) and its loader's epoch is no longer set by the engine.

        :return: ``engine``.
        """
        from ignite.engine import Events

        _metrics.unregister_engine(engine)
        if engine.has_event_handler(_surface.check_engine, Events.STARTED):
            engine.remove_event_handler(_surface.check_engine, Events.STARTED)
        if engine.has_event_handler(_set_epoch, Events.EPOCH_STARTED):
            engine.remove_event_handler(_set_epoch, Events.EPOCH_STARTED)
        return engine

    def bridge(self, model: Any) -> Any:
        """What another plugin offers for running ``model`` (an object that plugin owns) in Ignite,
        or ``None``: the ``polyparallel_adapter_bridge`` hook with ``adapter="ignite"``. Adapters
        import no other adapter; a bridge provides ``create_trainer(model, loss_fn, device,
        **kwargs)`` and ``create_evaluator(model, metrics, device, **kwargs)``, each returning an
        ignite ``Engine`` (the DeepSpeed plugin's: :mod:`polyparallel_deepspeed.ignite`)."""
        return self.strategy.plugin_manager.bridge("ignite", model)

    def create_supervised_trainer(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  loss_fn: Callable[..., torch.Tensor], data: Any = None, **kwargs: Any) -> Any:
        """``ignite.engine.create_supervised_trainer`` on this rank's device, attached.

        With ``pipeline > 1`` (``model`` a ``PipelineModel``) the trainer runs a GPipe step; its
        output is the loss on the last stage and ``None`` on the others. The optimizer should
        come from :meth:`auto_optim` (gradients of replicas averaged before ``step()``).
        ``model`` may be an object another plugin owns and bridges to Ignite (:meth:`bridge`): a
        DeepSpeed engine from ``strategy.adapt("deepspeed")`` (``optimizer`` ``None``: the engine
        steps its own).

        ``Strategy(precision=)`` and ``Strategy(accumulate=)`` make the step autocast in the compute
        dtype, scale the loss (fp16) and accumulate, on the runtime's device
        (:mod:`polyparallel_ignite.precision`); ``amp_mode=``, ``scaler=`` or
        ``gradient_accumulation_steps=`` that contradict them are refused, naming both.
        """
        from polyparallel_torch.pipeline import PipelineModel

        bridge = self.bridge(model)
        managed = self.strategy.precision is not None or self.strategy.accumulate > 1
        if bridge is not None:
            engine = bridge.create_trainer(model, loss_fn, self.device, **kwargs)
        elif isinstance(model, PipelineModel):
            if managed:
                raise pp.UnsupportedTopologyError(
                    f"the Ignite adapter does not map Strategy(precision=, accumulate=) onto a pipeline's GPipe step "
                    f"({self.strategy!r}): use precision=None and accumulate=1 with pipeline > 1.")
            engine = self._pipeline_trainer(model, optimizer, loss_fn, **kwargs)
        elif managed:
            from ignite.engine import Engine

            _precision.check_kwargs(self.strategy, kwargs)
            options = {k: kwargs.pop(k) for k in ("non_blocking", "prepare_batch", "model_transform",
                                                  "output_transform", "model_fn", "scaler") if k in kwargs}
            device = torch.device(kwargs.pop("device", self.device))
            unknown = sorted(set(kwargs) - {"amp_mode", "gradient_accumulation_steps", "deterministic"})
            if unknown:
                raise TypeError(f"create_supervised_trainer() got unexpected option(s) {unknown}.")
            if kwargs.get("deterministic"):
                raise TypeError("create_supervised_trainer(deterministic=True) builds ignite's DeterministicEngine, "
                                "which the adapter refuses (see the Ignite surface); leave it out.")
            update = _precision.training_step(model, optimizer, loss_fn, self.strategy, device, **options)
            engine = Engine(update)
            if update.scaler is not None:  # type: ignore[attr-defined]
                engine.state.scaler = update.scaler  # type: ignore[attr-defined]  # as ignite's scaler=True does
        else:
            from ignite.engine import create_supervised_trainer

            kwargs.setdefault("device", self.device)
            engine = create_supervised_trainer(model, optimizer, loss_fn, **kwargs)
        return self.attach(engine, data)

    def create_supervised_evaluator(self, model: nn.Module, metrics: Mapping[str, Any] | None = None,
                                    data: Any = None, **kwargs: Any) -> Any:
        """``ignite.engine.create_supervised_evaluator`` on this rank's device, attached.

        Metrics are attached only on ranks that hold outputs (the last pipeline stage); the others
        run the forward pass and leave ``state.metrics`` empty, without waiting on anyone.
        Tensor-parallel ``DTensor`` outputs are gathered before metrics see them. ``model`` may be
        an object another plugin bridges to Ignite (:meth:`bridge`), such as a DeepSpeed engine.
        """
        from polyparallel_torch.pipeline import PipelineModel

        metrics = dict(metrics or {}) if self.holds_metrics else {}
        bridge = self.bridge(model)
        if bridge is not None:
            engine = bridge.create_evaluator(model, metrics, self.device, **kwargs)
        elif isinstance(model, PipelineModel):
            engine = self._pipeline_evaluator(model, **kwargs)
            for name, metric in metrics.items():
                metric.attach(engine, name)
        else:
            from ignite.engine import create_supervised_evaluator

            kwargs.setdefault("device", self.device)
            policy, device = self.strategy.precision, torch.device(kwargs["device"])
            if policy is not None:
                forward = kwargs.pop("model_fn", lambda model, x: model(x))

                def model_fn(model: nn.Module, x: Any) -> Any:
                    with _precision.autocast(policy, device):
                        return forward(model, _precision.cast_inputs(x, policy))

                kwargs["model_fn"] = model_fn
            transform = kwargs.pop("output_transform", lambda x, y, y_pred: (y_pred, y))
            kwargs["output_transform"] = lambda x, y, y_pred: transform(x, y, full_output(y_pred))
            engine = create_supervised_evaluator(model, metrics=metrics, **kwargs)
        return self.attach(engine, data)

    def _pipeline_trainer(self, model: Any, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                          prepare_batch: Callable[..., Any] | None = None, non_blocking: bool = False,
                          output_transform: Callable[..., Any] | None = None) -> Any:
        from ignite.engine import Engine, _prepare_batch

        prepare = prepare_batch or _prepare_batch
        device = self.device

        def step(engine: Any, batch: Any) -> Any:
            x, y = prepare(batch, device=device, non_blocking=non_blocking)
            optimizer.zero_grad()
            loss = model.train_step(x, y, loss_fn)
            optimizer.step()
            if loss is None:
                return None
            return output_transform(x, y, loss) if output_transform else loss.item()

        return Engine(step)

    def _pipeline_evaluator(self, model: Any, prepare_batch: Callable[..., Any] | None = None,
                            non_blocking: bool = False, output_transform: Callable[..., Any] | None = None) -> Any:
        from ignite.engine import Engine, _prepare_batch

        prepare = prepare_batch or _prepare_batch
        device = self.device
        transform = output_transform or (lambda x, y, y_pred: (y_pred, y))

        def step(engine: Any, batch: Any) -> Any:
            x, y = prepare(batch, device=device, non_blocking=non_blocking)
            y_pred = model.eval_step(x)
            return None if y_pred is None else transform(x, y, y_pred)

        return Engine(step)

    # -- checkpoints ------------------------------------------------------------------------------------
    def checkpoint(self, to_save: Mapping[str, Any], dirname: Any, *, every: int | None = None,
                   **kwargs: Any) -> Any:
        """An ignite ``Checkpoint`` handler whose files are polyparallel checkpoints: every rank
        writes ``to_save`` (one model, its optimizer, the trainer engine, objects with
        ``state_dict``) through ``strategy.save`` into a directory under ``dirname``; the engine's
        state and its loader's position are saved too (:mod:`polyparallel_ignite.checkpoint`).

        :param every: attach it to the trainer engine of ``to_save`` every ``every`` iterations.
        :param kwargs: ``Checkpoint``'s own (``n_saved=``, ``score_function=``, ...).
        """
        from .checkpoint import make_checkpoint

        return make_checkpoint(self.strategy, to_save, dirname, every=every, **kwargs)

    def load_checkpoint(self, path: Any, to_load: Mapping[str, Any], loader: Any = None) -> dict[str, Any]:
        """Restore ``to_load`` from a polyparallel checkpoint (written by :meth:`checkpoint`, by
        Lightning or a plain loop) at this topology; the trainer engine's epoch and iteration, and
        with ``loader`` (the sharded loader the trainer will run) its position, so that
        ``trainer.run(loader, max_epochs=N)`` continues where the saved run stopped.

        :return: what ``strategy.load`` returned (progress and extras).
        """
        from .checkpoint import load_checkpoint

        return load_checkpoint(self.strategy, path, to_load, loader)

    # -- group-aware replacements of idist helpers -------------------------------------------------------
    def reduce_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``strategy.reduce_metrics``: over the data group, :class:`polyparallel.Mean` count-weighted."""
        return self.strategy.reduce_metrics(metrics)

    def barrier(self, axis: str = "data") -> None:
        """A barrier over one axis's group (``idist.barrier`` knows only the world), bounded by the
        strategy's timeout."""
        self.runtime.all_reduce(torch.zeros(1, device=self.device), "sum", "barrier", axis)

    def broadcast_metrics(self, metrics: Mapping[str, float] | None) -> dict[str, float]:
        """Send the metrics of the last pipeline stage (data coordinate 0) to every rank of its
        pipeline group, so every rank can take the same decision (early stopping, checkpoints).
        Ranks that hold no metrics pass ``None``. A no-op without a pipeline."""
        if self.session.topology.size("pipeline") == 1:
            return dict(metrics or {})
        gathered = self.runtime.all_gather_object(dict(metrics) if metrics is not None else None,
                                                  "broadcast_metrics", "pipeline")
        return dict(gathered[-1] or {})
