"""The caller's side of function mode: wait for the workers, and on the first failure stop them
and raise the root cause (:mod:`.root_cause`).

After the first failure (a worker exited with an error, or saved a failure record) the other ranks
get :data:`GRACE_S` seconds to save their own errors (a peer's collective error may reach the
parent first) and run their teardown; the rest are stopped (SIGTERM, which a worker turns into the
same teardown, then SIGKILL after :data:`STOP_S`), and :class:`polyparallel.LaunchError` carries the
report of the root cause.

A *frozen* worker (stopped by a signal, SIGSTOP, a paused machine: it cannot run, so a SIGTERM
would stay pending) is killed at once (SIGKILL) once a rank failed: it cannot run its teardown, and its peers'
teardown may wait on its connections. The report names a frozen rank, or a rank still running
without an error of its own, as the suspect when its peers timed out waiting for it
(:mod:`.root_cause`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import polyparallel as pp

from .base import is_frozen
from .launch_dir import error_path
from .records import read_failure
from .root_cause import RankEnd, root_cause

__all__ = ["GRACE_S", "STOP_S", "stop", "supervise"]

GRACE_S = 5.0
"""Seconds the other ranks get, after the first failure, to save their errors and exit."""
STOP_S = 5.0
"""Seconds a worker gets after SIGTERM, before SIGKILL."""


def supervise(processes: list[Any], outdir: str, nprocs: int, timeout: float | None) -> None:
    """Wait for the processes; on the first failure, stop them and raise the root cause."""
    from multiprocessing.connection import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running = [p for p in processes if p.exitcode is None]
        if _a_rank_failed(processes, outdir, nprocs):
            break
        if not running:
            return
        if deadline is not None and time.monotonic() > deadline:
            ice = [r for r, p in enumerate(processes) if p.exitcode is None and is_frozen(p.pid)]
            which = (f" Rank{'s' if len(ice) > 1 else ''} {', '.join(map(str, ice))} "
                     f"{'were' if len(ice) > 1 else 'was'} frozen (stopped by a signal, SIGSTOP)." if ice else
                     " A rank is probably waiting for a collective its peers never called.")
            raise pp.LaunchError(
                f"launch(): the {nprocs} processes did not finish within {timeout:g} s; they were terminated.{which}"
            )
        wait([p.sentinel for p in running], timeout=0.2)
    grace_end = time.monotonic() + GRACE_S
    frozen: set[int] = set()
    while time.monotonic() < grace_end:
        for rank, process in enumerate(processes):
            # Killed at once: it cannot run its teardown, and its peers' teardown may wait on
            # its connections (gloo's destructors do), which its death closes.
            if process.exitcode is None and rank not in frozen and is_frozen(process.pid):
                frozen.add(rank)
                process.kill()
        running = [p for r, p in enumerate(processes) if p.exitcode is None and r not in frozen]
        if not running:
            break
        wait([p.sentinel for p in running], timeout=max(0.0, min(0.2, grace_end - time.monotonic())))
    stopped = {r for r, p in enumerate(processes) if p.exitcode is None} | frozen
    stop(processes)
    cause = root_cause(_ends(processes, outdir, nprocs, stopped, frozen), nprocs)
    raise pp.LaunchError(cause.message, rank=cause.rank, traceback=cause.traceback)


def _a_rank_failed(processes: list[Any], outdir: str, nprocs: int) -> bool:
    """Whether some rank exited with an error or saved a failure record."""
    return any(p.exitcode not in (None, 0) for p in processes) or any(
        os.path.exists(error_path(outdir, r)) for r in range(nprocs))


def _ends(processes: list[Any], outdir: str, nprocs: int, stopped: set[int], frozen: set[int]) -> list[RankEnd]:
    """Every rank that did not succeed: it left a failure record, exited with an error, or was stopped."""
    ends = []
    for rank in range(nprocs):
        record = read_failure(error_path(outdir, rank))
        exitcode = processes[rank].exitcode
        if record is not None or rank in stopped or exitcode not in (None, 0):
            ends.append(RankEnd(rank, record, exitcode, stopped=rank in stopped, frozen=rank in frozen))
    return ends


def stop(processes: list[Any]) -> None:
    """Stop what still runs: SIGTERM (the worker tears down as after a failure), then SIGKILL; a
    frozen worker (which cannot run its teardown) gets SIGKILL at once."""
    for process in processes:
        if process.exitcode is None:
            if is_frozen(process.pid):
                process.kill()
            else:
                process.terminate()
    deadline = time.monotonic() + STOP_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()
