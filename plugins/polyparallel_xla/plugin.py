"""Hook implementations of the torch_xla runtime plugin (entry point ``xla``, extra ``xla``).

The core calls these hooks only for sessions (and launches) whose runtime is ``"xla"``, so they
need no ``session.runtime`` guard; torch_xla is imported inside the hooks, never at import. The
runtime runs the data axis only, and its priority is below torch's, so torch stays the automatic
choice where both are installed: ask for XLA with ``Strategy(runtime="xla")``.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Mapping
from typing import Any

import polyparallel as pp
from polyparallel import hookimpl

__all__: list[str] = []

RUNTIME = "xla"

CAPABILITIES = pp.Capabilities(
    # collective_trace: every host check and XLA all-reduce is recorded, per replica (runtime.py).
    RUNTIME, axes={"data"}, features={"xla_collectives", "mp_device_loader", "host_identity_checks", "timeouts",
                                      "collective_trace"},
    imports={"torch_xla"}, backends={"xla"}, priority=5,
    # Strategy(precision=): the torch runtime's mechanism on the XLA device (polyparallel_torch.precision,
    # from ops.wrap_model): bf16-mixed autocasts forward on "xla", bf16-true casts the parameters.
    precisions={"32", "bf16-mixed", "bf16-true"},
    precision_reasons={
        "fp16-mixed": "float16 needs loss scaling, and the XLA runtime makes no gradient scaler (its sync_grads "
                      "neither unscales nor skips steps with inf/NaN gradients); TPUs compute in bfloat16, so use "
                      "'bf16-mixed'",
        "custom": "the XLA runtime maps the presets '32', 'bf16-mixed' and 'bf16-true' only (gradients reduce in "
                  "the parameters' dtype)",
    },
)


def _loaded() -> bool:
    return "torch_xla" in sys.modules


def _runtime(session: pp.Session) -> Any:
    from .runtime import get_runtime

    return get_runtime(session)


@hookimpl
def polyparallel_capabilities() -> pp.Capabilities:
    return CAPABILITIES


@hookimpl
def polyparallel_process_info(strategy: pp.Strategy, runtime: str | None) -> pp.ProcessInfo | None:
    """Rank = the replica's global ordinal, world size and local rank from ``torch_xla.runtime``."""
    import torch_xla.runtime as xr

    info = pp.ProcessInfo(xr.global_ordinal(), xr.world_size(), xr.local_ordinal())
    if info.world_size > 1 and xr.addressable_device_count() > 1 and pp.current_session_scope() is None:
        raise pp.TopologyError(
            f"this process serves {xr.addressable_device_count()} XLA devices from threads (one replica each), but "
            f"{strategy!r} is used outside a replica's session scope, so every replica would share one rank. Start "
            "the function with polyparallel.launch(fn, strategy, nprocs=...), or run each replica's body inside "
            "`with polyparallel.session_scope(torch_xla.runtime.global_ordinal()):`."
        )
    return info


@hookimpl
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    if "torch" not in sys.modules:
        return None
    from torch.utils.data import DataLoader, Dataset

    if not isinstance(data, (Dataset, DataLoader)):
        return None
    from .ops import shard_data

    return shard_data(data, session, policy, strategy)


@hookimpl
def polyparallel_wrap_model(strategy: pp.Strategy, session: pp.Session, model: Any, options: dict[str, Any]) -> Any:
    if "torch" not in sys.modules:
        return None
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    precision = options.get("precision", strategy.precision)
    if isinstance(precision, pp.PrecisionPolicy):  # a script outside pp.launch meets the launch's refusal here
        CAPABILITIES.check_precision(precision)
    from .ops import wrap_model

    return wrap_model(model, _runtime(session), options, strategy.precision)


@hookimpl
def polyparallel_sync_grads(strategy: pp.Strategy, session: pp.Session, target: Any) -> Any:
    if "torch" not in sys.modules:
        return None
    import torch
    from torch import nn

    if not (isinstance(target, nn.Module) or (isinstance(target, (list, tuple)) and target and all(
            isinstance(g, torch.Tensor) or g is None for g in target))):
        return None
    from .ops import sync_grads

    return sync_grads(target, _runtime(session), strategy)


@hookimpl(trylast=True)
def polyparallel_reduce_metrics(strategy: pp.Strategy, session: pp.Session,
                                metrics: dict[str, Any]) -> dict[str, Any] | None:
    values = [v.total if isinstance(v, pp.Mean) else v for v in metrics.values()]
    torch = sys.modules.get("torch")
    if not all(isinstance(v, numbers.Real) or (torch is not None and isinstance(v, torch.Tensor)) for v in values):
        return None
    from .ops import reduce_metrics

    return reduce_metrics(metrics, _runtime(session), strategy.metric_policy)


@hookimpl
def polyparallel_sync_states(strategy: pp.Strategy, session: pp.Session, states: Any) -> Any:
    if "torch" not in sys.modules:
        return None
    import torch
    from torch import nn

    if not (isinstance(states, nn.Module) or (isinstance(states, Mapping) and states and all(
            isinstance(v, torch.Tensor) for v in states.values()))):
        return None
    from .ops import sync_states

    return sync_states(states, _runtime(session), strategy)


@hookimpl
def polyparallel_launch(fn: Any, strategy: pp.Strategy, runtime: str, nprocs: int, args: tuple, kwargs: dict,
                        timeout: float | None, trace_dir: str | None) -> list[Any] | None:
    from .launch import launch_function

    return launch_function(fn, strategy, nprocs, args, kwargs, timeout, trace_dir)
