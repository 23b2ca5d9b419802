"""``Strategy(precision=)`` on the torch runtime: each :class:`polyparallel.PrecisionPolicy`
field and the PyTorch mechanism ``wrap_model`` maps it to.

- ``param_dtype``: the parameters (and floating buffers) are *kept* in it: ``wrap_model`` casts
  the module once (``module.to(dtype)``) before wrapping. torch's optimizers keep their state in
  the parameters' dtype, so ``optimizer_dtype`` must be the same (another is refused).
- ``compute_dtype`` narrower than ``param_dtype`` (mixed precision):
  at ``zero=0``/``1`` (DDP, or a bare module) the module's forward runs under ``torch.autocast``
  in it (autocast's op lists: matmuls and convolutions in the narrow dtype, reductions and
  losses in float32), and floating outputs are cast back to the parameters' dtype, so the loss
  the loop computes on them runs in float32, as it would inside autocast; at ``zero=2``/``3``
  FSDP2's ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce,
  output_dtype=param)``: parameters are all-gathered in the compute dtype and every op runs in
  it (FSDP casts the floating inputs too), the sharded float32 parameters stay the master copy.
- ``compute_dtype == param_dtype`` narrower than float32 ("true" precision): floating inputs are
  cast to it at the module's forward (a float32 batch meets bfloat16 weights), outputs stay in it.
- ``reduce_dtype``: the dtype gradients travel in over the data axis. Equal to the gradients'
  dtype (every preset): DDP's and FSDP2's own reduction. Narrower than float32 gradients: under
  DDP a compress hook (torch's ``bf16_compress_hook`` for every backend: cast, all-reduce, cast back), under
  FSDP2 the policy's ``reduce_dtype``. Wider than the gradients, or narrower on a bare module
  (``sync_grads`` reduces in the gradients' dtype): refused.
- ``loss_scaling`` (fp16-mixed): a dynamic gradient scaler, ``torch.amp.GradScaler`` (under
  FSDP2 ``ShardedGradScaler``, whose inf check covers every shard); ``polyparallel_torch.steps``
  uses it (loss scaled in ``Step.backward``, ``scaler.step``/``update`` in ``Step.optimize``), a
  hand-written loop takes it from :func:`grad_scaler`. ``sync_grads`` refuses a step whose loss was
  never scaled (float16 gradients underflow silently without it).

Refused before any process starts (the launch hook) and again by ``wrap_model`` before any
collective (a script under torchrun): float64 with another dtype or under autocast (autocast has
no float32 target), ``optimizer_dtype`` other than ``param_dtype``, a ``reduce_dtype`` wider than the
gradients' or narrower on a bare module (tensor parallel at ``zero=0``), and any precision with
``pipeline > 1`` (the stages' schedule calls the submodules itself, outside the forward this
module wraps).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

import polyparallel as pp

__all__ = ["REFUSED", "attach_scaler", "cast_floating", "check", "check_scaled", "ddp_comm_hook", "fsdp_policy", "grad_scaler", "prepare",
           "state_bytes"]

#: Why the torch runtime does not run a combination (what :func:`check` says).
REFUSED = {
    "optimizer": "torch's optimizers keep their state in the parameters' dtype; set optimizer_dtype to param_dtype",
    "float64": "float64 runs only as precision=None (the model's own dtype): autocast has no float32 target and the "
               "presets are float32 or narrower",
    "reduce_wider": "the gradients are in the parameters' dtype; reducing them in a wider one gains nothing torch "
                    "exposes (DDP and FSDP2 reduce in the gradients' dtype or a narrower one)",
    "reduce_bare": "a bare module's gradients are reduced by sync_grads in their own dtype (tensor parallel at "
                   "zero=0); use zero=2/3 (FSDP2's reduce_dtype) or reduce_dtype=param_dtype",
    "pipeline": "the pipeline schedule calls each stage's submodules itself, outside the forward that autocast and "
                "the input casts wrap; use precision=None (build the model in the dtype you want) or pipeline=1",
}

_SCALERS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check(policy: pp.PrecisionPolicy | None, topology: pp.Topology | None = None, stage: int = 0,
          where: str = "the torch runtime") -> None:
    """Refuse what the torch runtime would not run as stated (the module docstring), naming why."""
    if policy is None or policy.name == "32":
        return

    def refuse(key: str) -> None:
        raise pp.UnsupportedTopologyError(f"{where} cannot run precision {policy!r}: {REFUSED[key]}.")

    dtypes = policy.dtypes()
    if "float64" in dtypes.values():
        refuse("float64")
    if policy.optimizer_dtype != policy.param_dtype:
        refuse("optimizer")
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}
    if bits[policy.reduce_dtype] > bits[policy.param_dtype]:
        refuse("reduce_wider")
    if topology is not None:
        if topology.size("pipeline") > 1:
            refuse("pipeline")
        if (policy.reduce_dtype != policy.param_dtype and topology.size("tensor") > 1 and stage < 2
                and topology.size("data") > 1):
            refuse("reduce_bare")


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (inside tuples, namedtuples, lists and dicts) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


class _Compute:
    """The forward hooks of a module under a precision: a pre-hook that enters autocast (mixed)
    or casts the floating inputs to the compute dtype ("true"), a hook (``always_call``: also
    when forward raises, so autocast never stays on) that leaves autocast and casts floating
    outputs to ``param_dtype``. Hooks, not a replaced ``forward``: they travel with the module
    (a ``deepcopy``, an EMA copy, computes with its own weights) and keep its class and state."""

    def __init__(self, device: torch.device, policy: pp.PrecisionPolicy, autocast: bool):
        self.device_type, self.autocast = device.type, autocast
        self.compute, self.param = _dtype(policy.compute_dtype), _dtype(policy.param_dtype)
        self.active: list[Any] = []  # entered autocast contexts (a module may be called re-entrantly)

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.autocast:
            context = torch.autocast(self.device_type, dtype=self.compute)
            context.__enter__()
            self.active.append(context)
            return None
        return cast_floating(args, self.compute), cast_floating(kwargs, self.compute)

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if self.autocast and self.active:
            self.active.pop().__exit__(None, None, None)
        return cast_floating(output, self.param)


def _install(module: nn.Module, device: torch.device, policy: pp.PrecisionPolicy, autocast: bool) -> None:
    compute = _Compute(device, policy, autocast)
    module.register_forward_pre_hook(compute.before, with_kwargs=True)
    module.register_forward_hook(compute.after, with_kwargs=True, always_call=True)


def prepare(model: nn.Module, policy: pp.PrecisionPolicy | None, device: torch.device, stage: int,
            data_size: int) -> nn.Module:
    """Cast ``model`` (on ``device``, not yet wrapped) to ``param_dtype`` and install the compute
    dtype: autocast around forward for mixed precision at zero=0/1 (FSDP2 casts at zero=2/3,
    :func:`fsdp_policy`), input casts for true precision; make the gradient scaler for loss scaling."""
    if policy is None or policy.name == "32":
        return model
    param = _dtype(policy.param_dtype)
    if param != torch.float32:
        model = model.to(param)
    fsdp = stage >= 2 and data_size > 1
    if policy.mixed and not fsdp:
        _install(model, device, policy, autocast=True)
    elif not policy.mixed:
        _install(model, device, policy, autocast=False)
    return model


def attach_scaler(model: nn.Module, policy: pp.PrecisionPolicy | None, device: torch.device, fsdp: bool) -> None:
    """Make the gradient scaler of a loss-scaling policy for the wrapped ``model``."""
    if policy is None or not policy.loss_scaling:
        return
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        _SCALERS[model] = ShardedGradScaler(device=device.type)
    else:
        _SCALERS[model] = torch.amp.GradScaler(device.type)


def grad_scaler(model: nn.Module) -> Any:
    """The gradient scaler ``wrap_model`` made for ``model`` under a loss-scaling precision
    (``fp16-mixed``), or ``None``: ``scaler.scale(loss).backward()``, then ``scaler.step(opt)``
    and ``scaler.update()`` (what ``polyparallel_torch.steps`` does)."""
    return _SCALERS.get(model)


def check_scaled(model: nn.Module) -> None:
    """``sync_grads`` under loss scaling: refuse gradients of a loss that was never scaled (the
    same on every rank: every rank runs the same loop), before any collective."""
    scaler = _SCALERS.get(model)
    if scaler is not None and getattr(scaler, "_scale", None) is None:
        raise pp.UnsupportedTopologyError(
            "sync_grads: the precision uses loss scaling (fp16-mixed), but this model's loss was never scaled: "
            "float16 gradients would underflow silently. Use polyparallel_torch.steps (step.backward scales the "
            "loss, step.optimize steps through the scaler), or scaler = polyparallel_torch.grad_scaler(model); "
            "scaler.scale(loss).backward(); scaler.step(opt); scaler.update().")


def fsdp_policy(policy: pp.PrecisionPolicy | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a mixed ``policy`` (``None`` otherwise: FSDP2 keeps
    the parameters' dtype, which ``prepare`` set)."""
    if policy is None or not policy.mixed:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_dtype(policy.compute_dtype), reduce_dtype=_dtype(policy.reduce_dtype),
                                output_dtype=_dtype(policy.param_dtype), cast_forward_inputs=True)


def ddp_comm_hook(policy: pp.PrecisionPolicy | None) -> Any:
    """The DDP comm hook that reduces gradients in a ``reduce_dtype`` narrower than the
    parameters', or ``None`` (DDP's own all-reduce, in the gradients' dtype).

    torch's ``bf16_compress_hook`` refuses any backend but NCCL/XCCL at registration, though gloo
    reduces bfloat16; this is the same hook (cast the bucket, pre-divide, all-reduce, cast back
    into the bucket) for every backend."""
    if policy is None or policy.reduce_dtype == policy.param_dtype:
        return None
    dtype = _dtype(policy.reduce_dtype)
    import torch.distributed as dist

    # No annotations: DDP refuses a hook whose ``bucket`` annotation is not dist.GradBucket (a string here).
    def hook(group, bucket):
        group = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done: Any) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    hook.__name__ = hook.__qualname__ = f"polyparallel_{name}_compress_hook"  # what DDP's logging records
    return hook


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (a DTensor's local
    shard only): the memory per rank that the precision and the sharding stage decide."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(model.parameters())
    out = {"params": sum(local(p).nbytes for p in params),
           "grads": sum(local(p.grad).nbytes for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(local(v).nbytes for v in state.values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out
