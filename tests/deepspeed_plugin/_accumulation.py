"""A stand-in until the torch runtime declares ``accumulation=True`` (see :func:`runtime_accumulates`)."""

import dataclasses


def runtime_accumulates(strategy):
    """The torch runtime's capabilities with ``accumulation=True`` in this process, where the
    installed torch runtime does not declare it yet (it does on branch prec-torch; then this is a
    no-op and can go): a session checks accumulation against its runtime, whose shard_data cuts
    the micro-batches, while DeepSpeed's engine accumulates by itself and these loops cut their own."""
    pm = strategy.plugin_manager
    runtimes = pm.runtimes()
    if not runtimes["torch"].accumulation:
        pm._runtimes = {**runtimes, "torch": dataclasses.replace(runtimes["torch"], accumulation=True)}
