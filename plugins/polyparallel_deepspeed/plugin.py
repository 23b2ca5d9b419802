"""Hook implementations of the DeepSpeed plugin (entry point ``deepspeed``).

Importing this module is cheap: torch and deepspeed are imported inside the factories, and the
hooks recognise a DeepSpeed engine only when deepspeed is already imported.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import polyparallel as pp
from polyparallel import hookimpl

from .capabilities import CAPABILITIES

__all__ = ["CAPABILITIES", "is_engine"]


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (``DeepSpeedEngine``, ``PipelineEngine``), without
    importing deepspeed (an engine exists only once it is imported)."""
    module = sys.modules.get("deepspeed.runtime.engine")
    return module is not None and isinstance(obj, module.DeepSpeedEngine)


def _make_engine(strategy: pp.Strategy, **kwargs: Any) -> Any:
    import importlib.util

    if "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None:
        raise pp.NoPluginError("adapt('deepspeed') needs DeepSpeed, which is not installed here: "
                               "DS_BUILD_OPS=0 pip install 'polyparallel[deepspeed]'.")
    from .adapter import initialize

    return initialize(strategy, **kwargs)


@hookimpl
def polyparallel_register_adapters(register: Any) -> None:
    register("deepspeed", _make_engine, capabilities=CAPABILITIES,
             description="DeepSpeed: deepspeed.initialize with the ZeRO stage, batch sizes and process groups of "
                         "the Strategy (PipelineModule when pipeline > 1); returns the engine")


@hookimpl(tryfirst=True)
def polyparallel_sync_grads(strategy: pp.Strategy, session: pp.Session, target: Any) -> Any:
    # DeepSpeed reduces (ZeRO 2/3: reduce-scatters) gradients itself in engine.backward() / the
    # pipeline schedule: a documented no-op, so a loop written for plain torch runs unchanged.
    return target if is_engine(target) else None


@hookimpl(tryfirst=True)
def polyparallel_sync_states(strategy: pp.Strategy, session: pp.Session, states: Any) -> Any:
    if not is_engine(states):
        return None
    from polyparallel_torch.runtime import get_runtime
    from polyparallel_torch.states import sync

    from .adapter import engine_states

    named: Mapping[str, Any] = engine_states(states)
    if named:
        sync(named, get_runtime(session), strategy)
    return states


def _engine_or_refuse(model: Any, operation: str) -> bool:
    """Whether this plugin answers for ``model`` (a DeepSpeed engine; the core asks this plugin on
    torch sessions only, the runtime its adapter declares); a ZeRO-3 ``engine.module`` is refused,
    its tensors being placeholders without the engine."""
    if "deepspeed" not in sys.modules:
        return False
    if is_engine(model):
        return True
    from .checkpoint import is_partitioned_module

    if is_partitioned_module(model):
        raise pp.CheckpointError(f"Strategy.{operation}(model=) got a module whose parameters ZeRO-3 partitioned (the "
                                 "engine's module): its tensors are placeholders. Pass the engine itself: "
                                 f"strategy.{operation}(path, model=engine, optimizer=engine.optimizer).")
    return False


@hookimpl(tryfirst=True)
def polyparallel_save_checkpoint(strategy: pp.Strategy, path: str, state: dict[str, Any],
                                 options: dict[str, Any]) -> Any:
    # A DeepSpeed engine is saved in the torch runtime's format (see polyparallel_deepspeed.checkpoint),
    # asynchronously too (options={"asynchronous": True}: Strategy.async_save).
    if not _engine_or_refuse(state.get("model"), "save"):
        return None
    from .checkpoint import save

    return save(strategy, path, state, options)


@hookimpl(tryfirst=True)
def polyparallel_load_checkpoint(strategy: pp.Strategy, path: str, state: dict[str, Any],
                                 options: dict[str, Any]) -> dict[str, Any] | None:
    # options: a partial load of the engine's weights (strict=False / keys=), or empty.
    if not _engine_or_refuse(state.get("model"), "load"):
        return None
    from .checkpoint import load

    return load(strategy, path, state, options)


@hookimpl
def polyparallel_adapter_bridge(adapter: str, obj: Any) -> Any:
    # The Ignite adapter's create_supervised_trainer/evaluator handed an engine: ignite engines
    # that step it (the Ignite adapter does not import this plugin; adapters stay independent).
    if adapter != "ignite" or not is_engine(obj):
        return None
    from . import ignite

    return ignite


@hookimpl
def polyparallel_register_demos(register: Any) -> None:
    from .demo import run_demo

    register("deepspeed", run_demo)
