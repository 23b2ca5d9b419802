"""``python -m polyparallel_torch.launchers.script_worker SCRIPT [ARGS]``: one worker of ``polyparallel launch``.

torchrun starts every worker through this module (as ``python -u -P -m
polyparallel_torch.launchers.script_worker``, :mod:`.torchrun`), which runs the script as
``__main__`` like ``python SCRIPT`` (the script's folder first on ``sys.path``, the working
directory not on it) and, when it raises, writes its failure record where torchrun's agent looks
for it (``TORCHELASTIC_ERROR_FILE``; the format: :mod:`.records`) and prints one line instead of
the traceback. The launcher (:func:`.torchrun.launch_script`) then prints the report of the root
cause once, instead of N interleaved tracebacks. A script that exits by ``SystemExit`` exits as
it asked.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from polyparallel._errors import exception_summary

__all__ = ["LAUNCHER_ENV", "main", "record_error"]

LAUNCHER_ENV = "POLYPARALLEL_LAUNCHER_PID"
"""The process id of ``polyparallel launch`` (whose torchrun agent starts the workers): a worker
ends when it dies, even by SIGKILL (the parent-death signal, as ``pp.launch``'s workers have)."""


def record_error(exc: BaseException) -> None:
    """Write ``exc`` to ``TORCHELASTIC_ERROR_FILE`` (nothing when torchrun did not set it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    from .records import write_failure

    world = os.environ.get("WORLD_SIZE")
    write_failure(path, exc, int(os.environ.get("RANK", "0")), int(world) if world else None)


def _script_path_first(folder: str) -> None:
    """Make ``sys.path`` what ``python SCRIPT`` gives: the script's folder first, the working
    directory not at all (its json.py or typing.py would shadow the standard library's). The
    launcher starts this module with ``python -P -m`` so that the interpreter never adds the
    working directory (a plain ``-m`` does, before any import of this module could undo it)."""
    if os.environ.get("PYTHONSAFEPATH"):
        return  # the user asked for a safe path: `python SCRIPT` would add nothing either
    if __name__ == "__main__" and not getattr(sys.flags, "safe_path", False) and sys.path:  # 3.11+
        sys.path[0] = folder  # a plain `python -m`: replace the working directory it put first
    else:
        sys.path.insert(0, folder)


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m polyparallel_torch.launchers.script_worker SCRIPT [ARGS]")
    script = argv[0]
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit():  # SIGTERM when the launcher dies; exit at once if it already has
        from .base import end_with_parent

        end_with_parent(int(launcher))
    sys.argv = argv
    _script_path_first(os.path.dirname(os.path.abspath(script)))
    from ..tracing import set_outcome

    try:
        runpy.run_path(script, run_name="__main__")
        set_outcome(None)  # the peers' reports: "rank 1 finished" (its runtime closes at exit)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as raised:
        from ..ddp_trace import explained

        # A backend error DDP raised out of a recorded backward: the runtime's own error, with the
        # hang report (the raw one is its cause).
        exc = explained(raised) or raised
        set_outcome(exc)
        record_error(exc)
        rank = os.environ.get("RANK", "?")
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            print(f"[rank {rank}] {exception_summary(exc)} "
                  "(the launcher reports the first failing rank)", file=sys.stderr, flush=True)
        else:  # not under the launcher: nobody else would show it
            traceback.print_exception(exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
