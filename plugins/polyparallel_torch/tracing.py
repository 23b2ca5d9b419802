"""The side channel of the torch runtime's hang reports: every rank's recent collectives and stack,
exchanged through the rendezvous store, which still works when the process group is stuck.

Each runtime of a world larger than one starts a :class:`SideChannel`: a daemon thread that polls
one counter in the default group's store (``store.add(key, 0)``, 5 times a second: one small
request, no work on the training thread) under a prefix of its own. A rank whose collective times
out (:meth:`SideChannel.collect`) bumps the counter and publishes its own state; every rank's
thread then publishes its latest trace entries (:mod:`polyparallel._trace`) and the Python stack
of the thread that runs its collectives (``sys._current_frames``), which it can do while that
thread is blocked in a collective (the backend releases the GIL while it waits) or busy in
Python (the interpreter switches threads every few milliseconds). The waiting rank reads them
for a few seconds and :func:`polyparallel._trace_report.describe_group` turns them into the
lines of its :class:`polyparallel.CollectiveTimeout`. A rank whose runtime closed publishes a
last state marked ``exited``; a rank that never answers is named as such. A later channel of the
same process (a new runtime after every earlier one closed) replaces that state with a live one
at once and ignores the requests made before it.

Nothing of this runs on the hot path: recording is the ring buffer's job; the store is touched by
the thread only, and by a failing rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from polyparallel import _trace
from polyparallel._errors import exception_summary
from polyparallel._trace_report import describe_group, location

__all__ = ["SideChannel", "start", "release", "hang_report", "mismatch_message", "where_of", "POLL_S", "STACK_FRAMES"]

POLL_S = 0.2
"""How often each rank's thread looks for a request (seconds)."""
STACK_FRAMES = 12
"""Innermost frames of a rank's stack shown in a report."""


def _stack_of(ident: int | None) -> str | None:
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return None
    return "".join(traceback.format_list(traceback.extract_stack(frame)[-STACK_FRAMES:]))


class SideChannel:
    """One runtime's channel: ``store`` (already prefixed), this ``rank``, the process's recorder."""

    def __init__(self, store: Any, rank: int, recorder: _trace.Recorder, poll_s: float = POLL_S):
        self.store, self.rank, self.recorder, self.poll_s = store, rank, recorder, poll_s
        # The prefix changes only per torchrun restart: an earlier channel of this process (an
        # earlier runtime, closed) may have left the request counter up and this rank's state
        # marked ``exited``. Requests made before this channel are not for it, and a fresh state
        # says the rank is alive (a peer's collect would otherwise report it as exited).
        self._seen = int(store.add("request", 0))
        self._dead = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one publication at a time (thread and failing rank)
        self.publish(self._seen, stack=False, fresh=True)
        self._thread = threading.Thread(target=self._loop, name="polyparallel-trace", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                generation = int(self.store.add("request", 0))
                if generation > self._seen:
                    self.publish(generation)
            except Exception:  # the store is gone (rank 0 exited): nobody can ask any more
                self._dead = True
                return

    def publish(self, generation: int, exited: bool = False, stack: bool = True, fresh: bool = False) -> None:
        """Write this rank's state (latest entries, stack) for request ``generation`` (``fresh``:
        the channel's first state, answering no request)."""
        with self._lock:
            self._seen = max(self._seen, generation)
            state = {"rank": self.rank, "gen": generation, "time": time.time(), "exited": exited,
                     "entries": self.recorder.last(8),
                     "stack": _stack_of(self.recorder.thread) if stack and not exited else None}
            self.store.set(f"state/{self.rank}", json.dumps(state))
        if generation and not exited and not fresh:  # a peer timed out: this rank may be killed next, so write now
            self.recorder.dump("a peer's collective timed out")

    def collect(self, ranks: list[int], wait_s: float) -> dict[int, dict[str, Any] | None]:
        """Ask every rank for its state and wait up to ``wait_s`` for the answers of ``ranks``
        (``None`` for a rank that did not answer)."""
        generation = int(self.store.add("request", 1))
        self.publish(generation, stack=False)  # this rank's own stack is the error's traceback
        states: dict[int, dict[str, Any] | None] = dict.fromkeys(ranks)
        deadline = time.monotonic() + wait_s
        while True:
            for rank in ranks:
                if states[rank] is not None:
                    continue
                key = f"state/{rank}"
                if self.store.check([key]):
                    state = json.loads(self.store.get(key))
                    if state["gen"] >= generation or state.get("exited"):
                        states[rank] = state
            if all(s is not None for s in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the thread and leave a last state marked ``exited`` (best effort)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1.0)
        if not self._dead:
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
    """A store for the workers' side channels, served by the launcher (it outlives the ranks):
    ``(store, "HOST:PORT")``; keep the store object alive while the workers run."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


# One channel per process, shared by its runtimes (refcounted): a peer still working in another
# runtime (another Strategy timeout or topology) must answer too, and its entries are the
# process's anyway (one process is one rank).
_SHARED: dict[str, Any] = {"channel": None, "users": 0}


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

        store = _own_store()
        if store is None:
            try:
                store = distributed_c10d._get_default_store()
            except Exception:  # a default group made without a store we can reach (e.g. by a custom init)
                return None
        # Per torchrun restart: the agent's store outlives the workers.
        prefix = f"polyparallel/trace/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        _SHARED["channel"] = SideChannel(dist.PrefixStore(prefix, store), runtime.rank, recorder)
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


def hang_report(runtime: Any, axis: str) -> tuple[str, str]:
    """What every rank of ``axis``'s group was doing, for a timeout's message: ``(summary, details)``
    (the summary goes on the error's first line, the details, such as stacks, below it);
    ``("", "")`` without a channel."""
    channel: SideChannel | None = getattr(runtime, "side_channel", None)
    if channel is None:
        return "", ""
    wait_s = min(5.0, max(1.0, runtime.timeout_s / 4))
    try:
        states = channel.collect(runtime.group_ranks(axis), wait_s)
    except Exception as exc:  # the store failed too: say so rather than hide the timeout
        return "", f"\nNo report of the other ranks: the rendezvous store failed too ({exception_summary(exc, first_line=False)})."
    summary, details = describe_group(states, runtime.rank, wait_s)
    return summary, "".join("\n" + line for line in details)


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
