"""The five operations on XLA devices (``shard_data``, ``wrap_model``, ``sync_grads``,
``reduce_metrics``, ``sync_states``), each checked on the host first
(:meth:`polyparallel_xla.runtime.XlaRuntime.check`), then one XLA all-reduce per dtype over the
data group's replica groups, executed before the operation returns."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

import polyparallel as pp

from .runtime import XlaRuntime, get_runtime

__all__ = ["DeviceLoader", "reduce_metrics", "shard_data", "sync_grads", "sync_states", "wrap_model"]

#: The operation name under which loader passes are checked (what a user sees when replicas
#: iterate their loaders unequally).
PASS_CHECK = "shard_data pass (iterate the loader alike on every rank, or pin epochs with loader.sampler.set_epoch)"


def _digest(parts: list[str]) -> str:
    shown = ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")
    return f"{len(parts)} [{shown}] digest {hashlib.blake2b(';'.join(parts).encode(), digest_size=12).hexdigest()}"


# -- shard_data ---------------------------------------------------------------------------------------
def _device_loader_class() -> type:
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    class DeviceLoader(MpDeviceLoader):
        """``MpDeviceLoader`` over a ``DataLoader`` whose sampler is this replica's data shard
        (:class:`polyparallel_torch.data.TopologySampler`). ``sampler`` is that sampler
        (``loader.sampler.set_epoch(e)`` pins the epoch), ``loader`` the host ``DataLoader``.

        Each unpinned pass is checked first, in the replica's own thread, over every rank (the
        sampler itself runs in the loader's background thread)."""

        def __init__(self, loader: torch.utils.data.DataLoader, device: Any, runtime: XlaRuntime | None, what: str):
            super().__init__(loader, device)
            self.loader = loader
            self._runtime = runtime
            self._what = what

        @property
        def sampler(self) -> Any:
            return self.loader.sampler

        @property
        def dataset(self) -> Any:
            return self.loader.dataset

        @property
        def batch_size(self) -> int | None:
            return self.loader.batch_size

        def __iter__(self) -> Iterator[Any]:
            sampler: Any = self.loader.sampler
            if self._runtime is not None and not sampler.pinned:
                self._runtime.check(PASS_CHECK, "world", f"epoch {sampler.epoch} of {self._what}")
            return super().__iter__()

    return DeviceLoader


DeviceLoader: Any = None  # the class, made on first use (it subclasses torch_xla's MpDeviceLoader)


def shard_data(data: Any, session: pp.Session, policy: pp.DataPolicy, strategy: pp.Strategy) -> Any:
    """A ``DeviceLoader`` (an ``MpDeviceLoader``) over this replica's shard of ``data`` (a
    ``Dataset`` or ``DataLoader``): the torch runtime's sampler arithmetic
    (:func:`polyparallel.shard_indices` over the data axis, global batch semantics, loader
    options kept, samplers whose meaning would be lost refused), batches moved to the device."""
    global DeviceLoader
    from polyparallel_torch.data import shard_loader

    loader = shard_loader(data, session, policy, strategy, pass_check=lambda s, what: None)
    if loader is None:
        return None
    if DeviceLoader is None:
        DeviceLoader = _device_loader_class()
    rt = get_runtime(session)
    sampler: Any = loader.sampler
    what = f"{sampler.dataset_len} samples, batch {loader.batch_size}"
    return DeviceLoader(loader, rt.device, rt if session.world_size > 1 else None, what)


# -- wrap_model ---------------------------------------------------------------------------------------------
def wrap_model(model: nn.Module, rt: XlaRuntime, options: dict[str, Any],
               precision: pp.PrecisionPolicy | None = None) -> nn.Module:
    """``model`` moved to this replica's XLA device, under ``precision`` (the Strategy's, or
    ``options["precision"]``: ``None`` leaves the dtypes to an adapter whose framework applies
    it), its parameters and buffers broadcast from data rank 0 (replicas start equal, as under
    DDP). No wrapper: gradients are averaged by ``sync_grads`` (or ``xm.optimizer_step``).

    The precision is the torch runtime's (:func:`polyparallel_torch.precision.prepare` at
    zero=0): ``bf16-mixed`` runs the forward under ``torch.autocast("xla", dtype=torch.bfloat16)``
    with float32 outputs, ``bf16-true`` casts the module to bfloat16 and its floating inputs at
    the forward; gradients reduce in the parameters' dtype."""
    unknown = sorted(set(options) - {"precision"})
    if unknown:
        raise TypeError(f"wrap_model() on the XLA runtime takes no options but precision=; received {unknown}. The "
                        "XLA runtime runs the data axis only (no tensor plan, no pipeline).")
    if "precision" in options:
        precision = options["precision"]
        if not (precision is None or isinstance(precision, pp.PrecisionPolicy)):
            raise TypeError(f"wrap_model(precision=) takes a PrecisionPolicy or None (the Strategy's precision is the "
                            f"default). Received: {precision!r}.")
    model.to(rt.device)
    if precision is not None:
        from polyparallel_torch.precision import prepare

        model = prepare(model, precision, rt.device, stage=0, data_size=rt.topology.size("data"))
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    rt.check("wrap_model", "data", _digest([f"{t.dtype}{list(t.shape)}" for t in tensors]))
    _broadcast(tensors, rt, "wrap_model")
    return model


def _broadcast(tensors: list[torch.Tensor], rt: XlaRuntime, operation: str) -> None:
    # XLA has no broadcast with replica groups: data rank 0 keeps its values, the others send zeros.
    if len(rt.group_ranks("data")) == 1 or not tensors:
        return
    # The factor must be device data, not a constant, so that every replica builds the same graph
    # (one compilation, the same collective keys): torch_xla turns a 0-d tensor holding 0 or 1
    # into a constant of the graph, so it is sent as a 1-element vector and reshaped there.
    keep = 1 if rt.coords["data"] == 0 else 0
    with torch.no_grad():
        factors = {t.dtype: torch.tensor([keep], dtype=t.dtype).to(t.device).reshape(()) for t in tensors}
        buffers = [t.detach() * factors[t.dtype] for t in tensors]
        rt.all_reduce(buffers, "sum", operation, "data")
        for t, b in zip(tensors, buffers):
            t.copy_(b)


# -- sync_grads -----------------------------------------------------------------------------------------------
def sync_grads(target: Any, rt: XlaRuntime, strategy: pp.Strategy) -> Any:
    """Average (``GradPolicy.op='mean'``) or sum the gradients of ``target`` (a module, or a list of
    tensors' gradients) over the data group, in place. A parameter whose gradient is ``None`` on
    some ranks but not others contributes zeros there (its gradient becomes a zero tensor); one
    with no gradient on any rank keeps ``None``, as under DDP."""
    rt.ensure_usable("sync_grads", "data")
    if isinstance(target, nn.Module):
        params = [p for p in target.parameters() if p.requires_grad]
        descr = [f"{p.dtype}{list(p.shape)}" for p in params]
        present = [p.grad is not None for p in params]
    else:
        params, descr = [], [f"{g.dtype}{list(g.shape)}" if g is not None else "None" for g in target]
        present = [g is not None for g in target]
    data_size = rt.topology.size("data")
    if data_size == 1:
        return target
    policy = strategy.grad_policy
    detail = f"{policy.op} {_digest(descr)}"
    if policy.check:
        everyone = rt.check("sync_grads", "data", detail, extra=present)
        union = [any(masks[i] for masks in everyone.values()) for i in range(len(present))]
    else:  # no host exchange: every rank must have the same gradients present
        union = present
    grads: list[torch.Tensor] = []
    for i, wanted in enumerate(union):
        if not wanted:
            continue
        if params:
            p = params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        else:
            grads.append(target[i])
    scale = 1.0 / data_size if policy.op == "mean" else 1.0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype in sorted(by_dtype, key=str):
        rt.all_reduce(by_dtype[dtype], "sum", "sync_grads", "data", scale=scale)
    return target


# -- reduce_metrics ------------------------------------------------------------------------------------------------
def reduce_metrics(metrics: Mapping[str, Any], rt: XlaRuntime, policy: pp.MetricPolicy) -> dict[str, Any]:
    """Reduce ``metrics`` over the data group: ``Mean(total, count)`` count-weighted, plain values
    by the ``MetricPolicy`` op. One float64 XLA all-reduce per op, after the host check whose
    descriptor holds every name, op and size (ranks reducing different names fail naming both).
    The packing is the torch runtime's (:func:`polyparallel_torch.metrics.reduce_layout`)."""
    from polyparallel_torch.metrics import layout, reduce_layout

    rt.ensure_usable("reduce_metrics", "data")
    items, signature, refusal = layout(metrics, policy, rt.rank)
    rt.check("reduce_metrics", "data", signature, refusal=refusal)
    return reduce_layout(items, lambda flat, op: rt.all_reduce([flat], op, "reduce_metrics", "data"), rt.device,
                         rt.topology.size("data"))


# -- sync_states ------------------------------------------------------------------------------------------------------
def sync_states(states: Any, rt: XlaRuntime, strategy: pp.Strategy) -> Any:
    """Apply ``strategy.state_policy`` in place to a module's parameters and buffers or a mapping of
    tensors: ``mean`` over the data group, ``broadcast`` from data rank 0, ``local`` untouched."""
    rt.ensure_usable("sync_states", "data")
    if rt.topology.size("data") == 1:
        return states
    named = ([*states.named_parameters(), *states.named_buffers()] if isinstance(states, nn.Module)
             else [(k, v) for k, v in states.items()])
    policy = strategy.state_policy
    groups: dict[str, list[torch.Tensor]] = {"mean": [], "broadcast": []}
    described = []
    for name, tensor in named:
        action = policy.action_for(name)
        if action == "local" or (action == "mean" and not tensor.is_floating_point()):
            continue
        groups[action].append(tensor)
        described.append(f"{name}:{action}:{tensor.dtype}{list(tensor.shape)}")
    rt.check("sync_states", "data", _digest(described))
    with torch.no_grad():
        means = [t.detach().clone() for t in groups["mean"]]
        rt.all_reduce(means, "sum", "sync_states", "data", scale=1.0 / rt.topology.size("data"))
        for t, m in zip(groups["mean"], means):
            t.copy_(m)
        _broadcast(groups["broadcast"], rt, "sync_states")
    return states
