"""Hook implementations of the Lightning plugin (the ``polyparallel`` entry point ``lightning``).

Importing this module is cheap: neither Lightning nor torch is imported until
``strategy.adapt("lightning")`` or the demo runs.

- ``polyparallel_register_adapters``: the adapter ``lightning``, which returns a Lightning
  strategy (see :mod:`polyparallel_lightning.strategy`) for ``Trainer(strategy=...)``.
- ``polyparallel_register_demos``: the ``lightning`` row of ``polyparallel demo``.

The five operations are not implemented here: the Lightning strategy routes them through the
polyparallel Strategy to the torch runtime plugin, which owns torch objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polyparallel as pp
from polyparallel import hookimpl
from polyparallel_torch.capabilities import CAPABILITIES as TORCH_CAPABILITIES  # imports no torch

from .precision import REFUSED as LIGHTNING_REFUSED  # imports no torch nor Lightning
from .precision import RUNS as LIGHTNING_PRECISIONS

__all__ = ["CAPABILITIES", "adapt"]


#: Data and tensor parallelism (and both at once); no pipeline stages: Lightning's training loop
#: runs one forward/backward per step on every rank, which a pipeline schedule would replace.
#: Sharding stages and their limits: the torch runtime's (stage 0 over Lightning's DDPStrategy,
#: 1-3 over its ModelParallelStrategy, the sharding itself done by the runtime's ``wrap_model``).
CAPABILITIES = pp.Capabilities(
    "lightning", axes={"data", "tensor"}, runtimes={"torch"},  # Lightning trains torch modules
    features={"lightning.pytorch", "pytorch_lightning", "ddp", "tensor_parallel_plan", "lightning_launcher",
              "external_launcher", "sync_dist_over_data", "consolidated_checkpoints", "fsdp2",
              "distributed_checkpoints"},
    stages=TORCH_CAPABILITIES.stages, stages_with=TORCH_CAPABILITIES.stages_with,
    # Strategy(precision=) as Lightning's precision plugin (polyparallel_lightning.precision).
    precisions=LIGHTNING_PRECISIONS, precision_reasons=LIGHTNING_REFUSED,
    # Strategy(accumulate=N) as Trainer(accumulate_grad_batches=N) over the runtime's micro-batches.
    accumulation=True,
)


def adapt(strategy: pp.Strategy, namespace: str | None = None, **kwargs: Any) -> Any:
    """``strategy.adapt("lightning", namespace=None, plan=None, **kwargs)``: a Lightning strategy for
    ``Trainer(strategy=...)`` of the namespace the user's Trainer comes from.

    :param namespace: ``"lightning.pytorch"`` (``import lightning``) or ``"pytorch_lightning"``; by
        default the one already imported (see :mod:`polyparallel_lightning.namespaces`).
    :param kwargs: ``plan=`` (tensor-parallel plan) and the Lightning base class's arguments:
        ``DDPStrategy``'s at stage 0, ``save_distributed_checkpoint=True`` at stages 1-3
        (checkpoints are always polyparallel DCP directories).
    :raises ImportError: Lightning is not installed; the message names ``polyparallel[lightning]``.
    """
    from .namespaces import resolve_namespace

    ns = resolve_namespace(namespace)  # before importing torch or Lightning: a missing one fails fast
    from .factory import make_strategy

    return make_strategy(strategy, ns, **kwargs)


@hookimpl
def polyparallel_register_adapters(register: Callable[..., None]) -> None:
    register("lightning", adapt, capabilities=CAPABILITIES,
             description="a Lightning strategy: Trainer(strategy=strategy.adapt('lightning'))")


@hookimpl
def polyparallel_register_demos(register: Callable[..., None]) -> None:
    from .demo import run_demo

    register("lightning", run_demo)
