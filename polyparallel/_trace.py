"""Collective trace: a per-process ring buffer of the collectives a runtime issues.

Every runtime that records (the torch runtime; the JAX runtime for its host-side collectives)
calls :meth:`Recorder.enter` when a collective starts (before its identity check) and :meth:`Recorder.finish` when it ends. An
entry holds the operation, the axis, its sequence number on that axis (``None`` for a collective
that is not identity-checked), a cheap summary of shapes and dtypes (the check's descriptor), the
caller's location, times and a state (``entered``: waiting for the peers to join, ``running``:
the peers joined, the payload moves, ``done``, ``failed``).

The caller's location is two frames, found by one walk up ``sys._getframe`` (no source lookup):
``site``, the first frame outside polyparallel's own packages (``polyparallel``,
``polyparallel_*``) and pluggy, and ``user``, the first frame outside those and the frameworks
polyparallel drives (torch, Lightning, torchmetrics, Ignite), so that a collective Lightning issues from its
loop is placed both in Lightning and in the user's ``trainer.fit(...)`` line.

Recording costs about a microsecond per collective (0.8 µs measured for one entry, entered and
finished: a frame walk, one small object, two ``time.time()`` calls; ``benchmarks/bench_trace.py``);
``POLYPARALLEL_TRACE=0`` turns it off (and the hang reports and trace files with it). The buffer
is process-wide, like logging: one process is one rank.

**Ranks that are threads.** Where one process runs several ranks as threads (torch_xla on PJRT
CPU: one replica thread per device), each rank runs inside :func:`polyparallel.session_scope`,
which enters :func:`scope`: a recorder of the scope's own, which :func:`get_recorder` returns in
that thread (a context variable) instead of the process's, so each rank's trace is its own
(``rank<r>.jsonl``, written when the scope ends and at exit). The recorders of the process's
scopes are listed by :func:`scoped_recorders`, so that a rank can read what a peer thread is
doing (:meth:`Recorder.state`: its latest entries and the stack of its thread) when a host check
times out. Code outside a scope (torch, JAX, a process that is one rank) sees the process's
recorder, as before.

``POLYPARALLEL_TRACE_DIR`` (or :func:`configure`, used by ``polyparallel.launch(trace_dir=)`` and
``polyparallel launch --trace-dir``) makes the process write its buffer as JSON lines to
``<dir>/rank<r>.jsonl`` when a collective fails and when the interpreter exits; ``polyparallel
trace DIR`` reads them (:mod:`polyparallel._trace_report`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

__all__ = ["Entry", "Recorder", "caller", "configure", "enabled", "get_recorder", "outcome_of", "scope",
           "scoped_recorders", "CAPACITY", "FEATURE", "STACK_FRAMES", "STATES"]

FEATURE = "collective_trace"
"""The :class:`polyparallel.Capabilities` feature of a runtime whose collectives are recorded here
(``launch(trace_dir=)`` is refused for a runtime without it: nothing would be written)."""

CAPACITY = 256
"""Entries kept per process (the oldest are dropped)."""

STATES = ("entered", "running", "done", "failed")

STACK_FRAMES = 12
"""Innermost frames of a rank's stack shown in a report (:meth:`Recorder.state`)."""

_ENV_SWITCH = "POLYPARALLEL_TRACE"
_ENV_DIR = "POLYPARALLEL_TRACE_DIR"

# Module roots whose frames are never "the caller": polyparallel itself, and pluggy's dispatch.
_OWN = OWN = ("polyparallel", "pluggy", "contextlib", "functools")
# Frameworks that issue collectives on the user's behalf: the user's frame is further up.
_FRAMEWORKS = NOT_USER = frozenset({"torch", "torch_xla", "lightning", "pytorch_lightning", "lightning_fabric", "ignite",
                                    "jax", "flax", "fastai", "deepspeed", "torchmetrics", "threading", "runpy"})


def enabled() -> bool:
    """Whether recording is on in this process (``POLYPARALLEL_TRACE=0`` turns it off)."""
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def caller(skip: int = 1) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """``(site, user)``: the first frame outside polyparallel (and pluggy), and the first frame
    outside polyparallel and the frameworks it drives, as ``(filename, line)``; the user frame
    falls back to the site when every frame belongs to a framework (a framework's own thread)."""
    frame: Any = sys._getframe(skip)
    site = None
    while frame is not None:
        root = frame.f_globals.get("__name__", "").partition(".")[0]
        if not root.startswith(_OWN):
            here = (frame.f_code.co_filename, frame.f_lineno)
            if site is None:
                site = here
            if root not in _FRAMEWORKS:
                return site, here
        frame = frame.f_back
    return site, site


class Entry:
    """One recorded collective (see the module documentation for the fields)."""

    __slots__ = ("n", "operation", "axis", "seq", "detail", "site", "user", "t0", "t1", "state", "error")

    def __init__(self, n: int, operation: str, axis: str, seq: int | None, detail: str,
                 site: tuple[str, int] | None, user: tuple[str, int] | None):
        self.n, self.operation, self.axis, self.seq, self.detail = n, operation, axis, seq, detail
        self.site, self.user = site, user
        self.t0 = time.time()
        self.t1: float | None = None
        self.state = "entered"
        self.error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (locations as ``"path:line"``)."""
        where = lambda loc: None if loc is None else f"{loc[0]}:{loc[1]}"  # noqa: E731
        return {"n": self.n, "operation": self.operation, "axis": self.axis, "seq": self.seq,
                "detail": self.detail[:200], "site": where(self.site), "user": where(self.user),
                "t0": self.t0, "t1": self.t1, "state": self.state, "error": self.error}


class Recorder:
    """The ring buffer of one process (one rank).

    :ivar rank: the global rank, set by the runtime that records (``RANK`` until then).
    :ivar trace_dir: where :meth:`dump` writes, or ``None``.
    :ivar thread: the thread that last entered a collective (whose stack a hang report shows).
    :ivar exited: the rank's work ended (its :func:`scope` closed); ``outcome`` says how
        (:func:`outcome_of`), when known.
    """

    def __init__(self, capacity: int = CAPACITY):
        self.entries: collections.deque[Entry] = collections.deque(maxlen=capacity)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.trace_dir: str | None = os.environ.get(_ENV_DIR) or None
        self.thread = threading.main_thread().ident
        self.failure: str | None = None  # the first failure dumped (kept in the header of later dumps)
        self.exited = False
        self.outcome: str | None = None
        self._n = 0
        self._lock = threading.Lock()  # dump() may run from the side channel's thread

    def enter(self, operation: str, axis: str, seq: int | None, detail: str = "", skip: int = 2) -> Entry:
        """Record a collective that starts now (state ``entered``); ``skip`` frames of the
        caller's own are not searched for its location."""
        self._n += 1
        site, user = caller(skip)
        entry = Entry(self._n, operation, axis, seq, detail, site, user)
        self.thread = threading.get_ident()
        self.entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: Entry | None, error: str | None = None) -> None:
        """Mark ``entry`` done (or failed, with why)."""
        if entry is None or entry.state in ("done", "failed"):
            return
        entry.t1 = time.time()
        if error is None:
            entry.state = "done"
        else:
            entry.state, entry.error = "failed", error[:300]

    def last(self, count: int = 8) -> list[dict[str, Any]]:
        """The latest ``count`` entries, oldest first, as dicts."""
        with self._lock:
            items = list(self.entries)[-count:]
        return [e.to_dict() for e in items]

    def state(self, stack: bool = True) -> dict[str, Any]:
        """What this rank is doing, as a hang report reads it
        (:func:`polyparallel._trace_report.describe_group`): its rank, latest entries, whether it
        exited and how, and (``stack``, while it has not exited) the Python stack of the thread that
        last entered a collective."""
        return {"rank": self.rank, "time": time.time(), "exited": self.exited,
                "outcome": self.outcome if self.exited else None, "entries": self.last(8),
                "stack": _stack_of(self.thread) if stack and not self.exited else None}

    def dump(self, reason: str = "exit", directory: str | None = None, failed: bool = False) -> str | None:
        """Write the whole buffer to ``<directory>/rank<r>.jsonl`` (default :attr:`trace_dir`): a
        header line (rank, host, pid, why, the first failure), then one line per entry; replaces
        an earlier dump. Returns the path, or ``None`` when there is no directory or it cannot be
        written. ``failed``: ``reason`` is this rank's failure (kept for later dumps)."""
        if failed and self.failure is None:
            self.failure = reason
        directory = directory or self.trace_dir
        if not directory:
            return None
        with self._lock:
            items = [e.to_dict() for e in self.entries]
        header = {"rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(),
                  "pid": os.getpid(), "reason": reason, "failure": self.failure, "time": time.time(), "dropped": max(0, self._n - len(items))}
        path = os.path.join(directory, f"rank{self.rank}.jsonl")
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                for record in (header, *items):
                    f.write(json.dumps(record) + "\n")
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        except OSError:
            return None
        return path


def _stack_of(ident: int | None) -> str | None:
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return None
    return "".join(traceback.format_list(traceback.extract_stack(frame)[-STACK_FRAMES:]))


def outcome_of(exc: BaseException | None) -> str:
    """How a rank's work ended, for its peers' reports: ``"finished"``, or ``"failed in
    training_step (train.py:42) with ValueError"`` (the innermost frame of the traceback outside
    polyparallel and the frameworks it drives, else the innermost one)."""
    if exc is None:
        return "finished"
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    own = [f for f in frames if f[0].f_globals.get("__name__", "").partition(".")[0] not in NOT_USER
           and not f[0].f_globals.get("__name__", "").startswith(OWN)]
    chosen = (own or frames)[-1] if frames else None
    where = "" if chosen is None else (f" in {chosen[0].f_code.co_name} "
                                       f"({os.path.basename(chosen[0].f_code.co_filename)}:{chosen[1]})")
    return f"failed{where} with {type(exc).__name__}"[:300]


_RECORDER: Recorder | None = None
_ATEXIT = False
_SCOPED: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("polyparallel_trace_scope", default=None)
_SCOPES: list[Recorder] = []  # the recorders of this process's scopes, oldest first
_SCOPES_LOCK = threading.Lock()


def get_recorder() -> Recorder | None:
    """The recorder of this rank: the current :func:`scope`'s (a rank that is a thread), else the
    process's; ``None`` when recording is off (``POLYPARALLEL_TRACE=0``)."""
    global _RECORDER
    scoped = _SCOPED.get()
    if scoped is not None:
        return scoped
    if _RECORDER is None:
        if not enabled():
            return None
        _RECORDER = Recorder()
    _register_exit_dump(_RECORDER)
    return _RECORDER


@contextlib.contextmanager
def scope(rank: int | None = None) -> Iterator[Recorder | None]:
    """Record the block (one rank run as a thread) in a recorder of its own: :func:`get_recorder`
    returns it in this context. It writes where the process's recorder would (its directory, or
    ``POLYPARALLEL_TRACE_DIR``), as ``rank<r>.jsonl`` of its own rank (``rank``, or set later by
    the runtime), when the block ends (then marked :attr:`~Recorder.exited`, with its outcome) and
    at exit. Yields ``None`` (and records nothing) when recording is off. :func:`polyparallel.session_scope`
    enters one per replica thread."""
    if not enabled():
        yield None
        return
    recorder = Recorder()
    if _RECORDER is not None:  # configure() before the scopes: the same directory and world
        recorder.trace_dir = _RECORDER.trace_dir or recorder.trace_dir
        recorder.world_size = _RECORDER.world_size
    if rank is not None:
        recorder.rank = rank
    with _SCOPES_LOCK:
        _SCOPES.append(recorder)
        del _SCOPES[:-1024]  # a process that runs many scopes keeps the latest
    _register_exit_dump(recorder)
    token = _SCOPED.set(recorder)
    outcome = "finished"
    try:
        yield recorder
    except BaseException as exc:
        outcome = outcome_of(exc)
        raise
    finally:
        _SCOPED.reset(token)
        recorder.outcome, recorder.exited = recorder.outcome or outcome, True
        with contextlib.suppress(Exception):
            recorder.dump("exit")


def scoped_recorders() -> dict[int, Recorder]:
    """The recorders of this process's :func:`scope` blocks by rank (the latest one of each rank,
    those that ended included): where a rank that is a thread finds its peers' traces."""
    with _SCOPES_LOCK:
        return {r.rank: r for r in _SCOPES}


def _register_exit_dump(recorder: Recorder) -> None:
    global _ATEXIT
    if recorder.trace_dir and not _ATEXIT:
        _ATEXIT = True
        atexit.register(_dump_at_exit)


def configure(trace_dir: str | None = None, rank: int | None = None, world_size: int | None = None) -> None:
    """Set where this rank's buffer is written (and its rank), e.g. in a launched worker (inside a
    :func:`scope`: the scope's recorder)."""
    recorder = get_recorder()
    if recorder is None:
        return
    if trace_dir is not None:
        recorder.trace_dir = os.path.abspath(trace_dir)
    if rank is not None:
        recorder.rank = rank
    if world_size is not None:
        recorder.world_size = world_size
    _register_exit_dump(recorder)  # once a directory is known


def _dump_at_exit() -> None:
    with _SCOPES_LOCK:
        scoped = list(_SCOPES)
    for recorder in scoped:
        if not recorder.exited:  # a scope still running at exit (its thread was not joined)
            with contextlib.suppress(Exception):
                recorder.dump("exit")
    # A process whose ranks are its scopes' writes no file of its own (it would be rank 0's).
    if _RECORDER is not None and not (scoped and not _RECORDER.entries):
        with contextlib.suppress(Exception):
            _RECORDER.dump("exit")
