"""``Strategy.load`` of the torch runtime: checks, verification, DCP's resharding read, and the
explicit partial load of a model (fine-tuning).

Before any collective every rank checks the marker, the files' sizes, DCP's index (read with an
allow-listed unpickler) and its save id, every rank file's save id, the model's keys and shapes,
the optimizer's state keys both ways, and the loader's global batch (for a ``PipelineModel``, every
stage's model and optimizer keys are gathered over the pipeline group first, so the whole model's
are compared and every stage refuses alike). Then each rank recomputes the SHA-256 of its share
of the files (about ``1/world`` of the bytes), and one agreement (the identity check of the
operation and a gather of what each rank found) makes every rank raise the same error for a
file at fault, naming it, before DCP reads anything. A read failure inside DCP is raised as a
:class:`polyparallel.CheckpointError` naming the rank and the operating system's error, on every
rank alike.

**Partial loading** (``strict=False`` or ``keys=``, never by default): only the model's
parameters and buffers are restored, those selected by ``keys`` (glob patterns over the model's
state-dict names, or a predicate) and, with ``strict=False``, only those the checkpoint holds
with the same shape; the others keep their values. ``Strategy.load`` then returns a
``load_report`` (``loaded``, ``missing``, ``unexpected``, ``mismatched``, ``excluded``), the same
on every rank. An optimizer or loader is refused with it (a new head needs a fresh optimizer),
and so is a selection that loads nothing.

A :class:`.checkpoint.StateDicts` given as ``model=`` (an engine's state converted by its plugin)
goes through every step above; its dicts are filled in place instead of ``set_state_dict``, and
its ``loaded`` says which model keys were read (a partial load's, or all), for the caller to apply.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polyparallel as pp
from polyparallel import _checkpoint_files, _checkpoints

from .checkpoint_files import read_dcp_metadata, read_rank_files, restore_rng, safe_reader
from .checkpoint_state import (
    StateDicts,
    all_stages,
    check_optimizer_of_model,
    has_optimizer_state,
    loader_of,
    module_of,
    optimizers_of,
    single_process,
    state_dict_options,
)
from .runtime import get_runtime

__all__ = ["load"]


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
        return get_state_dict(module, optimizers, options=state_dict_options())
    finally:
        for p, grad in zip(params if fresh else [], grads):
            p.grad = grad


# -- partial loading -----------------------------------------------------------------------------------------
def _selector(keys: Any) -> Callable[[str], bool] | None:
    if keys is None:
        return None
    if callable(keys):
        return lambda name: bool(keys(name))
    if isinstance(keys, str):
        keys = [keys]
    patterns = list(keys)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"Strategy.load(keys=) takes glob patterns over the model's state-dict names (a str or a "
                        f"list of str, e.g. ['backbone.*']) or a predicate name -> bool. Received: {keys!r}.")
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _select(path: str, expected: dict[str, Any], stored: dict[str, Any], strict: bool,
            keys: Callable[[str], bool] | None) -> dict[str, Any]:
    """The partial load's report (which model keys load), the same on every rank; refuses a
    strict selection the checkpoint cannot serve and a selection that loads nothing."""
    wanted = {k for k in expected if keys is None or keys(k)}
    excluded = sorted(set(expected) - wanted)

    def same_shape(k: str) -> bool:
        return expected[k] is None or stored[k] is None or tuple(expected[k]) == tuple(stored[k])

    mismatched = {k: {"checkpoint": stored[k], "model": expected[k]} for k in sorted(wanted & set(stored))
                  if not same_shape(k)}
    missing = sorted(wanted - set(stored))
    if strict and (missing or mismatched):
        problem = _mismatch({k: expected[k] for k in wanted}, {k: v for k, v in stored.items() if k in wanted})
        raise pp.CheckpointError(f"Strategy.load(keys=...): {path!r} cannot give every selected key: {problem}. "
                                 "Select only keys it holds with these shapes, or pass strict=False to load what "
                                 "matches and get the rest reported.")
    loaded = sorted(k for k in wanted & set(stored) if k not in mismatched)
    if not loaded:
        raise pp.CheckpointError(f"Strategy.load: nothing of {path!r} matches the selected keys of this model (it "
                                 f"holds {sorted(stored)[:6]}...; the model has {sorted(expected)[:6]}...). Nothing "
                                 "was loaded; check the names (the unwrapped module's state-dict names).")
    return {"loaded": loaded, "missing": missing, "unexpected": sorted(set(stored) - set(expected)),
            "mismatched": mismatched, "excluded": excluded}


def _partial_options(options: dict[str, Any], has_optim: bool, loader: Any,
                     module: Any) -> tuple[bool, Callable[[str], bool] | None]:
    strict, keys = options.get("strict", True), _selector(options.get("keys"))
    if not isinstance(strict, bool):
        raise TypeError(f"Strategy.load(strict=) takes True or False. Received: {strict!r}.")
    if strict and keys is None:
        return strict, keys
    if module is None:
        raise pp.CheckpointError("Strategy.load(strict=False / keys=) loads part of a model: pass model=.")
    if has_optim or loader is not None:
        raise pp.CheckpointError("Strategy.load(strict=False / keys=) restores model weights only: the optimizer's "
                                 "state and the loader's position belong to the whole saved model. Load without "
                                 "optimizer= and loader=, and build a fresh optimizer for the fine-tuning.")
    return strict, keys


# -- load ----------------------------------------------------------------------------------------------------
def load(strategy: pp.Strategy, path: str, state: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The torch runtime's ``polyparallel_load_checkpoint`` (see ``Strategy.load`` and the module
    docstring; ``options``: ``strict`` and ``keys`` of a partial load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from . import checkpoint_async
    from .checkpoint_commit import agree, dcp_failures, fail

    session = strategy.session()
    checkpoint_async.wait_in_flight(consume=False)  # a save of this process in flight is finished first
    model, optimizer, loader = state.get("model"), state.get("optimizer"), loader_of(state.get("loader"))
    module, optimizers = (module_of(model) if model is not None else None), optimizers_of(optimizer)
    if optimizers and module is None:
        raise pp.CheckpointError("Strategy.load(optimizer=) needs model= too: the optimizer's state is keyed by parameter name.")
    has_optim = has_optimizer_state(model, optimizers)  # first: a StateDicts takes no optimizer=
    check_optimizer_of_model("Strategy.load", module, optimizers)
    strict, keys = _partial_options(options or {}, has_optim, loader, module)
    partial = not strict or keys is not None
    meta = _checkpoints.read_marker(path)
    _checkpoints.verify_files(path, meta, hashed=())  # sizes (stat) here; contents below, shared by the ranks
    save_id = meta.get("id") if int(meta.get("version", 1)) >= 2 else None
    dcp_metadata = read_dcp_metadata(path)
    if save_id is not None and getattr(dcp_metadata.storage_meta, "save_id", None) != save_id:
        raise pp.CheckpointError(_checkpoint_files.foreign(path, ".metadata", dcp_metadata.storage_meta.save_id, save_id))
    index = dcp_metadata.state_dict_metadata
    files = read_rank_files(path, save_id)
    if loader is not None:
        if meta.get("loader") is None:
            raise pp.CheckpointError(f"Strategy.load: {path!r} was saved without loader=; there is no position to "
                                     "resume. Load it without loader= (the loader starts at epoch 0).")
        _checkpoints.check_loader_resume(path, meta["loader"], loader.state_dict())
    tensors: dict[str, Any] = {}
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    expected: dict[str, Any] = {}
    report: dict[str, Any] | None = None
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
        # refusals below alike and none enters the agreement while a peer raised.
        entries = all_stages(strategy, model, entries, "load_checkpoint")
        expected = {k[len("model."):]: v for k, v in entries.items() if k.startswith("model.")}
        if partial:
            report = _select(path, expected, stored, strict, keys)
            chosen = set(report["loaded"])
            model_state = {k: v for k, v in model_state.items() if k in chosen}
        else:
            problem = _mismatch(expected, stored)
            if problem is not None:
                raise pp.CheckpointError(f"Strategy.load: {path!r} holds another model than {type(module).__name__}: "
                                         f"{problem}. Load it into the model it was saved from (same architecture and "
                                         "sizes; any topology), or load part of it explicitly (strict=False, keys=).")
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
    # This rank's share of the content hashes; the agreement tells every rank what any found.
    share = _checkpoint_files.shares(meta.get("files") or {}, session.world_size)[session.rank]
    found = _checkpoint_files.problems(path, meta, share)
    loaded_keys = sorted(expected) if report is None else report["loaded"]
    failures = agree(strategy, "load_checkpoint", path,
                     [*loaded_keys, *sorted(extra_tensors), f"optim={has_optim}"], found[0] if found else None)
    if failures:
        raise pp.CheckpointError(failures[min(failures)])
    if tensors:
        rt = get_runtime(session)
        try:
            with rt.collective("load_checkpoint (DCP)", "world"), single_process(session):
                # In place: the dicts above see the values.
                dcp.load(tensors, storage_reader=safe_reader(path), no_dist=session.world_size == 1)
        except (pp.CollectiveError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise fail("load", path, None, dcp_failures(exc, session.rank), session.rank) from None
    if module is not None:
        values = _merged(files, "model")
        model_state.update({k: v for k, v in values.items() if report is None or k in report["loaded"]})
        optim_values = _merged(files, "optim")
        optim_state.update({k: optim_values[k] for k in optim_state if k in optim_values})
        if isinstance(model, StateDicts):  # filled in place (a partial load's selection too): its caller applies them
            model.model.update(model_state)
            model.loaded = sorted(model_state)
        else:
            set_options = state_dict_options() if report is None else StateDictOptions(flatten_optimizer_state_dict=True,
                                                                              strict=False)
            set_state_dict(module, optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=set_options)
    if loader is not None:
        loader.load_state_dict(meta["loader"])
    if session.rank in files:  # a rank the writing topology did not have keeps its own RNG
        restore_rng(files[session.rank]["rng"])
    progress = meta.get("progress") or {}
    result = {**{k: progress.get(k) for k in _checkpoints.PROGRESS}, **_checkpoints.join(extras, extra_tensors)}
    if report is not None:
        result[_checkpoints.LOAD_REPORT] = report
    return result
