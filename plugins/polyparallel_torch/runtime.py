"""Per-process torch.distributed runtime: the default group, a DeviceMesh, checked and bounded collectives.

**One runtime per group definition.** Process groups belong to the process, not to one
Strategy value: :func:`get_runtime` shares one :class:`TorchRuntime` between every session whose
groups would be the same — same resolved topology, communication backend and timeout — through
:meth:`polyparallel.Session.acquire`. ``strategy.replace(seed=1)`` therefore reuses the groups
(building new ones on some ranks only would hang). Policies (``GradPolicy``, ``MetricPolicy``,
``StatePolicy``) are *not* part of the runtime: each operation takes them from the Strategy it
was called with.

**Set-up** happens on the first operation, not at import: ``init_process_group`` with the
strategy's timeout (unless the process already has a default group: torchrun-started user code,
Lightning, ``idist.Parallel``), then ``init_device_mesh`` with the topology's axis names, so the
group of every axis is the one DeviceMesh builds. World size 1 makes no process group at all:
every collective is the identity, and callers have no special cases.

**Teardown** (when the last session holding the runtime closes) destroys the mesh sub-groups this
runtime made, and the default group only if polyparallel created it and no other runtime of the
process still uses it (a process-wide count); a default group someone else created is never
destroyed, nor ``dist.group.WORLD`` through a mesh dimension that aliases it.

The runtime is three layers, one module each (and :mod:`.process_groups` for the groups themselves):

- :mod:`.collectives` (:class:`~.collectives.BoundedCollectives`): the groups by axis, every
  collective bounded by the strategy's timeout, failures named (``CollectiveError`` /
  ``CollectiveTimeout`` with the group's hang report), the broken state, the trace.
- :mod:`.identity_checks` (:class:`~.identity_checks.CheckedCollectives`): the identity check
  before every operation, and the checked ``all_reduce`` / ``broadcast`` / ``all_gather_object``.
- this module (:class:`TorchRuntime`): making and releasing the groups, and sharing the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import polyparallel as pp
from polyparallel._errors import exception_summary

from . import process_groups
from .identity_checks import CheckedCollectives

__all__ = ["TorchRuntime", "get_runtime", "runtime_key"]

_STASH_KEY = "polyparallel_torch.runtime"


def runtime_key(session: pp.Session) -> tuple[Any, ...]:
    """What defines a runtime's process groups: (``"torch"``, resolved topology, backend, timeout)."""
    strategy = session.strategy
    backend = process_groups.resolved_backend(strategy, process_groups.default_device())
    return ("torch", session.topology, backend, float(strategy.timeout))


class TorchRuntime(CheckedCollectives):
    """The torch.distributed state of one group definition in one process, shared by sessions.

    :ivar session: the session that created it (the runtime outlives it while others hold it).
    :ivar mesh: the ``DeviceMesh`` (``None`` at world size 1), dims named like the topology axes.
    :ivar device: the device tensors of this rank live on.
    :ivar broken: why the runtime refuses collectives, or ``None`` while it is usable.
    """

    def __init__(self, session: pp.Session):
        super().__init__(session)
        self._at_close: list[Callable[[], None]] = []
        self._ddp_group: Any = None
        if self.world_size > 1:
            try:
                self._init_groups()
            except BaseException as exc:
                # Groups may be half made and peers may still be making them: drop, never destroy.
                self.mark_broken(f"making the process groups failed: {exception_summary(exc)}")
                self.close()
                raise

    # -- setup / teardown ---------------------------------------------------------------------------
    def _init_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        process_groups.check_backend(self.backend)
        if not process_groups.find_default_group(self.rank, self.world_size):
            with self.collective("init_process_group", "world"):
                process_groups.make_default_group(self.backend, self.rank, self.world_size, self.timeout)
        process_groups.use_default_group()
        self._uses_world = True
        # The hang reports' side channel (tracing.py), before the first check can time out.
        from . import tracing

        channel = self.side_channel = tracing.start(self)
        if channel is not None:
            self.at_close(lambda: tracing.release(channel))
        # Every rank makes the same runtime (a rank that made it with another timeout or topology
        # would pair its collectives wrongly): checked before the mesh, whose sub-group creation
        # would otherwise just wait for ranks that are not making it.
        self.check("start the torch runtime", "world",
                   f"{self.topology!r}, backend {self.backend}, timeout {self.timeout_s:g} s")
        # Sub-groups made by new_group() default to a 30-minute timeout, not the world's: pass ours.
        options = process_groups.subgroup_options(self.backend, self.timeout)
        override: Any = {axis: (self.backend, options) for axis in self.topology.axis_names} if options is not None else None
        with self.collective("init_device_mesh", "world"):
            self.mesh = init_device_mesh(
                self.device.type, self.topology.shape, mesh_dim_names=self.topology.axis_names,
                **({"backend_override": override} if override else {}),
            )

    def ddp_group(self) -> Any:
        """A second group of this rank's data-axis ranks, for DDP's gradient all-reduces alone
        (made on first use, by every rank: call it where every rank does, as ``wrap_model``,
        which asks for it only when DDP's backward is recorded).

        DDP's buckets travel there so that an operation a rank runs while its peer is in a
        recorded backward (:mod:`.ddp_trace`) waits on the data group, into the hang report,
        instead of pairing with a bucket of another size (gloo aborts the process then); and so
        that the identity check of a backward (``GradPolicy(check_backward=True)``), which
        travels over the data group, can be answered after the backward instead of before its
        first bucket: on the data group, a mismatch's descriptor exchange would meet the buckets
        already queued behind the check."""
        if self._ddp_group is None:
            mesh = self.mesh.mesh
            dim = self.topology.axis_names.index("data")
            ranks = mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()
            with self.collective("new_group (DDP's gradient all-reduces)", "world"):
                mine, groups = dist.new_subgroups_by_enumeration(ranks, timeout=self.timeout, backend=self.backend)

            def destroy() -> None:
                if self.broken is None and dist.is_initialized():
                    for group in groups:
                        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                            dist.destroy_process_group(group)

            self._ddp_group = mine
            self.at_close(destroy)
        return self._ddp_group

    @property
    def owns_default_group(self) -> bool:
        """Whether polyparallel created the default process group this runtime uses."""
        return self._uses_world and process_groups.owns_default_group()

    def at_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the runtime closes (before its groups go)."""
        self._at_close.append(fn)

    def close(self) -> None:
        """Release the groups (called when the last session holding the runtime closes).

        A usable runtime destroys the mesh sub-groups it made, then the default group if
        polyparallel created it and no other runtime uses it. A broken runtime destroys nothing."""
        if self.closed:
            return
        self.closed = True
        while self._at_close:
            self._at_close.pop()()
        mesh, self.mesh = self.mesh, None
        if not self._uses_world:
            return
        self._uses_world = False
        process_groups.release_groups(mesh, self.topology.axis_names, broken=self.broken is not None)


def get_runtime(session: pp.Session) -> TorchRuntime:
    """The :class:`TorchRuntime` of ``session``'s group definition, shared with every other
    session of this process that has the same one (:func:`runtime_key`); created, groups and all,
    on first use, closed when the last session holding it closes."""
    existing = session.peek(_STASH_KEY)
    if existing is not None:
        return existing
    rt = session.acquire(runtime_key(session), lambda: TorchRuntime(session), TorchRuntime.close)
    return session.stash(_STASH_KEY, lambda: rt)
