"""polyparallel's torch_xla runtime: the five operations on XLA devices (extra ``xla``).

``Strategy(data=N, runtime="xla")`` with ``polyparallel.launch(fn, strategy, nprocs=N)`` runs
``fn`` once per XLA device through ``torch_xla.launch``; inside it ``shard_data`` gives an
``MpDeviceLoader`` over the replica's data shard, ``wrap_model`` moves the module to the device,
``sync_grads``/``reduce_metrics``/``sync_states`` run XLA all-reduces over the data group, each
checked on the host first and bounded by the strategy's timeout (:mod:`.runtime`).
"""

from __future__ import annotations

__all__: list[str] = []
