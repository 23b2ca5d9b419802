"""``sync_states`` for torch: per-state ``mean`` / ``broadcast`` / ``local`` over the data axis.

The actions come from the ``StatePolicy`` of the Strategy the call was made with. The states are
packed into flat buckets per action and dtype, after one identity check whose descriptor holds
every state's action, dtype and shape, so ranks at different operations (or with different
states) raise an error naming both sides instead of averaging unrelated tensors. A tensor sharded
over ``data`` (an FSDP2 parameter at zero=2/3) has no replicas: it is left alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import TorchRuntime
from .sharding import sharded_over_data
from .tensors import apply_in_buckets, local_tensor, unwrap

__all__ = ["sync", "named_states"]


def named_states(states: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's parameters and buffers, or of a mapping of tensors."""
    if isinstance(states, nn.Module):
        module = unwrap(states)
        return [*module.named_parameters(), *module.named_buffers()]
    return [(k, v) for k, v in states.items() if isinstance(v, torch.Tensor)]


def sync(states: Any, rt: TorchRuntime, strategy: pp.Strategy) -> Any:
    """Apply ``strategy.state_policy`` to ``states`` in place."""
    if not isinstance(states, (nn.Module, Mapping)):
        return None
    rt.ensure_usable("sync_states", "data")
    if rt.topology.size("data") == 1:
        return states
    policy = strategy.state_policy
    groups: dict[str, list[torch.Tensor]] = {"mean": [], "broadcast": []}
    described: list[str] = []
    for name, tensor in named_states(states):
        action = policy.action_for(name)
        if action == "local" or sharded_over_data(tensor):
            continue
        local = local_tensor(tensor)
        if action == "mean" and not local.is_floating_point():
            continue  # an integer counter cannot be averaged; leave it alone
        groups[action].append(local.data)
        described.append(f"{name}:{action}:{local.dtype}{list(local.shape)}")
    shown = ", ".join(described[:4]) + (", ..." if len(described) > 4 else "")
    digest = hashlib.blake2b(";".join(described).encode(), digest_size=12).hexdigest()
    detail = f"{len(described)} states [{shown}] digest {digest}"
    bucket_bytes = strategy.grad_policy.bucket_bytes()
    with rt.operation("sync_states", "data", detail):
        for action, tensors in groups.items():
            apply_in_buckets(tensors, action, rt, "sync_states", bucket_bytes)
    return states
