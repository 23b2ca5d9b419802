"""Per-process torch.distributed runtime: the default group, a DeviceMesh, bounded collectives.

One :class:`TorchRuntime` lives in each :class:`polyparallel.Session` (``session.stash``). It is
created on the first operation, not at import: ``init_process_group`` with the strategy's
timeout, then ``init_device_mesh`` with the topology's axis names, so the group of every axis is
the one DeviceMesh builds. World size 1 makes no process group at all: every collective is the
identity, and callers have no special cases.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import polyparallel as pp

__all__ = ["TorchRuntime", "get_runtime", "default_device"]

_STASH_KEY = "polyparallel_torch.runtime"


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


class TorchRuntime:
    """The torch.distributed state of one strategy in one process.

    :ivar mesh: the ``DeviceMesh`` (``None`` at world size 1), dims named like the topology axes.
    :ivar device: the device tensors of this rank live on.
    """

    def __init__(self, session: pp.Session):
        self.session = session
        self.strategy = session.strategy
        self.topology = session.topology
        self.rank = session.rank
        self.world_size = session.world_size
        self.device = default_device()
        self.timeout = datetime.timedelta(seconds=self.strategy.timeout)
        self.mesh: Any = None
        self.owns_default_group = False
        self.backend = self.strategy.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.world_size > 1:
            self._init_groups()

    # -- setup / teardown ---------------------------------------------------------------------------
    def _init_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise pp.TopologyError(
                    f"torch.distributed is initialised with world size {dist.get_world_size()}, but this "
                    f"process was launched as rank {self.rank} of {self.world_size}."
                )
        else:
            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise pp.TopologyError(
                    f"WORLD_SIZE={self.world_size} but MASTER_ADDR/MASTER_PORT are not set: start the script "
                    "with `polyparallel launch`, torchrun, or call polyparallel.launch()."
                )
            with self.collective("init_process_group", "world"):
                dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                        timeout=self.timeout)
            self.owns_default_group = True
        # Sub-groups made by new_group() default to a 30-minute timeout, not the world's: pass ours.
        options = _backend_options(self.backend, self.timeout)
        override = {axis: (self.backend, options) for axis in self.topology.axis_names} if options is not None else None
        self.mesh = init_device_mesh(
            self.device.type, self.topology.shape, mesh_dim_names=self.topology.axis_names,
            **({"backend_override": override} if override else {}),
        )

    def close(self) -> None:
        """Destroy the groups this runtime made (the default group only if it made it)."""
        self.mesh = None
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_default_group = False

    # -- groups ---------------------------------------------------------------------------------------
    def group(self, axis: str) -> Any:
        """The process group of this rank along ``axis`` (``None`` when the axis has size 1 or
        the world is one process)."""
        if self.mesh is None or self.topology.size(axis) == 1:
            return None
        return self.mesh.get_group(axis)

    def submesh(self, axis: str) -> Any:
        """The 1-D DeviceMesh along ``axis`` (``None`` at world size 1)."""
        return None if self.mesh is None else self.mesh[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``."""
        return self.session.group_ranks(axis)

    def axis_size(self, axis: str) -> int:
        return self.topology.size(axis)

    # -- bounded collectives ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, operation: str, axis: str) -> Iterator[None]:
        """Turn any failure of the collectives inside into a :class:`polyparallel.CollectiveError`
        (or :class:`~polyparallel.CollectiveTimeout`) naming the operation, the axis and the rank."""
        try:
            yield
        except pp.PolyparallelError:
            raise
        except RuntimeError as exc:  # gloo/nccl raise RuntimeError/DistBackendError with backend text
            text = str(exc)
            timed_out = "timeout" in text.lower() or "timed out" in text.lower()
            peers = self.group_ranks(axis) if axis in self.topology.axis_names else list(range(self.world_size))
            kind = pp.CollectiveTimeout if timed_out else pp.CollectiveError
            what = (f"did not complete within the strategy's timeout of {self.strategy.timeout:g} s"
                    if timed_out else "failed")
            raise kind(
                f"{operation} over the {axis!r} axis {what} on rank {self.rank} (group ranks {peers}): "
                f"a peer did not join or has exited. Every rank of the group must call {operation}. "
                f"Backend said: {text.splitlines()[0] if text else type(exc).__name__}",
                operation=operation, axis=axis, rank=self.rank,
            ) from exc

    def wait(self, work: Any, operation: str, axis: str) -> None:
        """Wait for an async collective no longer than the strategy's timeout."""
        if work is None:
            return
        with self.collective(operation, axis):
            if not work.wait(self.timeout):
                raise pp.CollectiveTimeout(
                    f"{operation} over the {axis!r} axis did not complete within the strategy's timeout of "
                    f"{self.strategy.timeout:g} s on rank {self.rank} (group ranks {self.group_ranks(axis)}).",
                    operation=operation, axis=axis, rank=self.rank,
                )

    def all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str) -> torch.Tensor:
        """In-place all-reduce over ``axis`` (``sum``, ``avg``, ``max``, ``min``); identity when the
        axis has size 1."""
        group = self.group(axis)
        if group is None:
            return tensor
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.SUM}[op]
        with self.collective(operation, axis):
            work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
        self.wait(work, operation, axis)
        if op == "avg":
            tensor.div_(self.topology.size(axis))
        return tensor

    def broadcast(self, tensor: torch.Tensor, operation: str, axis: str, src_coord: int = 0) -> torch.Tensor:
        """In-place broadcast from the rank at coordinate ``src_coord`` of ``axis``."""
        group = self.group(axis)
        if group is None:
            return tensor
        src = self.group_ranks(axis)[src_coord]
        with self.collective(operation, axis):
            work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        self.wait(work, operation, axis)
        return tensor

    def all_gather_object(self, obj: Any, operation: str, axis: str) -> list[Any]:
        """Gather a picklable object from every rank of ``axis`` (bounded by the group timeout)."""
        group = self.group(axis)
        if group is None:
            return [obj]
        out: list[Any] = [None] * self.topology.size(axis)
        with self.collective(operation, axis):
            dist.all_gather_object(out, obj, group=group)
        return out


def _backend_options(backend: str, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def get_runtime(session: pp.Session) -> TorchRuntime:
    """The session's :class:`TorchRuntime`, created (groups and all) on first use."""
    existing = session.peek(_STASH_KEY)
    if existing is not None:
        return existing

    def make() -> TorchRuntime:
        rt = TorchRuntime(session)
        session.add_finalizer(rt.close)
        return rt

    return session.stash(_STASH_KEY, make)
