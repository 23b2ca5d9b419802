"""Hook implementations of the torch runtime plugin (entry point ``torch``).

The core calls these hooks only for sessions (and launches) whose runtime is ``"torch"``
(``PluginManager.call_for_runtime``), so another runtime's strategy never reaches torch and no
hook needs a ``session.runtime`` guard; within the runtime, a hook returns ``None`` for an object
that is not torch's.
Importing this module is cheap: torch is imported inside the hooks, and only once the object
handed to an operation could be torch's (if ``torch`` was never imported, it cannot be). The
declaration the core checks is :mod:`.capabilities`; this module sits on top of the plugin (no
other module of it imports this one).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import polyparallel as pp
from polyparallel import hookimpl

from .capabilities import CAPABILITIES, RUNTIME

__all__: list[str] = []


def _torch_loaded() -> bool:
    return "torch" in sys.modules


class _Lazy:
    """torch and this plugin's torch-importing modules, imported once on first use (hooks run
    on every operation: re-running import statements each call would dominate dispatch cost)."""

    def __getattr__(self, name: str) -> Any:
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, Dataset

        from . import data, grads, metrics, model, pipeline, runtime, sharding, states

        values = dict(torch=torch, nn=nn, DataLoader=DataLoader, Dataset=Dataset, data=data, grads=grads,
                      metrics=metrics, model=model, pipeline=pipeline, runtime=runtime, sharding=sharding,
                      states=states)
        self.__dict__.update(values)
        return values[name]


_lazy = _Lazy()


def _runtime(session: pp.Session) -> Any:
    return _lazy.runtime.get_runtime(session)


@hookimpl
def polyparallel_capabilities() -> pp.Capabilities:
    return CAPABILITIES


@hookimpl
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    if not _torch_loaded() or not isinstance(data, (_lazy.Dataset, _lazy.DataLoader)):
        return None
    return _lazy.data.shard_loader(data, session, policy, strategy)


@hookimpl
def polyparallel_wrap_model(strategy: pp.Strategy, session: pp.Session, model: Any, options: dict[str, Any]) -> Any:
    if not _torch_loaded() or not isinstance(model, _lazy.nn.Module):
        return None
    # before any collective
    options = _lazy.model.validate(model, session.topology, options, strategy.shard_policy.stage, strategy.accumulate,
                                   strategy.precision)
    return _lazy.model.wrap_module(model, _runtime(session), options, strategy)


@hookimpl
def polyparallel_sync_grads(strategy: pp.Strategy, session: pp.Session, target: Any) -> Any:
    if not _torch_loaded():
        return None
    if isinstance(target, _lazy.nn.Module) and strategy.precision is not None and strategy.precision.loss_scaling:
        from .precision import check_scaled

        check_scaled(target)  # before any collective, alike on every rank
    if isinstance(target, _lazy.nn.Module) or (
        isinstance(target, (list, tuple)) and target
        and all(isinstance(g, _lazy.torch.Tensor) or g is None for g in target)
    ):
        if _lazy.sharding.is_fsdp(target):  # FSDP2 reduce-scattered the gradients in backward
            return _lazy.sharding.sync_noop(target, _runtime(session), strategy, "FSDP module")
        if isinstance(target, _lazy.pipeline.PipelineModel) and target.data_parallel is not None:  # in DDP/FSDP2
            return _lazy.sharding.sync_noop(target, _runtime(session), strategy, "pipeline stage")
        return _lazy.grads.sync_gradients(target, _runtime(session), strategy)
    return None


def _owns_metrics(metrics: Mapping[str, Any]) -> bool:
    # Ours (on the torch runtime): any torch tensor, or only plain numbers/Means. A mapping
    # holding another framework's arrays is not ours.
    import numbers

    values = [v.total if isinstance(v, pp.Mean) else v for v in metrics.values()]
    if all(isinstance(v, numbers.Real) for v in values):
        return True
    return _torch_loaded() and any(isinstance(v, _lazy.torch.Tensor) for v in values)


@hookimpl(trylast=True)
def polyparallel_reduce_metrics(strategy: pp.Strategy, session: pp.Session,
                                metrics: dict[str, Any]) -> dict[str, Any] | None:
    if not _owns_metrics(metrics):
        return None
    return _lazy.metrics.reduce(metrics, _runtime(session), strategy.metric_policy)


@hookimpl
def polyparallel_sync_states(strategy: pp.Strategy, session: pp.Session, states: Any) -> Any:
    if not _torch_loaded():
        return None
    if not (isinstance(states, _lazy.nn.Module) or (
            isinstance(states, Mapping) and states
            and all(isinstance(v, _lazy.torch.Tensor) for v in states.values()))):
        return None
    return _lazy.states.sync(states, _runtime(session), strategy)


@hookimpl
def polyparallel_save_checkpoint(strategy: pp.Strategy, session: pp.Session, path: str, state: dict[str, Any],
                                 options: dict[str, Any]) -> Any:
    from .checkpoint import save

    return save(strategy, path, state, options)


@hookimpl
def polyparallel_load_checkpoint(strategy: pp.Strategy, session: pp.Session, path: str,
                                 state: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    from .checkpoint import load

    return load(strategy, path, state, options)


@hookimpl
def polyparallel_export_checkpoint(path: str, metadata: dict[str, Any], to: str, output: str) -> str | None:
    from .checkpoint_export import export

    return export(path, metadata, to, output)


@hookimpl
def polyparallel_launch(fn: Any, strategy: pp.Strategy, runtime: str, nprocs: int, args: tuple, kwargs: dict,
                        timeout: float | None, trace_dir: str | None = None) -> list[Any] | None:
    from .launchers.multiprocess import launch_function

    if strategy.precision is not None:  # what the capabilities cannot say, before any process starts
        from .precision import check

        topology = strategy.topology if strategy.topology.is_resolved else strategy.topology.resolve(nprocs)
        check(strategy.precision, topology, strategy.shard_policy.stage, "launch()")
    return launch_function(fn, strategy, nprocs, args, kwargs, timeout, trace_dir=trace_dir)


@hookimpl
def polyparallel_launch_script(command: list[str], options: dict[str, Any]) -> int:
    from .launchers.torchrun import launch_script

    return launch_script(command, options)


@hookimpl
def polyparallel_register_demos(register: Any) -> None:
    from .demo import run_demo, run_demo_zero3

    register("torch", run_demo)
    register("torch-zero3", run_demo_zero3)


@hookimpl
def polyparallel_register_advisors(register: Any) -> None:
    from .advisor import TorchAdvisor  # imports no torch until a method runs

    register(RUNTIME, TorchAdvisor())
