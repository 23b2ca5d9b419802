"""Lightning checkpoints of tensor-parallel models: one consolidated file, loadable anywhere.

Under ``tensor > 1`` the runtime's plan turns some parameters (and their optimizer state) into
DTensor shards. A Lightning checkpoint is one file written by one rank, so the shards are
gathered to full tensors when the checkpoint is dumped (:func:`to_full`, a collective over each
tensor group that every rank joins, as Lightning calls ``dump_checkpoint`` on every rank), and cut
back into this rank's shards when loaded into a model that is already parallelised
(:func:`localize_state`, :func:`localize_optimizer`; local slicing, no communication). A
checkpoint written at ``tensor=2`` therefore loads at ``tensor=1`` and vice versa.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_tensor_parallel", "to_full", "localize_state", "localize_optimizer"]


def _dtensor_type() -> type[DTensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (the plan was applied already)."""
    dtensor = _dtensor_type()
    return any(isinstance(p, dtensor) for p in module.parameters())


def to_full(obj: Any) -> Any:
    """``obj`` (nested dicts/lists/tuples of tensors) with every DTensor gathered to a full tensor."""
    dtensor = _dtensor_type()
    if isinstance(obj, dtensor):
        return obj.full_tensor()
    if isinstance(obj, Mapping):
        return {k: to_full(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_full(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_full(v) for v in obj)
    return obj


def _shard_like(full: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    # src_data_rank=None: every rank holds the full tensor already; slice locally, no collective.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def localize_state(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """A copy of ``state`` (a full state dict) whose entries are cut into the shards of the
    DTensor entries of ``module``'s own state dict."""
    dtensor = _dtensor_type()
    out = dict(state)
    for name, current in module.state_dict().items():
        value = out.get(name)
        if isinstance(current, dtensor) and isinstance(value, torch.Tensor) and not isinstance(value, dtensor):
            out[name] = _shard_like(value, current)
    return out


def localize_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """In place: optimizer state of DTensor parameters (momentum, Adam moments) loaded as full
    tensors is cut into the parameter's shards."""
    dtensor = _dtensor_type()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, dtensor) or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == param.shape:
                    state[key] = _shard_like(value, param)
