"""``strategy.save(path, model=engine)`` / ``strategy.load(path, model=engine)`` of a DeepSpeed
engine, in the torch runtime's checkpoint format (:mod:`polyparallel_torch.checkpoint`, format
version 2), so that a checkpoint written by DeepSpeed at any ZeRO stage or with a pipeline loads
into FSDP2 or DDP at another data size, into Lightning or Ignite, or into a plain module in one
process, and the other way round.

This module only converts: the engine's state becomes a
:class:`polyparallel_torch.checkpoint.StateDicts` (full tensors under the plain module's names),
and the torch runtime's ``save`` / ``load`` do the rest exactly as for its own models: every file
hashed while written, the save id, the agreements (a failure on any rank, such as a full disk, is
the same ``CheckpointError`` on every rank and the staging directory is removed), the marker
listing the tensors, the commit. Hence also, with nothing of their own here:

- ``strategy.async_save(path, model=engine, ...)``: the gathered copies are staged by DCP and
  written and committed in the background; the engine may train on at once (a later save or load
  waits for it). ``pp.CheckpointManager(strategy, dir, keep=N, asynchronous=...)`` saves and
  restores an engine through these.
- ``polyparallel checkpoint export``: a DeepSpeed checkpoint is a torch checkpoint (runtime
  ``torch``, framework ``deepspeed``); its export holds the weights, the optimizer state and the
  extra ``"deepspeed"``.
- partial loads, ``strategy.load(path, model=engine, keys=[...])`` or ``strict=False``: the
  selected parameters and buffers only (the rest keeps its values; ``load_report`` as for any
  model). The optimizer is refused with them (before its state is touched), and the engine's
  counters and LR scheduler are not restored (their extra comes back in the result).

What a DeepSpeed checkpoint holds, under the names a plain module would have (no ``module.``
prefix; a pipeline stage's layers under their index in the unsplit ``nn.Sequential``):

- **parameters**: the fp32 master copy where DeepSpeed keeps one (ZeRO 1-3: the optimizer's
  partitions, gathered with DeepSpeed's ``safe_get_full_fp32_param``; ZeRO-0 with bf16: the
  float32 copies its bf16 wrapper steps), else the module's tensor (ZeRO 0 in fp32, frozen
  parameters; at ZeRO-3 gathered); persistent **buffers** as they are. A bf16 engine
  (``Strategy(precision="bf16-mixed")``) so saves float32 weights, which load into an fp32 model
  or engine as into a bf16 one (whose bfloat16 module gets them rounded, its master copy exact);
- **optimizer state** (``optimizer=engine.optimizer``, or the torch optimizer given to ``adapt``),
  in the layout ``get_state_dict(..., flatten_optimizer_state_dict=True)`` gives a plain module:
  ``state.<name>.<key>`` per parameter (DeepSpeed's flat partitions gathered with
  ``safe_get_full_optimizer_state``; a per-group scalar such as Adam's ``step`` repeated for each
  parameter of the group) and ``param_groups.<name>.<hyperparameter>``;
- the extra ``"deepspeed"``: the engine's ``global_steps``, ``global_samples``, ``skipped_steps``
  and its LR scheduler's ``state_dict()`` (or ``None``), restored into an engine (and returned as
  an extra by any other load);
- what every torch checkpoint holds: the loader's position, each rank's RNG states, the extras.

Refused on every rank before any collective (a checkpoint that would not restore the run):
an fp16 engine (its loss scaler has no place in the format), optimizer or parameter offload (partitions swapped to host or
NVMe), a save between the micro-steps of a gradient-accumulation boundary (the accumulated
gradients are not saved), ``optimizer=`` that is not the engine's, an optimizer that has taken no
step yet (no state to save; save without ``optimizer=``), optimizer state that is neither
per element nor a per-group scalar, a ZeRO-3 module (``engine.module``) given instead of the
engine, and an extra named ``"deepspeed"``.

Every rank gathers the same parameters in the same order (the gathers are DeepSpeed's
collectives over the data group), and a save or load holds the full fp32 parameters and
optimizer state of its stage in host memory on every rank for the duration of the call; the
torch runtime's DCP writes each tensor once (replicas are de-duplicated).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import polyparallel as pp
from polyparallel import _checkpoints

__all__ = ["ENGINE_EXTRA", "is_partitioned_module", "load", "save"]

#: The extra holding the engine's counters and LR scheduler state.
ENGINE_EXTRA = "deepspeed"
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def is_partitioned_module(model: Any) -> bool:
    """Whether ``model`` is a module whose parameters ZeRO-3 partitioned (``engine.module``):
    its tensors are placeholders, so it cannot be checkpointed without its engine."""
    return isinstance(model, nn.Module) and any(hasattr(p, "ds_id") for p in model.parameters())


@dataclass
class _Layout:
    """Where a DeepSpeed engine keeps each parameter's optimizer state."""

    stage: int
    inner: torch.optim.Optimizer | None  # the torch optimizer DeepSpeed steps (its flat partitions at ZeRO 1-3)
    # id(parameter) -> (the tensor the inner optimizer's state is keyed by, its param group index)
    slots: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # ZeRO-0 bf16: id(bfloat16 module parameter) -> its float32 master copy (DeepSpeed's wrapper's fp32_groups)
    masters: dict[int, torch.Tensor] = field(default_factory=dict)

    def flats(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for flat, _ in self.slots.values():
            seen.setdefault(id(flat), flat)
        return list(seen.values())

    def flats_of(self, group: int) -> list[torch.Tensor]:
        return [f for f in self.flats() if any(g == group and f is t for t, g in self.slots.values())]


def _refuse(where: str, why: str) -> pp.CheckpointError:
    return pp.CheckpointError(f"{where} of a DeepSpeed engine: {why}")


def _layout(engine: Any, where: str) -> _Layout:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if engine.fp16_enabled():
        raise _refuse(where, "fp16 engines are not checkpointed by polyparallel (their loss scaler has no place in "
                             "the portable format). Train in fp32 or bf16 (Strategy(precision='bf16-mixed')), or use "
                             "DeepSpeed's own engine.save_checkpoint.")
    if engine.zero_offload_optimizer() is not None or engine.zero_offload_param() is not None:
        raise _refuse(where, "ZeRO offload (offload_optimizer / offload_param) swaps partitions out of the "
                             "optimizer; the checkpoint hooks read only in-memory partitions. Remove the offload "
                             "options.")
    stage, opt, inner = engine.zero_optimization_stage(), engine.optimizer, engine.basic_optimizer
    layout = _Layout(stage, inner if isinstance(inner, torch.optim.Optimizer) else None)
    if layout.inner is None:
        return layout
    if stage == 0 and engine.bfloat16_enabled() and hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        # DeepSpeed's bf16 wrapper (FP16_UnfusedOptimizer without loss scaling): the inner optimizer
        # holds float32 copies of the bfloat16 module's parameters, its state keyed by them.
        if getattr(opt, "cur_scale", 1.0) != 1.0:
            raise _refuse(where, f"its bf16 wrapper scales the loss ({opt.cur_scale}), a state the portable format "
                                 "has no place for.")
        for g, (low, high) in enumerate(zip(opt.fp16_groups, opt.fp32_groups)):
            for p, master in zip(low, high):
                layout.slots[id(p)] = (master, g)
                layout.masters[id(p)] = master
    elif stage == 0:
        if opt is not inner:
            raise _refuse(where, f"its optimizer is DeepSpeed's {type(opt).__name__} wrapper, which polyparallel "
                                 "cannot read. Use a torch optimizer in fp32.")
        layout.slots = {id(p): (p, g) for g, group in enumerate(inner.param_groups) for p in group["params"]}
    elif isinstance(opt, DeepSpeedZeroOptimizer):
        layout.slots = {id(p): (opt.single_partition_of_fp32_groups[g], g)
                        for g, params in enumerate(opt.bit16_groups) for p in params}
    elif isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        layout.slots = {id(p): (opt.fp32_partitioned_groups_flat[s], opt.sub_group_to_group_id[s])
                        for s, params in enumerate(opt.fp16_groups) for p in params}
    else:
        raise _refuse(where, f"its ZeRO-{stage} optimizer is {type(opt).__name__}, which polyparallel cannot read.")
    return layout


def _state_keys(layout: _Layout, where: str) -> tuple[list[str], list[str]]:
    """The inner optimizer's state keys: (per element, per group scalar). Checked on every rank
    alike (the partitions have the same keys everywhere)."""
    if layout.inner is None or layout.stage == 0:
        return [], []
    per_element: set[str] = set()
    scalar: set[str] = set()
    kinds = []
    for flat in layout.flats():
        state = layout.inner.state.get(flat, {})
        kinds.append(sorted(state))
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == flat.shape:
                per_element.add(key)
            elif (isinstance(value, torch.Tensor) and value.dim() == 0) or isinstance(value, (bool, int, float)):
                scalar.add(key)
            else:
                raise _refuse(where, f"its optimizer's state {key!r} is a {type(value).__name__} "
                                     f"{tuple(getattr(value, 'shape', ()))}, neither per element nor one value per "
                                     "group; it cannot be written per parameter.")
    if any(k != kinds[0] for k in kinds):
        raise _refuse(where, f"its optimizer's partitions hold different state keys ({kinds[:3]}).")
    return sorted(per_element), sorted(scalar)


def _check_optimizer(engine: Any, optimizer: Any, layout: _Layout, where: str) -> bool:
    if optimizer is None:
        return False
    if layout.inner is None:
        raise _refuse(where, "the engine has no optimizer; pass no optimizer=.")
    if optimizer is not engine.optimizer and optimizer is not layout.inner:
        raise _refuse(where, f"optimizer= must be engine.optimizer (or the torch optimizer given to adapt); received "
                             f"{type(optimizer).__name__}, another object.")
    return True


# -- reading full values (collectives over the data group, the same on every rank) ------------------
@contextlib.contextmanager
def _gathered(param: nn.Parameter, stage: int) -> Iterator[None]:
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            yield
    else:
        yield


def _has_master(param: nn.Parameter, layout: _Layout) -> bool:
    return (layout.stage > 0 or id(param) in layout.masters) and id(param) in layout.slots and param.requires_grad


def _full_param(param: nn.Parameter, layout: _Layout) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    if id(param) in layout.masters:
        return layout.masters[id(param)].detach().clone()
    if _has_master(param, layout):
        return safe_get_full_fp32_param(param).detach().clone()
    with _gathered(param, layout.stage):
        return param.detach().clone()


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def _entries(engine: Any) -> list[tuple[str, torch.Tensor]]:
    """The module's state-dict entries (parameters as ``nn.Parameter``, persistent buffers), in order."""
    return list(engine.module.state_dict(keep_vars=True).items())


def engine_state(engine: Any, with_optimizer: bool, where: str = "Strategy.save") -> Any:
    """The engine's state as a :class:`polyparallel_torch.checkpoint.StateDicts` (full tensors)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import safe_get_full_optimizer_state

    from polyparallel_torch.checkpoint import StateDicts

    layout = _layout(engine, where)
    per_element, scalar = _state_keys(layout, where) if with_optimizer else ([], [])
    if with_optimizer and layout.inner is not None and not layout.inner.state:
        raise _refuse(where, "its optimizer has taken no step yet, so it holds no state to save; save without "
                             "optimizer= (or after a step).")
    model: dict[str, Any] = {}
    optim: dict[str, Any] | None = {} if with_optimizer else None
    for name, tensor in _entries(engine):
        if not isinstance(tensor, nn.Parameter):
            model[name] = tensor.detach().clone()
            continue
        model[name] = _full_param(tensor, layout)
        if optim is None or layout.inner is None or id(tensor) not in layout.slots:
            continue
        flat, group = layout.slots[id(tensor)]
        if layout.stage == 0:
            for key, value in layout.inner.state.get(flat, {}).items():
                optim[f"state.{name}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        else:
            for key in per_element:
                optim[f"state.{name}.{key}"] = safe_get_full_optimizer_state(tensor, key).detach().clone()
            for key in scalar:
                value = layout.inner.state[flat][key]
                optim[f"state.{name}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in layout.inner.param_groups[group].items():
            if key != "params":
                optim[f"param_groups.{name}.{key}"] = value
    return StateDicts(model, optim, pipeline=isinstance(engine, PipelineEngine) and engine.num_stages > 1)


def _engine_extra(engine: Any) -> dict[str, Any]:
    scheduler = getattr(engine, "lr_scheduler", None)
    return {**{k: int(getattr(engine, k)) for k in _COUNTERS},
            "lr_scheduler": None if scheduler is None else scheduler.state_dict()}


def save(strategy: pp.Strategy, path: str, state: dict[str, Any], options: dict[str, Any] | None = None) -> Any:
    """The DeepSpeed plugin's ``polyparallel_save_checkpoint`` for ``model=engine``: the path, or
    with ``options={"asynchronous": True}`` (``Strategy.async_save``) the torch runtime's future
    once the gathered copies are staged (the engine may train on at once)."""
    from polyparallel_torch import checkpoint as torch_checkpoint

    where = "Strategy.save"
    state = dict(state)
    engine, optimizer = state.pop("model"), state.pop("optimizer", None)
    if ENGINE_EXTRA in state:
        raise _refuse(where, f"the extra name {ENGINE_EXTRA!r} holds the engine's counters and LR scheduler; name "
                             "yours otherwise.")
    layout = _layout(engine, where)
    with_optimizer = _check_optimizer(engine, optimizer, layout, where)
    accumulation = engine.gradient_accumulation_steps()
    if engine.micro_steps % accumulation:
        raise _refuse(where, f"it is between gradient-accumulation boundaries ({engine.micro_steps} micro-steps, "
                             f"gradient_accumulation_steps={accumulation}); the accumulated gradients are not saved. "
                             "Save after engine.step() completed a boundary.")
    extra = _engine_extra(engine)
    # What the torch runtime would refuse after the gathers below, refused before them (every rank alike).
    try:
        extras = {k: v for k, v in state.items() if k not in ("loader", "framework")}
        _checkpoints.split({**extras, ENGINE_EXTRA: extra}, lambda v: isinstance(v, torch.Tensor), "extras")
    except TypeError as exc:
        raise _refuse(where, f"{exc}") from None
    loader = state.get("loader")
    if loader is not None and hasattr(loader, "state_dict"):
        try:
            loader.state_dict()
        except (TypeError, ValueError) as exc:
            raise pp.CheckpointError(f"{where}(loader=): this loader has no position to save ({exc}). Give a loader "
                                     "strategy.shard_data made with a batch size, or save without loader=.") from None
    converted = engine_state(engine, with_optimizer, where)
    state.setdefault("framework", "deepspeed")
    return torch_checkpoint.save(strategy, path, {**state, "model": converted, ENGINE_EXTRA: extra}, options)


# -- load ----------------------------------------------------------------------------------------------
def _init_optimizer_state(layout: _Layout) -> None:
    """Create the inner optimizer's state on a fresh engine, as torch's DCP does for a fresh
    optimizer: one step with zero gradients and lr 0 (no parameter changes), so that the state
    the checkpoint's values are read into exists with the optimizer's own keys. Local: no
    collective. ZeRO 1/2 then link DeepSpeed's per-parameter views of it."""
    inner = layout.inner
    if inner is None or inner.state:
        return
    flats = layout.flats()
    saved = [(f, f.grad) for f in flats]
    groups = [(g, g["params"], g.get("lr")) for g in inner.param_groups]
    try:
        if layout.stage == 3:  # DeepSpeed puts a sub-group's partition in its group only while it steps
            for index, group in enumerate(inner.param_groups):
                group["params"] = layout.flats_of(index)
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        for group in inner.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        inner.step()
    finally:
        for group, params, lr in groups:
            group["params"] = params
            if lr is not None:
                group["lr"] = lr
        for flat, grad in saved:
            flat.grad = grad


def _targets(engine: Any, layout: _Layout, with_optimizer: bool, where: str) -> Any:
    """Tensors of the checkpoint's shapes to read into (full, as a plain module holds them)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from polyparallel_torch.checkpoint import StateDicts

    if with_optimizer:
        _init_optimizer_state(layout)
        if layout.stage in (1, 2):
            engine.optimizer._lazy_init_hp_params_optimizer_state()
    per_element, scalar = _state_keys(layout, where) if with_optimizer else ([], [])
    model: dict[str, Any] = {}
    optim: dict[str, Any] | None = {} if with_optimizer else None
    for name, tensor in _entries(engine):
        # The float32 master copy is what is saved, where DeepSpeed keeps one (bf16 module parameters).
        dtype = torch.float32 if isinstance(tensor, nn.Parameter) and _has_master(tensor, layout) else tensor.dtype
        model[name] = torch.empty(_shape(tensor), dtype=dtype)
        if optim is None or layout.inner is None or not isinstance(tensor, nn.Parameter) or id(tensor) not in layout.slots:
            continue
        flat, group = layout.slots[id(tensor)]
        if layout.stage == 0:
            items = list(layout.inner.state.get(flat, {}).items())
        else:
            items = [(k, torch.empty(_shape(tensor), dtype=layout.inner.state[flat][k].dtype)) for k in per_element]
            items += [(k, layout.inner.state[flat][k]) for k in scalar]
        for key, value in items:
            optim[f"state.{name}.{key}"] = torch.empty_like(value) if isinstance(value, torch.Tensor) else value
        for key, value in layout.inner.param_groups[group].items():
            if key != "params":
                optim[f"param_groups.{name}.{key}"] = value
    return StateDicts(model, optim, pipeline=isinstance(engine, PipelineEngine) and engine.num_stages > 1)


def _local(param: Any, value: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of the full ``value`` (DeepSpeed pads the last one)."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    group = param.ds_process_group
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    padded = torch.zeros(size * world, dtype=value.dtype)
    padded[:value.numel()] = value.reshape(-1)
    return padded[rank * size:(rank + 1) * size]


def _set_param(param: Any, value: torch.Tensor, layout: _Layout) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    # The master copy from the value read (float32 where the checkpoint holds it), the module's
    # parameter from it cast to the parameter's dtype (bfloat16 under bf16).
    master, value = value.float(), value.to(param.dtype)
    if layout.stage == 3:
        local = _local(param, value)
        param.ds_tensor.data.copy_(local)
        if _has_master(param, layout):
            safe_set_local_fp32_param(param, _local(param, master))
        if param.data.numel() == param.ds_numel:  # a persistent (or gathered) parameter holds the whole tensor too
            param.data.copy_(value.view(param.ds_shape))
        return
    with torch.no_grad():
        param.data.copy_(value)
        if id(param) in layout.masters:
            layout.masters[id(param)].copy_(master)
            return
    if _has_master(param, layout):
        safe_set_full_fp32_param(param, master)


def _group_values(layout: _Layout, optim: dict[str, Any], entries: list[tuple[str, torch.Tensor]],
                  scalar: list[str], path: str) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """The per-group values to set: (flat id -> scalar state, group -> hyperparameters), refusing
    parameters of one DeepSpeed group whose saved values differ (before anything is changed)."""
    states: dict[int, dict[str, Any]] = {}
    hyper: dict[int, dict[str, Any]] = {}
    assert layout.inner is not None
    for name, tensor in entries:
        if id(tensor) not in layout.slots:
            continue
        flat, group = layout.slots[id(tensor)]
        wanted = [(states.setdefault(id(flat), {}), k, optim[f"state.{name}.{k}"]) for k in scalar]
        wanted += [(hyper.setdefault(group, {}), k, optim[f"param_groups.{name}.{k}"])
                   for k in layout.inner.param_groups[group] if k != "params" and f"param_groups.{name}.{k}" in optim]
        for into, key, value in wanted:
            if key in into and not _same(into[key], value):
                raise pp.CheckpointError(f"Strategy.load: {path!r} holds different {key!r} values for parameters that "
                                         f"DeepSpeed keeps in one group ({into[key]!r} and {value!r} at {name!r}); "
                                         "this engine cannot hold them. Load it with the torch runtime instead.")
            into[key] = value
    return states, hyper


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return bool(a == b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b))


def _apply(engine: Any, layout: _Layout, converted: Any, path: str) -> None:
    """Put the values read into the engine (those of ``converted.loaded``: all, or a partial
    load's selection): local copies only (no collective)."""
    from deepspeed.utils import safe_set_full_optimizer_state, safe_set_local_optimizer_state

    loaded = set(converted.model if converted.loaded is None else converted.loaded)
    entries = [(name, tensor) for name, tensor in _entries(engine) if name in loaded]
    optim = converted.optim
    per_element, scalar = _state_keys(layout, "Strategy.load") if optim is not None else ([], [])
    states, hyper = _group_values(layout, optim, entries, scalar, path) if optim is not None else ({}, {})
    for name, tensor in entries:
        value = converted.model[name]
        if not isinstance(tensor, nn.Parameter):
            with torch.no_grad():
                tensor.copy_(value)
            continue
        _set_param(tensor, value, layout)
        if optim is None or layout.inner is None or id(tensor) not in layout.slots:
            continue
        if layout.stage == 0:
            flat = layout.slots[id(tensor)][0]
            for key, saved in layout.inner.state.get(flat, {}).items():
                loaded = optim[f"state.{name}.{key}"]
                if isinstance(saved, torch.Tensor):
                    saved.copy_(loaded)
                else:
                    layout.inner.state[flat][key] = loaded
            continue
        for key in per_element:
            loaded = optim[f"state.{name}.{key}"].float()
            if layout.stage == 3:
                safe_set_local_optimizer_state(tensor, _local(tensor, loaded), key)
            else:
                safe_set_full_optimizer_state(tensor, loaded, key)
    assert layout.inner is not None or not (states or hyper)
    for flat in layout.flats():
        for key, value in states.get(id(flat), {}).items():
            held = layout.inner.state[flat][key]  # type: ignore[union-attr]
            if isinstance(held, torch.Tensor):
                held.copy_(torch.as_tensor(value))
            else:
                layout.inner.state[flat][key] = value  # type: ignore[union-attr]
    for group, values in hyper.items():
        params = layout.inner.param_groups[group]  # type: ignore[union-attr]
        for key, value in values.items():
            params[key] = tuple(value) if isinstance(params.get(key), tuple) else value


def load(strategy: pp.Strategy, path: str, state: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed plugin's ``polyparallel_load_checkpoint`` for ``model=engine``; ``options``:
    a partial load (``strict``/``keys``) of the engine's weights, answered by the torch runtime's
    selection and ``load_report``. A partial load restores the selected parameters and buffers
    only: not the optimizer (refused, as for any model), nor the engine's counters and LR
    scheduler (their extra ``"deepspeed"`` is returned, not applied)."""
    from polyparallel_torch import checkpoint as torch_checkpoint

    where = "Strategy.load"
    options = dict(options or {})
    partial = options.get("strict", True) is not True or options.get("keys") is not None
    engine, optimizer = state["model"], state.get("optimizer")
    if partial and optimizer is not None:
        # Refused before _targets creates the optimizer's state (the torch runtime refuses it too, later).
        raise _refuse(where, "a partial load (strict=False / keys=) restores the model's weights only, not the "
                             "optimizer's state (it belongs to the whole saved model). Load without optimizer= "
                             "and let the engine's optimizer start fresh for the fine-tuning.")
    layout = _layout(engine, where)
    with_optimizer = _check_optimizer(engine, optimizer, layout, where)
    converted = _targets(engine, layout, with_optimizer, where)
    result = torch_checkpoint.load(strategy, path, {"model": converted, "loader": state.get("loader")}, options)
    _apply(engine, layout, converted, path)
    if partial:
        return result
    extra = result.pop(ENGINE_EXTRA, None)
    if isinstance(extra, dict):
        for key in _COUNTERS:
            if isinstance(extra.get(key), int):
                setattr(engine, key, extra[key])
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and extra.get("lr_scheduler") is not None:
            scheduler.load_state_dict(extra["lr_scheduler"])
    return result
