"""What every way to launch shares: a port for the rendezvous, the environment that tells a
worker its rank, a worker's signals, and atomic writes of the files a launcher reads."""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

__all__ = ["Stopped", "end_with_parent", "free_port", "is_frozen", "proc_state", "rank_environment", "stop_on_sigterm",
           "write_atomically"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a local rendezvous)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
                     master_port: int) -> dict[str, str]:
    """The variables torch.distributed (and :func:`polyparallel.Session`) read a process's place
    in the world from, as torchrun sets them."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


# -- a worker's signals ---------------------------------------------------------------------------------------------


class Stopped(BaseException):
    """The launcher sent SIGTERM: another rank failed and this one is being stopped."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not interrupt the teardown
    raise Stopped()


def stop_on_sigterm() -> None:
    """Turn the first SIGTERM into :class:`Stopped` (raised wherever the worker is), so that a
    stopped worker tears down like a failed one; later ones are ignored."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def end_with_parent(parent: int) -> None:
    """SIGTERM when the process ``parent`` (the launcher) dies; exit at once if it already has.
    (torch asks for SIGINT, which a shell may have set to be ignored for background jobs, and
    which user code catches as KeyboardInterrupt.) Only Linux has the parent-death signal."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        raise SystemExit(1)


def proc_state(pid: int) -> str | None:
    """The process's state letter in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` ended but not
    reaped), ``None`` when it is gone (or where there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_frozen(pid: int | None) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it cannot run."""
    return pid is not None and proc_state(pid) in ("T", "t")


# -- files ---------------------------------------------------------------------------------------------------------


def write_atomically(path: str, data: bytes) -> None:
    """Write ``path`` so that a reader sees either no file or all of it, never a part (a worker may
    be killed while it writes; a launcher may read at any moment)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
