"""Script mode: ``polyparallel launch SCRIPT`` hands the script to ``torch.distributed.run``, the
elastic agent torchrun uses (multi-node rendezvous, restarts).

Each worker runs the script through :mod:`.script_worker`, which saves a failure for the agent
(:mod:`.records`) instead of printing its traceback: when workers fail, :func:`launch_script`
prints the report of the root cause once (:mod:`.root_cause`, as function mode does), not one
traceback per rank.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from collections.abc import Set as AbstractSet
from typing import Any

from polyparallel._errors import exception_summary

from .base import free_port
from .frozen import FrozenWatch
from .records import record_of
from .root_cause import RankEnd, root_cause
from .script_worker import LAUNCHER_ENV

__all__ = ["launch_script"]

WORKER_MODULE = "polyparallel_torch.launchers.script_worker"
"""The module every worker runs the script through (``python -m``)."""


def launch_script(command: list[str], options: dict[str, Any]) -> int:
    """``polyparallel launch``: hand the command to ``torch.distributed.run`` (torchrun).

    ``options`` are the command's, validated by it: with no ``rdzv_endpoint`` (or port 0) on one
    node, the rendezvous is 127.0.0.1 on a free port; ``rdzv_timeout`` bounds how long the agents
    wait for every node to join; ``trace_dir`` makes every worker write its collective trace there.
    Returns the exit code.
    """
    problem = script_problem(command)
    if problem is not None:
        print(f"polyparallel launch: {problem}", file=sys.stderr, flush=True)
        return 2
    from torch.distributed import run as torchrun

    endpoint = options.get("rdzv_endpoint") or "127.0.0.1:0"
    host, _, port = endpoint.rpartition(":")
    if port in ("", "0"):
        host = host or "127.0.0.1"
        endpoint = f"{host}:{free_port(host.strip('[]'))}"
    argv = [
        f"--nproc-per-node={options.get('nproc_per_node', 1)}",
        f"--nnodes={options.get('nnodes', 1)}",
        f"--node-rank={options.get('node_rank', 0)}",
        f"--max-restarts={options.get('max_restarts', 0)}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
    ]
    if options.get("rdzv_timeout") is not None:
        argv.append(f"--rdzv-conf=join_timeout={max(1, math.ceil(options['rdzv_timeout']))}")
    # With restarts, torchrun's default of sharing its rendezvous store with the workers hands a
    # restarted worker the previous attempt's gloo/nccl addresses (pytorch/pytorch#135712: the
    # restarted init_process_group fails with "Connection refused"); a store per attempt avoids
    # it. Set only while torchrun runs, unless the user chose a value.
    fresh_store = options.get("max_restarts", 0) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    if fresh_store:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if command and not command[0].startswith("-"):  # a script: run through the reporting wrapper
        # -P: the interpreter does not put the working directory first on sys.path (`-m` would,
        # and `python SCRIPT` does not); the wrapper puts the script's folder there instead.
        # torchrun's own `-m` cannot take interpreter flags: it runs the command as given instead
        # (with -u, as it would). -P exists from Python 3.11; on 3.10 the wrapper replaces
        # sys.path[0] itself, after its own few imports.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        argv += ["--no-python", os.getenv("PYTHON_EXEC", sys.executable), "-u", *safe_path, "-m", WORKER_MODULE]
    trace_dir = options.get("trace_dir")
    saved = {name: os.environ.get(name) for name in ("POLYPARALLEL_TRACE_DIR", LAUNCHER_ENV)}
    # The agent (torchrun.run, in this process) hands this process's environment to the workers.
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers end with this process (script_worker)
    if trace_dir:
        os.environ["POLYPARALLEL_TRACE_DIR"] = os.path.abspath(trace_dir)
    watch = FrozenWatch(WORKER_MODULE)
    try:
        with watch:
            torchrun.run(torchrun.parse_args([*argv, *command]))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError

        if isinstance(exc, ChildFailedError):
            print(f"polyparallel launch: {_report(exc.failures, watch.killed)}", file=sys.stderr, flush=True)
            return 1
        hint = ""
        if isinstance(exc, RendezvousError):
            hint = (f" (rendezvous at {endpoint}, --nnodes {options.get('nnodes', 1)}). Not every node joined in "
                    f"time (--rdzv-timeout {options.get('rdzv_timeout')} s): start the same command on every node, "
                    "with the same --nnodes and --rdzv-endpoint (a HOST:PORT all nodes reach) and its own --node-rank.")
        print(f"polyparallel launch: {exception_summary(exc)}{hint}", file=sys.stderr, flush=True)
        return 1
    finally:
        if fresh_store:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


def script_problem(command: list[str]) -> str | None:
    """Why the script cannot run (missing, or it does not compile), judged before any agent or
    worker starts (a worker would fail only after the rendezvous, every rank alike); ``None``
    when it can. A command that starts with an option (``-m``) is torchrun's to run."""
    if not command or command[0].startswith("-"):
        return None
    script = command[0]
    if not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" (looked for in {os.getcwd()})"
        return f"no such script: {script!r}{where}. No process was started: give the path of a Python script."
    try:
        with open(script, "rb") as f:
            compile(f.read(), script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        line = f"\n    {exc.text.rstrip()}" if exc.text else ""
        return (f"{script}:{exc.lineno}: {type(exc).__name__}: {exc.msg}{line}\nNo process was started: fix the "
                "script and launch again.")
    except (OSError, ValueError) as exc:
        return f"cannot read the script {script!r}: {exc}. No process was started."
    return None


def _report(failures: dict[int, Any], frozen: AbstractSet[int] = frozenset()) -> str:
    """The report of torchrun's failed workers (``ProcessFailure`` by global rank); ``frozen``:
    the pids of the frozen workers the watch killed (:mod:`.frozen`)."""
    ends = []
    for rank, failure in sorted(failures.items()):
        record = record_of(failure.error_file_data)
        was_frozen = record is None and failure.pid in frozen
        # SIGTERM is how the agent stops the other workers once one failed: a consequence, not a cause.
        stopped = record is None and (failure.exitcode == -signal.SIGTERM or was_frozen)
        ends.append(RankEnd(rank, record, failure.exitcode, stopped=stopped, frozen=was_frozen,
                            detail="" if record or was_frozen else str(failure.message)))
    # The agent does not know the world size; the workers' records say it.
    sizes = [int(e.record["world_size"]) for e in ends if e.record and e.record.get("world_size")]
    world = max(sizes) if sizes else (int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None)
    return root_cause(ends, world).message
