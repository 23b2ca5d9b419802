"""Bounded collectives: the bottom layer of :class:`polyparallel_torch.runtime.TorchRuntime`.

:class:`BoundedCollectives` holds a runtime's groups (looked up by axis) and runs collectives
over them; :mod:`.identity_checks` adds the checks before them and :mod:`.runtime` the making and
releasing of the groups.

**What is bounded.** Every collective run through the runtime is bounded by the strategy's
timeout and turned into a ``CollectiveError``/``CollectiveTimeout`` naming operation, axis and
rank (:meth:`BoundedCollectives.collective`, :meth:`~BoundedCollectives.wait`; which backend
errors are timeouts: :mod:`.backend_errors`). Collectives run by torch itself over these groups
(DTensor's redistributions, pipelining's send/recv inside a schedule step) carry the same
group timeout, but their failures are torch's own errors unless they happen inside a runtime call;
DDP's gradient all-reduces are recorded once per backward (and identity-checked with
``GradPolicy(check_backward=True)``; no communication hook: :mod:`.ddp_trace`), so a desync or a
silent peer there is reported like a runtime operation's (the bucket all-reduces themselves stay
torch's); FSDP2's all-gathers and reduce-scatters are recorded (not checked) by custom comms running torch's default inside
(:mod:`.fsdp_trace`), their failures raised as the runtime's.

**Broken runtime.** After a :class:`~polyparallel.CollectiveTimeout` or any
:class:`~polyparallel.CollectiveError`, a late peer may still be inside a collective of these
groups and would pair with the next one: the runtime is marked broken (``broken``) and refuses
every later collective with an error saying why and to restart the processes. Closing a broken
runtime destroys no process group (a peer may still wait in it, and gloo can abort the process
when a group is torn down under a pending operation); it only drops references.

**Trace.** Every operation (one entry for its check and payload) and every collective outside one
(``collective`` + ``wait``) is recorded in the process's collective trace
(:mod:`polyparallel._trace`; off with ``POLYPARALLEL_TRACE=0``). A timeout's error says what every
rank of the group was doing, read through the side channel of :mod:`polyparallel_torch.tracing`
(started when the groups are made); so does a backend failure that is not a timeout (a peer's
connection closed: the peer's last state says whether it finished or failed, and where), after
a shorter wait. A failure writes the trace to the trace directory.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary

from .backend_errors import is_timeout
from .process_groups import default_device, resolved_backend

__all__ = ["BoundedCollectives"]

PEER_GONE_WAIT_S = 1.0
"""How long a collective that failed without timing out (a peer's connection closed) waits for
the peers' states on the side channel: a live rank's thread answers within its poll interval, an
ended one's last state is already there."""


class BoundedCollectives:
    """A runtime's groups and the bounded collectives over them (the state every layer shares).

    :ivar session: the session that created the runtime (it outlives it while others hold it).
    :ivar mesh: the ``DeviceMesh`` (``None`` at world size 1), dims named like the topology axes.
    :ivar device: the device tensors of this rank live on.
    :ivar broken: why the runtime refuses collectives, or ``None`` while it is usable.
    """

    def __init__(self, session: pp.Session):
        self.session = session
        self.topology = session.topology
        self.coords = dict(session.coords)
        self.rank = session.rank
        self.world_size = session.world_size
        self.device = default_device()
        self.timeout_s = float(session.strategy.timeout)
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.backend = resolved_backend(session.strategy, self.device)
        self.mesh: Any = None
        self.broken: str | None = None
        self.closed = False
        self._uses_world = False
        self._covered: dict[str, str] = {}  # axis -> the open operation whose check covers it
        # The collective trace (polyparallel._trace): None when POLYPARALLEL_TRACE=0.
        self._rec = _trace.get_recorder()
        if self._rec is not None:
            self._rec.rank, self._rec.world_size = self.rank, self.world_size
        self._unchecked: dict[str, _trace.Entry] = {}  # axis -> latest unchecked collective's entry
        self.side_channel: Any = None

    # -- groups ---------------------------------------------------------------------------------------
    def group(self, axis: str) -> Any:
        """The process group of this rank along ``axis`` (``None`` when the axis has size 1 or
        the world is one process; the default group for ``"world"``)."""
        if axis == "world":  # identity checks of the runtime itself (also before the mesh exists)
            return dist.group.WORLD if self._uses_world else None
        if self.mesh is None:
            return None
        if self.topology.size(axis) == 1:
            return None
        return self.mesh.get_group(axis)

    def submesh(self, axis: str) -> Any:
        """The 1-D DeviceMesh along ``axis`` (``None`` at world size 1)."""
        return None if self.mesh is None else self.mesh[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (every rank for ``"world"``)."""
        if axis not in self.topology.axis_names:
            return list(range(self.world_size))
        return self.topology.group_of(self.rank, axis)

    def axis_size(self, axis: str) -> int:
        """Size of ``axis``."""
        return self.topology.size(axis)

    # -- usability ------------------------------------------------------------------------------------
    def ensure_usable(self, operation: str, axis: str) -> None:
        """Raise :class:`polyparallel.CollectiveError` if the runtime is broken or closed."""
        if self.broken is not None:
            raise pp.CollectiveError(
                f"{operation} over the {axis!r} axis refused on rank {self.rank}: this process's torch runtime "
                f"is broken since an earlier collective failed ({self.broken}). A peer may still be inside that "
                "collective and would pair with the next one, mixing values of different operations. Restart the "
                "processes (polyparallel.launch / `polyparallel launch` start them afresh); a runtime cannot be "
                "repaired in place.",
                operation=operation, axis=axis, rank=self.rank,
            )
        if self.closed:
            raise pp.CollectiveError(
                f"{operation} over the {axis!r} axis refused on rank {self.rank}: the torch runtime was closed "
                "(every session that used it was closed). Use a model wrapped by an open session's strategy.",
                operation=operation, axis=axis, rank=self.rank,
            )

    def mark_broken(self, reason: str) -> None:
        """Refuse every later collective of this runtime (the first reason is kept); write the
        trace now when a trace directory is set (the process may not reach its normal exit)."""
        if self.broken is None:
            self.broken = reason
            if self._rec is not None:
                self._rec.dump(reason, failed=True)

    # -- bounded collectives ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, operation: str, axis: str, label: str | None = None, *, record: bool = True,
                   resume: bool = False) -> Iterator[None]:
        """Refuse to start on a broken runtime; turn any failure of the collectives inside into a
        :class:`polyparallel.CollectiveError` (or :class:`~polyparallel.CollectiveTimeout`) naming
        the operation (as ``label`` in the message, e.g. with its sequence number), the axis and
        the rank, and mark the runtime broken.

        Outside an operation on ``axis`` (:meth:`~.identity_checks.CheckedCollectives.operation`)
        the collective is recorded in the trace as an unchecked one (no sequence number); ``resume``
        continues the latest such entry when it has the same operation (the :meth:`wait` for the
        work an async collective started), ``record=False`` records nothing (the identity check
        records its operation itself)."""
        self.ensure_usable(operation, axis)
        entry = None
        if record and self._rec is not None and axis not in self._covered:
            last = self._unchecked.get(axis)
            if resume and last is not None and last.operation == operation and self._rec.entries \
                    and self._rec.entries[-1] is last:
                entry, entry.state, entry.t1 = last, "entered", None
            else:
                entry = self._unchecked[axis] = self._rec.enter(operation, axis, None, label or "", skip=3)
        try:
            yield
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            self._collective_failed(exc, operation, axis, label)
            raise
        _trace.Recorder.finish(entry)

    def _collective_failed(self, exc: BaseException, operation: str, axis: str, label: str | None) -> None:
        """Mark the runtime broken for ``exc``; raise a backend error as a ``CollectiveError`` (with
        the hang report of the group when it is a timeout)."""
        if isinstance(exc, pp.CollectiveError):
            self.mark_broken(str(exc).splitlines()[0])
            return
        if isinstance(exc, pp.PolyparallelError) or not isinstance(exc, RuntimeError):
            return
        # gloo/nccl raise RuntimeError/DistBackendError with backend text
        timed_out = is_timeout(exc)
        kind = pp.CollectiveTimeout if timed_out else pp.CollectiveError
        what = (f"did not complete within the strategy's timeout of {self.timeout_s:g} s"
                if timed_out else "failed")
        # A timeout asks every rank of the group what it is doing; a peer that went away (gloo's
        # "Connection closed by peer") is asked too, briefly: its last state says whether it
        # finished or failed, and where ("rank 1 failed in f (x.py:3) with ValueError").
        summary, details = self._hang_report(axis) if timed_out else self._hang_report(axis, PEER_GONE_WAIT_S)
        error = kind(
            f"{label or operation} over the {axis!r} axis {what} on rank {self.rank} (group ranks "
            f"{self.group_ranks(axis)}): {summary + '. ' if summary else 'a peer did not join or has exited. '}"
            f"Every rank of the group must call {operation}. Backend said: {exception_summary(exc)}{details}",
            operation=operation, axis=axis, rank=self.rank,
        )
        if summary:
            error.peers_named = True  # type: ignore[attr-defined]  # it says what the peers did (launchers' root cause)
        self.mark_broken(str(error).splitlines()[0])
        raise error from exc

    def _hang_report(self, axis: str, wait_s: float | None = None) -> tuple[str, str]:
        from .tracing import hang_report

        return hang_report(self, axis, wait_s)

    def wait(self, work: Any, operation: str, axis: str, label: str | None = None, *, record: bool = True) -> None:
        """Wait for an async collective no longer than the strategy's timeout (in the trace, the
        wait continues the entry of the :meth:`collective` that started the work)."""
        if work is None:
            return
        with self.collective(operation, axis, label, record=record, resume=True):
            if not work.wait(self.timeout):
                summary, details = self._hang_report(axis)
                raise pp.CollectiveTimeout(
                    f"{label or operation} over the {axis!r} axis did not complete within the strategy's timeout of "
                    f"{self.timeout_s:g} s on rank {self.rank} (group ranks {self.group_ranks(axis)})"
                    f"{': ' + summary if summary else ''}.{details}",
                    operation=operation, axis=axis, rank=self.rank,
                )

    def _all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str, group: Any,
                    label: str | None = None, record: bool = True) -> None:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.SUM}[op]
        with self.collective(operation, axis, label, record=record):
            work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
        self.wait(work, operation, axis, label, record=record)
