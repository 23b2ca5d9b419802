"""One logical checkpoint of a (sharded) model with ``torch.distributed.checkpoint`` (DCP).

:func:`save_checkpoint` writes the model (and optionally the optimizer) of every rank into one
DCP directory: each rank writes the shards it holds (FSDP2 shards over ``data``, DTensor shards
over ``tensor``, its stage of a pipeline), and a tensor replicated on several ranks (a DDP
replica, a tensor-parallel shard repeated over ``data``) is written once, by one of them (DCP's
de-duplication of the save plans). :func:`load_checkpoint` reads it into a model wrapped by any
topology and sharding stage — another data size, or a plain module in a single process
(``pp.Strategy(data=1)``) — because DCP reshards on load. The state is taken and put back with
``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict``, so keys are the
unwrapped module's (no ``module.`` prefix from DDP; a pipeline stage keeps the unsplit model's
names), and a checkpoint loads into the bare module it came from.

Loading first compares the checkpoint's keys and shapes with the model's, on every rank, before
any collective: a checkpoint of another model is refused with the keys that differ. A pipeline
stage holds only its own keys, so for a ``PipelineModel`` every stage's keys are gathered over the
pipeline group first and the whole model's are compared (and checked in the identity check). Both calls
then run the runtime's identity check over every rank (all at the same save/load of the same
path) before DCP's own collectives over the default group (bounded by the strategy's timeout).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import get_runtime

__all__ = ["load_checkpoint", "save_checkpoint"]


def _module(model: Any) -> nn.Module:
    from .pipeline import PipelineModel

    if isinstance(model, PipelineModel):
        return model.stage  # this rank's stage, under the unsplit model's names
    if not isinstance(model, nn.Module):
        raise TypeError(f"model= must be an nn.Module (the one strategy.wrap_model returned). Received: {model!r}.")
    return model


def _optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError("save_checkpoint/load_checkpoint cannot take a ZeroRedundancyOptimizer (zero=1): its state "
                        "is partitioned by torch's own scheme, not as DTensors. Checkpoint the model only, or call "
                        "optimizer.consolidate_state_dict(to=0) and save optimizer.state_dict() on rank 0.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or None. Received: {optimizer!r}.")
    return (optimizer,)


def _check_identity(strategy: pp.Strategy, operation: str, path: str, keys: list[str]) -> None:
    session = strategy.session()
    rt = get_runtime(session)
    rt.ensure_usable(operation, "world")
    if session.world_size > 1:
        digest = hashlib.blake2b(";".join(keys).encode(), digest_size=8).hexdigest()
        rt.check(operation, "world", f"{os.path.abspath(path)}, {len(keys)} keys {digest}")


def _all_stages(strategy: pp.Strategy, model: Any, entries: dict[str, Any], operation: str) -> dict[str, Any]:
    """``entries`` (key -> shape) of every pipeline stage: each rank of a ``PipelineModel`` holds its
    own stage's keys only, so they are gathered over the pipeline group (one collective, run by
    every rank). Any other model: ``entries`` as they are (no collective)."""
    from .pipeline import PipelineModel

    if not isinstance(model, PipelineModel) or model.num_stages == 1:
        return entries
    merged: dict[str, Any] = {}
    for part in get_runtime(strategy.session()).all_gather_object(entries, f"{operation} (stage keys)", "pipeline"):
        merged.update(part)
    return merged


def save_checkpoint(strategy: pp.Strategy, path: str | os.PathLike[str], *, model: Any,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model`` (and ``optimizer``) as one DCP checkpoint in the directory ``path``.

    Every rank calls it with the same path (on a file system they share); each shard is written
    once. Entries: ``model.<key>`` for the module's state, ``optim.*`` for the optimizer's.

    :param model: the module ``strategy.wrap_model`` returned (FSDP2, DDP, DTensor, a
        ``PipelineModel``) or a plain module.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    module, optimizers = _module(model), _optimizers(optimizer)
    model_state, optim_state = get_state_dict(module, optimizers)
    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    _check_identity(strategy, "save_checkpoint", str(path),
                    sorted(_all_stages(strategy, model, dict.fromkeys(model_state), "save_checkpoint")))
    rt = get_runtime(strategy.session())
    with rt.collective("save_checkpoint (DCP)", "world"):
        dcp.save(state, checkpoint_id=os.fspath(path))


def _mismatch(expected: dict[str, Any], stored: dict[str, Any]) -> str | None:
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    resized = sorted(k for k in set(expected) & set(stored) if expected[k] is not None and stored[k] is not None
                     and tuple(expected[k]) != tuple(stored[k]))
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        parts.append(f"not in the model: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    if resized:
        parts.append("other shapes: " + ", ".join(f"{k} {list(stored[k])} in the checkpoint vs {list(expected[k])}"
                                                  for k in resized[:4]))
    return "; ".join(parts) or None


def load_checkpoint(strategy: pp.Strategy, path: str | os.PathLike[str], *, model: Any,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a :func:`save_checkpoint` directory into ``model`` (and ``optimizer``) in place, at
    any topology and stage (DCP reshards), or into a plain module with ``pp.Strategy(data=1)``.

    :raises ValueError: on every rank, before any collective (for a ``PipelineModel``: after
        only the gather of its stages' keys over the pipeline group), when the checkpoint holds
        another model (keys or shapes differ; the message names them) or no optimizer state was saved.
    :raises FileNotFoundError: ``path`` holds no DCP checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.fspath(path)
    module, optimizers = _module(model), _optimizers(optimizer)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"load_checkpoint: {path!r} holds no checkpoint written by save_checkpoint "
                                "(no DCP .metadata file).") from None
    stored = {k[len("model."):]: (list(v.size) if isinstance(v, TensorStorageMetadata) else None)
              for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    model_state, optim_state = get_state_dict(module, optimizers)
    expected = {k: (list(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in model_state.items()}
    expected = _all_stages(strategy, model, expected, "load_checkpoint")  # a pipeline: the whole model's
    problem = _mismatch(expected, stored)
    if problem is not None:
        raise ValueError(f"load_checkpoint: {path!r} holds another model than {type(module).__name__}: {problem}. "
                         "Load it into the model it was saved from (same architecture and sizes; any topology).")
    if optimizers and not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
        raise ValueError(f"load_checkpoint: {path!r} holds no optimizer state (it was saved without optimizer=); "
                         "load the model only, or save with the optimizer.")
    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    _check_identity(strategy, "load_checkpoint", path, sorted(expected))
    rt = get_runtime(strategy.session())
    with rt.collective("load_checkpoint (DCP)", "world"):
        dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizers, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
