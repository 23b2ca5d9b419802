"""``wrap_model`` for torch: tensor parallel (DTensor plans), then DDP or FSDP2 over the data group.

- ``tensor > 1``: ``torch.distributed.tensor.parallel.parallelize_module`` over the tensor
  sub-mesh, with the user's ``plan=`` or, for an ``nn.Sequential`` of ``nn.Linear`` layers, the
  Megatron default (:func:`default_plan`): consecutive Linear layers alternate column- then
  row-parallel, so activations between a pair stay sharded and one all-reduce closes each pair.
- ``pipeline > 1``: an ``nn.Sequential`` cut into stages on ``torch.distributed.pipelining``
  (:mod:`polyparallel_torch.pipeline`); with ``data > 1`` each stage module is an FSDP2 module
  over the data group: sharded at zero=2/3, replicated at zero=0 (HSDP with a shard dimension of
  one rank); zero=1 is refused before launch (pipeline.py says why, and why not DDP).
- ``data > 1`` alone: ``DistributedDataParallel`` over the data group only (DDP's reducer buckets
  and overlaps the all-reduce with backward; ``sync_grads`` is then a no-op), its bucket
  all-reduces recorded once per backward, and identity-checked with
  ``GradPolicy(check_backward=True)`` (:mod:`.ddp_trace`; DDP over a
  second group of the data ranks, :meth:`~.runtime.TorchRuntime.ddp_group`, or over the data
  group itself with the recording off, ``POLYPARALLEL_TRACE_DDP=0``).
  Never DataParallel.
- ``Strategy(zero=2|3)`` with ``data > 1``: FSDP2 ``fully_shard`` over the data dimension of the
  mesh, after the tensor plan (:mod:`polyparallel_torch.sharding`); ``sync_grads`` is a no-op.
- ``data > 1`` with ``tensor > 1`` at zero=0: the tensor-parallel module is returned as is, its parameters
  broadcast over the data group, and ``strategy.sync_grads(model)`` reduces the local gradient
  shards over the data group in flat buckets. Why not DDP here: torch's DDP+TP bridge
  (``_pre_dp_module_transform``) swaps DTensor parameters for plain attributes after the first
  forward, so ``model.parameters()`` and ``state_dict()`` silently lose the sharded weights
  (seen with torch 2.13) — checkpoints and optimizers built later would miss them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import polyparallel as pp

from .capabilities import CAPABILITIES
from .runtime import TorchRuntime
from .tensors import broadcast_over_data, is_ddp, shapes_digest

__all__ = ["default_plan", "validate", "wrap_module", "wrap_ddp"]


def default_plan(model: nn.Module) -> dict[str, Any]:
    """Megatron column/row pairs for an ``nn.Sequential`` whose Linear layers come in pairs.

    Layers in between (activations, dropout) are element-wise and work on the sharded
    activations. An odd Linear out stays replicated (its output is the model's, e.g. logits).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"wrap_model(tensor>1) has a default plan only for nn.Sequential MLPs; {type(model).__name__} "
            "needs plan={'submodule.path': ColwiseParallel() | RowwiseParallel(), ...}."
        )
    linear = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    for name, m in model.named_children():
        if not isinstance(m, (nn.Linear, nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity)):
            raise TypeError(
                f"the default tensor-parallel plan only shards Linear layers separated by element-wise "
                f"activations; layer {name!r} is a {type(m).__name__}, which would see a sharded activation. "
                "Pass plan= for this model."
            )
    if len(linear) < 2:
        raise TypeError("the default tensor-parallel plan needs at least two nn.Linear layers (a column/row pair).")
    plan: dict[str, Any] = {}
    for first, second in zip(linear[0::2], linear[1::2]):
        plan[first], plan[second] = ColwiseParallel(), RowwiseParallel()
    return plan


def _check_plan(model: nn.Module, plan: dict[str, Any], tensor_size: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    names = dict(model.named_modules())
    for path, style in plan.items():
        if path not in names and not any(ch in path for ch in "*?["):
            known = ", ".join(n for n in names if n) or "(no submodules)"
            raise pp.TopologyError(
                f"tensor-parallel plan names submodule {path!r}, which {type(model).__name__} does not have. "
                f"Submodules: {known}."
            )
        module = names.get(path)
        if isinstance(module, nn.Linear):
            dim = module.out_features if isinstance(style, ColwiseParallel) else module.in_features
            if dim % tensor_size:
                raise pp.TopologyError(
                    f"{path!r} ({module}) cannot be split {type(style).__name__}-wise over tensor={tensor_size}: "
                    f"{dim} features is not a multiple of {tensor_size}."
                )


def validate(model: nn.Module, topology: pp.Topology, options: dict[str, Any], stage: int = 0,
             accumulate: int = 1, precision: pp.PrecisionPolicy | None = None) -> dict[str, Any]:
    """Check the options and the plan against the model *before* any process group exists;
    return the options with the tensor plan resolved (the default plan when none is given)."""
    from .sharding import is_fsdp, validate_sharding

    unknown = set(options) - {"plan", "ddp_kwargs", "fsdp_kwargs", "shard_modules", "loss_fn", "microbatches",
                              "split_points", "stages", "precision"}
    if unknown:
        raise TypeError(f"wrap_model() got unknown options {sorted(unknown)}; torch accepts plan=, ddp_kwargs=, "
                        "at zero=2/3 fsdp_kwargs= and shard_modules=, and for pipeline>1 loss_fn=, microbatches=, "
                        "split_points= or stages=.")
    if is_ddp(model) or is_fsdp(model):
        raise TypeError(f"wrap_model() got a model that is already {type(model).__name__} (DDP or fully_shard); "
                        "pass the bare module.")
    # The stage this runtime shards at (the session checked only the axes: an adapter such as
    # DeepSpeed may shard by itself on these groups); refused here before any collective.
    if "precision" in options:  # an adapter whose framework applies the precision itself passes None
        precision = options["precision"]
        if not (precision is None or isinstance(precision, pp.PrecisionPolicy)):
            raise TypeError(f"wrap_model(precision=) takes a PrecisionPolicy or None (the Strategy's precision is the "
                            f"default). Received: {precision!r}.")
    CAPABILITIES.check(topology, stage, precision)
    from .precision import check as check_precision

    check_precision(precision, topology, stage, "wrap_model()")
    validate_sharding(model, topology, stage, options)
    if precision is not None and "mp_policy" in (options.get("fsdp_kwargs") or {}):
        raise TypeError(f"fsdp_kwargs= may not set mp_policy under Strategy(precision={precision!r}): the Strategy's "
                        "precision decides FSDP2's MixedPrecisionPolicy (set precision=None to pass your own).")
    if topology.size("pipeline") > 1:
        from .pipeline import validate_pipeline

        if accumulate > 1:
            raise pp.UnsupportedTopologyError(
                f"the torch runtime does not accumulate gradients over pipeline stages (Strategy(accumulate="
                f"{accumulate}) with pipeline={topology.size('pipeline')}): its schedule already splits each batch "
                "into micro-batches and reduces once per step. Use wrap_model(microbatches=) for the pipeline's "
                "micro-batches and accumulate=1.")

        validate_pipeline(model, topology, options)
        return {**options, "precision": precision}
    options = {**options, "precision": precision}
    if topology.size("tensor") > 1:
        options["plan"] = options.get("plan") or default_plan(model)
        _check_plan(model, options["plan"], topology.size("tensor"))
    return options


def wrap_module(model: nn.Module, rt: TorchRuntime, options: dict[str, Any], strategy: pp.Strategy) -> nn.Module:
    """Apply the topology to ``model`` (options already :func:`validate`-d): the precision
    (``options["precision"]``, the Strategy's unless the caller gave one; :mod:`.precision`),
    tensor plan, then data parallelism over the data group (bucket sizes from ``strategy.grad_policy``)."""
    rt.ensure_usable("wrap_model", "data")
    topology = rt.topology
    stage = strategy.shard_policy.stage
    precision = options.get("precision", strategy.precision)
    bucket_bytes = strategy.grad_policy.bucket_bytes()
    if topology.size("pipeline") > 1:
        from .pipeline import wrap_pipeline

        return wrap_pipeline(model, rt, options, strategy)
    from .precision import attach_scaler, prepare

    model = prepare(model.to(rt.device), precision, rt.device, stage, topology.size("data"))
    if topology.size("tensor") > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        model = parallelize_module(model, rt.submesh("tensor"), options["plan"])
    # A plan with tensor=1 is legal (the same script runs on any topology): nothing to shard.
    if topology.size("data") > 1 and stage >= 2:
        from .sharding import shard_module

        model = shard_module(model, rt, stage, options, precision=precision)
    elif topology.size("data") > 1 and topology.size("tensor") > 1:
        broadcast_over_data(model, rt, bucket_bytes)
    elif topology.size("data") > 1:
        model = wrap_ddp(model, rt, options, strategy)
    attach_scaler(model, precision, rt.device, fsdp=topology.size("data") > 1 and stage >= 2)
    return model


def wrap_ddp(model: nn.Module, rt: TorchRuntime, options: dict[str, Any], strategy: pp.Strategy) -> nn.Module:
    """``model`` (on the device) in DistributedDataParallel over the data ranks: the runtime's
    :meth:`~.runtime.TorchRuntime.ddp_group`, a second group of them, when each backward is
    recorded (:mod:`.ddp_trace`); the data group itself with the recording off
    (``POLYPARALLEL_TRACE_DDP=0``: plain DDP, as torch's and Lightning's own)."""
    kwargs = dict(options.get("ddp_kwargs") or {})
    if rt.device.type == "cuda":
        kwargs.setdefault("device_ids", [rt.device.index])
    if strategy.grad_policy.bucket_mb is not None:
        # Only when asked: passing DDP's own default explicitly drops its small first bucket,
        # and with it the overlap of the first all-reduce with backward (10-20% slower here).
        kwargs.setdefault("bucket_cap_mb", strategy.grad_policy.bucket_mb)
    # process_group=, not device_mesh=: given a sliced mesh, DDP installs its DTensor bridge
    # (forward hooks walking every parameter, ~10% of a small step here) even without DTensors.
    from .ddp_trace import enabled, install
    from .precision import ddp_comm_hook

    # Recorded: over a second group of the data ranks, so that a rank's operation out of step with
    # its peer's backward waits into the hang report naming it instead of pairing with a bucket,
    # and, checked (GradPolicy(check_backward=True)), so that the backward's identity check (over
    # the data group) is answered after the backward, not before its first bucket (.ddp_trace).
    # Recording off: plain DDP, on the data group, as Lightning's and torch's own DDP.
    group = rt.ddp_group() if enabled() else rt.group("data")
    operation = "wrap_model (DDP parameter broadcast)"
    with rt.operation(operation, "data", shapes_digest(model)), rt.collective(operation, "data"):
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)

    # The bucket all-reduces recorded (and with check_backward identity-checked: .ddp_trace), then
    # reduced by DDP's default hook or, with reduce_dtype narrower than the gradients, the compress
    # hook (cast, all-reduce, cast back).
    install(ddp, rt, strategy.grad_policy.check_backward, ddp_comm_hook(options.get("precision", strategy.precision)))
    return ddp
