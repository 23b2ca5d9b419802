"""Hook implementations of the JAX plugin (the ``polyparallel`` entry point ``jax``).

Importing this module is cheap: JAX, Flax and optax are imported inside the hooks.

Routing: the JAX runtime (``Strategy(runtime="jax")``, or the automatic choice where JAX is the
only runtime installed or imported) is declared by ``polyparallel_capabilities``. The core calls
the hooks below only for sessions (and launches) whose runtime is ``"jax"``, so a torch strategy
never reaches JAX and a JAX strategy never reaches torch, with no guard here. Within the JAX
runtime, each operation owns its objects:

- ``shard_data``: numpy arrays and tuples/lists/dicts of them (host data);
- ``wrap_model``: ``flax.nnx.Module``; ``sync_grads``: pytrees of ``jax.Array`` (tracers included);
- ``reduce_metrics``: numbers, ``jax.Array`` and ``polyparallel.Mean`` of them;
- ``sync_states``: NNX modules and states, and mappings of ``jax.Array``;
- ``process_info``: ranks are devices, not processes; ``launch``: JAX processes joined by
  ``jax.distributed``;
- ``save_checkpoint``/``load_checkpoint`` (``Strategy.save``/``load``): a
  :class:`polyparallel_jax.Model`, or an ``nnx.Module`` with an ``nnx.Optimizer``, and a
  :class:`polyparallel_jax.ShardedArrays` loader (orbax-checkpoint, resharded to the reading mesh).
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable
from typing import Any

import polyparallel as pp

#: The runtime name this plugin answers for.
RUNTIME = "jax"

# collective_trace: the host-side collectives between processes (reduce_metrics/sync_states/predict
# gathers, checkpoint agreements) are recorded in polyparallel's trace (ops.bounded), and
# launch(trace_dir=) writes every process's (launch.py).
FEATURES = frozenset({"shard_map", "gspmd_tensor_parallel", "partition_rules", "sync_batch_stats",
                      "multi_process", "collective_timeout", "elegy_model", "collective_trace"})


def _jax_loaded() -> bool:
    # An object can only be a JAX object if jax was imported already: checking sys.modules
    # first keeps the hooks from importing JAX for another framework's objects.
    return "jax" in sys.modules


def _capabilities(target: str, **runtime: Any) -> pp.Capabilities:
    # Precisions (polyparallel_jax.precision): the runtime's operations and the Model map each
    # dtype of the policy; fp16-mixed (loss scaling) is refused with its reason. Accumulation:
    # shard_data gives each step's micro-batches, the Model scans them and reduces once.
    from .precision import REFUSED, RUNS

    return pp.Capabilities(target=target, axes={"data", "tensor"}, features=FEATURES, precisions=RUNS,
                           precision_reasons=REFUSED, accumulation=True, **runtime)


# -- registration ------------------------------------------------------------------------------


@pp.hookimpl
def polyparallel_capabilities() -> pp.Capabilities:
    """The JAX runtime runs ``data`` and ``tensor`` axes (no pipeline stages); it needs jax, has no
    communication backend to choose (``Strategy(backend=None)``), and comes after torch in the
    automatic choice (priority 0)."""
    return _capabilities(RUNTIME, imports={"jax", "jaxlib"}, priority=0)  # jax.Array lives in jaxlib


@pp.hookimpl
def polyparallel_register_adapters(register: Callable[..., None]) -> None:
    """``strategy.adapt("jax")`` (alias ``"elegy"``) -> :class:`polyparallel_jax.Model` bound to
    the strategy (``adapt("jax", module=..., loss=...)``), or a factory of them without ``module``."""
    for name in ("jax", "elegy"):
        register(name, _model_factory, capabilities=_capabilities(name, runtimes={RUNTIME}),
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
def polyparallel_process_info(runtime: str | None) -> pp.ProcessInfo | None:
    """On the JAX runtime, the world is the JAX devices (joins the multi-process world first)."""
    from .runtime import process_info

    return process_info()


@pp.hookimpl(tryfirst=True)
def polyparallel_launch(fn: Callable[..., Any], strategy: pp.Strategy, runtime: str, nprocs: int, args: tuple,
                        kwargs: dict, timeout: float | None, trace_dir: str | None) -> list[Any] | None:
    """Run ``fn`` in ``nprocs`` JAX processes (one CPU device each) joined by
    ``jax.distributed``; only on the JAX runtime."""
    from polyparallel._payload import inspect_payload, refuse_interactive

    from . import precision
    from .launch import launch_processes

    precision.check(strategy.precision, "launch()")  # what the capabilities cannot say, before any process
    # JAX is not fork-safe (its runtime is multithreaded): fresh interpreters only.
    refuse_interactive(inspect_payload(fn, args, kwargs), runtime,
                       "fresh interpreters (JAX cannot be forked; in a notebook, JAX runs on several devices in the "
                       "kernel itself: no launch is needed)")
    return launch_processes(fn, nprocs, args=args, kwargs=kwargs,
                            timeout=timeout if timeout is not None else max(120.0, 4 * strategy.timeout),
                            trace_dir=trace_dir)


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

    return ShardedArrays(data, runtime_for(strategy, session), policy, strategy.seed, strategy.accumulate)


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
    from . import precision
    from .ops import wrap_model
    from .runtime import runtime_for

    precision.check(strategy.precision, "wrap_model()")
    dtypes = precision.dtypes(strategy.precision)
    return wrap_model(runtime_for(strategy, session), model, options.get("plan"),
                      *((dtypes.param, dtypes.optimizer) if dtypes is not None else ()))


@pp.hookimpl
def polyparallel_sync_grads(strategy: pp.Strategy, session: pp.Session, target: Any) -> Any:
    """Gradients (a pytree of ``jax.Array``) -> their mean over ``data``."""
    if not _jax_loaded():
        return None
    from .ops import is_jax_tree, sync_grads

    return sync_grads(strategy, target) if is_jax_tree(target) else None


@pp.hookimpl
def polyparallel_reduce_metrics(strategy: pp.Strategy, session: pp.Session, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """Numbers, ``jax.Array`` and ``Mean`` values -> reduced over ``data``, count-weighted."""
    if not metrics:
        return None
    from .ops import is_jax_metric, reduce_metrics

    plain = [_is_number(v) for v in metrics.values()]
    if not all(p or is_jax_metric(v) for p, v in zip(plain, metrics.values())):
        return None
    runtime = _runtime_if_concrete(strategy, session)
    reduced = reduce_metrics(strategy, runtime, session.rank, metrics)
    if all(plain) and runtime is not None:  # numbers in, numbers out (as on every runtime)
        return {name: float(value) for name, value in reduced.items()}
    return reduced


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


def _is_number(value: Any) -> bool:
    # Plain numbers (and Means of them): on the JAX runtime they are this process's values.
    if isinstance(value, pp.Mean):
        return isinstance(value.total, numbers.Real) and isinstance(value.count, numbers.Real)
    return isinstance(value, numbers.Real)


def _runtime_if_concrete(strategy: pp.Strategy, session: pp.Session) -> Any:
    # Inside shard_map the collectives need no runtime object; outside, cross-process reductions
    # need the mesh (which processes hold which data coordinates).
    from .ops import inside_data_axis
    from .runtime import runtime_for

    return None if inside_data_axis() else runtime_for(strategy, session)


# -- checkpoints -------------------------------------------------------------------------------


def _checkpoint_objects(session: pp.Session, state: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """(model, optimizer, loader) when this plugin owns them (the core asks it on the JAX runtime only): a ``Model`` (which holds its own
    optimizer state) or an ``nnx.Module`` (optionally an ``nnx.Optimizer``), a ``ShardedArrays``.
    Other optimizers are refused with a ``CheckpointError`` (the plugin manager passes
    polyparallel errors through unwrapped)."""
    if "flax" not in sys.modules:
        return None
    from flax import nnx

    from .data import ShardedArrays
    from .model import Model

    model, optimizer, loader = state.get("model"), state.get("optimizer"), state.get("loader")
    if loader is not None and not isinstance(loader, ShardedArrays):
        return None
    if isinstance(model, Model):
        if optimizer is not None:
            raise pp.CheckpointError("A polyparallel_jax.Model holds its optimizer state: save/load it with model= only. "
                            f"Received optimizer={type(optimizer).__name__}.")
        return model, None, loader
    if isinstance(model, nnx.Module) and not isinstance(model, nnx.Optimizer):
        if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
            raise pp.CheckpointError("With an nnx.Module, optimizer= must be a flax.nnx.Optimizer (its state is restored in "
                            f"place). Received: {type(optimizer).__name__}.")
        return model, optimizer, loader
    return None


@pp.hookimpl
def polyparallel_save_checkpoint(strategy: pp.Strategy, session: pp.Session, path: str, state: dict[str, Any]) -> Any:
    """A JAX model (``Model``, or ``nnx.Module`` + ``nnx.Optimizer``) and loader -> an
    orbax-checkpoint directory under the core's commit marker; only on the JAX runtime."""
    objects = _checkpoint_objects(session, state)
    if objects is None:
        return None
    from . import saving
    from .model import Model

    model, optimizer, loader = objects
    framework = state.get("framework") or "flax"
    extras = {k: v for k, v in state.items() if k not in ("model", "optimizer", "loader", "framework")}
    if isinstance(model, Model):
        model.place(strategy)  # the Model saves from its placement on this strategy
        return saving.save_model(model, path, extras, framework, loader)
    return saving.save_module(strategy, path, model, optimizer, loader, framework, extras)


@pp.hookimpl
def polyparallel_load_checkpoint(strategy: pp.Strategy, session: pp.Session, path: str,
                                 state: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    """Restore a JAX checkpoint into ``state``'s objects, resharded to this strategy's mesh;
    only on the JAX runtime. A partial load (``strict=False`` / ``keys=``) is refused: the JAX
    runtime restores whole models only."""
    objects = _checkpoint_objects(session, state)
    if objects is None:
        return None
    if options:
        raise pp.CheckpointError("Strategy.load(strict=False / keys=): the JAX runtime loads whole models only; "
                                 "nothing was loaded. Load it whole, or copy the arrays you need from "
                                 "polyparallel_jax.checkpoint.restore(path, {name: target}).")
    from . import saving
    from .model import Model

    model, optimizer, loader = objects
    if isinstance(model, Model):
        return saving.load_model(model, path, strategy, loader)
    return saving.load_module(path, model, optimizer, loader)
