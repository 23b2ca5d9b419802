"""What several XLA CPU devices in one process need (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``):
applied by :func:`polyparallel.launch` itself when it starts replicas on PJRT CPU
(:mod:`polyparallel_xla.launch`: :func:`launch_env` for the replicas' process,
:func:`install_ordered_sync` in each replica), so that trying XLA on CPU before a TPU does not
end with XLA aborting the process. On TPU (a process per device) none of this applies.

**Why.** On PJRT CPU (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``) the N replicas are
threads of one process, and multi-device collectives deadlock upstream (pytorch/xla issue 9089):
replica threads that reach ``torch_xla.sync()`` together each compile the same graph and get
different collective keys (``op_id``), so XLA's rendezvous never completes and XLA aborts the
process after its termination timeout (10 s, also when a peer is merely slow); buffer donation and token release block as well, and
the execution thread pool defaults to the core count. Replicas must also build identical graphs:
torch_xla folds the scalars 0 and 1 into a graph as constants, so a rank-dependent ``fill_(rank)``
would give each replica its own graph. On TPU each replica is its own process and
none of this applies. :func:`install_ordered_sync` waits for every replica thread at each sync, then lets one at a time compile and
launch its graph (the next one then finds it in the compilation cache, with the same keys), and
:data:`CPU_ENV` turns off parameter aliasing, widens the thread pool and keeps 0 and 1 as data. With both, all-reduce,
``xm.optimizer_step`` and ``MpDeviceLoader`` work at 2 and 4 CPU devices.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["CPU_ENV", "cpu_env", "install_ordered_sync", "launch_env", "on_pjrt_cpu"]

#: Environment for N XLA CPU devices served by threads (besides ``CPU_NUM_DEVICES``).
CPU_ENV = {"PJRT_DEVICE": "CPU", "XLA_ENABLE_PARAM_ALIASING": "false", "XLA_THREAD_POOL_SIZE": "16",
           "XLA_NO_SPECIAL_SCALARS": "1"}

_lock = threading.Lock()
_installed: dict[str, Any] = {}


def cpu_env(devices: int) -> dict[str, str]:
    """:data:`CPU_ENV` with ``CPU_NUM_DEVICES=devices``."""
    return {**CPU_ENV, "CPU_NUM_DEVICES": str(devices)}


def install_ordered_sync() -> None:
    """Replace ``torch_xla.sync`` (which ``xm.mark_step`` and ``MpDeviceLoader`` call too) in *this
    process* by one that lets a single replica thread compile and launch at a time, and
    ``xm.all_reduce`` by one that syncs first. Idempotent.
    ``xm.all_reduce`` (which ``xm.optimizer_step`` calls) executes the replica's pending work
    first, in such an ordered sync, so that the collective's graph is the same in every replica.
    Only for PJRT CPU devices (pytorch/xla issue 9089): ``polyparallel.launch`` calls it in every
    replica there; code that starts its own replicas calls it in each."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    with _lock:
        if "sync" in _installed:
            return
        original = torch_xla.sync
        turn = threading.Lock()
        # Every replica thread reaches each sync (the loops are alike); waiting for all of them
        # first keeps one replica's collective from waiting in XLA's rendezvous, whose 10 s
        # termination timeout aborts the process, while another is still busy on a loaded machine.
        arrive = threading.Barrier(int(os.environ.get("CPU_NUM_DEVICES", "1")), timeout=120)

        def ordered_sync(wait: bool = False, reset_scope: bool = True) -> None:
            arrive.wait()
            with turn:
                original(wait, reset_scope)

        original_all_reduce = xm.all_reduce

        def all_reduce_alone(*args: Any, **kwargs: Any) -> Any:
            # A graph holding a collective must be the same in every replica (one compilation,
            # the same keys), but a replica's pending work may differ: fastai keeps the last
            # batch's predictions alive, and an uneven shard's last batch has another shape. That
            # work is executed first, so the collective's graph holds the collective alone.
            ordered_sync()
            return original_all_reduce(*args, **kwargs)

        _installed["sync"] = original
        _installed["all_reduce"] = original_all_reduce
        torch_xla.sync = ordered_sync
        xm.all_reduce = all_reduce_alone


def on_pjrt_cpu(env: Mapping[str, str] | None = None) -> bool:
    """Whether the replicas run on PJRT CPU devices (``PJRT_DEVICE=CPU``)."""
    return (os.environ if env is None else env).get("PJRT_DEVICE", "").upper() == "CPU"


def launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`CPU_ENV`'s settings added where it sets none (a value the user set is kept)."""
    return {**CPU_ENV, **env}

