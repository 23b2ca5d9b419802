"""What an exception from torch.distributed means: a timeout, or the consequence of a peer's failure.

The ground floor of the runtime and the launchers (imports nothing of the plugin, and torch only
when asked). Both questions are answered by exception type where torch has one, and by the
backend's message where it has none, each in one small function here:

- :func:`is_timeout`: torch raises no exception type of its own for a timeout. Measured with
  torch 2.13 and gloo, a collective that ran out of time raises a plain ``RuntimeError``
  ("Operation timed out!" from ``Work.wait(timeout)``, "Application timeout caused pair closure"
  from a blocking call, "Timed out waiting 2000ms for recv operation to complete" on a
  sub-group); NCCL raises ``DistBackendError`` for timeouts and for every other failure alike
  ("Watchdog caught collective operation timeout"). Only the message tells them apart.
- :func:`is_collective_failure`: a ``polyparallel.CollectiveError`` or any ``torch.distributed.DistError``
  (backend, network and store errors), in the exception or its causes; gloo reports a peer that
  went away as a plain ``RuntimeError`` ("Connection closed by peer", "Broken pipe"), so its words
  are matched too.
"""

from __future__ import annotations

import re

import polyparallel as pp

__all__ = ["is_collective_failure", "is_timeout"]

# Text of the errors gloo/nccl raise when a peer has gone (they arrive as RuntimeError or DistError).
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|third_party/gloo/|ProcessGroupGloo|"
                        r"ProcessGroupNCCL|NCCL (error|communicator)", re.IGNORECASE)


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend's error says that a collective ran out of time (by its message: torch
    has no exception type for it, see the module documentation)."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def is_collective_failure(exc: BaseException) -> bool:
    """A polyparallel collective error or a backend's connection error, in ``exc`` or its causes."""
    from torch.distributed import DistError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (pp.CollectiveError, DistError)):
            return True
        if isinstance(current, RuntimeError) and _PEER_GONE.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False
