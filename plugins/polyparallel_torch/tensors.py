"""The torch runtime's helpers on modules and tensors, used by every operation (the ground floor:
imports nothing of the plugin).

- Modules: :func:`is_ddp`, :func:`unwrap` (the module inside DDP), :func:`full_state` (DTensors
  gathered to full tensors), :func:`local_tensor` (a DTensor's local shard), :func:`shapes_digest`
  (what an identity check compares of a module's tensors).
- Buckets: :func:`buckets` groups tensors by dtype and device into lists of at most a size;
  :func:`apply_in_buckets` averages or broadcasts tensors over the data group, one collective per
  flat bucket; :func:`broadcast_over_data` makes data replicas start equal with it.

The helpers that run collectives take the runtime as an argument (:class:`Collectives`: what they
need of :class:`polyparallel_torch.runtime.TorchRuntime`), so that this module depends on no other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["DEFAULT_BUCKET_BYTES", "Collectives", "apply_in_buckets", "broadcast_over_data", "buckets", "full_state",
           "is_ddp", "local_tensor", "shapes_digest", "unwrap"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class Collectives(Protocol):
    """What the helpers here need of a runtime (:class:`~polyparallel_torch.runtime.TorchRuntime` has it)."""

    def all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str) -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, operation: str, axis: str, src_coord: int = 0) -> torch.Tensor: ...

    def operation(self, name: str, axis: str, detail: str = "") -> AbstractContextManager[str]: ...


# -- modules ------------------------------------------------------------------------------------------------------


def is_ddp(model: Any) -> bool:
    """Whether ``model`` is already wrapped by DistributedDataParallel."""
    return isinstance(model, nn.parallel.DistributedDataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers with DTensors gathered to full tensors (for checks and checkpoints)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in unwrap(model).state_dict().items():
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a tensor-parallel parameter is reduced over ``data`` shard by
    shard), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def shapes_digest(model: nn.Module) -> str:
    """``"<n> tensors, digest <hex>"`` of the local shapes and dtypes of a module's parameters and
    buffers: what ranks must agree on before a collective over them."""
    local = [local_tensor(t) for t in [*model.parameters(), *model.buffers()]]
    text = ";".join(f"{t.dtype}{list(t.shape)}" for t in local)
    return f"{len(local)} tensors, digest {hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}"


# -- buckets ------------------------------------------------------------------------------------------------------


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


def apply_in_buckets(tensors: list[torch.Tensor], action: str, rt: Collectives, operation: str,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """``mean`` (average) or ``broadcast`` (from data rank 0) ``tensors`` over the data group in
    place, packed into flat buckets of one dtype (in a deterministic order on every rank). The
    caller runs it inside ``rt.operation(...)`` (one identity check for all buckets)."""
    with torch.no_grad():
        for bucket in buckets(tensors, bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            if action == "mean":
                rt.all_reduce(flat, "avg", operation, "data")
            else:
                rt.broadcast(flat, operation, "data")
            for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(synced)


def broadcast_over_data(model: nn.Module, rt: Collectives, bucket_bytes: int | None = None) -> None:
    """Make data replicas start equal (what DDP does at construction): parameters and buffers
    from data rank 0, shard by shard (after one identity check of their shapes)."""
    tensors = [local_tensor(t) for t in [*model.parameters(), *model.buffers()]]
    operation = "wrap_model (parameter broadcast)"
    with rt.operation(operation, "data", shapes_digest(model)):
        apply_in_buckets([t.data for t in tensors], "broadcast", rt, operation, bucket_bytes or DEFAULT_BUCKET_BYTES)
