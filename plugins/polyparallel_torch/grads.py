"""``sync_grads`` for torch: bucketed all-reduce of gradients over the data group.

A DDP-wrapped module already reduced its gradients during ``backward()`` (DDP's reducer,
bucketed and overlapped with the backward pass): ``sync_grads`` is then a no-op that answers.
For a bare module (or a list of tensors) gradients are packed into flat buffers of at most
``GradPolicy.bucket_mb`` MB per dtype: one collective per bucket, not one per parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .model import is_ddp
from .runtime import TorchRuntime

__all__ = ["sync_gradients", "no_sync", "buckets"]


def _local(t: torch.Tensor) -> torch.Tensor:
    # A tensor-parallel DTensor gradient is reduced over the data axis shard by shard.
    return t.to_local() if hasattr(t, "to_local") else t


def buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Group tensors into lists of one dtype/device and at most ``bucket_bytes`` each."""
    open_: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    sizes: dict[tuple[Any, Any], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if open_.get(key) and sizes[key] + nbytes > bucket_bytes:
            yield open_.pop(key)
            sizes[key] = 0
        open_.setdefault(key, []).append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    yield from (b for b in open_.values() if b)


def sync_gradients(target: Any, rt: TorchRuntime) -> Any:
    """Average (or sum, per ``GradPolicy.op``) gradients of ``target`` over the data group."""
    if is_ddp(target) or rt.topology.size("data") == 1:
        return target  # DDP's reducer already averaged them; or there is nobody to average with
    if isinstance(target, nn.Module):
        grads = [_local(p.grad) for p in target.parameters() if p.grad is not None]
    else:
        grads = [_local(g) for g in target if g is not None]
    op = "avg" if rt.strategy.grad_policy.op == "mean" else "sum"
    bucket_bytes = int(rt.strategy.grad_policy.bucket_mb * 1024 * 1024)
    for bucket in buckets(grads, bucket_bytes):
        if len(bucket) == 1:
            rt.all_reduce(bucket[0], op, "sync_grads", "data")
            continue
        flat = _flatten_dense_tensors(bucket)
        rt.all_reduce(flat, op, "sync_grads", "data")
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)
    return target


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without synchronising (DDP's ``no_sync``; a no-op for bare modules,
    whose gradients are only synced when ``strategy.sync_grads`` is called)."""
    if is_ddp(model):
        with model.no_sync():
            yield
    else:
        yield
