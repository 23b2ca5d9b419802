"""The ``lightning`` adapter's factory: which Lightning strategy class a Strategy gets.

Stage 0 is :mod:`.ddp`'s class (over Lightning's ``DDPStrategy``), stages 1-3 :mod:`.sharded`'s
(over ``ModelParallelStrategy``). Both are built on :class:`~.strategy.StrategyMixin`; this module
sits above all three, so the mixin's module imports neither of them.
"""

from __future__ import annotations

from typing import Any

import polyparallel as pp

from .ddp import ddp_strategy_class
from .namespaces import Namespace
from .sharded import sharded_strategy_class

__all__ = ["make_strategy", "strategy_class"]


def strategy_class(namespace: str, stage: int = 0) -> type:
    """The Lightning strategy class of the adapter for a Lightning ``namespace`` (``"lightning.pytorch"``
    or ``"pytorch_lightning"``) and a sharding ``stage``: :mod:`.ddp`'s for stage 0, :mod:`.sharded`'s
    for stages 1-3 (built on first use and cached)."""
    return ddp_strategy_class(namespace) if stage == 0 else sharded_strategy_class(namespace)


def make_strategy(strategy: pp.Strategy, namespace: Namespace, plan: Any = None, **kwargs: Any) -> Any:
    """The ``lightning`` adapter: ``strategy.adapt("lightning", namespace=None, plan=None, **kwargs)``.

    :param namespace: which Lightning's Trainer will receive it, already resolved by
        :func:`~polyparallel_lightning.namespaces.resolve_namespace` (see it for the automatic rule).
    :param plan: the tensor-parallel plan (see :class:`StrategyMixin`).
    :param kwargs: passed to the Lightning base class: ``DDPStrategy`` at stage 0 (``start_method=``,
        ``find_unused_parameters=``...); at stages 1-3 only ``save_distributed_checkpoint=True``.
    """
    cls = strategy_class(namespace.pytorch, strategy.shard_policy.stage)
    return cls(strategy, namespace=namespace.pytorch, plan=plan, **kwargs)
