"""fastai plugin for polyparallel (``pip install 'polyparallel[fastai]'``).

Registered through the ``polyparallel`` entry point ``fastai = "polyparallel_fastai.plugin"``.
``strategy.adapt("fastai")`` is a fastai ``Callback`` that runs a ``Learner`` over the data axis
(on the torch runtime's gloo/nccl processes, or any runtime the adapter declares), without
``accelerate`` and without CUDA::

    def train(strategy):                      # runs in every process: pp.launch(train, strategy, nprocs=2, ...)
        dls = DataLoaders.from_dsets(train_ds, valid_ds, bs=64)
        learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=[accuracy, RocAuc()],
                        cbs=strategy.adapt("fastai"))
        learn.fit(3)                          # what it prints is the global value over the data group
        return learn.recorder.values

``strategy.shard_data`` also takes a fastai ``DataLoader`` (:mod:`polyparallel_fastai.data`).
``import polyparallel_fastai`` imports neither torch nor fastai.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ParallelCallback", "LocalSmoothLoss"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'polyparallel_fastai' has no attribute {name!r}")
