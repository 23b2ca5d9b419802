"""Making and releasing the torch.distributed process groups of a runtime (:mod:`.runtime` drives it).

- The device and backend: :func:`default_device`, :func:`resolved_backend`, and
  :func:`check_backend`, which refuses a backend this torch cannot run before any group exists.
- The default group: :func:`find_default_group` adopts one the process already has (torchrun-
  started user code, Lightning, ``idist.Parallel``) or says one must be made; :func:`make_default_group`
  makes it. A process-wide count of the runtimes using it decides when :func:`release_groups` may
  destroy it: only when polyparallel created it, the last runtime using it closes, and no runtime of
  this process broke (destroying the default group destroys every group, a broken one included).
- The mesh's sub-groups: :func:`subgroup_options` gives them the strategy's timeout (they default
  to 30 minutes, not the world's); :func:`release_groups` destroys the ones a runtime made, never
  ``dist.group.WORLD`` through a mesh dimension that aliases it.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

import polyparallel as pp

__all__ = ["check_backend", "default_device", "find_default_group", "make_default_group", "owns_default_group",
           "release_groups", "resolved_backend", "subgroup_options", "use_default_group"]

# The default process group, when polyparallel created it, and how many open runtimes use it.
_WORLD: dict[str, Any] = {"group": None, "users": 0, "broken": False}
# The rendezvous store of this process (see _rendezvous_store): its key, the store, groups made.
_STORE: dict[str, Any] = {}


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def resolved_backend(strategy: pp.Strategy, device: torch.device) -> str:
    """The strategy's backend, or the default for ``device`` (nccl on CUDA, else gloo)."""
    return strategy.backend or ("nccl" if device.type == "cuda" else "gloo")


def check_backend(backend: str) -> None:
    """Refuse a backend torch cannot run here, before any process group: it would otherwise fail
    inside c10d, late and obscurely (or, for nccl without a GPU, only at the first collective)."""
    available = [b for b in ("gloo", "nccl", "ucc", "mpi", "xccl") if dist.is_backend_available(b)]
    if backend not in available:
        raise pp.TopologyError(
            f"Strategy(backend={backend!r}): this torch build cannot run the {backend!r} process-group "
            f"backend; available here: {', '.join(available) or 'none'}. Use one of them, or backend=None "
            "(nccl on CUDA, else gloo)."
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise pp.TopologyError(
            "Strategy(backend='nccl') needs CUDA devices, and this process sees none; use backend='gloo' "
            "(or backend=None, which picks gloo on CPU)."
        )


def find_default_group(rank: int, world_size: int) -> bool:
    """Whether the process has a default group of ``world_size`` ranks already (``False``: one
    must be made, and the environment to make it is there)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise pp.TopologyError(
                f"torch.distributed is initialised with world size {dist.get_world_size()}, but this "
                f"process was launched as rank {rank} of {world_size}."
            )
        if _WORLD["group"] is not dist.group.WORLD:  # someone else's (or ours, re-made by them)
            _WORLD["group"] = None
        return True
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise pp.TopologyError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set: start the script "
            "with `polyparallel launch`, torchrun, or call polyparallel.launch()."
        )
    return False


def _rendezvous_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The store a new default group rendezvouses through: one TCP store per process and
    ``MASTER_ADDR:MASTER_PORT`` for the process's lifetime, and a fresh key prefix per group made.

    Letting ``init_process_group`` make a store each time races when a process makes a second
    default group after destroying its first one (a later runtime in the same processes): rank 0's
    old store server may still be serving when rank 1 connects, so rank 1 joins the old store and
    rank 0's new one waits for it until its timeout ("1/2 clients joined"). A store that stays
    up, with one prefix per generation (every rank makes the same sequence of groups, so the
    counts agree), has nothing to race. ``None`` under torchrun's agent store
    (``TORCHELASTIC_USE_AGENT_STORE``): that store outlives the workers already, and torch's own
    env rendezvous keeps its per-restart prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    key = (address, port, world_size, rank)
    if _STORE.get("key") != key:
        _STORE.update(key=key, generation=0, store=_new_store(address, port, rank, world_size, timeout))
    store = _STORE["store"]
    store.set_timeout(timeout)
    _STORE["generation"] += 1
    return dist.PrefixStore(f"polyparallel/default-group/{_STORE['generation']}", store)


def make_default_group(backend: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """``init_process_group`` through :func:`_rendezvous_store` (the default group is then
    polyparallel's to destroy)."""
    store = _rendezvous_store(rank, world_size, timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            **({"store": store} if store is not None else {}))
    _WORLD["group"] = dist.group.WORLD


def _new_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The rendezvous store of :func:`_rendezvous_store`: rank 0 serves it, the others connect.
    When ``MASTER_ADDR`` is a loopback address (one host: the ``polyparallel.launch`` workers, a
    single-node launch) rank 0 serves it on loopback only, where ``TCPStore`` would listen on
    every interface; on a port it cannot bind so, torch's own server."""
    from .channel_auth import is_loopback, loopback_store

    options: dict[str, Any] = {"world_size": world_size, "timeout": timeout,
                               "use_libuv": os.environ.get("USE_LIBUV", "1") == "1"}
    if rank == 0 and is_loopback(host):
        try:
            return loopback_store(port, host, wait_for_workers=False, **options)
        except OSError:  # the port is held by another store torch shares in this process: torch's own way
            pass
    return dist.TCPStore(host, port, is_master=rank == 0, wait_for_workers=False, **options)


def use_default_group() -> None:
    """Count one more open runtime using the default group."""
    _WORLD["users"] += 1


def owns_default_group() -> bool:
    """Whether polyparallel created the default process group in use now."""
    return _WORLD["group"] is not None and _WORLD["group"] is dist.group.WORLD


def release_groups(mesh: Any, axis_names: tuple[str, ...], broken: bool) -> None:
    """A runtime using the default group closed: destroy its mesh sub-groups, then the default
    group if polyparallel created it and no other runtime uses it. When this runtime or an
    earlier one broke, destroy nothing (a peer may still wait in a group, and gloo can abort the
    process when a group is torn down under a pending operation)."""
    _WORLD["users"] -= 1
    if broken or _WORLD["broken"]:
        _WORLD["broken"] = True
        return
    if mesh is not None and dist.is_initialized():
        world = dist.group.WORLD
        destroyed: set[int] = set()
        for axis in axis_names:
            group = mesh.get_group(axis)
            if group is None or group is world or id(group) in destroyed:
                continue
            destroyed.add(id(group))
            dist.destroy_process_group(group)
    if _WORLD["users"] == 0 and dist.is_initialized() and owns_default_group():
        dist.destroy_process_group()
        _WORLD["group"] = None


def subgroup_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Options that give ``init_device_mesh``'s sub-groups ``timeout`` (its ``backend_override=``),
    or ``None`` for a backend without them. DeviceMesh passes each sub-group the timeout of the
    options it is given (it reads their ``_timeout`` itself)."""
    if backend == "gloo":
        try:
            # Public: the backend-neutral Backend.Options(backend, timeout) constructor, which torch
            # exposes as ProcessGroupGloo.Options (inherited from Backend; torch's stub declares a
            # gloo subclass without arguments instead, hence the ignore). new_group takes no other
            # gloo option from it.
            return dist.ProcessGroupGloo.Options(backend="gloo", timeout=timeout)  # type: ignore[call-arg]
        except (AttributeError, TypeError):
            # A torch whose ProcessGroupGloo.Options is missing or takes no arguments (as its stub
            # says): the timeout then has no public setter, only the private attribute torch's own
            # new_group sets.
            options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            return options
    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        # ProcessGroupNCCL.Options() takes no timeout and has no public setter: _timeout is what
        # torch's own new_group sets and DeviceMesh reads. (A backend-neutral Backend.Options
        # would fail new_group's check that NCCL gets ProcessGroupNCCL.Options.)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return None
