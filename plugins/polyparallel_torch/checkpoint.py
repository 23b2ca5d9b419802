"""Portable, atomic checkpoints of the torch runtime (``Strategy.save`` / ``Strategy.load``).

A checkpoint is a directory: the tensors of the model, the optimizer and the extras as one
``torch.distributed.checkpoint`` (DCP) checkpoint, each rank's RNG states and non-tensor values
as JSON (``ranks/``, :mod:`.checkpoint_files`), and the commit marker
``polyparallel-checkpoint.json`` with the metadata (topology, progress, loader position,
extras; :mod:`polyparallel._checkpoints`).

Saving: each rank writes the shards it holds (FSDP2 shards over ``data``, DTensor shards over
``tensor``, its stage of a pipeline); a tensor replicated on several ranks (a DDP replica, a
tensor-parallel shard repeated over ``data``) is written once, by one of them (DCP's
de-duplication of the save plans). Everything goes into ``<path>.partial-<token>``; after a
barrier rank 0 writes the marker and renames the directory to ``path``; a last check tells every
rank it was published. A job killed while saving leaves only the staging directory, which
``Strategy.load`` and ``polyparallel.latest_checkpoint`` never take.

Loading reads into a model wrapped by any topology and sharding stage — another data size, or a
plain module in a single process (``pp.Strategy(data=1)``) — because DCP reshards. The state is
taken and put back with ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (the optimizer's flattened, per parameter name), so keys are the unwrapped
module's (no ``module.`` prefix from DDP; a pipeline stage keeps the unsplit model's names).
Before any collective every rank checks the marker, the files' sizes, DCP's index (read with an
allow-listed unpickler), the model's keys and shapes, the optimizer's state keys both ways (a
state the optimizer would not take is refused, not dropped; a fresh optimizer's state is created
first even when gradients are present), and the loader's global batch (for a ``PipelineModel``,
every stage's model and optimizer keys are gathered over the pipeline group first, so the whole
model's are compared and every stage refuses alike). Saving likewise reads the loader's
position on every rank before its first collective. Then the runtime's identity check (every rank at the same load of the
same path) runs before DCP's own collectives over the default group, bounded by the timeout.

A plugin whose objects the torch runtime cannot read (DeepSpeed's engine) converts them itself
and passes a :class:`StateDicts` as ``model=``: the same files, checks and commit, without
``get_state_dict`` / ``set_state_dict``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import secrets
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel._errors import exception_summary

from .checkpoint_files import _safe_reader, read_dcp_metadata, read_rank_files, restore_rng, write_rank_file
from .runtime import get_runtime

__all__ = ["StateDicts", "load", "load_checkpoint", "save", "save_checkpoint"]

_TOKEN = "polyparallel_torch.checkpoint.token"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer state: keyed by parameter name, so it loads at any topology and into
    # any grouping of parameters, and every pipeline stage has its own keys.
    return StateDictOptions(flatten_optimizer_state_dict=True)


@dataclasses.dataclass
class StateDicts:
    """A model (and optimizer) state already converted to this format, given as ``model=`` to
    :func:`save` / :func:`load` by a plugin whose objects the torch runtime cannot read itself
    (DeepSpeed's engine: ``polyparallel_deepspeed.checkpoint``). Everything else is the same:
    files, marker, atomic commit, checks and resharding.

    :param model: a plain module's ``state_dict()`` (parameter and buffer name -> tensor, no
        wrapper prefix; full tensors or DTensors). For :func:`load`, tensors of the shapes and
        dtypes to read into (filled in place).
    :param optim: ``None`` (no optimizer), or the flattened optimizer state dict that
        ``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`` gives:
        ``state.<name>.<key>`` tensors and ``param_groups.<name>.<hyperparameter>`` values. For
        :func:`load`, the state to read into (its tensors filled in place, its values replaced).
    :param pipeline: this rank holds one pipeline stage's keys; the whole model's are gathered
        over the pipeline group, as for a ``PipelineModel``.
    """

    model: dict[str, Any]
    optim: dict[str, Any] | None = None
    pipeline: bool = False


def _module(model: Any) -> nn.Module:
    from .pipeline import PipelineModel

    if isinstance(model, PipelineModel):
        return model.stage  # this rank's stage, under the unsplit model's names
    if isinstance(model, StateDicts):
        return nn.Module()  # holds nothing: its state comes converted, in StateDicts.model
    if not isinstance(model, nn.Module):
        raise pp.CheckpointError(f"model= must be an nn.Module (the one strategy.wrap_model returned). Received: {model!r}.")
    return model


def _optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
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


def _has_optim(model: Any, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
    """Whether an optimizer's state is saved or loaded: ``optimizer=``'s, or a :class:`StateDicts`' own."""
    if not isinstance(model, StateDicts):
        return bool(optimizers)
    if optimizers:
        raise pp.CheckpointError("model=StateDicts(...) carries its optimizer's state itself (optim=); pass no optimizer=.")
    return model.optim is not None


def _loader(loader: Any) -> Any:
    from .data import ShardedLoader

    if loader is not None and not isinstance(loader, ShardedLoader):
        raise pp.CheckpointError(f"loader= must be a loader strategy.shard_data returned (its position is saved). "
                        f"Received: {type(loader).__name__}.")
    return loader


def _check_identity(strategy: pp.Strategy, operation: str, path: str, keys: list[str]) -> None:
    session = strategy.session()
    rt = get_runtime(session)
    rt.ensure_usable(operation, "world")
    if session.world_size > 1:
        digest = hashlib.blake2b(";".join(keys).encode(), digest_size=8).hexdigest()
        rt.check(operation, "world", f"{path}, {len(keys)} keys {digest}")


def _all_stages(strategy: pp.Strategy, model: Any, entries: dict[str, Any], operation: str) -> dict[str, Any]:
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


def _split(section: str, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A flat state dict's tensors (DCP keys ``<section>.<key>``) and its other values (JSON)."""
    tensors = {f"{section}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    try:
        values = _checkpoints.split(others, lambda _: False, section)[0]
    except TypeError as exc:
        raise pp.CheckpointError(f"Strategy.save: the {section} state holds {exc}") from None
    return tensors, values


def _token(strategy: pp.Strategy) -> str:
    """A name for this session's staging directories, the same on every rank (one gather, at the
    first save only, so that later saves write before their first collective)."""
    session = strategy.session()

    def agree() -> str:
        token = torch.tensor([secrets.randbits(48)], dtype=torch.int64)
        if session.world_size > 1:  # rank 0's
            get_runtime(session).broadcast(token, "save_checkpoint (token)", "world")
        return f"{int(token.item()):012x}"

    return session.stash(_TOKEN, agree)


@contextlib.contextmanager
def _single(session: pp.Session) -> Iterator[None]:
    """DCP warns that it "assumes" one process whenever no process group exists, even when told
    so (no_dist=True); in one process that is what was asked, so that warning is silenced here."""
    with warnings.catch_warnings():
        if session.world_size == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# -- save ----------------------------------------------------------------------------------------------------
def save(strategy: pp.Strategy, path: str, state: dict[str, Any]) -> str:
    """The torch runtime's ``polyparallel_save_checkpoint`` (see ``Strategy.save``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    session = strategy.session()
    state = dict(state)
    model, optimizer, loader = state.pop("model", None), state.pop("optimizer", None), _loader(state.pop("loader", None))
    framework = state.pop("framework", None)
    module, optimizers = (_module(model) if model is not None else None), _optimizers(optimizer)
    if optimizers and module is None:
        raise pp.CheckpointError("Strategy.save(optimizer=) needs model= too: the optimizer's state is saved per parameter name.")
    has_optim = _has_optim(model, optimizers)
    try:
        extras, extra_tensors = _checkpoints.split(state, lambda v: isinstance(v, torch.Tensor), "extras")
    except TypeError as exc:
        raise pp.CheckpointError(f"Strategy.save: {exc} Convert arrays of other frameworks to torch tensors.") from None
    tensors: dict[str, Any] = {k: v.detach() for k, v in extra_tensors.items()}
    values: dict[str, Any] = {}
    model_keys: list[str] = []
    if module is not None:
        model_state, optim_state = ((model.model, model.optim or {}) if isinstance(model, StateDicts)
                                    else get_state_dict(module, optimizers, options=_options()))
        part, values["model"] = _split("model", model_state)
        tensors.update(part)
        if has_optim:
            part, values["optim"] = _split("optim", optim_state)
            tensors.update(part)
        model_keys = sorted(_all_stages(strategy, model, dict.fromkeys(model_state), "save_checkpoint"))
    # The metadata, on every rank and before any collective: a loader that has no position
    # (no batch_size) is refused by every rank alike, not by rank 0 alone after the tensors are written.
    loader_state = None
    if loader is not None:
        try:
            loader_state = loader.state_dict()
        except (TypeError, ValueError) as exc:
            raise pp.CheckpointError(f"Strategy.save(loader=): this loader has no position to save ({exc}). Give "
                                     "a loader strategy.shard_data made with a batch size, or save without "
                                     "loader=.") from None
    metadata = _checkpoints.base_metadata(strategy, session, framework)
    metadata.update(
        torch=torch.__version__, tensors="torch.distributed.checkpoint", model_keys=len(model_keys),
        contents={"model": module is not None, "optimizer": has_optim, "loader": loader is not None,
                  "extras": sorted(state)},
        loader=loader_state, extras=extras,
        progress=None if loader_state is None else {"epoch": loader_state["epoch"], "step": loader_state["batches"],
                                                    "global_step": loader_state["global_step"]})
    token = _token(strategy)
    staging = _checkpoints.staging_path(path, token)
    # Written before any collective of this save: a peer that dies now leaves a staging
    # directory that was never published.
    os.makedirs(staging, exist_ok=True)
    write_rank_file(staging, session.rank, values)
    # Rank-independent: a pipeline stage's own keys differ from its peers'.
    _check_identity(strategy, "save_checkpoint", path, [*model_keys, *sorted(extra_tensors), f"optim={has_optim}"])
    rt = get_runtime(session)
    with rt.collective("save_checkpoint (DCP)", "world"), _single(session):
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging), no_dist=session.world_size == 1)
    outcome = "written"
    if session.world_size > 1:
        rt.check("save_checkpoint (written)", "world", path)  # every rank finished its files
    if session.rank == 0:
        try:
            _checkpoints.write_marker(staging, metadata)
            _checkpoints.publish(staging, path)
            outcome = "published"
        except Exception as exc:  # any error is told to the peers below, which else wait for the timeout
            outcome = f"failed on rank 0: {exception_summary(exc, first_line=False)}"
    if session.world_size > 1:
        # Every rank returns once the checkpoint is published (or learns that it was not).
        rt.check("save_checkpoint (publish)", "world", "published" if session.rank else outcome)
    if outcome.startswith("failed"):
        raise pp.CheckpointError(f"Strategy.save: publishing {path!r} {outcome}.")
    return path


# -- load ----------------------------------------------------------------------------------------------------
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


def _merged(files: dict[int, dict[str, Any]], section: str) -> dict[str, Any]:
    """The non-tensor values of ``section`` over every rank's file (keys are parameter names, so
    the union holds every stage's; replicas wrote equal values)."""
    merged: dict[str, Any] = {}
    for payload in files.values():
        merged.update(_checkpoints.join(payload["values"].get(section, {}), {}))
    return merged


def _state_for_load(module: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> tuple[dict, dict]:
    """``get_state_dict`` of ``module`` and ``optimizers``, with the optimizer's state initialised:
    DCP creates the state of a fresh optimizer (the tensors the checkpoint's are read into) by a
    step with zero gradients, but skips that when any parameter has a ``.grad`` (a backward ran
    before the load), which would leave no state to load into and drop the saved one silently.
    The gradients are set aside for that step and put back."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    fresh = bool(optimizers) and not any(o.state for o in optimizers)
    grads = [p.grad for p in params] if fresh else []
    try:
        if fresh:
            for p in params:
                p.grad = None
        return get_state_dict(module, optimizers, options=_options())
    finally:
        for p, grad in zip(params if fresh else [], grads):
            p.grad = grad


def load(strategy: pp.Strategy, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """The torch runtime's ``polyparallel_load_checkpoint`` (see ``Strategy.load``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import set_state_dict

    session = strategy.session()
    model, optimizer, loader = state.get("model"), state.get("optimizer"), _loader(state.get("loader"))
    module, optimizers = (_module(model) if model is not None else None), _optimizers(optimizer)
    if optimizers and module is None:
        raise pp.CheckpointError("Strategy.load(optimizer=) needs model= too: the optimizer's state is keyed by parameter name.")
    has_optim = _has_optim(model, optimizers)
    meta = _checkpoints.read_marker(path)
    _checkpoints.verify_files(path, meta)
    index = read_dcp_metadata(path).state_dict_metadata
    files = read_rank_files(path)
    if loader is not None:
        if meta.get("loader") is None:
            raise pp.CheckpointError(f"Strategy.load: {path!r} was saved without loader=; there is no position to "
                                     "resume. Load it without loader= (the loader starts at epoch 0).")
        _checkpoints.check_loader_resume(path, meta["loader"], loader.state_dict())
    tensors: dict[str, Any] = {}
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    if module is not None:
        stored = {k[len("model."):]: (list(v.size) if isinstance(v, TensorStorageMetadata) else None)
                  for k, v in index.items() if k.startswith("model.")}
        stored.update(dict.fromkeys(_merged(files, "model")))
        model_state, optim_state = ((model.model, model.optim or {}) if isinstance(model, StateDicts)
                                    else _state_for_load(module, optimizers))
        optim_tensors = {f"optim.{k}": v for k, v in optim_state.items() if isinstance(v, torch.Tensor)}
        entries = {f"model.{k}": (list(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in model_state.items()}
        entries.update(dict.fromkeys(optim_tensors))
        # A pipeline: the whole model's keys (one gather), so that every stage decides the
        # refusals below alike and none enters the identity check while a peer raised.
        entries = _all_stages(strategy, model, entries, "load_checkpoint")
        expected = {k[len("model."):]: v for k, v in entries.items() if k.startswith("model.")}
        problem = _mismatch(expected, stored)
        if problem is not None:
            raise pp.CheckpointError(f"Strategy.load: {path!r} holds another model than {type(module).__name__}: "
                                     f"{problem}. Load it into the model it was saved from (same architecture and "
                                     "sizes; any topology).")
        if has_optim and not (meta.get("contents") or {}).get("optimizer"):
            raise pp.CheckpointError(f"Strategy.load: {path!r} holds no optimizer state (it was saved without "
                                     "optimizer=); load the model only, or save with the optimizer.")
        tensors.update({f"model.{k}": v for k, v in model_state.items() if isinstance(v, torch.Tensor)})
        if has_optim:
            wanted = {k for k in entries if k.startswith("optim.")}
            saved = {k for k, v in index.items() if k.startswith("optim.state.") and isinstance(v, TensorStorageMetadata)}
            absent, left = sorted(wanted - set(index)), sorted(saved - wanted)
            if absent or left:
                what = (f"{absent[:4]} are missing from it" if absent else
                        f"its {left[:4]} would not be loaded (this optimizer has no such state)")
                raise pp.CheckpointError(f"Strategy.load: {path!r} holds another optimizer's state: {what}. Load it "
                                         "into the optimizer type (and settings, e.g. momentum) it was saved with.")
        tensors.update(optim_tensors)
    extras = meta.get("extras") or {}
    extra_tensors = {}
    for key in _checkpoints.tensor_refs(extras):
        entry = index.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise pp.CheckpointError(f"Strategy.load: {path!r} is incomplete: the extra tensor {key} is missing.")
        extra_tensors[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    tensors.update(extra_tensors)
    _check_identity(strategy, "load_checkpoint", path, [*sorted(expected), *sorted(extra_tensors),
                                                        f"optim={has_optim}"])
    rt = get_runtime(session)
    if tensors:
        with rt.collective("load_checkpoint (DCP)", "world"), _single(session):
            dcp.load(tensors, storage_reader=_safe_reader(path), no_dist=session.world_size == 1)  # in place: the dicts above see the values
    if module is not None:
        model_state.update(_merged(files, "model"))
        optim_values = _merged(files, "optim")
        optim_state.update({k: optim_values[k] for k in optim_state if k in optim_values})
        if not isinstance(model, StateDicts):  # a StateDicts' dicts are filled in place: its caller applies them
            set_state_dict(module, optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=_options())
    if loader is not None:
        loader.load_state_dict(meta["loader"])
    if session.rank in files:  # a rank the writing topology did not have keeps its own RNG
        restore_rng(files[session.rank]["rng"])
    progress = meta.get("progress") or {}
    return {**{k: progress.get(k) for k in _checkpoints.PROGRESS}, **_checkpoints.join(extras, extra_tensors)}


# -- the functions of earlier releases ------------------------------------------------------------------------
def save_checkpoint(strategy: pp.Strategy, path: str | os.PathLike[str], *, model: Any,
                    optimizer: torch.optim.Optimizer | None = None) -> str:
    """``strategy.save(path, model=model, optimizer=optimizer)``: one committed DCP checkpoint."""
    return strategy.save(path, model=model, optimizer=optimizer)


def load_checkpoint(strategy: pp.Strategy, path: str | os.PathLike[str], *, model: Any,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``strategy.load(path, model=model, optimizer=optimizer)``, at any topology (DCP reshards),
    or into a plain module with ``pp.Strategy(data=1)``."""
    return strategy.load(path, model=model, optimizer=optimizer)
