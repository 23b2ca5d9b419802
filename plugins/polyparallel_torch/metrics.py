"""``reduce_metrics`` for torch: count-weighted, over the data group only, bounded in time.

All values travel in one float64 buffer per reduction op (one all-reduce for the sums, and one
each for max and min when asked for), after the runtime's identity check
(:meth:`~polyparallel_torch.runtime.TorchRuntime.check`), whose descriptor holds every name, op
and size: ranks that reduce different names — or that are at another operation altogether — get an
error naming both sides, not a hang or a silently wrong number. A value of the wrong type is
refused on every rank of the group (its peers learn it through the check). The ops come from the
``MetricPolicy`` of the Strategy the call was made with.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

import polyparallel as pp

from .runtime import TorchRuntime

__all__ = ["reduce"]


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype=torch.float64, device="cpu").reshape(-1)
    return torch.tensor([float(value)], dtype=torch.float64)


def reduce(metrics: dict[str, Any], rt: TorchRuntime, policy: pp.MetricPolicy) -> dict[str, Any]:
    """Reduce ``metrics`` over the data axis; see :meth:`polyparallel.Strategy.reduce_metrics`."""
    rt.ensure_usable("reduce_metrics", "data")
    names = sorted(metrics)
    layout: list[tuple[str, str, int, Any]] = []  # name, op, numel, original value
    refusal = None
    for name in names:
        value = metrics[name]
        if isinstance(value, pp.Mean):
            layout.append((name, "weighted", 2, value))
        elif isinstance(value, (torch.Tensor, numbers.Real)):
            layout.append((name, policy.op_for(name), _as_tensor(value).numel(), value))
        elif refusal is None:
            refusal = (
                f"reduce_metrics(): metric {name!r} is a {type(value).__name__} ({value!r}) on rank {rt.rank}; "
                "expected a number, a torch tensor or polyparallel.Mean(total, count). Convert it first, e.g. "
                f"float(value)."
            )
    data_size = rt.topology.size("data")
    signature = ", ".join(f"{n}:{op}[{k}]" for n, op, k, _ in layout)
    if refusal is not None:  # on every rank of the data group: the peers learn why
        rt.check("reduce_metrics", "data", signature, refusal=refusal)
    with rt.operation("reduce_metrics", "data", signature):
        return _reduce(layout, rt, data_size)


def _reduce(layout: list[tuple[str, str, int, Any]], rt: TorchRuntime, data_size: int) -> dict[str, Any]:
    by_op: dict[str, list[torch.Tensor]] = {"sum": [], "max": [], "min": []}
    for _name, op, _, value in layout:
        if op == "weighted":
            by_op["sum"].append(torch.tensor([float(value.total), float(value.count)], dtype=torch.float64))
        else:
            by_op["sum" if op in ("mean", "sum") else op].append(_as_tensor(value))
    reduced: dict[str, torch.Tensor] = {}
    for op, parts in by_op.items():
        if parts:
            flat = torch.cat(parts).to(rt.device)
            rt.all_reduce(flat, op, "reduce_metrics", "data")
            reduced[op] = flat.cpu()
    offsets = dict.fromkeys(by_op, 0)
    out: dict[str, Any] = {}
    for name, op, numel, value in layout:
        key = "sum" if op in ("weighted", "mean", "sum") else op
        chunk = reduced[key][offsets[key]: offsets[key] + numel]
        offsets[key] += numel
        if op == "weighted":
            total, count = chunk.tolist()
            out[name] = total / count if count else math.nan
            continue
        if op == "mean":
            chunk = chunk / data_size
        if isinstance(value, torch.Tensor):
            out[name] = chunk.reshape(value.shape).to(dtype=value.dtype if value.is_floating_point() else torch.float64)
        else:
            out[name] = float(chunk.item())
    return out
