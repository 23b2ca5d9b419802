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
from collections.abc import Callable, Mapping
from typing import Any

import torch

import polyparallel as pp

from .runtime import TorchRuntime

__all__ = ["Layout", "layout", "reduce", "reduce_layout"]


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype=torch.float64, device="cpu").reshape(-1)
    return torch.tensor([float(value)], dtype=torch.float64)


Layout = list[tuple[str, str, int, Any]]  # name, op ("weighted" for a Mean), numel, original value


def layout(metrics: Mapping[str, Any], policy: pp.MetricPolicy, rank: int) -> tuple[Layout, str, str | None]:
    """How ``metrics`` travel: ``(layout, signature, refusal)``, by sorted name. ``signature`` (every
    name, op and size) is what the identity check compares between ranks; ``refusal`` names the first
    value of a wrong type (``None``: all fine). Shared with other torch-based runtimes (XLA)."""
    out: Layout = []
    refusal = None
    for name in sorted(metrics):
        value = metrics[name]
        if isinstance(value, pp.Mean):
            out.append((name, "weighted", 2, value))
        elif isinstance(value, (torch.Tensor, numbers.Real)):
            out.append((name, policy.op_for(name), _as_tensor(value).numel(), value))
        elif refusal is None:
            refusal = (
                f"reduce_metrics(): metric {name!r} is a {type(value).__name__} ({value!r:.60}) on rank {rank}; "
                "expected a number, a torch tensor or polyparallel.Mean(total, count). Convert it first, e.g. "
                f"float(value)."
            )
    return out, ", ".join(f"{n}:{op}[{k}]" for n, op, k, _ in out), refusal


def reduce(metrics: dict[str, Any], rt: TorchRuntime, policy: pp.MetricPolicy) -> dict[str, Any]:
    """Reduce ``metrics`` over the data axis; see :meth:`polyparallel.Strategy.reduce_metrics`."""
    rt.ensure_usable("reduce_metrics", "data")
    items, signature, refusal = layout(metrics, policy, rt.rank)
    if refusal is not None:  # on every rank of the data group: the peers learn why
        rt.check("reduce_metrics", "data", signature, refusal=refusal)
    with rt.operation("reduce_metrics", "data", signature):
        return reduce_layout(items, lambda flat, op: rt.all_reduce(flat, op, "reduce_metrics", "data"), rt.device,
                             rt.topology.size("data"))


def reduce_layout(items: Layout, all_reduce: Callable[[torch.Tensor, str], object], device: Any,
                  data_size: int) -> dict[str, Any]:
    """The reduction itself: one float64 buffer per op (sum, max, min) on ``device``, reduced in
    place by ``all_reduce(buffer, op)``, then unpacked by name (``Mean`` values count-weighted,
    ``mean`` values divided by ``data_size``, tensors keep their shape)."""
    by_op: dict[str, list[torch.Tensor]] = {"sum": [], "max": [], "min": []}
    for _name, op, _, value in items:
        if op == "weighted":
            by_op["sum"].append(torch.tensor([float(value.total), float(value.count)], dtype=torch.float64))
        else:
            by_op["sum" if op in ("mean", "sum") else op].append(_as_tensor(value))
    reduced: dict[str, torch.Tensor] = {}
    for op, parts in by_op.items():
        if parts:
            flat = torch.cat(parts).to(device)
            all_reduce(flat, op)
            reduced[op] = flat.cpu()
    offsets = dict.fromkeys(by_op, 0)
    out: dict[str, Any] = {}
    for name, op, numel, value in items:
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
