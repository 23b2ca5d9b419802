"""The caller's side of function mode: wait for the workers, and on the first failure stop them
and raise the root cause (:mod:`.root_cause`).

After the first failure (a worker exited with an error, or saved a failure record) the other ranks
get :data:`GRACE_S` seconds to save their own errors (a peer's collective error may reach the
parent first) and run their teardown; the rest are stopped (SIGTERM, which a worker turns into the
same teardown, then SIGKILL after :data:`STOP_S`), and :class:`polyparallel.LaunchError` carries the
report of the root cause.
"""

from __future__ import annotations

import os
import time
from typing import Any

import polyparallel as pp

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
            raise pp.LaunchError(
                f"launch(): the {nprocs} processes did not finish within {timeout:g} s; they were "
                "terminated. A rank is probably waiting for a collective its peers never called."
            )
        wait([p.sentinel for p in running], timeout=0.2)
    grace_end = time.monotonic() + GRACE_S
    while time.monotonic() < grace_end:
        running = [p for p in processes if p.exitcode is None]
        if not running:
            break
        wait([p.sentinel for p in running], timeout=max(0.0, min(0.2, grace_end - time.monotonic())))
    stopped = {r for r, p in enumerate(processes) if p.exitcode is None}
    stop(processes)
    cause = root_cause(_ends(processes, outdir, nprocs, stopped), nprocs)
    raise pp.LaunchError(cause.message, rank=cause.rank, traceback=cause.traceback)


def _a_rank_failed(processes: list[Any], outdir: str, nprocs: int) -> bool:
    """Whether some rank exited with an error or saved a failure record."""
    return any(p.exitcode not in (None, 0) for p in processes) or any(
        os.path.exists(error_path(outdir, r)) for r in range(nprocs))


def _ends(processes: list[Any], outdir: str, nprocs: int, stopped: set[int]) -> list[RankEnd]:
    """Every rank that did not succeed: it left a failure record, exited with an error, or was stopped."""
    ends = []
    for rank in range(nprocs):
        record = read_failure(error_path(outdir, rank))
        exitcode = processes[rank].exitcode
        if record is not None or rank in stopped or exitcode not in (None, 0):
            ends.append(RankEnd(rank, record, exitcode, stopped=rank in stopped))
    return ends


def stop(processes: list[Any]) -> None:
    """Stop what still runs: SIGTERM (the worker tears down as after a failure), then SIGKILL."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + STOP_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()
