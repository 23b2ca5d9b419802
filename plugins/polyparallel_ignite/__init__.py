"""PyTorch-Ignite plugin for polyparallel (``pip install 'polyparallel[ignite]'``).

Registered through the ``polyparallel`` entry point ``ignite = "polyparallel_ignite.plugin"``.
Use it through a strategy::

    ignite = pp.Strategy(data=-1, tensor=2).adapt("ignite")
    loader = ignite.auto_dataloader(train_set, batch_size=64)      # the global batch size
    model = ignite.auto_model(model, plan=plan)                     # DDP / DTensor / pipeline
    optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1), model)
    trainer = ignite.create_supervised_trainer(model, optimizer, loss_fn, data=loader)
    evaluator = ignite.create_supervised_evaluator(model, {"acc": Accuracy()})
    ignite.checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, "ckpts", every=500)
    ignite.load_checkpoint(path, {"model": model, "optimizer": optimizer, "trainer": trainer}, loader=loader)

``import polyparallel_ignite`` imports neither torch nor ignite.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IgniteAdapter", "PipelineModel", "split_sequential", "data_group_world", "full_output"]


def __getattr__(name: str) -> Any:
    if name in ("IgniteAdapter", "full_output"):
        from . import adapter
        return getattr(adapter, name)
    if name in ("PipelineModel", "split_sequential"):  # the torch runtime's, re-exported
        from polyparallel_torch import pipeline
        return getattr(pipeline, name)
    if name == "data_group_world":
        from .metrics import data_group_world
        return data_group_world
    raise AttributeError(f"module 'polyparallel_ignite' has no attribute {name!r}")
