"""``sync_states`` for torch: per-state ``mean`` / ``broadcast`` / ``local`` over the data axis."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .grads import buckets
from .model import unwrap
from .runtime import TorchRuntime

__all__ = ["sync", "named_states", "apply_in_buckets"]


def named_states(states: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's parameters and buffers, or of a mapping of tensors."""
    if isinstance(states, nn.Module):
        module = unwrap(states)
        return [*module.named_parameters(), *module.named_buffers()]
    return [(k, v) for k, v in states.items() if isinstance(v, torch.Tensor)]


def sync(states: Any, rt: TorchRuntime) -> Any:
    """Apply the strategy's :class:`~polyparallel.StatePolicy` to ``states`` in place."""
    if not isinstance(states, (nn.Module, Mapping)):
        return None
    if rt.topology.size("data") == 1:
        return states
    policy = rt.strategy.state_policy
    groups: dict[str, list[torch.Tensor]] = {"mean": [], "broadcast": []}
    for name, tensor in named_states(states):
        action = policy.action_for(name)
        if action == "local":
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if action == "mean" and not local.is_floating_point():
            continue  # an integer counter cannot be averaged; leave it alone
        groups[action].append(local.data)
    for action, tensors in groups.items():
        apply_in_buckets(tensors, action, rt, "sync_states")
    return states


def apply_in_buckets(tensors: list[torch.Tensor], action: str, rt: TorchRuntime, operation: str) -> None:
    """``mean`` (average) or ``broadcast`` (from data rank 0) ``tensors`` over the data group in
    place, packed into flat buckets of one dtype (in a deterministic order on every rank)."""
    with torch.no_grad():
        for bucket in buckets(tensors, rt.strategy.grad_policy.bucket_bytes()):
            flat = _flatten_dense_tensors(bucket)
            if action == "mean":
                rt.all_reduce(flat, "avg", operation, "data")
            else:
                rt.broadcast(flat, operation, "data")
            for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(synced)
