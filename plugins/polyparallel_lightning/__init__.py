"""PyTorch Lightning plugin for polyparallel: ``Trainer(strategy=strategy.adapt("lightning"))``.

Modules, by role:

- :mod:`.plugin`: the hook implementations (entry point ``lightning``); cheap to import.
- :mod:`.namespaces`: ``lightning.pytorch`` vs ``pytorch_lightning``, and how the adapter picks one.
- :mod:`.strategy`: what the adapter's Lightning strategies share, and the factory.
- :mod:`.ddp`: stage 0, over Lightning's ``DDPStrategy``; :mod:`.sharded`: stages 1-3 (FSDP2),
  over Lightning's ``ModelParallelStrategy`` (one class per namespace each).
- :mod:`.environment`: the cluster environment (Lightning's launcher, or an external one).
- :mod:`.checkpoint`: consolidated checkpoints of tensor-parallel models (stage 0).
- :mod:`.predict`: ``trainer.predict`` returns every rank's rows, once each, in order.
- :mod:`.surface`: the declared surface (every callback, Trainer/Tuner method: works or refused).
- :mod:`.testing`: ``LightningDriver`` for the conformance kit.
- :mod:`.demo`: the ``lightning`` row of ``polyparallel demo``.

Importing this package imports neither torch nor Lightning.
"""

from __future__ import annotations

__all__: list[str] = []
