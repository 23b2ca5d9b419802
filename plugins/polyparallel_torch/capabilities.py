"""What the torch runtime runs, as data the core checks before any process starts.

Framework-free (imports no torch), at the bottom of the plugin: the hook module (:mod:`.plugin`)
declares it, :func:`polyparallel_torch.model.validate` applies the sharding stage it allows, and
the adapters that run on this runtime (Lightning, Ignite) take its stages from it.
"""

from __future__ import annotations

import polyparallel as pp

__all__ = ["CAPABILITIES", "RUNTIME"]

RUNTIME = "torch"

CAPABILITIES = pp.Capabilities(
    RUNTIME, axes={"data", "tensor", "pipeline"}, excludes=({"tensor", "pipeline"},),
    features={"ddp", "fsdp2", "zero_redundancy_optimizer", "dcp_checkpoint", "tensor_parallel_plan",
              "pipeline_gpipe", "bucketing", "no_sync", "gloo", "nccl", "timeouts", "collective_trace"},
    # The automatic choice prefers torch when several runtimes are installed and imported (or none is).
    imports={"torch"}, backends={"gloo", "nccl"}, priority=10,
    # 1: ZeroRedundancyOptimizer (polyparallel_torch.make_optimizer); 2, 3: FSDP2 (sharding.py).
    # Adapters that shard on this runtime's groups themselves (DeepSpeed ZeRO) need the stage here too.
    stages={0, 1, 2, 3},
    # Strategy(accumulate=N): shard_data gives micro-batches, polyparallel_torch.steps reduces once
    # per step (DDP require_backward_grad_sync, FSDP2 set_requires_gradient_sync); accumulation.py.
    accumulation=True,
    # Strategy(precision=): autocast, bf16-true casts, FSDP2 MixedPrecisionPolicy, DDP compress hooks,
    # GradScaler/ShardedGradScaler (precision.py, which also refuses the combinations it cannot map).
    precisions={"32", "bf16-mixed", "bf16-true", "fp16-mixed", "custom"},
    stages_with={
        "tensor": ({0, 2, 3}, "its stage 1 is torch's ZeroRedundancyOptimizer, which updates and broadcasts whole "
                              "parameters, not tensor-parallel shards (zero=2 and zero=3 shard them with FSDP2 over "
                              "data on the 2-D mesh)"),
        # With data == 1 there is nothing to shard, but zero=1 would still build a ZeroRedundancyOptimizer
        # over DTensor stage parameters; one rule for every data size keeps the message simple.
        "pipeline": ({0, 2, 3}, "each pipeline stage is replicated over data by FSDP2 (its parameters are DTensors), "
                                "and stage 1 is torch's ZeroRedundancyOptimizer, which cannot broadcast DTensors "
                                "(zero=2 also shards gradients, one reduce-scatter per step)"),
    },
)
