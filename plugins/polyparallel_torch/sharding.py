"""Sharding stages (``Strategy(zero=1|2|3)``) in the torch runtime, built from PyTorch's own parts.

- **Stage 3** (parameters, gradients and optimizer state sharded over the data axis): PyTorch's
  FSDP2, ``torch.distributed.fsdp.fully_shard`` over the ``data`` dimension of the runtime's
  ``DeviceMesh``. Default wrapping policy (torchtitan's): every direct child of the model that
  holds parameters is one FSDP unit — the children of an ``nn.ModuleList``/``nn.ModuleDict``
  (a transformer's ``layers``) each get their own — then the root takes the rest. Units reshard
  (free the gathered parameters) after forward, except the last one, which backward needs
  first. ``shard_modules=[path, ...]`` names the units instead. With ``tensor > 1`` the tensor
  plan is applied first (DTensor over the ``tensor`` dimension) and ``fully_shard`` then shards
  over ``data`` on the same 2-D mesh, as torchtitan does.
- **Stage 2** (gradients and optimizer state sharded): the same FSDP2 units with
  ``reshard_after_forward=False`` — FSDP1's ``SHARD_GRAD_OP``, the ZeRO-2 equivalent PyTorch
  names. The gathered parameters stay from forward to the end of backward (one all-gather per
  step, no re-gather in backward); gradients are reduce-scattered, so each rank keeps and steps
  only its shard of gradients and optimizer state. One difference from DeepSpeed's ZeRO-2:
  between steps FSDP2 frees the gathered parameters (DeepSpeed keeps a full copy), so stage 2
  here holds *less* memory at rest, the same at peak, and the same traffic per step.
- **Stage 1** (optimizer state sharded): the model is replicated as at stage 0 (DDP), and
  :func:`make_optimizer` builds ``torch.distributed.optim.ZeroRedundancyOptimizer`` over the data
  group: each rank keeps and steps the optimizer state of its partition of the parameters and
  broadcasts the updated values. :func:`make_optimizer` returns the plain optimizer at every other
  stage, so one script runs at any stage. Stage 1 with ``tensor > 1`` is refused before launch
  (``ZeroRedundancyOptimizer`` broadcasts whole parameters, not DTensor shards): use zero=2 or 3.

Before sharding, ``wrap_model`` broadcasts the parameters and buffers from data rank 0 (as DDP,
and FSDP1's ``sync_module_states``, do), so every stage starts from the same values.

``strategy.sync_grads(model)`` on an FSDP module is a no-op (FSDP reduce-scatters the gradients
in backward, its collectives recorded: :mod:`.fsdp_trace`); with
``GradPolicy(check_backward=True)`` it runs the runtime's identity check, so a rank that skipped
a ``sync_grads`` is reported as with a bare module. ``sync_states`` leaves
tensors sharded over ``data`` alone (there are no replicas to average or copy) and applies the
``StatePolicy`` to the rest (buffers such as BatchNorm statistics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import TorchRuntime
from .tensors import broadcast_over_data

__all__ = ["default_units", "is_fsdp", "make_optimizer", "replicate_module", "shard_module", "sharded_over_data", "sync_noop",
           "validate_sharding"]

# Options of fully_shard the Strategy decides: the user may not pass them in fsdp_kwargs=.
_DECIDED = ("mesh", "reshard_after_forward", "dp_mesh_dims")


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` was applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def default_units(model: nn.Module) -> list[str]:
    """The submodule paths the default policy shards as FSDP units (the root comes last, apart):
    each direct child holding parameters, and each child of an ``nn.ModuleList``/``nn.ModuleDict``."""
    def holds_params(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [f"{name}.{n}" for n, c in child.named_children() if holds_params(c)]
        elif holds_params(child):
            units.append(name)
    return units


def validate_sharding(model: nn.Module, topology: pp.Topology, stage: int, options: dict[str, Any]) -> None:
    """Refuse sharding options that cannot apply, before any collective."""
    kwargs = options.get("fsdp_kwargs")
    units = options.get("shard_modules")
    if stage < 2:
        given = [k for k in ("fsdp_kwargs", "shard_modules") if options.get(k) is not None]
        if given:
            raise TypeError(f"wrap_model() got {', '.join(f'{k}=' for k in given)} at sharding stage zero={stage}; "
                            "they configure FSDP2, which the torch runtime uses at zero=2 and zero=3 only.")
        return
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise TypeError(f"fsdp_kwargs= must be a dict of fully_shard options. Received: {kwargs!r}.")
        decided = sorted(k for k in kwargs if k in _DECIDED)
        if decided:
            raise TypeError(f"fsdp_kwargs= may not set {decided}: the Strategy decides them (mesh: the data "
                            "axis; reshard_after_forward: zero=3 reshards, zero=2 does not).")
    if units is not None:
        if isinstance(units, str) or not isinstance(units, Iterable):
            raise TypeError(f"shard_modules= must be a list of submodule paths. Received: {units!r}.")
        names = dict(model.named_modules())
        missing = [u for u in units if not isinstance(u, str) or not u or u not in names]
        if missing:
            known = ", ".join(n for n in names if n) or "(no submodules)"
            raise pp.TopologyError(f"shard_modules= names {missing}, which {type(model).__name__} does not have "
                                   f"(the root is always a unit; name submodules only). Submodules: {known}.")


def shard_module(model: nn.Module, rt: TorchRuntime, stage: int, options: dict[str, Any],
                 pipelined: bool = False, precision: pp.PrecisionPolicy | None = None) -> nn.Module:
    """Apply FSDP2 at ``stage`` (2 or 3) over the data dimension of ``rt``'s mesh, in place
    (parameters already on the device and, with ``tensor > 1``, already DTensors over ``tensor``).
    Returns ``model``, now an ``FSDPModule``.

    :param pipelined: ``model`` is a pipeline stage: no unit reshards after forward (every
        micro-batch's backward would gather it again), as torchtitan does with pipelines.
    :param precision: a mixed precision becomes every unit's ``MixedPrecisionPolicy``
        (:func:`polyparallel_torch.precision.fsdp_policy`)."""
    from torch.distributed.fsdp import fully_shard

    broadcast_over_data(model, rt)  # replicas start from data rank 0's values, as under DDP
    kwargs = dict(options.get("fsdp_kwargs") or {})
    from .precision import fsdp_policy

    mp_policy = fsdp_policy(precision)
    if mp_policy is not None:  # parameters gathered in the compute dtype, gradients reduced in reduce_dtype
        kwargs["mp_policy"] = mp_policy
    mesh = rt.submesh("data")
    names = dict(model.named_modules())
    given = options.get("shard_modules")
    paths = list(given) if given is not None else default_units(model)
    last = paths[-1] if paths and given is None else None  # the default units are in forward order
    # fully_shard goes bottom-up: a unit nested in another must be sharded first.
    paths.sort(key=lambda p: -p.count("."))
    # The units compute in the policy's dtype and hand their outputs on in it; only the root casts
    # the model's output back (a cast at every unit's output would only be undone by the next unit).
    unit_kwargs = kwargs if mp_policy is None else {**kwargs, "mp_policy": dataclasses.replace(mp_policy, output_dtype=None)}
    for path in paths:
        # Stage 3 frees gathered parameters after forward; not the last unit, which backward needs at once.
        reshard = stage == 3 and path != last and not pipelined
        fully_shard(names[path], mesh=mesh, reshard_after_forward=reshard, **unit_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **kwargs)
    from .fsdp_trace import install

    install(model, rt)  # every unit's all-gathers and reduce-scatters recorded (.fsdp_trace; torch's comms inside)
    return model


def replicate_module(model: nn.Module, rt: TorchRuntime) -> nn.Module:
    """Replicate ``model`` over the data group with FSDP2 as HSDP whose shard dimension has one
    rank, in place: parameters are broadcast from data rank 0, then stay whole on every rank, and
    backward all-reduces (averages) the gradients over ``data``. Returns ``model``, an ``FSDPModule``.

    Used for pipeline stages at zero=0/1 (the tensor axis is 1 there): the runtime mesh's
    ``("data", "tensor")`` slice is that ``(data, 1)`` mesh, so no process group is made."""
    from torch.distributed.fsdp import fully_shard

    if rt.topology.size("tensor") != 1:  # validate_pipeline refuses pipeline x tensor before this
        raise pp.UnsupportedTopologyError(f"replicate_module needs tensor=1; the topology is {rt.topology!r}.")
    broadcast_over_data(model, rt)
    fully_shard(model, mesh=rt.mesh["data", "tensor"], reshard_after_forward=False)
    return model


def sharded_over_data(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor sharded over a mesh dimension named ``data`` (an FSDP
    parameter): each data rank holds another part, so it has no replicas to synchronise."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return False
    names = mesh.mesh_dim_names or ()
    return any(p.is_shard() and i < len(names) and names[i] == "data" for i, p in enumerate(placements))


def sync_noop(target: nn.Module, rt: TorchRuntime, strategy: pp.Strategy, what: str) -> nn.Module:
    """``sync_grads`` on a module whose gradients torch reduced in backward (FSDP2, or a pipeline
    stage: FSDP2 or HSDP): nothing to reduce, as on a DDP model, and so by default nothing at
    all (the backward's collectives are recorded: .fsdp_trace, .ddp_trace); with
    ``GradPolicy(check_backward=True)`` the identity check of ``sync_grads``, so a rank that
    skipped one or runs another operation is found at once, as with a bare module. (The check is
    a blocking 16-byte all-reduce, about 0.5 ms a step on gloo here: the largest cost of the
    FSDP2 step against a hand-written ``fully_shard`` loop, docs/benchmarks.md.)"""
    rt.ensure_usable("sync_grads", "data")
    if rt.topology.size("data") > 1 and strategy.grad_policy.check_backward:
        rt.check("sync_grads", "data", f"{what}: reduced in backward")
    return target


def make_optimizer(strategy: pp.Strategy, model: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer],
                   **defaults: Any) -> torch.optim.Optimizer:
    """The optimizer for ``model`` at ``strategy``'s sharding stage: at ``zero=1`` (with
    ``data > 1``) a ``ZeroRedundancyOptimizer`` over the data group, which keeps the optimizer
    state of this rank's partition only; otherwise ``optimizer_class(model.parameters(),
    **defaults)`` (at zero=2/3 the parameters are FSDP shards, so its state is sharded already).

    >>> opt = polyparallel_torch.make_optimizer(strategy, model, torch.optim.AdamW, lr=1e-3)  # doctest: +SKIP

    :param model: the module returned by ``strategy.wrap_model``.
    :param optimizer_class: a ``torch.optim.Optimizer`` subclass.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"make_optimizer() needs an optimizer class such as torch.optim.AdamW (it builds the "
                        f"optimizer per sharding stage). Received: {optimizer_class!r}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_optimizer() needs the module returned by strategy.wrap_model. Received: {model!r}.")
    from .runtime import get_runtime

    session = strategy.session()
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy.shard_policy.stage != 1 or session.topology.size("data") == 1:
        return optimizer_class(params, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rt = get_runtime(session)
    rt.ensure_usable("make_optimizer", "data")
    # ZeroRedundancyOptimizer's constructor runs no collective; its step() broadcasts each
    # partition from its owner over the data group (torch's collective, bounded by the group timeout).
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=rt.group("data"),
                                   **defaults)
