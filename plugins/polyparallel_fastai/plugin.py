"""Hook implementations of the fastai plugin (entry point ``fastai``).

Importing this module is cheap: fastai and torch are imported inside the hooks, and only once
the object handed to an operation could be fastai's (if fastai was never imported, it cannot be).
"""

from __future__ import annotations

from typing import Any

import polyparallel as pp
from polyparallel import hookimpl

__all__: list[str] = []

#: The data axis only (no tensor parallel: fastai models are arbitrary modules, and the
#: callback's gradient, metric and checkpoint paths are written for whole replicas), on the
#: runtimes the callback's five operations were written for.
CAPABILITIES = pp.Capabilities(
    "fastai", axes={"data"}, runtimes={"torch", "xla"},
    features={"ddp", "metrics_over_data_group", "accum_metrics", "timeouts", "no_accelerate", "cpu"},
    # Strategy(precision=) as fastai's MixedPrecision on the model's device (polyparallel_fastai.precision).
    precisions={"32", "bf16-mixed", "fp16-mixed"},
    precision_reasons={
        "bf16-true": "fastai has no bfloat16 'true' precision (its ModelToHalf is float16 and casts inputs by hand); "
                     "use 'bf16-mixed' (learn.to_bf16())",
        "custom": "fastai's MixedPrecision runs bfloat16 or float16 autocast over float32 parameters only"},
    # Strategy(accumulate=N): fastai's GradientAccumulation over shard_data's micro-batches.
    accumulation=True,
)


def _make_adapter(strategy: pp.Strategy, **kwargs: Any) -> Any:
    if kwargs:
        raise TypeError(f"strategy.adapt('fastai') takes no options; received {sorted(kwargs)}. Set batch size, "
                        "shuffling and the remainder on the Strategy (batch_size=, data_policy=).")
    from .callback import ParallelCallback

    return ParallelCallback(strategy)


@hookimpl
def polyparallel_register_adapters(register: Any) -> None:
    register("fastai", _make_adapter, capabilities=CAPABILITIES,
             description="fastai: a Learner callback (sharded DataLoaders, wrapped model, metrics and recorder "
                         "losses global over the data group, learn.save once); no accelerate, no CUDA")


@hookimpl
def polyparallel_shard_data(strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
    # A data type this plugin owns, whatever the runtime: the shard is computed with
    # polyparallel.shard_indices alone, and batches move to the model's device in the Learner.
    from .data import is_fastai_loader

    if not is_fastai_loader(data):
        return None
    from .data import shard_fastai_loader

    return shard_fastai_loader(data, session, policy, strategy)


@hookimpl
def polyparallel_register_demos(register: Any) -> None:
    from .demo import run_demo

    register("fastai", run_demo)
