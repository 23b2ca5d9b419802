"""Per-replica torch_xla runtime: the XLA device, replica groups per axis, checked collectives.

**A rank is an XLA device.** ``torch_xla.launch`` runs the training function once per device:
one process per device on TPU, and on PJRT CPU (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``) one
*thread* per device in a single process. Rank, world size and local rank come from
``torch_xla.runtime`` (``global_ordinal``, ``world_size``, ``local_ordinal``); replica threads
each run in their own :func:`polyparallel.session_scope`, so every one has its own session and
its own :class:`XlaRuntime` (the runtime key holds the rank).

**Collectives** are XLA collectives: ``xm.all_reduce`` with the axis's replica groups (every
group of the axis, as XLA requires, from :meth:`polyparallel.Topology.groups`), then
``torch_xla.sync()`` so the operation has executed when it returns (values can be read, and a
graph holding a collective is never left to an implicit sync).

**Identity checks, on the host.** A collective inside an XLA graph cannot be bounded from
Python: on PJRT CPU a rank that never joins makes the others wait in XLA's rendezvous until XLA
aborts the whole process (after 10 s, "Termination timeout ... Exiting to ensure a consistent
program state"), and on TPU it waits without end. So every operation is first checked on the
host, where waiting *can* be bounded: each rank writes (operation, axis, sequence number,
shapes) to a key-value store (``torch.distributed.HashStore`` shared by the replica threads of
one process; a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` when the replicas are several
processes) and waits for its group's entries no longer than ``strategy.timeout``. A rank that
skipped an operation makes its peers fail with :class:`polyparallel.CollectiveTimeout` naming
the operation, the axis and the rank (and the peers that did not come), before any XLA
collective is issued; ranks at different operations get a :class:`polyparallel.CollectiveError`
naming both sides. The XLA collective itself runs only once every rank of the group has
announced the same operation. What stays unbounded: a peer that dies *between* the check and the
collective (XLA's own behaviour then applies), and collectives users issue themselves.
After a failure the runtime is broken and refuses every later operation.

**Trace.** Every host check and every XLA all-reduce is recorded in the replica's collective
trace (:mod:`polyparallel._trace`): the replica's own recorder (each replica thread runs in its
own :func:`polyparallel.session_scope`, which has one), so a trace file is one rank. A check is an
entry with its operation, axis, sequence number, descriptor and the user's line; each XLA
all-reduce after it an entry ``"<operation>: XLA all-reduce"`` without a sequence number. The
check's descriptor carries the caller's line, so ranks out of step are told where each side was
called. A check that times out names what every peer replica of this process is doing (read from
its recorder: its open or last entry, or its stack when it is outside any) and writes every
replica's trace; a peer in another process (TPU hosts) is named as not having reached the check.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary
from polyparallel._trace_report import describe_group, location

__all__ = ["HostChannel", "XlaRuntime", "get_runtime", "runtime_key"]

_STASH_KEY = "polyparallel_xla.runtime"
_CHANNEL_KEY = "polyparallel_xla.channel"


def _sync() -> None:
    """Execute the pending graph of this replica (``torch_xla.sync``, looked up at each call)."""
    import torch_xla

    torch_xla.sync()


MAX_ENTRY = 16 * 1024 * 1024
"""The largest host-check entry a rank reads (bytes): a descriptor and one flag per parameter."""


def _entry_problem(value: Any) -> str | None:
    """Why a decoded entry is not ``[[operation, detail, refusal or null, caller], extra]``
    (``caller``: ``file.py:line``; ``extra``: ``null`` or a list of booleans, integers and
    strings), or ``None``."""
    if not isinstance(value, list) or len(value) != 2:
        return "an entry is [descriptor, extra]"
    descriptor, extra = value
    if (not isinstance(descriptor, list) or len(descriptor) != 4 or not isinstance(descriptor[0], str)
            or not isinstance(descriptor[1], str) or not isinstance(descriptor[2], (str, type(None)))
            or not isinstance(descriptor[3], str)):
        return "a descriptor is [operation, detail, refusal or null, caller] (texts)"
    if extra is not None and (not isinstance(extra, list)
                              or not all(isinstance(x, (bool, int, str)) for x in extra)):
        return "the extra value is null or a list of booleans, integers and texts"
    return None


class HostChannel:
    """Bounded host-side exchange of small descriptors between the ranks of a group.

    One key per (axis, group, sequence number, rank) in a ``torch.distributed.Store``. A rank
    writes its own entry, waits (bounded) for its group's, and deletes its previous entry once
    every peer has written the next one (a peer that wrote entry ``s + 1`` has read entry ``s``).

    Entries are JSON (``[[operation, detail, refusal, caller], extra]``), checked when read: the store of
    a multi-process job is a ``TCPStore`` anyone who reaches ``MASTER_PORT`` can write to, so a
    value of another shape is refused (:class:`polyparallel.CollectiveError` naming the rank and
    the key), never executed or trusted.
    """

    def __init__(self, store: Any, timeout: float):
        self.store = store
        self.timeout = float(timeout)

    def exchange(self, tag: str, seq: int, rank: int, ranks: Sequence[int],
                 value: tuple[tuple[str, str, str | None, str], list[Any] | None]) -> dict[int, Any] | list[int]:
        """Publish ``value`` (a descriptor ``(operation, detail, refusal, caller)`` and a list or ``None``)
        under ``tag``/``seq`` and return every rank's value by rank (the descriptor as a tuple), or
        the ranks whose value did not arrive within the timeout."""
        import datetime

        descriptor, extra = value
        self.store.set(f"{tag}/{seq}/{rank}", json.dumps([list(descriptor), None if extra is None else list(extra)]))
        keys = [f"{tag}/{seq}/{r}" for r in ranks]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception:  # the store raises a timeout error whose type differs between torch releases
            missing = [r for r in ranks if not self.store.check([f"{tag}/{seq}/{r}"])]
            # Withdraw this rank's entry: a late peer must not pass the check and wait alone in the
            # XLA collective (it fails at once, told that this rank gave up). A peer that read the
            # entry in the instant before is not reached.
            gave_up = f"rank {rank} gave up waiting for it after the strategy's timeout of {self.timeout:g} s"
            self.store.set(f"{tag}/{seq}/{rank}", json.dumps([[descriptor[0], descriptor[1], gave_up, descriptor[3]], None]))
            return missing
        values = {r: self._read(k, r, rank) for r, k in zip(ranks, keys)}
        if seq > 1:
            self.store.delete_key(f"{tag}/{seq - 1}/{rank}")
        return values

    def _read(self, key: str, writer: int, me: int) -> tuple[tuple[str, str, str | None, str], list[Any] | None]:
        raw = self.store.get(key)
        problem = f"{len(raw)} bytes (at most {MAX_ENTRY})" if len(raw) > MAX_ENTRY else None
        if problem is None:
            try:
                value = json.loads(raw)
                problem = _entry_problem(value)
            except (ValueError, UnicodeDecodeError) as exc:
                problem = f"not JSON ({type(exc).__name__})"
        if problem is not None:
            raise pp.CollectiveError(
                f"the host check on rank {me} read a value for rank {writer} ({key!r}) that polyparallel did not "
                f"write: {problem}. Something other than this job's replicas writes to the job's store "
                "(MASTER_ADDR:MASTER_PORT): keep it on loopback or a trusted network. The operation was not run.",
                operation="host check", axis=key.split("/")[0], rank=me,
            )
        return tuple(value[0]), value[1]


def _make_channel(session: pp.Session) -> HostChannel:
    """The store of this world: one in-process ``HashStore`` when every rank is a thread of this
    process, else a ``TCPStore`` served by the process of rank 0 at ``MASTER_ADDR:MASTER_PORT``."""
    import torch.distributed as dist
    import torch_xla.runtime as xr

    timeout = float(session.strategy.timeout)
    if xr.addressable_device_count() == session.world_size:
        return HostChannel(dist.HashStore(), timeout)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise pp.TopologyError(
            f"the XLA replicas of this job run in {session.world_size // xr.addressable_device_count()} processes; "
            "polyparallel's XLA runtime checks each operation on the host through a TCP store, which needs "
            "MASTER_ADDR and MASTER_PORT (the address of the first process's host and a free port) in every process."
        )
    import datetime

    from polyparallel_torch.channel_auth import is_loopback, loopback_store

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    master = xr.process_index() == 0
    options: dict[str, Any] = {"world_size": xr.process_count(), "timeout": datetime.timedelta(seconds=timeout)}
    # On one host, the store listens on loopback only (a TCPStore listens on every interface
    # unless it is handed a bound socket): the torch runtime's loopback_store.
    if master and is_loopback(host):
        return HostChannel(loopback_store(port, host, **options), timeout)
    return HostChannel(dist.TCPStore(host, port, is_master=master, **options), timeout)


def runtime_key(session: pp.Session) -> tuple[Any, ...]:
    """What defines one replica's runtime: (``"xla"``, rank, resolved topology, timeout)."""
    return ("xla", session.rank, session.topology, float(session.strategy.timeout))


class XlaRuntime:
    """The torch_xla state of one replica (rank) for one group definition.

    :ivar device: this replica's XLA device.
    :ivar broken: why the runtime refuses collectives, or ``None`` while it is usable.
    """

    def __init__(self, session: pp.Session, channel: HostChannel):
        import torch_xla

        self.topology = session.topology
        self.rank = session.rank
        self.world_size = session.world_size
        self.coords = dict(session.coords)
        self.timeout_s = float(session.strategy.timeout)
        self.device = torch_xla.device()
        self.channel = channel
        self.broken: str | None = None
        self.closed = False
        self._seq: dict[str, int] = {}
        # This replica's trace: its session scope's recorder (a replica thread), else the process's.
        self.recorder = _trace.get_recorder()
        if self.recorder is not None:
            self.recorder.rank, self.recorder.world_size = self.rank, self.world_size

    def close(self) -> None:
        """Drop the runtime (XLA devices need no teardown; the store is shared)."""
        self.closed = True

    def mark_broken(self, reason: str) -> None:
        """Refuse every later collective (the first reason is kept)."""
        if self.broken is None:
            self.broken = reason

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (every rank for ``"world"``)."""
        if axis == "world":
            return list(range(self.world_size))
        return self.topology.group_of(self.rank, axis)

    def replica_groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``: what ``xm.all_reduce(groups=)`` takes."""
        if axis == "world":
            return [list(range(self.world_size))]
        return [list(g) for g in self.topology.groups(axis)]

    def ensure_usable(self, operation: str, axis: str) -> None:
        """Raise :class:`polyparallel.CollectiveError` if the runtime is broken or closed."""
        if self.broken is not None or self.closed:
            why = (f"is broken since an earlier operation failed ({self.broken}); a peer may be inside that "
                   "operation and would pair with the next one. Restart the replicas (polyparallel.launch starts "
                   "them afresh)." if self.broken is not None else
                   "was closed (every session that used it was closed).")
            raise pp.CollectiveError(f"{operation} over the {axis!r} axis refused on rank {self.rank}: this replica's "
                                     f"XLA runtime {why}", operation=operation, axis=axis, rank=self.rank)

    def check(self, operation: str, axis: str, detail: str = "", extra: Any = None,
              refusal: str | None = None) -> dict[int, Any]:
        """Check, on the host and bounded by the strategy's timeout, that every rank of ``axis``'s
        group is at the same operation with the same ``detail``; return every rank's ``extra``.

        :param refusal: this rank cannot run the operation (an input error it found): its peers
            learn it here instead of waiting, and every rank raises ``TypeError``.
        :raises polyparallel.CollectiveTimeout: a peer did not reach the operation in time.
        :raises polyparallel.CollectiveError: the ranks are at different operations or shapes.
        """
        self.ensure_usable(operation, axis)
        ranks = self.group_ranks(axis)
        if len(ranks) == 1:
            if refusal is not None:
                raise TypeError(refusal)
            return {self.rank: extra}
        seq = self._seq[axis] = self._seq.get(axis, 0) + 1
        entry = self.recorder.enter(operation, axis, seq, detail, skip=2) if self.recorder is not None else None
        mine = (operation, detail, refusal, _where(entry))
        tag = f"{axis}/{ranks[0]}"
        name = f"{operation} #{seq}"
        try:
            got = self.channel.exchange(tag, seq, self.rank, ranks, (mine, extra))
        except Exception as exc:  # a value polyparallel did not write, or the store failed
            self._failed(entry, exception_summary(exc), f"{name} over the {axis!r} axis failed on rank {self.rank}: "
                         f"{exception_summary(exc)}")
            raise
        if isinstance(got, list):
            summary, details = self._hang_report(axis, ranks, got)
            message = (f"{name} over the {axis!r} axis did not complete within the strategy's timeout of "
                       f"{self.timeout_s:g} s on rank {self.rank} (group ranks {ranks}): "
                       f"{summary or f'rank(s) {got} never reached it'}. Every rank of the group must call "
                       f"{operation}; a rank that skipped it is one operation behind. No XLA collective was issued."
                       + details)
            self.mark_broken(message.splitlines()[0])
            self._failed(entry, f"CollectiveTimeout: {message.splitlines()[0]}", message.splitlines()[0], peers=True)
            raise pp.CollectiveTimeout(message, operation=operation, axis=axis, rank=self.rank)
        others = {r: v[0] for r, v in got.items()}
        if any(d[:3] != mine[:3] for d in others.values()):
            message = _mismatch_message(self.rank, name, mine, others, axis, ranks)
            self.mark_broken(message.splitlines()[0])
            self._failed(entry, f"{'TypeError' if refusal is not None else 'CollectiveError'}: "
                         f"{message.splitlines()[0]}", message.splitlines()[0])
            if refusal is not None:
                raise TypeError(f"{refusal}\n{message}")
            raise pp.CollectiveError(message, operation=operation, axis=axis, rank=self.rank)
        if refusal is not None:
            _trace.Recorder.finish(entry, f"refused: {refusal}")
            raise TypeError(refusal)
        _trace.Recorder.finish(entry)
        return {r: v[1] for r, v in got.items()}

    def _failed(self, entry: _trace.Entry | None, error: str, reason: str, peers: bool = False) -> None:
        """Mark ``entry`` failed and write this replica's trace (``peers``: and the trace of every
        peer replica of this process, which may be aborted with it)."""
        if self.recorder is None:
            return
        _trace.Recorder.finish(entry, error)
        self.recorder.dump(reason, failed=True)
        if peers:
            for rank, recorder in _trace.scoped_recorders().items():
                if rank != self.rank and not recorder.exited:
                    recorder.dump("a peer's host check timed out")

    def _hang_report(self, axis: str, ranks: list[int], missing: list[int]) -> tuple[str, str]:
        """``(summary, details)`` of what every rank of the group is doing, read from the
        recorders of the replicas that are threads of this process; ``("", "")`` when no peer is."""
        local = _trace.scoped_recorders() if self.recorder is not None else {}
        peers = [r for r in ranks if r != self.rank and r in local]
        if not peers:
            return "", ""
        states = {r: local[r].state(stack=r != self.rank) for r in [self.rank, *peers] if r in local}
        summary, details = describe_group(states, self.rank, 0.0)
        elsewhere = [r for r in missing if r not in local]
        if elsewhere:
            summary += f"; {_trace_ranks(elsewhere)} (in other processes) never reached it"
        return summary, "".join("\n" + line for line in details)

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: str, operation: str, axis: str,
                   scale: float = 1.0) -> None:
        """Reduce ``tensors`` (on this device) in place over ``axis`` with one XLA all-reduce
        (``sum``, ``max``, ``min``; then times ``scale``) and execute it. The caller checked the
        operation first (:meth:`check`)."""
        import torch_xla.core.xla_model as xm

        self.ensure_usable(operation, axis)
        tensors = list(tensors)
        if not tensors:
            return
        if len(self.group_ranks(axis)) == 1:
            if scale != 1.0:
                with torch.no_grad():
                    for t in tensors:
                        t.mul_(scale)
            return
        reduce_type = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]
        entry = None
        if self.recorder is not None:
            entry = self.recorder.enter(f"{operation}: XLA all-reduce", axis, None, _describe(op, tensors), skip=2)
            entry.state = "running"  # the check passed: every rank of the group is here
        try:
            # pin_layout=False: a pinned layout builds one graph per ordinal (pytorch/xla#9089),
            # and nothing here needs a fixed layout. A list is reduced in place, coalesced.
            xm.all_reduce(reduce_type, tensors, scale=scale, groups=self.replica_groups(axis), pin_layout=False)
            _sync()
        except RuntimeError as exc:
            message = (f"{operation} over the {axis!r} axis failed on rank {self.rank} (group ranks "
                       f"{self.group_ranks(axis)}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            self.mark_broken(message)
            self._failed(entry, f"CollectiveError: {message}", message)
            raise pp.CollectiveError(message, operation=operation, axis=axis, rank=self.rank) from exc
        _trace.Recorder.finish(entry)


def _where(entry: _trace.Entry | None) -> str:
    """The caller's location of a check (``train.py:57``), from its trace entry or the stack."""
    site, user = (entry.site, entry.user) if entry is not None else _trace.caller(3)
    fmt = lambda loc: None if loc is None else f"{loc[0]}:{loc[1]}"  # noqa: E731
    return location({"site": fmt(site), "user": fmt(user)})


def _describe(op: str, tensors: list[torch.Tensor]) -> str:
    """``sum 2 tensor(s): float32[16, 6], float32[16], ...``: an all-reduce's entry detail."""
    shapes = [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors[:4]]
    return f"{op} {len(tensors)} tensor(s): {', '.join(shapes)}{', ...' if len(tensors) > 4 else ''}"


def _trace_ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _mismatch_message(rank: int, name: str, mine: tuple[Any, ...], others: dict[int, tuple[Any, ...]], axis: str,
                      ranks: list[int]) -> str:
    # A descriptor: (operation, detail, refusal, caller's location); the sequence number is ``name``'s.
    seq = name.rpartition(" #")[2]

    def side(d: tuple[Any, ...], where: bool = False) -> str:
        text = f"{d[0]} #{seq}" if where else d[0]
        at = f" at {d[3]}" if where else ""
        if d[2] is not None:
            return f"{text} (refused: {d[2]}){at}"
        return (f"{text} ({d[1]})" if d[1] else text) + at

    other_rank, other = next((r, d) for r, d in others.items() if d[:3] != mine[:3])
    return "\n".join([
        f"operations out of step over the {axis!r} axis (group ranks {ranks}) at {name}: {side(mine)} on rank {rank} "
        f"vs {side(other)} on rank {other_rank} (called at {mine[3]} and {other[3]}).",
        "Every rank of a group must call the same polyparallel operations in the same order, with the same shapes; "
        "no payload was exchanged. Each rank of the group called:",
        *(f"  rank {r}: {side(d, where=True)}" for r, d in sorted(others.items())),
        "The runtime is now broken: fix the program and restart the replicas.",
    ])


def get_runtime(session: pp.Session) -> XlaRuntime:
    """The :class:`XlaRuntime` of ``session``'s replica (shared with the other sessions of the same
    rank that define the same groups), made on first use. Makes no collective."""
    existing = session.peek(_STASH_KEY)
    if existing is not None:
        return existing
    channel_key = (_CHANNEL_KEY, session.topology, float(session.strategy.timeout))
    channel = session.acquire(channel_key, lambda: _make_channel(session), _release_channel)
    rt = session.acquire(runtime_key(session), lambda: XlaRuntime(session, channel), XlaRuntime.close)
    return session.stash(_STASH_KEY, lambda: rt)


def _release_channel(channel: HostChannel) -> None:
    channel.store = None

