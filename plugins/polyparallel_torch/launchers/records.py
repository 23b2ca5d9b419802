"""The failure record: what a failed worker leaves for its launcher, in one format for every way
to launch.

A worker whose function or script raised writes one file, atomically (a worker stopped while it
writes leaves no file rather than half of one: torchrun's agent, reading half a file, failed the
whole launch with a ``JSONDecodeError`` instead of restarting it). The file has the layout of
torch's ``ErrorHandler``, which torchrun's agent reads (``message``, with the traceback and a
timestamp), plus a ``polyparallel`` record, which is what the launchers read
(:func:`record_of`):

- ``rank``, ``world_size``: where the worker was;
- ``host``, ``time`` (wall clock), ``monotonic`` (this host's clock): when it failed, to order
  the failures (:mod:`.root_cause` uses the monotonic clock when all records come from one host);
- ``collective``: whether the error is a collective failure, which is usually a consequence of
  a peer's failure (:func:`polyparallel_torch.backend_errors.is_collective_failure`);
- ``timeout``: whether it is a collective timeout (a peer never answered:
  :func:`polyparallel_torch.backend_errors.is_timeout`); ``explained``: whether the error itself
  says what every peer was doing (a :class:`polyparallel.CollectiveTimeout` of the strategy's
  operations carries the hang report, the desync error of an identity check names both sides; a
  backend's own timeout, DDP's in an unrecorded backward, does neither: :func:`explains`);
- ``summary``: the error in one line; ``traceback``: all of it.

Function mode writes it as ``<rank>.err.json`` in the launch directory, script mode where
torchrun asks (``TORCHELASTIC_ERROR_FILE``).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from typing import Any

import polyparallel as pp
from polyparallel._errors import exception_summary

from ..backend_errors import is_collective_failure, is_timeout
from .base import write_atomically

__all__ = ["explains", "failure_record", "read_failure", "record_of", "write_failure"]


def failure_record(exc: BaseException, rank: int, world_size: int | None) -> dict[str, Any]:
    """The ``polyparallel`` record of ``exc``, raised on ``rank`` of ``world_size``."""
    return {
        "rank": rank, "world_size": world_size, "host": socket.gethostname(), "time": time.time(),
        "monotonic": time.monotonic(), "collective": is_collective_failure(exc), "timeout": is_timeout(exc),
        "explained": explains(exc), "summary": exception_summary(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def explains(exc: BaseException) -> bool:
    """Whether ``exc`` is a polyparallel report that says what the peers were doing: a
    :class:`polyparallel.CollectiveTimeout` (with its hang report) or the desync error of an
    identity check, which names both sides, or a backend failure with the peers' states from the
    side channel, "rank 1 finished" (``peers_named``)."""
    return isinstance(exc, pp.CollectiveTimeout) or bool(getattr(exc, "peers_named", False))


def write_failure(path: str, exc: BaseException, rank: int, world_size: int | None) -> None:
    """Write ``exc``'s failure file at ``path`` (nothing if its folder is gone: the launcher was
    killed and took it along)."""
    record = failure_record(exc, rank, world_size)
    data = {
        "message": {"message": exception_summary(exc, first_line=False),
                    "extraInfo": {"py_callstack": record["traceback"], "timestamp": str(int(record["time"]))}},
        "polyparallel": record,
    }
    try:
        write_atomically(path, json.dumps(data).encode())
    except OSError:
        pass


def record_of(data: Any) -> dict[str, Any] | None:
    """The ``polyparallel`` record in a failure file's data (``None`` when the file is not ours:
    torchrun's agent hands back whatever a worker wrote there)."""
    record = data.get("polyparallel") if isinstance(data, dict) else None
    return record if isinstance(record, dict) else None


def read_failure(path: str) -> dict[str, Any] | None:
    """The record of the failure file at ``path``, ``None`` when there is none (or not ours)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return record_of(json.load(f))
    except (OSError, ValueError):
        return None
