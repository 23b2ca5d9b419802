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

``POLYPARALLEL_TRACE_DIR`` (or :func:`configure`, used by ``polyparallel.launch(trace_dir=)`` and
``polyparallel launch --trace-dir``) makes the process write its buffer as JSON lines to
``<dir>/rank<r>.jsonl`` when a collective fails and when the interpreter exits; ``polyparallel
trace DIR`` reads them (:mod:`polyparallel._trace_report`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["Entry", "Recorder", "caller", "configure", "enabled", "get_recorder", "CAPACITY", "FEATURE", "STATES"]

FEATURE = "collective_trace"
"""The :class:`polyparallel.Capabilities` feature of a runtime whose collectives are recorded here
(``launch(trace_dir=)`` is refused for a runtime without it: nothing would be written)."""

CAPACITY = 256
"""Entries kept per process (the oldest are dropped)."""

STATES = ("entered", "running", "done", "failed")

_ENV_SWITCH = "POLYPARALLEL_TRACE"
_ENV_DIR = "POLYPARALLEL_TRACE_DIR"

# Module roots whose frames are never "the caller": polyparallel itself, and pluggy's dispatch.
_OWN = OWN = ("polyparallel", "pluggy", "contextlib", "functools")
# Frameworks that issue collectives on the user's behalf: the user's frame is further up.
_FRAMEWORKS = NOT_USER = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric", "ignite", "jax", "flax",
                         "fastai", "deepspeed", "torchmetrics", "threading", "runpy"})


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
    """

    def __init__(self, capacity: int = CAPACITY):
        self.entries: collections.deque[Entry] = collections.deque(maxlen=capacity)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.trace_dir: str | None = os.environ.get(_ENV_DIR) or None
        self.thread = threading.main_thread().ident
        self.failure: str | None = None  # the first failure dumped (kept in the header of later dumps)
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


_RECORDER: Recorder | None = None
_ATEXIT = False


def get_recorder() -> Recorder | None:
    """This process's recorder, or ``None`` when recording is off (``POLYPARALLEL_TRACE=0``)."""
    global _RECORDER, _ATEXIT
    if _RECORDER is None:
        if not enabled():
            return None
        _RECORDER = Recorder()
    if _RECORDER.trace_dir and not _ATEXIT:
        _ATEXIT = True
        atexit.register(_dump_at_exit)
    return _RECORDER


def configure(trace_dir: str | None = None, rank: int | None = None, world_size: int | None = None) -> None:
    """Set where this process's buffer is written (and its rank), e.g. in a launched worker."""
    recorder = get_recorder()
    if recorder is None:
        return
    if trace_dir is not None:
        recorder.trace_dir = os.path.abspath(trace_dir)
    if rank is not None:
        recorder.rank = rank
    if world_size is not None:
        recorder.world_size = world_size
    get_recorder()  # registers the exit dump once a directory is known


def _dump_at_exit() -> None:
    if _RECORDER is not None:
        with contextlib.suppress(Exception):
            _RECORDER.dump("exit")
