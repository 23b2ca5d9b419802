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

**Identity checks.** Every polyparallel operation (``sync_grads`` on a bare module, ``sync_states``,
``reduce_metrics``, the parameter broadcast of ``wrap_model``, a pipeline step, and any direct
:meth:`TorchRuntime.all_reduce` / :meth:`~TorchRuntime.broadcast` /
:meth:`~TorchRuntime.all_gather_object` call) first runs :meth:`TorchRuntime.check`: one int64
all-reduce of ``[h, -h]`` with MAX over the operation's group, where ``h`` is a 62-bit blake2b
hash of (operation, axis, per-axis sequence number, shapes and dtypes). All ranks agree iff
``max(h) == min(h)``; otherwise every rank of the group gathers the descriptors and raises
:class:`polyparallel.CollectiveError` naming both sides and where each was called ("sync_states #3
on rank 0 vs sync_grads #3 on rank 1 (called at train.py:40 and train.py:42)"), before any payload
collective could mix a running mean with a gradient. The check cannot see a skipped operation at the moment it is skipped (the skipping rank
sends nothing): the ranks then pair one operation apart, and the first pairing of two different
operations (or shapes) is reported; if the ops are all alike, the last one times out. Making the
runtime is checked too, over the default group: ranks that made it with another topology,
backend or timeout fail at once naming both. ``GradPolicy(check=False)`` skips the check of
``sync_grads``, the one operation on the hot path.

**Trace.** Every operation (one entry for its check and payload) and every collective outside one
(``collective`` + ``wait``) is recorded in the process's collective trace
(:mod:`polyparallel._trace`; off with ``POLYPARALLEL_TRACE=0``). A timeout's error says what every
rank of the group was doing, read through the side channel of :mod:`polyparallel_torch.tracing`
(started when the groups are made), and a failure writes the trace to the trace directory.

**Broken runtime.** After a :class:`~polyparallel.CollectiveTimeout` or any
:class:`~polyparallel.CollectiveError`, a late peer may still be inside a collective of these
groups and would pair with the next one: the runtime is marked broken (:attr:`TorchRuntime.broken`)
and refuses every later collective with an error saying why and to restart the processes. Closing
a broken runtime destroys no process group (a peer may still wait in it, and gloo can abort the
process when a group is torn down under a pending operation); it only drops references.

**What is bounded.** Every collective run through this module is bounded by the strategy's
timeout and turned into a ``CollectiveError``/``CollectiveTimeout`` naming operation, axis and
rank. Collectives run by torch itself over these groups (DDP's reducer during ``backward()``,
DTensor's redistributions, pipelining's send/recv inside a schedule step) carry the same group
timeout, but their failures are torch's own errors unless they happen inside a runtime call.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary

__all__ = ["TorchRuntime", "default_device", "get_runtime", "runtime_key"]

_STASH_KEY = "polyparallel_torch.runtime"

# The default process group, when polyparallel created it, and how many open runtimes use it:
# it is destroyed only when the last of them closes, and only if no runtime of this process broke
# (destroying the default group destroys every group, a broken one included).
_WORLD: dict[str, Any] = {"group": None, "users": 0, "broken": False}


def default_device() -> torch.device:
    """The device this process computes on: its local CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def _hash62(text: str) -> int:
    # Deterministic across processes (Python's hash() is salted per process); 62 bits so that both
    # h and -h fit an int64.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _resolved_backend(strategy: pp.Strategy, device: torch.device) -> str:
    return strategy.backend or ("nccl" if device.type == "cuda" else "gloo")


def runtime_key(session: pp.Session) -> tuple[Any, ...]:
    """What defines a runtime's process groups: (``"torch"``, resolved topology, backend, timeout)."""
    strategy = session.strategy
    return ("torch", session.topology, _resolved_backend(strategy, default_device()), float(strategy.timeout))


class TorchRuntime:
    """The torch.distributed state of one group definition in one process, shared by sessions.

    :ivar session: the session that created it (the runtime outlives it while others hold it).
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
        self.backend = _resolved_backend(session.strategy, self.device)
        self.mesh: Any = None
        self.broken: str | None = None
        self.closed = False
        self._uses_world = False
        self._seq: dict[str, int] = {}  # per-axis sequence number of checked operations
        self._covered: dict[str, str] = {}  # axis -> the open operation whose check covers it
        self._at_close: list[Callable[[], None]] = []
        # The collective trace (polyparallel._trace): None when POLYPARALLEL_TRACE=0.
        self._rec = _trace.get_recorder()
        if self._rec is not None:
            self._rec.rank, self._rec.world_size = self.rank, self.world_size
        self._unchecked: dict[str, _trace.Entry] = {}  # axis -> latest unchecked collective's entry
        self.side_channel: Any = None
        if self.world_size > 1:
            try:
                self._init_groups()
            except BaseException as exc:
                # Groups may be half made and peers may still be making them: drop, never destroy.
                self.mark_broken(f"making the process groups failed: {str(exc).splitlines()[0] if str(exc) else exc!r}")
                self.close()
                raise

    # -- setup / teardown ---------------------------------------------------------------------------
    def _check_backend(self) -> None:
        # Before any process group: a backend torch cannot run otherwise fails inside c10d, late
        # and obscurely (or, for nccl without a GPU, only at the first collective).
        available = [b for b in ("gloo", "nccl", "ucc", "mpi", "xccl") if dist.is_backend_available(b)]
        if self.backend not in available:
            raise pp.TopologyError(
                f"Strategy(backend={self.backend!r}): this torch build cannot run the {self.backend!r} process-group "
                f"backend; available here: {', '.join(available) or 'none'}. Use one of them, or backend=None "
                "(nccl on CUDA, else gloo)."
            )
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise pp.TopologyError(
                "Strategy(backend='nccl') needs CUDA devices, and this process sees none; use backend='gloo' "
                "(or backend=None, which picks gloo on CPU)."
            )

    def _init_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._check_backend()
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise pp.TopologyError(
                    f"torch.distributed is initialised with world size {dist.get_world_size()}, but this "
                    f"process was launched as rank {self.rank} of {self.world_size}."
                )
            if _WORLD["group"] is not dist.group.WORLD:  # someone else's (or ours, re-made by them)
                _WORLD["group"] = None
        else:
            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise pp.TopologyError(
                    f"WORLD_SIZE={self.world_size} but MASTER_ADDR/MASTER_PORT are not set: start the script "
                    "with `polyparallel launch`, torchrun, or call polyparallel.launch()."
                )
            with self.collective("init_process_group", "world"):
                dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                        timeout=self.timeout)
            _WORLD["group"] = dist.group.WORLD
        _WORLD["users"] += 1
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
        options = _backend_options(self.backend, self.timeout)
        override: Any = {axis: (self.backend, options) for axis in self.topology.axis_names} if options is not None else None
        with self.collective("init_device_mesh", "world"):
            self.mesh = init_device_mesh(
                self.device.type, self.topology.shape, mesh_dim_names=self.topology.axis_names,
                **({"backend_override": override} if override else {}),
            )

    @property
    def owns_default_group(self) -> bool:
        """Whether polyparallel created the default process group this runtime uses."""
        return self._uses_world and _WORLD["group"] is not None and _WORLD["group"] is dist.group.WORLD

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
        _WORLD["users"] -= 1
        if self.broken is not None or _WORLD["broken"]:
            _WORLD["broken"] = True
            return
        if mesh is not None and dist.is_initialized():
            world = dist.group.WORLD
            destroyed: set[int] = set()
            for axis in self.topology.axis_names:
                group = mesh.get_group(axis)
                if group is None or group is world or id(group) in destroyed:
                    continue
                destroyed.add(id(group))
                dist.destroy_process_group(group)
        if _WORLD["users"] == 0 and _WORLD["group"] is not None and dist.is_initialized() \
                and _WORLD["group"] is dist.group.WORLD:
            dist.destroy_process_group()
            _WORLD["group"] = None

    def mark_broken(self, reason: str) -> None:
        """Refuse every later collective of this runtime (the first reason is kept); write the
        trace now when a trace directory is set (the process may not reach its normal exit)."""
        if self.broken is None:
            self.broken = reason
            if self._rec is not None:
                self._rec.dump(reason, failed=True)

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

    # -- bounded collectives ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, operation: str, axis: str, label: str | None = None, *, record: bool = True,
                   resume: bool = False) -> Iterator[None]:
        """Refuse to start on a broken runtime; turn any failure of the collectives inside into a
        :class:`polyparallel.CollectiveError` (or :class:`~polyparallel.CollectiveTimeout`) naming
        the operation (as ``label`` in the message, e.g. with its sequence number), the axis and
        the rank, and mark the runtime broken.

        Outside an :meth:`operation` on ``axis`` the collective is recorded in the trace as an
        unchecked one (no sequence number); ``resume`` continues the latest such entry when it
        has the same operation (the :meth:`wait` for the work an async collective started),
        ``record=False`` records nothing (the identity check records its operation itself)."""
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
        text = str(exc)
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        kind = pp.CollectiveTimeout if timed_out else pp.CollectiveError
        what = (f"did not complete within the strategy's timeout of {self.timeout_s:g} s"
                if timed_out else "failed")
        summary, details = self._hang_report(axis) if timed_out else ("", "")
        error = kind(
            f"{label or operation} over the {axis!r} axis {what} on rank {self.rank} (group ranks "
            f"{self.group_ranks(axis)}): {summary + '. ' if summary else 'a peer did not join or has exited. '}"
            f"Every rank of the group must call {operation}. Backend said: "
            f"{text.splitlines()[0] if text else type(exc).__name__}{details}",
            operation=operation, axis=axis, rank=self.rank,
        )
        self.mark_broken(str(error).splitlines()[0])
        raise error from exc

    def _hang_report(self, axis: str) -> tuple[str, str]:
        from .tracing import hang_report

        return hang_report(self, axis)

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

    # -- identity checks ---------------------------------------------------------------------------------
    def check(self, operation: str, axis: str, detail: str = "", refusal: str | None = None) -> str:
        """Check that every rank of ``axis``'s group is at the same operation, raising
        :class:`polyparallel.CollectiveError` on every rank of the group (naming both sides) if not.

        :param detail: what must match besides the name: shapes, dtypes, names (rank-independent).
        :param refusal: this rank cannot run the operation (an input error it found): the peers
            learn it through the check instead of waiting for a collective that never comes; the
            local rank then raises ``TypeError(refusal)``.
        :return: the operation's label in errors, ``"<operation> #<sequence number>"``.
        """
        label, entry = self._check(operation, axis, detail, refusal)
        _trace.Recorder.finish(entry)
        return label

    def _check(self, operation: str, axis: str, detail: str = "",
               refusal: str | None = None) -> tuple[str, _trace.Entry | None]:
        """:meth:`check`, returning the label and the operation's trace entry, left open (state
        ``running``) for the caller to finish."""
        return self.start_check(operation, axis, detail, refusal, skip=4)()

    def start_check(self, operation: str, axis: str, detail: str = "", refusal: str | None = None,
                    skip: int = 3) -> Callable[[], tuple[str, _trace.Entry | None]]:
        """:meth:`check` in two halves: start its all-reduce now and return the function that waits
        for it and answers as ``_check`` does; pass it as :meth:`operation`'s ``check``. The caller
        may do local work in between (``sync_grads`` packs gradients while the check travels) but
        must start no other collective before the answer."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            def agreed() -> tuple[str, _trace.Entry | None]:
                if refusal is not None:
                    raise TypeError(refusal)
                return operation, None

            return agreed
        seq = self._seq[axis] = self._seq.get(axis, 0) + 1
        entry = None if self._rec is None else self._rec.enter(operation, axis, seq, detail, skip=skip)
        h = _hash62(f"{operation}\0{axis}\0{seq}\0{detail}\0{refusal or ''}")
        buf = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        name = f"{operation} #{seq}"
        try:
            with self.collective(operation, axis, name, record=False):
                work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        return lambda: self._finish_check(work, buf, group, operation, axis, seq, detail, refusal, entry)

    def _finish_check(self, work: Any, buf: torch.Tensor, group: Any, operation: str, axis: str, seq: int,
                      detail: str, refusal: str | None, entry: _trace.Entry | None) -> tuple[str, _trace.Entry | None]:
        name = f"{operation} #{seq}"
        try:
            self.wait(work, operation, axis, name, record=False)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        high, neg_low = buf.tolist()
        if high == -neg_low:
            if refusal is not None:
                _trace.Recorder.finish(entry, f"refused: {refusal}")
                raise TypeError(refusal)
            if entry is not None:
                entry.state = "running"
            return name, entry
        # Every rank of the group saw the mismatch: all of them gather the descriptors, with the
        # caller's location (found again here when the trace is off: this path is rare).
        from .tracing import mismatch_message, where_of

        where = where_of(entry)
        out: list[Any] = [None] * len(self.group_ranks(axis))
        mine = (self.rank, operation, seq, detail, refusal, where)
        try:
            with self.collective(operation, axis, f"{name} (identity check)", record=False):
                dist.all_gather_object(out, mine, group=group)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        message = mismatch_message(mine, out, axis, self.group_ranks(axis))
        _trace.Recorder.finish(entry, message.splitlines()[0])
        self.mark_broken(message.splitlines()[0])
        if refusal is not None:
            raise TypeError(f"{refusal}\n{message}")
        raise pp.CollectiveError(message, operation=operation, axis=axis, rank=self.rank)

    @contextlib.contextmanager
    def operation(self, name: str, axis: str, detail: str = "",
                  check: bool | Callable[[], tuple[str, _trace.Entry | None]] = True) -> Iterator[str]:
        """One polyparallel operation over ``axis``: :meth:`check` once (unless ``check`` is
        false; a function returned by :meth:`start_check` is finished instead), then the
        collectives of the body over that axis skip their own checks. Yields the operation's
        label; the trace holds one entry for the whole operation."""
        if callable(check):
            label, entry = check()
        elif check:
            label, entry = self._check(name, axis, detail)
        else:
            label = name
            entry = None
            if self._rec is not None and self.group(axis) is not None:
                entry = self._rec.enter(name, axis, None, detail, skip=3)
                entry.state = "running"
        previous = self._covered.get(axis)
        self._covered[axis] = label
        try:
            yield label
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        finally:
            if previous is None:
                self._covered.pop(axis, None)
            else:
                self._covered[axis] = previous
        _trace.Recorder.finish(entry)

    @contextlib.contextmanager
    def _checked(self, operation: str, axis: str, detail: str) -> Iterator[str]:
        # A direct collective: inside an operation on its axis it is covered by that operation's
        # check (and trace entry), else it is an operation of its own.
        covered = self._covered.get(axis)
        if covered is not None:
            yield covered
            return
        with self.operation(operation, axis, detail) as label:
            yield label

    def _all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str, group: Any,
                    label: str | None = None, record: bool = True) -> None:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "avg": dist.ReduceOp.SUM}[op]
        with self.collective(operation, axis, label, record=record):
            work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
        self.wait(work, operation, axis, label, record=record)

    # -- collectives -------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str) -> torch.Tensor:
        """In-place all-reduce over ``axis`` (``sum``, ``avg``, ``max``, ``min``); identity when the
        axis has size 1. Checked (:meth:`check`) unless inside an :meth:`operation` on ``axis``."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return tensor
        with self._checked(operation, axis, f"all_reduce {op} {tensor.dtype} {list(tensor.shape)}") as label:
            self._all_reduce(tensor, op, operation, axis, group, label)
        if op == "avg":
            tensor.div_(self.topology.size(axis))
        return tensor

    def broadcast(self, tensor: torch.Tensor, operation: str, axis: str, src_coord: int = 0) -> torch.Tensor:
        """In-place broadcast from the rank at coordinate ``src_coord`` of ``axis`` (checked like
        :meth:`all_reduce`)."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return tensor
        with self._checked(operation, axis, f"broadcast from {src_coord} {tensor.dtype} {list(tensor.shape)}") as label:
            src = self.group_ranks(axis)[src_coord]
            with self.collective(operation, axis, label):
                work = dist.broadcast(tensor, src=src, group=group, async_op=True)
            self.wait(work, operation, axis, label)
        return tensor

    def all_gather_object(self, obj: Any, operation: str, axis: str) -> list[Any]:
        """Gather a picklable object from every rank of ``axis`` (bounded by the group timeout,
        checked like :meth:`all_reduce`)."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return [obj]
        out: list[Any] = [None] * self.topology.size(axis)
        with self._checked(operation, axis, "all_gather_object") as label, self.collective(operation, axis, label):
            dist.all_gather_object(out, obj, group=group)
        return out


def _backend_options(backend: str, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def get_runtime(session: pp.Session) -> TorchRuntime:
    """The :class:`TorchRuntime` of ``session``'s group definition, shared with every other
    session of this process that has the same one (:func:`runtime_key`); created, groups and all,
    on first use, closed when the last session holding it closes."""
    existing = session.peek(_STASH_KEY)
    if existing is not None:
        return existing
    rt = session.acquire(runtime_key(session), lambda: TorchRuntime(session), TorchRuntime.close)
    return session.stash(_STASH_KEY, lambda: rt)
