"""What a torch checkpoint takes: the objects handed to ``Strategy.save``/``load`` checked and
turned into state dicts (a module, its optimizer, a loader, or :class:`StateDicts` converted by
another plugin). The ground floor of the checkpoint modules: :mod:`.checkpoint` (save),
:mod:`.checkpoint_load` and :mod:`.checkpoint_async` build on it; it imports none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import get_runtime

__all__ = ["StateDicts", "all_stages", "check_optimizer_of_model", "has_optimizer_state", "loader_of", "module_of",
           "optimizers_of", "single_process", "state_dict_options", "state_dicts_of"]


def state_dict_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer state: keyed by parameter name, so it loads at any topology and into
    # any grouping of parameters, and every pipeline stage has its own keys.
    return StateDictOptions(flatten_optimizer_state_dict=True)


@dataclasses.dataclass
class StateDicts:
    """A model (and optimizer) state already converted to this format, given as ``model=`` to
    :func:`save` / :func:`load` by a plugin whose objects the torch runtime cannot read itself
    (DeepSpeed's engine: ``polyparallel_deepspeed.checkpoint``). Everything else is the same:
    files hashed while written, save id, agreements, failures, commit, ``async_save``, checks,
    resharding and partial loads.

    :param model: a plain module's ``state_dict()`` (parameter and buffer name -> tensor, no
        wrapper prefix; full tensors or DTensors). For :func:`load`, tensors of the shapes and
        dtypes to read into (filled in place). For an asynchronous save, tensors the caller no
        longer changes (copies): DCP stages them while the training goes on.
    :param optim: ``None`` (no optimizer), or the flattened optimizer state dict that
        ``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`` gives:
        ``state.<name>.<key>`` tensors and ``param_groups.<name>.<hyperparameter>`` values. For
        :func:`load`, the state to read into (its tensors filled in place, its values replaced).
    :param pipeline: this rank holds one pipeline stage's keys; the whole model's are gathered
        over the pipeline group, as for a ``PipelineModel``.
    :ivar loaded: after :func:`load`, the keys of ``model`` that were read (all of them, or
        those of a partial load's ``load_report``); the caller applies those only.
    """

    model: dict[str, Any]
    optim: dict[str, Any] | None = None
    pipeline: bool = False
    loaded: list[str] | None = None


def module_of(model: Any) -> nn.Module:
    from .pipeline import PipelineModel

    if isinstance(model, PipelineModel):
        return model.stage  # this rank's stage, under the unsplit model's names
    if isinstance(model, StateDicts):
        return nn.Module()  # holds nothing: its state comes converted, in StateDicts.model
    if not isinstance(model, nn.Module):
        raise pp.CheckpointError(f"model= must be an nn.Module (the one strategy.wrap_model returned). Received: {model!r}.")
    return model


def optimizers_of(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise pp.CheckpointError("checkpoints cannot take a ZeroRedundancyOptimizer (zero=1): its state is partitioned by "
                        "torch's own scheme, not as DTensors. Checkpoint the model only, or call "
                        "optimizer.consolidate_state_dict(to=0) and save optimizer.state_dict() on rank 0.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise pp.CheckpointError(f"optimizer= must be a torch.optim.Optimizer or None. Received: {optimizer!r}.")
    return (optimizer,)


def has_optimizer_state(model: Any, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
    """Whether an optimizer's state is saved or loaded: ``optimizer=``'s, or a :class:`StateDicts`' own."""
    if not isinstance(model, StateDicts):
        return bool(optimizers)
    if optimizers:
        raise pp.CheckpointError("model=StateDicts(...) carries its optimizer's state itself (optim=); pass no optimizer=.")
    return model.optim is not None


def state_dicts_of(model: Any, module: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> tuple[dict, dict]:
    """``get_state_dict`` of the model and optimizers, or a :class:`StateDicts`' own dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if isinstance(model, StateDicts):
        return model.model, model.optim or {}
    return get_state_dict(module, optimizers, options=state_dict_options())


def loader_of(loader: Any) -> Any:
    from .data import ShardedLoader

    if loader is not None and not isinstance(loader, ShardedLoader):
        raise pp.CheckpointError(f"loader= must be a loader strategy.shard_data returned (its position is saved). "
                        f"Received: {type(loader).__name__}.")
    return loader


def check_optimizer_of_model(where: str, module: nn.Module | None,
                              optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Refuse an optimizer holding parameters the model has not (its state is saved and restored
    per parameter name of the model: a stranger's parameters have none)."""
    if module is None or not optimizers:
        return
    own = {id(p) for p in module.parameters()}
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    strangers = [p for p in params if id(p) not in own]
    if strangers:
        shapes = [list(p.shape) for p in strangers[:4]]
        raise pp.CheckpointError(
            f"{where}(optimizer=): {len(strangers)} of the optimizer's {len(params)} parameters (shapes {shapes}"
            f"{' ...' if len(strangers) > 4 else ''}) are not parameters of model= ({type(module).__name__}): the "
            "optimizer was built on another model (or on the model before strategy.wrap_model replaced its "
            "parameters). Its state is saved per parameter name of the model; pass the optimizer made from "
            "this model's parameters, e.g. torch.optim.AdamW(model.parameters()) after wrap_model.")


def all_stages(strategy: pp.Strategy, model: Any, entries: dict[str, Any], operation: str) -> dict[str, Any]:
    """``entries`` (key -> shape) of every pipeline stage: each rank of a ``PipelineModel`` holds its
    own stage's keys only, so they are gathered over the pipeline group (one collective, run by
    every rank). Any other model: ``entries`` as they are (no collective)."""
    from .pipeline import PipelineModel

    staged = model.pipeline if isinstance(model, StateDicts) else isinstance(model, PipelineModel) and model.num_stages > 1
    if not staged:
        return entries
    merged: dict[str, Any] = {}
    for part in get_runtime(strategy.session()).all_gather_object(entries, f"{operation} (stage keys)", "pipeline"):
        merged.update(part)
    return merged


@contextlib.contextmanager
def single_process(session: pp.Session) -> Iterator[None]:
    """DCP warns that it "assumes" one process whenever no process group exists, even when told
    so (no_dist=True); in one process that is what was asked, so that warning is silenced here."""
    with warnings.catch_warnings():
        if session.world_size == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
