"""Portable, atomic checkpoints of the torch runtime (``Strategy.save`` / ``async_save`` / ``load``).

A checkpoint is a directory: the tensors of the model, the optimizer and the extras as one
``torch.distributed.checkpoint`` (DCP) checkpoint, each rank's RNG states and non-tensor values
as JSON (``ranks/``, :mod:`.checkpoint_files`), and the commit marker
``polyparallel-checkpoint.json`` (format version 2, :mod:`polyparallel._checkpoints`): topology,
progress, loader position, extras, every tensor's name/shape/dtype, the save id, and the size and
SHA-256 of every file.

Saving: each rank writes the shards it holds (FSDP2 shards over ``data``, DTensor shards over
``tensor``, its stage of a pipeline); a tensor replicated on several ranks (a DDP replica, a
tensor-parallel shard repeated over ``data``) is written once, by one of them (DCP's
de-duplication of the save plans). Everything goes into ``<path>.partial-<save id>``, every file
hashed while it is written (:func:`.checkpoint_files.hashing_writer`). Before DCP writes, one
agreement checks that every rank is at the same save and tells every rank what failed on any
(its JSON file could not be written: a full disk); after it, the ranks gather their file records
and rank 0 writes the marker and renames the directory to ``path``
(:mod:`.checkpoint_commit`). A failure anywhere is the same :class:`polyparallel.CheckpointError`
on every rank (path, rank, the operating system's error), and the staging directory is removed.
A job killed while saving leaves only the staging directory, which ``Strategy.load`` and
``polyparallel.latest_checkpoint`` never take. ``Strategy.async_save`` stages the tensors and
commits in the background (:mod:`.checkpoint_async`).

Loading (:mod:`.checkpoint_load`) reads into a model wrapped by any topology and sharding stage —
another data size, or a plain module in a single process (``pp.Strategy(data=1)``) — because DCP
reshards. The state is taken and put back with ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (the optimizer's flattened, per parameter name), so keys are the unwrapped
module's (no ``module.`` prefix from DDP; a pipeline stage keeps the unsplit model's names).
An optimizer must be built on the model's own parameters (checked on save and load).

A plugin whose objects the torch runtime cannot read (DeepSpeed's engine) converts them itself
and passes a :class:`StateDicts` as ``model=`` to :func:`save` / :func:`load`: the same files,
hashes, save id, agreements, failures, commit, asynchronous save and partial loads, without
``get_state_dict`` / ``set_state_dict``.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel._errors import exception_summary

from .checkpoint_files import hashing_writer, write_rank_file
from .checkpoint_load import load
from .checkpoint_state import (
    StateDicts,
    all_stages,
    check_optimizer_of_model,
    has_optimizer_state,
    loader_of,
    module_of,
    optimizers_of,
    single_process,
    state_dicts_of,
)
from .runtime import get_runtime

__all__ = ["StateDicts", "load", "load_checkpoint", "next_save_id", "save", "save_checkpoint"]

_TOKEN = "polyparallel_torch.checkpoint.token"
_COUNT = "polyparallel_torch.checkpoint.count"


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


def next_save_id(strategy: pp.Strategy) -> str:
    """This save's identity, the same on every rank without a collective: the session's token and
    the number of its saves (every rank saves in step; the agreement of each save checks it)."""
    session = strategy.session()
    token = _token(strategy)
    count = session.stash(_COUNT, lambda: [0])
    count[0] += 1
    return f"{token}-{count[0]}"


def _arrays(dcp_metadata: Any) -> list[dict[str, Any]]:
    """The marker's tensor listing (name, global shape, dtype) from the index DCP wrote."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return [{"name": k, "shape": list(v.size), "dtype": str(v.properties.dtype).replace("torch.", "")}
            for k, v in sorted(dcp_metadata.state_dict_metadata.items()) if isinstance(v, TensorStorageMetadata)]


# -- save ----------------------------------------------------------------------------------------------------
def save(strategy: pp.Strategy, path: str, state: dict[str, Any], options: dict[str, Any] | None = None) -> Any:
    """The torch runtime's ``polyparallel_save_checkpoint`` (see ``Strategy.save``): the path, or
    with ``options={"asynchronous": True}`` (``Strategy.async_save``) a
    :class:`~.checkpoint_async.CheckpointFuture` once the tensors are staged."""
    import torch.distributed.checkpoint as dcp

    from . import checkpoint_async
    from .checkpoint_commit import Channel, agree, commit, dcp_failures, fail

    asynchronous = bool((options or {}).get("asynchronous"))
    session = strategy.session()
    # One save at a time: a save in flight is finished first (its error, unretrieved, stops this one).
    previous = checkpoint_async.wait_in_flight()
    state = dict(state)
    model, optimizer, loader = state.pop("model", None), state.pop("optimizer", None), loader_of(state.pop("loader", None))
    framework = state.pop("framework", None)
    module, optimizers = (module_of(model) if model is not None else None), optimizers_of(optimizer)
    if optimizers and module is None:
        raise pp.CheckpointError("Strategy.save(optimizer=) needs model= too: the optimizer's state is saved per parameter name.")
    has_optim = has_optimizer_state(model, optimizers)  # first: a StateDicts takes no optimizer=
    check_optimizer_of_model("Strategy.save", module, optimizers)
    try:
        extras, extra_tensors = _checkpoints.split(state, lambda v: isinstance(v, torch.Tensor), "extras")
    except TypeError as exc:
        raise pp.CheckpointError(f"Strategy.save: {exc} Convert arrays of other frameworks to torch tensors.") from None
    tensors: dict[str, Any] = {k: v.detach() for k, v in extra_tensors.items()}
    values: dict[str, Any] = {}
    model_keys: list[str] = []
    if module is not None:
        model_state, optim_state = state_dicts_of(model, module, optimizers)
        part, values["model"] = _split("model", model_state)
        tensors.update(part)
        if has_optim:
            part, values["optim"] = _split("optim", optim_state)
            tensors.update(part)
        model_keys = sorted(all_stages(strategy, model, dict.fromkeys(model_state), "save_checkpoint"))
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
    save_id = next_save_id(strategy)
    metadata = _checkpoints.base_metadata(strategy, session, framework, save_id)
    metadata.update(
        torch=torch.__version__, tensors="torch.distributed.checkpoint", model_keys=len(model_keys),
        contents={"model": module is not None, "optimizer": has_optim, "loader": loader is not None,
                  "extras": sorted(state)},
        loader=loader_state, extras=extras,
        progress=None if loader_state is None else {"epoch": loader_state["epoch"], "step": loader_state["batches"],
                                                    "global_step": loader_state["global_step"]})
    staging = _checkpoints.staging_path(path, save_id)
    # Written before any collective of this save: a peer that dies now leaves a staging
    # directory that was never published. A local failure (a full disk) is told to every rank
    # by the agreement below, which every rank enters whatever happened here.
    problem, rank_record = previous, None
    if problem is None:
        try:
            os.makedirs(staging, exist_ok=True)
            rank_record = write_rank_file(staging, session.rank, values, save_id)
        except OSError as exc:
            problem = exception_summary(exc)
    # Rank-independent keys (a pipeline stage's own keys differ from its peers') and the save id.
    keys = [*model_keys, *sorted(extra_tensors), f"optim={has_optim}", f"save {save_id}",
            f"async={asynchronous}"]
    failures = agree(strategy, "save_checkpoint", path, keys, problem)
    if failures:
        raise fail("save", path, staging, failures, session.rank)
    assert rank_record is not None
    rt = get_runtime(session)
    writer = hashing_writer(staging, save_id)
    if asynchronous:
        with single_process(session):
            return checkpoint_async.start(strategy, rt, path, staging, tensors, writer, metadata, rank_record, _arrays)
    try:
        with rt.collective("save_checkpoint (DCP)", "world"), single_process(session):
            written = dcp.save(tensors, storage_writer=writer, no_dist=session.world_size == 1)
    except (pp.CollectiveError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise fail("save", path, staging, dcp_failures(exc, session.rank), session.rank) from None
    records = writer.records.complete(staging)
    rel, size, digest = rank_record
    records[rel] = (size, digest)
    return commit(Channel(session.world_size, runtime=rt), session.rank, staging, path, metadata, records,
                  _arrays(written))


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
