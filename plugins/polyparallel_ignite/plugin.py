"""Hook implementations of the Ignite plugin (entry point ``ignite``).

Importing this module is cheap: ignite and torch are imported inside the factories.
"""

from __future__ import annotations

from typing import Any

import polyparallel as pp
from polyparallel import hookimpl
from polyparallel_torch.capabilities import CAPABILITIES as TORCH_CAPABILITIES  # imports no torch

__all__: list[str] = []

#: Data, tensor (DTensor plans) and pipeline (``torch.distributed.pipelining``) — each with data;
#: pipeline together with tensor is declared unsupported, so it is refused before launch. The
#: sharding stages are the torch runtime's: ``auto_model`` is ``strategy.wrap_model`` and
#: ``auto_optim`` builds the runtime's stage-1 optimizer, so whatever stage the runtime runs, the
#: adapter runs (the runtime's own refusals, e.g. of a stage with some axis, apply as well).
CAPABILITIES = pp.Capabilities(
    "ignite", axes={"data", "tensor", "pipeline"}, excludes=({"tensor", "pipeline"},), runtimes={"torch"},
    features={"ddp", "tensor_parallel_plan", "gpipe", "metrics_over_data_group", "timeouts", "idist_parallel"},
    stages=TORCH_CAPABILITIES.stages, stages_with=TORCH_CAPABILITIES.stages_with,
    # Strategy(precision=) in the adapter's supervised step (polyparallel_ignite.precision).
    precisions={"32", "bf16-mixed", "bf16-true", "fp16-mixed"},
    precision_reasons={"custom": "the Ignite adapter maps the presets; another combination (a reduce dtype other "
                                 "than the parameters', say) needs the torch runtime's gradient communication"},
    # Strategy(accumulate=N): gradient_accumulation_steps=N over auto_dataloader's micro-batches.
    accumulation=True,
)


def _make_adapter(strategy: pp.Strategy, **kwargs: Any) -> Any:
    from .adapter import IgniteAdapter

    return IgniteAdapter(strategy, **kwargs)


@hookimpl
def polyparallel_register_adapters(register: Any) -> None:
    register("ignite", _make_adapter, capabilities=CAPABILITIES,
             description="PyTorch-Ignite: auto_dataloader/auto_model/auto_optim and engines whose metrics "
                         "reduce over the data group")


@hookimpl
def polyparallel_register_demos(register: Any) -> None:
    from .demo import run_demo

    register("ignite", run_demo)
