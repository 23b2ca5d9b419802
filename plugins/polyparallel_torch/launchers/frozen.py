"""Script mode's frozen workers: :class:`FrozenWatch` kills, once a worker has ended, the workers
that are frozen (stopped by a signal, SIGSTOP, a paused machine).

torchrun's agent stops the other workers of a failed job with SIGTERM and waits 30 s before
SIGKILL; a frozen worker cannot receive the SIGTERM, so every such job took 30 s more than its
failure. The watch, a daemon thread of ``polyparallel launch`` (the agent's process, whose
children the workers are), polls the workers' states in ``/proc`` a few times a second: once one
of them has failed (it saved its failure record, ``TORCHELASTIC_ERROR_FILE``) or ended, a frozen
peer can only hold the job: it kills the frozen ones (their death also closes the connections
that the failed worker's exit would wait on), and the report names them (:func:`.torchrun.launch_script`). Function mode does the same in
:mod:`.supervise`.
"""

from __future__ import annotations

import os
import signal
import threading

from .base import is_frozen, proc_state

__all__ = ["FrozenWatch"]


class FrozenWatch:
    """A context manager: while it is open, frozen workers of this process are killed once a
    worker has ended; :attr:`killed` holds their pids."""

    def __init__(self, marker: str, poll_s: float = 0.25) -> None:
        self.marker = marker  # a word of the workers' command lines (their module)
        self.poll_s = poll_s
        self.killed: set[int] = set()
        self._parent = os.getpid()
        self._seen: set[int] = set()
        self._error_files: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="polyparallel-frozen-watch", daemon=True)

    def __enter__(self) -> FrozenWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1.0)

    def _workers(self) -> set[int]:
        found: set[int] = set()
        try:
            entries = os.listdir("/proc")
        except OSError:
            return found
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self._parent:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if self.marker.encode() in f.read():
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for pid in self._workers() - self._seen:
                self._seen.add(pid)
                self._error_files[pid] = _error_file(pid)
            ended = any(proc_state(pid) in (None, "Z") for pid in self._seen) or any(
                path and os.path.exists(path) for path in self._error_files.values())
            if not ended:
                continue
            for pid in self._seen - self.killed:
                if is_frozen(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.add(pid)


def _error_file(pid: int) -> str:
    """Where the worker saves its failure record (its ``TORCHELASTIC_ERROR_FILE``), ``""`` if unknown."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"TORCHELASTIC_ERROR_FILE="):
                    return item.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        pass
    return ""
