"""A launched process started by ``fork`` (a function of a notebook or of ``python -``) begins as a
copy of its parent: this module makes its polyparallel state the one a fresh process has.

:func:`forget_parent` (first thing in the child) drops the parent's plugin manager (its sessions,
process-group references and atexit registration), its collective-trace recorder, and the
parent's ``atexit`` handlers (a notebook kernel's own); :func:`run_exit_handlers` (last thing)
runs the handlers the child registered, which a forked ``multiprocessing`` child would otherwise
skip (it ends with ``os._exit``). Used by the launchers only; nothing here runs in a parent.
"""

from __future__ import annotations

import atexit
import threading

__all__ = ["forget_parent", "run_exit_handlers"]


def forget_parent() -> None:
    """In a forked child: forget the parent's polyparallel state and ``atexit`` handlers."""
    from . import _manager, _trace

    atexit._clear()  # the parent's handlers (a kernel's, its plugin manager's) are not this process's
    _manager._default = None
    _manager._default_lock = threading.Lock()  # another thread of the parent may have held it
    _trace._RECORDER = None
    _trace._ATEXIT = False
    _trace._SCOPES = []  # the parent's replica threads are not this process's
    _trace._SCOPES_LOCK = threading.Lock()


def run_exit_handlers() -> None:
    """In a forked child, before it ends: run the ``atexit`` handlers it registered."""
    atexit._run_exitfuncs()
