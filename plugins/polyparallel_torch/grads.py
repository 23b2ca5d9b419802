"""``sync_grads`` for torch: bucketed all-reduce of gradients over the data group.

A DDP-wrapped module already reduced its gradients during ``backward()`` (DDP's reducer,
bucketed and overlapped with the backward pass): ``sync_grads`` is then a no-op that answers.
For a bare module gradients are copied into persistent flat buffers of at most
``GradPolicy.bucket_mb`` MB per dtype (kept per module, rebuilt if its parameters change): one
collective per bucket, not one per parameter. A list of gradient tensors is packed per call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

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


class _FlatBuffers:
    """Persistent flat buffers of a module's gradients (one per bucket) whose views become the
    parameters' ``.grad`` — DDP's "gradient as bucket view" — so that a loop that zeroes
    gradients in place (``zero_grad(set_to_none=False)``) syncs with one all-reduce per bucket
    and no copy at all. Fresh gradients (``set_to_none=True``, the default) are copied in with one
    ``_foreach_copy_`` per bucket, then replaced by the views. A tensor as large as a bucket is
    reduced in place, uncopied."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int):
        self.key = tuple(map(id, params))
        self.buckets: list[tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]] = []
        self.sharded: dict[int, list[bool]] = {}
        locals_ = [_local(p) for p in params]
        by_id = {id(local): param for local, param in zip(locals_, params)}
        for bucket in buckets(locals_, bucket_bytes):
            owners = [by_id[id(t)] for t in bucket]
            if len(bucket) == 1:
                self.buckets.append((None, owners, []))
                continue
            numels = [t.numel() for t in bucket]
            flat = torch.zeros(sum(numels), dtype=bucket[0].dtype, device=bucket[0].device)
            views = [v.view(t.shape) for v, t in zip(flat.split(numels), bucket)]
            self.buckets.append((flat, owners, views))
            self.sharded[id(flat)] = [hasattr(p, "to_local") for p in owners]

    def sync(self, rt: TorchRuntime, op: str) -> None:
        for flat, params, views in self.buckets:
            grads = [p.grad for p in params]
            if flat is None:  # one large tensor: reduce it where it is
                if grads[0] is not None:
                    rt.all_reduce(_local(grads[0]), op, "sync_grads", "data")
                continue
            if all(g is v for g, v in zip(grads, views)):
                rt.all_reduce(flat, op, "sync_grads", "data")  # gradients already live in the buffer
                continue
            if any(g is None for g in grads):
                flat.zero_()  # an unused parameter contributes zeros, as with DDP
                present = [(_local(g), v) for g, v in zip(grads, views) if g is not None and g is not v]
                if present:
                    torch._foreach_copy_([v for _, v in present], [g for g, _ in present])
            else:  # one C++ call packs every gradient (faster than per-tensor copies when small)
                torch.cat([_local(g).reshape(-1) for g in grads], out=flat)
            rt.all_reduce(flat, op, "sync_grads", "data")
            for p, g, v, sharded in zip(params, grads, views, self.sharded[id(flat)]):
                if sharded:  # a DTensor's .grad must stay a DTensor: copy back into its shard
                    if g is not None:
                        _local(g).copy_(v)
                else:
                    p.grad = v


_BUFFERS: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[torch.Tensor], _FlatBuffers]]" = weakref.WeakKeyDictionary()
# Bumped whenever any module registers a parameter (torch's global registration hook, installed
# on the first sync): a module's cached parameter list is reused while the count is unchanged,
# which saves walking the module tree on every step (2 ms for 2,000 parameters here).
_registrations = [0]
_hook_installed = [False]


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


def _params_of(module: nn.Module, bucket_bytes: int) -> tuple[list[torch.Tensor], _FlatBuffers]:
    if not _hook_installed[0]:
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        _hook_installed[0] = True
    cached = _BUFFERS.get(module)
    if cached is not None and cached[0] == _registrations[0] and all(p.requires_grad for p in cached[1]):
        return cached[1], cached[2]
    params = [p for p in module.parameters() if p.requires_grad]
    flat = cached[2] if cached is not None and cached[2].key == tuple(map(id, params)) else _FlatBuffers(params, bucket_bytes)
    _BUFFERS[module] = (_registrations[0], params, flat)
    return params, flat


def sync_gradients(target: Any, rt: TorchRuntime) -> Any:
    """Average (or sum, per ``GradPolicy.op``) gradients of ``target`` over the data group."""
    if is_ddp(target) or rt.topology.size("data") == 1:
        return target  # DDP's reducer already averaged them; or there is nobody to average with
    op = "avg" if rt.strategy.grad_policy.op == "mean" else "sum"
    bucket_bytes = rt.strategy.grad_policy.bucket_bytes()
    if isinstance(target, nn.Module):
        _, flat = _params_of(target, bucket_bytes)
        flat.sync(rt, op)
        return target
    grads = [_local(g) for g in target if g is not None]
    for bucket in buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        rt.all_reduce(flat, op, "sync_grads", "data")
        torch._foreach_copy_(bucket, [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)])
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
