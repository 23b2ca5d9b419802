"""Hook implementations of the JAX plugin (the ``polyparallel`` entry point ``jax``).

Importing this module is cheap: JAX, Flax and optax are imported inside the hooks.

Dispatch (every operation hook is ``firstresult``; a hook returns ``None`` for objects that are
not JAX's, so the next plugin is asked):

- ``shard_data`` owns numpy arrays and tuples/lists/dicts of them (host data). torch objects are
  never numpy arrays, but another plugin may also accept numpy, so this hook is ``trylast``: it
  answers only when no other plugin took the object.
- ``wrap_model`` owns ``flax.nnx.Module``; ``sync_grads`` owns pytrees of ``jax.Array`` (tracers
  included); ``reduce_metrics`` owns mappings whose values are all ``jax.Array`` or
  ``polyparallel.Mean`` of them (plain numbers are left to other runtimes); ``sync_states`` owns
  NNX modules and states and mappings of ``jax.Array``.
- ``process_info`` (``tryfirst``) answers only for JAX strategies (``backend="jax"`` or
  ``POLYPARALLEL_RUNTIME=jax``): their ranks are devices, not processes. ``launch`` likewise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import polyparallel as pp

from .runtime import is_jax_strategy

FEATURES = frozenset({"shard_map", "gspmd_tensor_parallel", "partition_rules", "sync_batch_stats",
                      "multi_process", "collective_timeout", "elegy_model"})


def _jax_loaded() -> bool:
    # An object can only be a JAX object if jax was imported already: checking sys.modules
    # first keeps the hooks from importing JAX for another framework's objects.
    return "jax" in sys.modules


def _capabilities(target: str) -> pp.Capabilities:
    return pp.Capabilities(target=target, axes={"data", "tensor"}, features=FEATURES)


# -- registration ------------------------------------------------------------------------------


@pp.hookimpl
def polyparallel_capabilities() -> pp.Capabilities:
    """The JAX runtime runs ``data`` and ``tensor`` axes (no pipeline stages)."""
    return _capabilities("jax")


@pp.hookimpl
def polyparallel_register_adapters(register: Callable[..., None]) -> None:
    """``strategy.adapt("jax")`` (alias ``"elegy"``) -> :class:`polyparallel_jax.Model` bound to
    the strategy (``adapt("jax", module=..., loss=...)``), or a factory of them without ``module``."""
    for name in ("jax", "elegy"):
        register(name, _model_factory, capabilities=_capabilities(name),
                 description="Elegy-style Model(module, loss, optimizer, metrics).fit(..., strategy=) on Flax NNX")


def _model_factory(strategy: pp.Strategy, **kwargs: Any) -> Any:
    import functools

    from .model import Model

    if "module" in kwargs:
        return Model(strategy=strategy, **kwargs)
    return functools.partial(Model, strategy=strategy, **kwargs)


@pp.hookimpl
def polyparallel_register_demos(register: Callable[..., None]) -> None:
    """``polyparallel demo`` entry ``jax``: the digits MLP with ``Model.fit(strategy=...)``."""
    from . import demo

    register("jax", demo.run)


# -- lifecycle ---------------------------------------------------------------------------------


@pp.hookimpl(tryfirst=True)
def polyparallel_process_info(strategy: pp.Strategy) -> pp.ProcessInfo | None:
    """For a JAX strategy, the world is the JAX devices (joins the multi-process world first)."""
    if not is_jax_strategy(strategy):
        return None
    from .runtime import process_info

    return process_info()


@pp.hookimpl(tryfirst=True)
def polyparallel_launch(fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int, args: tuple,
                        kwargs: dict, timeout: float | None) -> list[Any] | None:
    """Run ``fn`` in ``nprocs`` JAX processes (one CPU device each) joined by
    ``jax.distributed``; only for JAX strategies."""
    if not is_jax_strategy(strategy):
        return None
    from .launch import launch_processes

    return launch_processes(fn, nprocs, args=args, kwargs=kwargs,
                            timeout=timeout if timeout is not None else max(120.0, 4 * strategy.timeout))


# -- the five operations -----------------------------------------------------------------------


@pp.hookimpl(trylast=True)
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    """Numpy host data -> :class:`polyparallel_jax.data.ShardedArrays` over the data axis."""
    if "numpy" not in sys.modules:
        return None
    from .data import ShardedArrays, is_host_data

    if not is_host_data(data):
        return None
    from .runtime import runtime_for

    return ShardedArrays(data, runtime_for(strategy, session), policy, strategy.seed)


@pp.hookimpl
def polyparallel_wrap_model(strategy: pp.Strategy, session: pp.Session, model: Any, options: dict[str, Any]) -> Any:
    """An ``nnx.Module`` -> :class:`polyparallel_jax.ops.ShardedModule` (``plan=`` partition rules)."""
    if "flax" not in sys.modules:
        return None
    from flax import nnx

    if not isinstance(model, nnx.Module):
        return None
    unknown = set(options) - {"plan"}
    if unknown:
        raise TypeError(f"wrap_model() of an NNX module takes plan= only. Received: {sorted(unknown)}.")
    from .ops import wrap_model
    from .runtime import runtime_for

    return wrap_model(runtime_for(strategy, session), model, options.get("plan"))


@pp.hookimpl
def polyparallel_sync_grads(strategy: pp.Strategy, target: Any) -> Any:
    """Gradients (a pytree of ``jax.Array``) -> their mean over ``data``."""
    if not _jax_loaded():
        return None
    from .ops import is_jax_tree, sync_grads

    return sync_grads(strategy, target) if is_jax_tree(target) else None


@pp.hookimpl
def polyparallel_reduce_metrics(strategy: pp.Strategy, session: pp.Session, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """``jax.Array`` / ``Mean`` values -> reduced over ``data``, count-weighted."""
    if not _jax_loaded() or not metrics:
        return None
    from .ops import is_jax_metric, reduce_metrics

    if not all(is_jax_metric(v) for v in metrics.values()):
        return None
    return reduce_metrics(strategy, _runtime_if_concrete(strategy, session), session.rank, metrics)


@pp.hookimpl
def polyparallel_sync_states(strategy: pp.Strategy, session: pp.Session, states: Any) -> Any:
    """NNX module/state or mapping of ``jax.Array`` -> synced per ``strategy.state_policy``."""
    if not _jax_loaded():
        return None
    from flax import nnx

    from .ops import is_jax_tree, sync_states

    if not isinstance(states, (nnx.Module, nnx.State)) and not (isinstance(states, dict) and is_jax_tree(states)):
        return None
    return sync_states(strategy, _runtime_if_concrete(strategy, session), session.rank, states)


def _runtime_if_concrete(strategy: pp.Strategy, session: pp.Session) -> Any:
    # Inside shard_map the collectives need no runtime object; outside, cross-process reductions
    # need the mesh (which processes hold which data coordinates).
    from .ops import inside_data_axis
    from .runtime import runtime_for

    return None if inside_data_axis() else runtime_for(strategy, session)
