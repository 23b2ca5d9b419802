"""The Lightning strategies the adapter returns, and what they share.

``Trainer(strategy=strategy.adapt("lightning"))`` gets, by the Strategy's sharding stage
(``Strategy(zero=)``, :class:`polyparallel.ShardPolicy`):

- stage 0 (replicas): :mod:`.ddp`, over Lightning's ``DDPStrategy``;
- stage 1-3 (sharded over the data axis): :mod:`.sharded`, over Lightning's
  ``ModelParallelStrategy`` (FSDP2 + tensor parallelism on a ``DeviceMesh``, Lightning >= 2.4).

Both take every parallel decision from the polyparallel :class:`~polyparallel.Strategy` and the
torch runtime; this module holds :class:`StrategyMixin`, the behaviour they share:

============================  =================================================================
process groups, timeouts      the torch runtime (``get_runtime(session)``: ``init_process_group``
                              with the strategy's timeout, a ``DeviceMesh`` pipeline x data x tensor)
data sharding                 ``distributed_sampler_kwargs`` give the *data* axis (size, coordinate)
                              and the strategy's seed; the sampler Lightning injects from them is
                              replaced by ``strategy.shard_data`` (training: the
                              ``DataPolicy.remainder``; validation/test: ``"uneven"``, every sample
                              once, so count-weighted metrics are exact)
model wrapping                ``strategy.wrap_model`` (stage 0: DDP over the data sub-mesh or the
                              tensor plan; stage 1-3: the plan, then FSDP2 over the data dimension)
gradients                     ``strategy.sync_grads(model)`` after the closure, before the optimizer
                              step (a documented no-op under DDP and FSDP2, which reduce in backward)
``self.log(sync_dist=True)``  ``reduce`` over the *data* group through the runtime's bounded
                              all-reduce (Lightning's epoch means are batch-size weighted); the
                              logged key is part of the identity check (``_logged_key``)
states                        ``strategy.sync_states(model)`` at validation/test/predict start and
                              before each checkpoint (the ``StatePolicy``)
predictions                   gathered at ``on_predict_end``: every row once, in order, on every
                              rank (:mod:`.predict`)
refusals                      the declared surface's refused callbacks and Tuner calls, at
                              ``setup_environment``, before any collective (:mod:`.surface`)
checkpoints                   ``strategy.save``/``strategy.load``: one DCP directory that reshards
                              (:mod:`.checkpoint`); the training loader resumes mid-epoch
decisions, barriers           over the world (every rank must agree to stop or to save)
============================  =================================================================

**Lightning names relied on** (both namespaces; checked against 2.4.0 and 2.6): public —
``Strategy``/``ParallelStrategy`` methods and properties ``setup``, ``setup_environment``,
``set_world_ranks``, ``root_device``, ``distributed_sampler_kwargs``, ``process_group_backend``,
``reduce``, ``reduce_boolean_decision``, ``barrier``, ``broadcast``, ``optimizer_step``,
``process_dataloader``, ``on_validation_start``/``on_test_start``/``on_predict_start``/``on_predict_end``,
``teardown``, ``model``, ``lightning_module``, ``accelerator``, ``precision_plugin`` (its setter,
which the Trainer's connector calls with the plugin of ``Trainer(precision=)``, is overridden to
reconcile it with ``Strategy(precision=)``; :mod:`.precision`), ``block_backward_sync`` (overridden:
the runtime's ``no_sync``), ``Trainer.accumulate_grad_batches``, the precision plugins ``Precision``,
``MixedPrecision``, ``HalfPrecision`` and their ``precision`` attribute,
``cluster_environment``, ``parallel_devices``, ``world_size``/``global_rank``/``local_rank``,
``num_processes``/``num_nodes``, ``checkpoint_io``, ``lightning_fabric...reset_seed``, the
``LightningEnvironment`` cluster environment, ``trainer.state``; for checkpoints (:mod:`.checkpoint`)
``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint``, ``lightning_module_state_dict``,
``optimizer_state``, ``load_model_state_dict``, ``load_optimizer_state_dict``,
``restore_checkpoint_after_setup``, ``lightning_restore_optimizer``, ``trainer.train_dataloader``
and the fit loop's resumable-loader protocol (a train loader with ``state_dict``/``load_state_dict``); the stage-specific names are
listed in :mod:`.ddp` and :mod:`.sharded`. Private, read or wrapped but never overridden:
``_layer_sync`` (the ``sync_batchnorm`` plugin Lightning's connector sets on every
``ParallelStrategy``; read to refuse it under tensor replicas) and the Trainer's
``_data_connector._resolve_sampler`` (wrapped on one Trainer to silence a warning that is
wrong here; if a Lightning release removes it, the warning shows and nothing else changes).
No private Lightning method is overridden.

Nothing outlives the objects handed over: the launcher variables polyparallel's session reads
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) are set from what
Lightning knows only while the session and its process groups are made, and removed right after;
Lightning's warning about ``DistributedSampler`` during ``validate``/``test`` is silenced around
that one call of the Trainer the strategy serves, and the silencer is removed at ``teardown``.
A plain Trainer made afterwards in the same process sees the environment and warning filters it
would have seen without polyparallel.

The classes are built per Lightning namespace (cached); the behaviour lives in mixins that
import nothing from Lightning at module level.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .checkpoint import CheckpointMixin
from .environment import environment_class, launched_externally
from .namespaces import NAMESPACES
from .precision import check_stage, reconcile, reconcile_accumulation

__all__ = ["StrategyMixin"]

#: Lightning's warning that an injected ``DistributedSampler`` repeats evaluation samples.
_SAMPLER_WARNING = "Using `DistributedSampler` with the dataloaders"

#: Keyword arguments that come from the polyparallel Strategy, not from the adapter's caller.
_FROM_STRATEGY = {"cluster_environment": "the launch (polyparallel's own environment)",
                  "process_group_backend": "Strategy(backend=...)", "timeout": "Strategy(timeout=...)",
                  "data_parallel_size": "Strategy(data=...)", "tensor_parallel_size": "Strategy(tensor=...)"}


_LAUNCHING_NOTHING: dict[type, type] = {}


def _launching_nothing(script_launcher: type) -> type:
    """Lightning's ``_SubprocessScriptLauncher`` (of one namespace), marked interactive-compatible:
    used only where the cluster environment creates the processes, so it starts none and only
    calls the function (Lightning's notebook check is about starting processes from a notebook)."""
    if script_launcher not in _LAUNCHING_NOTHING:
        _LAUNCHING_NOTHING[script_launcher] = type(script_launcher.__name__, (script_launcher,), {
            "__doc__": _launching_nothing.__doc__, "__module__": __name__,
            "is_interactive_compatible": property(lambda self: True)})
    return _LAUNCHING_NOTHING[script_launcher]


class StrategyMixin(CheckpointMixin):
    """The polyparallel behaviour shared by the adapter's Lightning strategies (module docstring).

    :param polyparallel_strategy: the :class:`polyparallel.Strategy` that decides everything.
    :param namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"`` (set by the factory).
    :param plan: tensor-parallel plan for ``tensor > 1``: ``{"submodule.path": ColwiseParallel()
        | RowwiseParallel(), ...}`` relative to the LightningModule, or a callable
        ``plan(lightning_module) -> dict``. Default: the runtime's Megatron plan of the module's
        single ``nn.Sequential`` child.
    :param kwargs: arguments of the Lightning base class (see the stage's class).
    """

    def __init__(self, polyparallel_strategy: pp.Strategy, *, namespace: str, plan: Any = None, **kwargs: Any):
        given = sorted(set(kwargs) & set(_FROM_STRATEGY))
        if given:
            where = "; ".join(f"{k} comes from {_FROM_STRATEGY[k]}" for k in given)
            raise TypeError(f"adapt('lightning') got {given}, which the polyparallel Strategy decides: {where}.")
        if plan is not None and not (callable(plan) or isinstance(plan, Mapping)):
            raise TypeError(f"adapt('lightning', plan=) must be a dict or a callable(module) -> dict. "
                            f"Received: {type(plan).__name__}.")
        self._pp = polyparallel_strategy
        self._ns = NAMESPACES[namespace]
        self._plan = plan
        self._runtime_cache: Any = None
        self._quieted: Any = None  # the Trainer's data connector whose sampler warning is silenced
        check_stage(polyparallel_strategy.precision, polyparallel_strategy.shard_policy.stage)
        self._init_lightning(environment_class(namespace)(), timedelta(seconds=polyparallel_strategy.timeout),
                             kwargs)

    def _init_lightning(self, environment: Any, timeout: timedelta, kwargs: dict[str, Any]) -> None:
        """Call the Lightning base class's ``__init__`` (each stage's mixin knows its arguments)."""
        raise NotImplementedError

    # -- precision and accumulation (polyparallel_lightning.precision) ---------------------------------
    @property
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin: the one ``Strategy(precision=)`` maps to."""
        return super().precision_plugin  # type: ignore[misc]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # The Trainer's connector assigns the plugin of Trainer(precision=)/plugins= while the
        # Trainer is built: reconciled with the Strategy here, a contradiction refused here.
        accelerator = getattr(self, "_accelerator", None)
        device = type(accelerator).__name__.removesuffix("Accelerator").lower() if accelerator is not None else "cpu"
        self._precision_plugin = reconcile(self._pp.precision, plugin, self._ns.pytorch, device)

    def _reconcile_trainer(self) -> None:
        """``Trainer(accumulate_grad_batches=)`` reconciled with ``Strategy(accumulate=)`` (at the
        start of every run, from ``setup_distributed``, before any step)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:
            reconcile_accumulation(self._pp, trainer)

    # -- what this process is -----------------------------------------------------------------------
    @property
    def polyparallel_strategy(self) -> pp.Strategy:
        """The polyparallel Strategy this Lightning strategy follows."""
        return self._pp

    @property
    def topology(self) -> pp.Topology:
        """The strategy's topology resolved against Lightning's world size."""
        return self._pp.topology.resolve(self.world_size)  # type: ignore[attr-defined]

    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning injects a sampler only for distributed strategies."""
        return True

    @property
    def root_device(self) -> torch.device:
        """This rank's device: ``parallel_devices[local_rank]``; on CPU, with fewer ``devices`` than
        processes started by an external launcher, the CPU."""
        devices, local = self.parallel_devices, self.local_rank  # type: ignore[attr-defined]
        if devices and local < len(devices):
            return devices[local]
        if devices and all(d.type == "cpu" for d in devices):
            return devices[0]
        raise pp.TopologyError(
            f"local rank {local} has no device: Trainer(devices=) gives {len(devices or [])} "
            f"({devices}). Set devices to the number of processes started on this node."
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data axis only: ranks that share a data coordinate (tensor replicas) get the same
        shard; shuffling is seeded by the polyparallel Strategy."""
        topology = self.topology
        return {"num_replicas": topology.size("data"),
                "rank": topology.coords(self.global_rank)["data"],  # type: ignore[attr-defined]
                "seed": self._pp.seed}

    @property
    def process_group_backend(self) -> str | None:
        """The runtime's backend once its groups exist; before, the one ``Strategy(backend=)`` names."""
        rt = self._runtime_cache
        return rt.backend if rt is not None else self._pp.backend

    @property
    def runtime(self) -> Any:
        """The torch runtime of this process (process groups, mesh, bounded collectives)."""
        rt = self._runtime_cache
        if rt is None or rt.session.closed:
            from polyparallel_torch.runtime import get_runtime

            with self._launcher_environment():
                rt = self._runtime_cache = get_runtime(self._session())
        return rt

    @contextlib.contextmanager
    def _launcher_environment(self) -> Iterator[None]:
        """The launcher's variables, from Lightning's ranks, while the session and its process
        groups are made: polyparallel reads them, and Lightning's own launchers set only some.
        Those this adds are removed afterwards: left behind, ``RANK``/``WORLD_SIZE`` would make
        every later Trainer or session of the process believe an external launcher started it."""
        if self.world_size <= 1 or launched_externally():  # type: ignore[attr-defined]
            yield
            return
        env = self.cluster_environment  # type: ignore[attr-defined]
        wanted = {"RANK": self.global_rank, "WORLD_SIZE": self.world_size,  # type: ignore[attr-defined]
                  "LOCAL_RANK": self.local_rank, "MASTER_ADDR": env.main_address,  # type: ignore[attr-defined]
                  "MASTER_PORT": env.main_port}
        added = {key: str(value) for key, value in wanted.items() if key not in os.environ}
        os.environ.update(added)
        try:
            yield
        finally:
            for key, value in added.items():
                if os.environ.get(key) == value:
                    del os.environ[key]

    def _session(self) -> pp.Session:
        session = self._pp.session()
        world = self.world_size  # type: ignore[attr-defined]
        if session.world_size != world and session.world_size == 1:
            # Made before Lightning launched the other processes: it holds no process group.
            session.close()
            session = self._pp.session()
        if session.world_size != world:
            raise pp.TopologyError(
                f"This process belongs to a world of {session.world_size} (its polyparallel session) but "
                f"Lightning sees {world} processes. Launch once: either Trainer(devices=N) alone, or "
                "`polyparallel launch`/torchrun/polyparallel.launch with devices matching the processes per node."
            )
        return session

    # -- launch and process groups ---------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        """Lightning's launcher; where the processes already exist (``pp.launch``, ``polyparallel
        launch``, torchrun, SLURM) its script launcher starts none and only calls the function (after
        validating the settings and choosing the CPU threads per process), which works in an
        interactive session too: it is marked so (:func:`_launching_nothing`). Otherwise, in a
        notebook cell whose function ``pp.launch`` forks, Lightning refuses every launcher not marked
        notebook-compatible, and the Trainer could not even be built."""
        super()._configure_launcher()  # type: ignore[misc]
        env, launcher = self.cluster_environment, self._launcher  # type: ignore[attr-defined]
        if (env is not None and env.creates_processes_externally and launcher is not None
                and type(launcher).__name__ == "_SubprocessScriptLauncher"):
            launcher.__class__ = _launching_nothing(type(launcher))

    def set_world_ranks(self) -> None:
        """Lightning's ranks, then the topology checked against the world they make. Lightning's
        accelerator connector calls this when the Trainer is built, before it configures the
        launcher: a topology that does not fit is refused before any process starts."""
        super().set_world_ranks()  # type: ignore[misc]
        world = self.world_size  # type: ignore[attr-defined]
        try:
            self._pp.topology.resolve(world)
        except pp.TopologyError as exc:
            how = ("the external launcher started" if launched_externally() else
                   f"Trainer(devices={self.num_processes}, num_nodes={self.num_nodes}) makes")  # type: ignore[attr-defined]
            raise pp.TopologyError(
                f"{self._pp!r} cannot run on the {world} processes {how}: {exc}"
            ) from None

    def setup_environment(self) -> None:
        """Refuse what the adapter's declared surface refuses (:mod:`.surface`: the Trainer's
        callbacks, the Tuner), before any process group or collective; then Lightning's."""
        from .surface import check_trainer

        check_trainer(getattr(self.lightning_module, "_trainer", None))  # type: ignore[attr-defined]
        super().setup_environment()  # type: ignore[misc]

    def setup_distributed(self) -> None:
        """Ranks from the cluster environment, then the runtime's groups (not Lightning's
        ``init_process_group``): the strategy's timeout and backend, a mesh over the topology."""
        self._reconcile_trainer()
        importlib.import_module(f"{self._ns.fabric}.utilities.seed").reset_seed()
        self.set_world_ranks()
        rt = self.runtime  # made inside the launcher's variables (see _launcher_environment)
        if rt.device.type != self.root_device.type:
            raise pp.TopologyError(
                f"The torch runtime computes on {rt.device} but the Trainer's accelerator gives {self.root_device}. "
                "Use Trainer(accelerator=...) matching the runtime's device (cuda when available, else cpu)."
            )

    # -- model ---------------------------------------------------------------------------------------------
    def _refuse_layer_sync(self) -> None:
        # `_layer_sync`: Lightning's connector sets it on every ParallelStrategy (private; read only).
        if getattr(self, "_layer_sync", None) is not None and self.topology.size("tensor") > 1:
            raise pp.UnsupportedTopologyError(
                "Trainer(sync_batchnorm=True) synchronises over the world, which would mix tensor-parallel "
                f"replicas (tensor={self.topology.size('tensor')}). Use sync_batchnorm=False, or tensor=1."
            )

    def _tensor_plan(self, module: nn.Module) -> dict[str, Any]:
        plan = self._plan(module) if callable(self._plan) else self._plan
        if plan is not None:
            return dict(plan)
        from polyparallel_torch.model import default_plan

        sequential = [(name, child) for name, child in module.named_children() if isinstance(child, nn.Sequential)]
        if len(sequential) != 1:
            raise TypeError(
                f"tensor={self.topology.size('tensor')} needs a tensor-parallel plan for {type(module).__name__}: "
                f"the default plan applies to a module with exactly one nn.Sequential child, it has "
                f"{len(sequential)}. Pass strategy.adapt('lightning', plan={{'layer.path': ColwiseParallel(), ...}})."
            )
        name, child = sequential[0]
        try:
            return {f"{name}.{path}": style for path, style in default_plan(child).items()}
        except TypeError as exc:
            raise TypeError(f"{exc} (in {type(module).__name__}.{name}; pass strategy.adapt('lightning', "
                            "plan={...}))") from None

    def _after_setup(self, trainer: Any) -> None:
        """What every stage's ``setup`` ends with."""
        self._scope_torchmetrics()
        self._quiet_sampler_warning(trainer)

    def _quiet_sampler_warning(self, trainer: Any) -> None:
        # Lightning warns (validate/test) that an injected DistributedSampler repeats evaluation
        # samples; the adapter replaces it by an "uneven" shard (each sample once), so the warning
        # is wrong here. Silenced around the one call that emits it, on this Trainer only, until
        # teardown: a process-wide filter would hide it from every other Trainer too.
        connector = getattr(trainer, "_data_connector", None)
        resolve = getattr(connector, "_resolve_sampler", None)
        if connector is None or resolve is None or hasattr(resolve, "_polyparallel_original"):
            return

        def resolve_sampler(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SAMPLER_WARNING)
                return resolve(*args, **kwargs)

        resolve_sampler._polyparallel_original = resolve  # type: ignore[attr-defined]
        connector._resolve_sampler = resolve_sampler  # an instance attribute: this Trainer only
        self._quieted = connector

    def teardown(self) -> None:
        """Lightning's teardown; the Trainer gets its data connector back as Lightning made it."""
        connector, self._quieted = self._quieted, None
        if connector is not None:
            vars(connector).pop("_resolve_sampler", None)
        super().teardown()

    def _scope_torchmetrics(self) -> None:
        # torchmetrics reduce over the world unless told otherwise: with tensor replicas that
        # counts every sample once per replica. Point the unscoped ones at the data group.
        if self.topology.size("tensor") == 1 or "torchmetrics" not in sys.modules:
            return
        from torchmetrics import Metric

        group = self.runtime.group("data")
        for module in self.lightning_module.modules():  # type: ignore[attr-defined]
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = group

    # -- gradients --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """What Lightning enters for the micro-batches of an accumulation before the step's last:
        no gradient reduction in their backward (DDP's ``no_sync``, and FSDP2's
        ``set_requires_gradient_sync(False)``, which Lightning's own strategy leaves out), so
        each optimizer step reduces once."""
        from polyparallel_torch import no_sync

        model = self.model  # type: ignore[attr-defined]
        with no_sync(model) if isinstance(model, nn.Module) else contextlib.nullcontext():
            yield

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (forward, backward), ``strategy.sync_grads(model)``, then Lightning's step
        (gradient clipping and ``on_before_optimizer_step`` see the synchronised gradients)."""

        def closure_then_sync() -> Any:
            output = closure()
            self._pp.sync_grads(self.model)  # type: ignore[attr-defined]
            return output

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)  # type: ignore[misc]

    # -- metrics, decisions, collectives -------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: reduce over the data group (an explicit
        ``sync_dist_group`` is honoured as given). In place, as Lightning expects."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is not None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        op = _op_name(reduce_op)
        if op == "avg" and not tensor.is_floating_point():
            tensor = tensor.float()
        key = _logged_key(sys._getframe(1))
        if key is None:  # called directly, or a Lightning whose result collection is not the known one
            return self.runtime.all_reduce(tensor, op, "reduce (self.log sync_dist=True)", "data")
        # The key is part of the identity: ranks syncing different keys fail at once naming both.
        name, fx = key
        operation = f"self.log({name!r}, sync_dist=True)"
        rt = self.runtime
        with rt.operation(operation, "data", f"{fx}: all_reduce {op} {tensor.dtype} {list(tensor.shape)}"):
            return rt.all_reduce(tensor, op, operation, "data")

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Over the world: every rank (tensor replicas too) must stop, or save, together."""
        votes = torch.tensor(int(decision), device=self.root_device)
        with self.runtime.collective("reduce_boolean_decision", "world"):
            votes = super().reduce(votes, reduce_op="sum")  # type: ignore[misc]
        return bool(votes == self.world_size) if all else bool(votes)  # type: ignore[attr-defined]

    def barrier(self, name: str | None = None) -> None:
        """A world barrier, bounded by the strategy's timeout (an error names the rank)."""
        with self.runtime.collective(f"barrier({name})" if name else "barrier", "world"):
            super().barrier(name)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object from global rank ``src`` (checkpoint paths, decisions)."""
        with self.runtime.collective("broadcast", "world"):
            return super().broadcast(obj, src)  # type: ignore[misc]

    # -- states -------------------------------------------------------------------------------------------
    def sync_states(self) -> None:
        """``strategy.sync_states(model)``: the StatePolicy over the data axis (BatchNorm statistics
        averaged, parameters broadcast from data rank 0, counters left alone)."""
        if self.world_size > 1 and self.model is not None:  # type: ignore[attr-defined]
            self._pp.sync_states(self.model)  # type: ignore[attr-defined]

    def on_validation_start(self) -> None:
        """Evaluate with synchronised states."""
        super().on_validation_start()  # type: ignore[misc]
        self.sync_states()

    def on_test_start(self) -> None:
        """Test with synchronised states."""
        super().on_test_start()  # type: ignore[misc]
        self.sync_states()

    def on_predict_start(self) -> None:
        """Predict with synchronised states."""
        super().on_predict_start()  # type: ignore[misc]
        self.sync_states()

    def on_predict_end(self) -> None:
        """Every rank's predictions gathered and put in order (:mod:`.predict`): ``trainer.predict``
        returns every row once, in the loader's order, on every rank, as one process does."""
        super().on_predict_end()  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        loop = getattr(trainer, "predict_loop", None)
        if self.world_size <= 1 or loop is None or not loop.return_predictions:  # type: ignore[attr-defined]
            return
        import torch.distributed as dist

        from .predict import merge_predictions

        mine = [list(batches) for batches in loop._predictions]  # private: one list per dataloader
        gathered: list[Any] = [None] * self.world_size  # type: ignore[attr-defined]
        with self.runtime.collective("predict (gather every rank's rows)", "world"):
            dist.all_gather_object(gathered, mine)
        topology = self.topology
        by_data: dict[int, Any] = {}
        for rank, batches in enumerate(gathered):  # one tensor replica per data coordinate
            by_data.setdefault(topology.coords(rank)["data"], batches)
        ranks = [by_data[d] for d in sorted(by_data)]
        for index, batches in enumerate(loop._predictions):
            batches[:] = merge_predictions([r[index] for r in ranks])

    # -- data -------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: Any) -> Any:
        """Replace the ``DistributedSampler`` Lightning injected from :attr:`distributed_sampler_kwargs`
        by ``strategy.shard_data``: the DataPolicy's remainder for training, ``"uneven"`` for
        evaluation. Loaders with other samplers are left as Lightning made them. The training
        loader is resumable (:func:`.checkpoint.epoch_length_loader`)."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        from torch.utils.data import DataLoader, DistributedSampler

        if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
            return dataloader
        sampler, expected = dataloader.sampler, self.distributed_sampler_kwargs
        if (sampler.num_replicas, sampler.rank) != (expected["num_replicas"], expected["rank"]):
            return dataloader  # the user's own sampler, over another world: not ours to change
        overrides: dict[str, Any] = {"shuffle": sampler.shuffle}
        if not self._training():
            overrides["remainder"] = "uneven"
            return self._pp.shard_data(dataloader, **overrides)
        if sampler.drop_last:
            overrides["remainder"] = "drop"
        from .checkpoint import epoch_length_loader

        return epoch_length_loader(self._pp.shard_data(dataloader, **overrides))

    def _training(self) -> bool:
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is None or trainer.state.stage == "train"


def _logged_key(frame: Any) -> tuple[str, str] | None:
    """``(name, hook)`` of the ``self.log`` value a ``reduce`` call syncs, or ``None``.

    Lightning calls ``strategy.reduce(tensor, reduce_op=, group=)`` with no name, through the sync
    function it stores on the logged value's metadata, from ``_ResultMetric.update``/``compute``
    (``...logger_connector.result``, both namespaces). No public route carries the key, and
    wrapping that stored function would mean writing private attributes Lightning regenerates;
    so, as a last resort, the direct caller's frame is read (never changed): its ``self.meta.name``
    and ``.fx``. Anything else (a direct call, another Lightning layout) gives ``None``."""
    for _ in range(2):  # the caller (the stored partial adds no frame), or one wrapper above it
        if frame is None:
            return None
        if frame.f_globals.get("__name__", "").endswith(".logger_connector.result") and \
                frame.f_code.co_name in ("update", "compute"):
            meta = getattr(frame.f_locals.get("self"), "meta", None)
            name, fx = getattr(meta, "name", None), getattr(meta, "fx", None)
            return (name, fx) if isinstance(name, str) and isinstance(fx, str) else None
        frame = frame.f_back
    return None


#: Lightning's ``reduce_op`` strings as the runtime's op names.
_OP_NAMES = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}


@functools.cache
def _reduce_ops() -> tuple[tuple[Any, str], ...]:
    """``torch.distributed.ReduceOp`` members and their op names (built on first use)."""
    import torch.distributed as dist

    return ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"),
            (dist.ReduceOp.AVG, "avg"))


def _op_name(reduce_op: Any) -> str:
    """Lightning's ``reduce_op`` (``"mean"``, ``"sum"``, a ``ReduceOp``...) as the runtime's op name."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = _OP_NAMES.get(reduce_op.lower())
    else:
        name = next((name for op, name in _reduce_ops() if reduce_op == op), None)
    if name is None:
        raise ValueError(f"reduce(): unsupported reduce_op {reduce_op!r}; expected 'mean', 'sum', 'max', 'min' "
                         "or the matching torch.distributed.ReduceOp.")
    return name
