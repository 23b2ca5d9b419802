"""The side channel of the torch runtime's hang reports: every rank's recent collectives and stack,
exchanged through the rendezvous store, which still works when the process group is stuck.

Each runtime of a world larger than one starts a :class:`SideChannel`: a daemon thread that polls
one request key in the store (a ``compare_set`` that never waits, 5 times a second: one small
request, no work on the training thread) under a prefix of its own. A rank whose collective times
out (:meth:`SideChannel.collect`) posts the next request and publishes its own state; every rank's
thread then publishes its latest trace entries (:mod:`polyparallel._trace`) and the Python stack
of the thread that runs its collectives (``sys._current_frames``), which it can do while that
thread is blocked in a collective (the backend releases the GIL while it waits) or busy in
Python (the interpreter switches threads every few milliseconds). The waiting rank reads them
for a few seconds and :func:`polyparallel._trace_report.describe_group` turns them into the
lines of its :class:`polyparallel.CollectiveTimeout`. A rank whose runtime closed publishes a
last state marked ``exited``, with its ``outcome`` when known (:func:`set_outcome`: ``finished``,
or ``failed in training_step (train.py:42) with ValueError``); a rank that never answers is named as such. A later channel of the
same process (a new runtime after every earlier one closed) replaces that state with a live one
at once and ignores the requests made before it.

Every value is signed with a key rank 0 hands to its peers over the process group, and checked
when read (:mod:`.channel_auth`): what others write to the store is ignored and reported in the
next hang report, never believed.

Nothing of this runs on the hot path: recording is the ring buffer's job; the store is touched by
the thread only, and by a failing rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from typing import Any

from polyparallel import _trace
from polyparallel._errors import exception_summary
from polyparallel._trace_report import describe_group, location

from . import channel_auth

__all__ = ["SideChannel", "start", "release", "set_outcome", "outcome_of", "hang_report", "mismatch_message", "where_of", "POLL_S", "STACK_FRAMES"]

POLL_S = 0.2
"""How often each rank's thread looks for a request (seconds)."""
STACK_FRAMES = _trace.STACK_FRAMES
"""Innermost frames of a rank's stack shown in a report."""


_stack_of = _trace._stack_of  # the stack of a rank's collectives thread (the core's, shared with the XLA runtime)


_MISSING = b"\0polyparallel: no such key"
"""What :meth:`SideChannel._read` gets for a missing key (``compare_set`` as a read that never waits)."""
MAX_REJECTED = 8
"""Rejected values whose reason a channel keeps (it counts them all)."""


class SideChannel:
    """One runtime's channel: ``store`` (already prefixed), this ``rank``, the process's recorder,
    and the job's ``key`` (:mod:`.channel_auth`: every value written is signed with it, every value
    read is checked, and one that fails is ignored and counted in :attr:`rejected`)."""

    def __init__(self, store: Any, rank: int, recorder: _trace.Recorder, poll_s: float = POLL_S,
                 key: bytes | None = None):
        self.store, self.rank, self.recorder, self.poll_s = store, rank, recorder, poll_s
        self.key = key if key is not None else os.urandom(channel_auth.KEY_BYTES)
        self.rejected: list[str] = []
        self.rejected_count = 0
        # An earlier channel of this process (an earlier runtime, closed) may have left a request
        # and this rank's state marked ``exited`` under the same prefix. Requests made before this
        # channel are not for it, and a fresh state says the rank is alive.
        self._seen = self._request_gen() or 0
        self._dead = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one publication at a time (thread and failing rank)
        self.publish(self._seen, stack=False, fresh=True)
        self._thread = threading.Thread(target=self._loop, name="polyparallel-trace", daemon=True)
        self._thread.start()

    # -- reading and checking ----------------------------------------------------------------------
    def _read(self, name: str) -> bytes | None:
        """The raw value of ``name``, or ``None`` when there is none (never waits)."""
        raw = self.store.compare_set(name, _MISSING, _MISSING)
        return None if raw == _MISSING else raw

    def _reject(self, why: str) -> None:
        self.rejected_count += 1
        if len(self.rejected) < MAX_REJECTED and why not in self.rejected:
            self.rejected.append(why)
        if self.rejected_count == 1:
            warnings.warn(f"polyparallel's side channel (hang reports) on rank {self.rank} ignored a value in its "
                          f"store: {why}. Something other than this job's ranks writes to the store (see the "
                          "operations guide on hangs).", RuntimeWarning, stacklevel=2)

    def _checked(self, name: str, raw: bytes | None, problem: Any, *args: Any) -> Any:
        if raw is None:
            return None
        value, why = channel_auth.unseal(self.key, name, raw)
        if why is None:
            why = problem(value, *args)
            why = None if why is None else f"{name}: {why}"
        if why is not None:
            self._reject(why)
            return None
        return value

    def _request_gen(self) -> int | None:
        """The generation of the latest valid request, ``None`` when there is none."""
        request = self._checked("request", self._read("request"), channel_auth.request_problem)
        return None if request is None else int(request["gen"])

    # -- the thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                generation = self._request_gen()
            except Exception:  # the store is gone (rank 0 exited): nobody can ask any more
                self._dead = True
                return
            if generation is not None and generation > self._seen:
                try:
                    self.publish(generation)
                except Exception:
                    self._dead = True
                    return

    def publish(self, generation: int, exited: bool = False, stack: bool = True, fresh: bool = False) -> None:
        """Write this rank's state (latest entries, stack) for request ``generation`` (``fresh``:
        the channel's first state, answering no request)."""
        with self._lock:
            self._seen = max(self._seen, generation)
            state = {"rank": self.rank, "gen": generation, "time": time.time(), "exited": exited,
                     "outcome": _SHARED["outcome"] if exited else None,
                     "entries": self.recorder.last(8),
                     "stack": _stack_of(self.recorder.thread) if stack and not exited else None}
            name = f"state/{self.rank}"
            self.store.set(name, channel_auth.seal(self.key, name, state))
        if generation and not exited and not fresh:  # a peer timed out: this rank may be killed next, so write now
            self.recorder.dump("a peer's collective timed out")

    def _ask(self) -> int:
        """Post a request one generation above every earlier one (a compare-and-set, so two ranks
        that ask at once both get an answer); returns its generation."""
        request = b""
        for _ in range(20):
            raw = self._read("request")
            current = self._checked("request", raw, channel_auth.request_problem)
            generation = max(self._seen, 0 if current is None else int(current["gen"])) + 1
            request = channel_auth.seal(self.key, "request", {"gen": generation, "rank": self.rank})
            if self.store.compare_set("request", b"" if raw is None else raw, request) == request:
                return generation
        self.store.set("request", request)  # contended or tampered with all along: post it anyway
        return generation

    def collect(self, ranks: list[int], wait_s: float) -> dict[int, dict[str, Any] | None]:
        """Ask every rank for its state and wait up to ``wait_s`` for the answers of ``ranks``
        (``None`` for a rank that did not answer, or whose answer is not signed with the job's key)."""
        generation = self._ask()
        self.publish(generation, stack=False)  # this rank's own stack is the error's traceback
        states: dict[int, dict[str, Any] | None] = dict.fromkeys(ranks)
        deadline = time.monotonic() + wait_s
        reposted = time.monotonic()
        while True:
            for rank in ranks:
                if states[rank] is not None:
                    continue
                name = f"state/{rank}"
                state = self._checked(name, self._read(name), channel_auth.state_problem, rank)
                if state is not None and (state["gen"] >= generation or state["exited"]):
                    states[rank] = state
            if all(s is not None for s in states.values()) or time.monotonic() > deadline:
                return states
            if time.monotonic() - reposted > 0.5 and (self._request_gen() or 0) < generation:
                self._ask()  # the request was overwritten (by something that does not hold the key)
                reposted = time.monotonic()
            time.sleep(0.05)

    def rejected_note(self) -> str:
        """A line for a report when values were rejected (``""`` when none were)."""
        if not self.rejected_count:
            return ""
        return (f"The side channel ignored {self.rejected_count} value(s) in its store that this job's ranks did "
                f"not write ({'; '.join(self.rejected)}): something else can write to the store (see the "
                "operations guide on hangs: keep the job's stores on loopback or a trusted network).")

    def close(self) -> None:
        """Stop the thread and leave a last state marked ``exited`` (best effort)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1.0)
        if not self._dead:
            if _SHARED["outcome"] is None and sys.exc_info()[1] is not None:
                set_outcome(sys.exc_info()[1])  # closed by a `with` block an exception leaves
            with contextlib.suppress(Exception):
                self.publish(self._seen, exited=True)


STORE_ENV = "POLYPARALLEL_TRACE_STORE"
"""``HOST:PORT`` of a store that outlives the ranks, set by ``polyparallel.launch`` in its workers."""


def _own_store() -> Any:
    """A client of a store that outlives every rank (the launcher's, or torchrun's agent store),
    or ``None``: then the default group's store, which lives in rank 0's process (when rank 0
    exits first, a peer's poll fails once and its channel stops)."""
    import datetime

    import torch.distributed as dist

    endpoint = os.environ.get(STORE_ENV)
    if not endpoint and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        endpoint = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    try:
        return dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=30))
    except Exception:
        return None


def serve_store() -> tuple[Any, str]:
    """A store for the workers' side channels, served by the launcher (it outlives the ranks) on
    loopback only: ``(store, "HOST:PORT")``; keep the store object alive while the workers run."""
    store = channel_auth.loopback_store(wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def _share_key(runtime: Any) -> bytes:
    """The channel's key: drawn by rank 0 and handed to every rank over the default process group
    (a broadcast every rank of the world makes here), so it never goes through a store."""
    import torch
    import torch.distributed as dist

    token = torch.frombuffer(bytearray(os.urandom(channel_auth.KEY_BYTES)), dtype=torch.uint8).to(runtime.device)
    with runtime.collective("share the hang reports' key", "world", record=False):
        dist.broadcast(token, src=0)
    return bytes(token.cpu().tolist())


# One channel per process, shared by its runtimes (refcounted): a peer still working in another
# runtime (another Strategy timeout or topology) must answer too, and its entries are the
# process's anyway (one process is one rank).
_SHARED: dict[str, Any] = {"channel": None, "users": 0, "key": None, "outcome": None}


outcome_of = _trace.outcome_of
"""How the rank's work ended, for its peers' reports (:func:`polyparallel._trace.outcome_of`)."""


def set_outcome(exc: BaseException | None) -> None:
    """Record how this process's work ended (:func:`outcome_of`); the channel's last state says it
    to the peers ("rank 1 failed in training_step (train.py:42) with ValueError", "rank 1 finished").
    The launchers call it when the function or script returns or raises; a channel closed while an
    exception propagates (a session's ``with`` block) says that exception."""
    _SHARED["outcome"] = outcome_of(exc)


def start(runtime: Any) -> SideChannel | None:
    """The process's side channel, for a torch runtime that is making its groups (``None`` when
    tracing is off, at world size 1, or when the default group has no store); release it with
    :func:`release` when the runtime closes."""
    recorder = _trace.get_recorder()
    if recorder is None or runtime.world_size == 1:
        return None
    if _SHARED["channel"] is None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        # First: every rank makes this broadcast (once per process), whatever store it finds. Later
        # channels of the process keep the key, so they read what earlier ones left.
        key = _SHARED["key"] = _SHARED["key"] or _share_key(runtime)
        store = _own_store()
        if store is None:
            try:
                store = distributed_c10d._get_default_store()
            except Exception:  # a default group made without a store we can reach (e.g. by a custom init)
                return None
        # Per torchrun restart: the agent's store outlives the workers.
        prefix = f"polyparallel/trace/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        _SHARED["channel"] = SideChannel(dist.PrefixStore(prefix, store), runtime.rank, recorder, key=key)
    _SHARED["users"] += 1
    return _SHARED["channel"]


def release(channel: SideChannel) -> None:
    """A runtime is done with the channel; the last one closes it."""
    if channel is not _SHARED["channel"]:
        return
    _SHARED["users"] -= 1
    if _SHARED["users"] <= 0:
        _SHARED["channel"], _SHARED["users"] = None, 0
        channel.close()


def hang_report(runtime: Any, axis: str, wait_s: float | None = None) -> tuple[str, str]:
    """What every rank of ``axis``'s group was doing, for a timeout's message (or a backend
    failure's): ``(summary, details)`` (the summary goes on the error's first line, the details,
    such as stacks, below it); ``("", "")`` without a channel. The answers are awaited ``wait_s``
    at most (default: a quarter of the strategy's timeout, 1 to 5 s)."""
    channel: SideChannel | None = getattr(runtime, "side_channel", None)
    if channel is None:
        return "", ""
    if wait_s is None:
        wait_s = min(5.0, max(1.0, runtime.timeout_s / 4))
    try:
        states = channel.collect(runtime.group_ranks(axis), wait_s)
    except Exception as exc:  # the store failed too: say so rather than hide the timeout
        return "", f"\nNo report of the other ranks: the rendezvous store failed too ({exception_summary(exc, first_line=False)})."
    summary, details = describe_group(states, runtime.rank, wait_s)
    note = channel.rejected_note()
    return summary, "".join("\n" + line for line in [*details, *([note] if note else [])])


def where_of(entry: _trace.Entry | None) -> str:
    """The caller's location of an operation (``train.py:57``), from its trace entry or the stack."""
    site, user = (entry.site, entry.user) if entry is not None else _trace.caller(2)
    fmt = lambda loc: None if loc is None else f"{loc[0]}:{loc[1]}"  # noqa: E731
    return location({"site": fmt(site), "user": fmt(user)})


def mismatch_message(mine: tuple[Any, ...], everyone: list[Any], axis: str, ranks: list[int]) -> str:
    """The desync error of an identity check: both sides (operation, sequence number, caller's
    location; the shapes when only they differ), then what every rank of the group called."""
    # A descriptor: (rank, operation, sequence number, detail, refusal, caller's location).
    def side(d: tuple[Any, ...], with_detail: bool, where: bool = False) -> str:
        text = f"{d[1]} #{d[2]}" + (f" at {d[5]}" if where else "")
        if d[4] is not None:
            return f"{text} (refused: {d[4]})"
        return f"{text} ({d[3]})" if with_detail and d[3] else text

    other = next((d for d in everyone if d[1:5] != mine[1:5]), everyone[0])
    detail = mine[1:3] == other[1:3]  # same operation and number: the shapes are what differs
    lines = [
        (f"operations out of step over the {axis!r} axis (group ranks {ranks}): {side(mine, detail)} on rank "
         f"{mine[0]} vs {side(other, detail)} on rank {other[0]} (called at {mine[5]} and {other[5]})."),
        ("Every rank of a group must call the same polyparallel operations in the same order, with the same "
         "shapes (a rank that skipped or added one is reported at its next operation); no payload was exchanged. "
         "Each rank of the group called:"),
        *(f"  rank {d[0]}: {side(d, True, where=True)}" for d in everyone),
        ("The runtime is now broken (the ranks disagree on what comes next): fix the program and restart the "
         "processes."),
    ]
    return "\n".join(lines)
