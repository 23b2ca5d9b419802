"""Which rank made a launch fail, and the report that says so: one function for every way to launch.

When workers fail, several usually report an error: the rank that failed first, and the peers
that lost it ("Connection closed by peer", a collective timeout). The launcher reports the root
cause, chosen in this order:

1. the earliest failure that is not a collective failure (its record says; earliest by the
   records' monotonic clock when they all come from one host, else by wall clock);
2. else the lowest rank that ended without a record and was not stopped by the launcher (a
   signal, ``os._exit``: likelier the cause than a peer's collective error, which is what its
   death looks like from the other side);
3. else, when the peers' collectives timed out, the rank they waited for, named as the suspect:
   the lowest one that was frozen (stopped by a signal, SIGSTOP: it cannot run); else, when no
   peer's error already says what every rank was doing (the strategy's own timeouts carry that
   hang report, and so does a backend's timeout raised out of a recorded DDP backward once
   the launcher's worker turned it into one: ``ddp_trace.explained``; a backend's own timeout,
   such as DDP's with ``POLYPARALLEL_TRACE_DDP=0``, does not), the lowest one the
   launcher found alive but silent (no error of its own: it never called the collective, or is
   stuck outside one);
4. else the earliest collective failure that is a polyparallel report naming the peers' side (a
   desync error naming both operations, a timeout with its hang report: the record's
   ``explained``), else the earliest collective failure (a backend's own error, such as gloo's
   timeout raised in an unrecorded DDP backward, names no peer);
5. else the lowest rank the launcher stopped.

The report is the root cause's line (its error in one line, or how it ended), its whole
traceback, and one line per other rank that did not succeed.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RankEnd", "RootCause", "exit_text", "root_cause"]


@dataclass(frozen=True)
class RankEnd:
    """How one rank that did not succeed ended, as its launcher saw it.

    :ivar record: its failure record (:mod:`.records`), when it left one.
    :ivar exitcode: its exit code (negative: the signal that killed it), ``None`` if unknown.
    :ivar stopped: the launcher stopped it after another rank failed.
    :ivar detail: the launcher's own words on how it ended (torchrun's message), if any.
    :ivar frozen: it was stopped by a signal (SIGSTOP, a paused machine) when the launcher
        stopped it: it could not run, so it never answered its peers.
    """

    rank: int
    record: dict[str, Any] | None
    exitcode: int | None
    stopped: bool = False
    detail: str = ""
    frozen: bool = False


@dataclass(frozen=True)
class RootCause:
    """The rank to report, the report, and the root cause's traceback (``""``: it left none)."""

    rank: int
    message: str
    traceback: str


def exit_text(code: int | None) -> str:
    """How a process ended: ``"was killed by SIGKILL"``, ``"exited with code 1"``."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _clock(records: list[dict[str, Any]]) -> Callable[[RankEnd], float]:
    # Monotonic clocks compare on one host only (a wall clock may step between two failures).
    same_host = len({r.get("host") for r in records}) == 1 and all("monotonic" in r for r in records)
    key = "monotonic" if same_host else "time"
    return lambda end: float((end.record or {}).get(key, 0.0))


def _choose(ends: Sequence[RankEnd]) -> RankEnd:
    recorded = [e for e in ends if e.record]
    when = _clock([e.record for e in recorded if e.record])
    own = sorted((e for e in recorded if e.record and not e.record.get("collective")), key=when)
    silent = sorted((e for e in ends if not e.record and not e.stopped), key=lambda e: e.rank)
    # A polyparallel report that names the peers' side beats a backend's bare error (rule 4).
    collective = sorted((e for e in recorded if e.record and e.record.get("collective")),
                        key=lambda e: (not (e.record or {}).get("explained"), when(e)))
    stopped = sorted((e for e in ends if not e.record and e.stopped), key=lambda e: (not e.frozen, e.rank))
    return (own or silent or _waited_for(ends, stopped) or collective or stopped)[0]


def _waited_for(ends: Sequence[RankEnd], stopped: list[RankEnd]) -> list[RankEnd]:
    """The stopped ranks that are suspects (rule 3): frozen ones, or silent ones nobody explained."""
    timeouts = [e.record for e in ends if e.record and e.record.get("timeout")]
    if not timeouts:
        return []
    frozen = [e for e in stopped if e.frozen]
    if frozen or any(r.get("explained") for r in timeouts):
        return frozen
    return stopped


def _line(end: RankEnd) -> str:
    """One other rank's line in the report."""
    if end.record:
        kind = " (collective failure: probably a consequence)" if end.record.get("collective") else ""
        return f"  rank {end.rank}: {end.record['summary']}{kind}"
    detail = f" ({end.detail})" if end.detail else ""
    if end.frozen:
        return f"  rank {end.rank}: frozen (stopped by a signal), killed by the launcher{detail}"
    if end.stopped:
        return f"  rank {end.rank}: stopped by the launcher{detail}"
    return f"  rank {end.rank}: {exit_text(end.exitcode)}, no traceback{detail}"


def root_cause(ends: Sequence[RankEnd], world_size: int | None = None) -> RootCause:
    """The root cause of a failed launch among ``ends`` (every rank that did not succeed) and
    its report; ``world_size``, when known, is named in the report's first line."""
    if not ends:
        raise ValueError("root_cause() needs the ranks that did not succeed; none was given.")
    root = _choose(ends)
    of = f" of {world_size}" if world_size else ""
    others = [_line(end) for end in sorted(ends, key=lambda e: e.rank) if end.rank != root.rank]
    tail = ("\nOther ranks:\n" + "\n".join(others)) if others else ""
    if root.record:
        text = str(root.record["traceback"]).rstrip()
        return RootCause(root.rank, f"rank {root.rank}{of} failed: {root.record['summary']}\n{text}{tail}", text)
    detail = f": {root.detail}" if root.detail else ""
    timeouts = sorted((e for e in ends if e.record and e.record.get("timeout")), key=lambda e: e.rank)
    if root.stopped and timeouts:
        how = ("was frozen (stopped by a signal, SIGSTOP, or its machine paused) and never answered; the launcher "
               "killed it" if root.frozen else
               "was still running but never answered (no error of its own: it skipped a collective its peers "
               "called, or is stuck outside one); the launcher stopped it")
        peer = timeouts[0].record or {}
        return RootCause(root.rank, f"rank {root.rank}{of} is the suspect: its peers' collectives timed out waiting "
                                    f"for it, and it {how}{detail}\nRank {timeouts[0].rank}'s timeout:\n"
                                    f"{str(peer.get('traceback', '')).rstrip()}{tail}", "")
    return RootCause(root.rank, f"rank {root.rank}{of} {exit_text(root.exitcode)} without a traceback (killed, or it "
                                f"ended the process itself){detail}{tail}", "")
