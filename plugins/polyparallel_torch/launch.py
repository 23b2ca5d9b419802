"""Launching: ``polyparallel.launch`` on spawned processes, ``polyparallel launch`` on torchrun.

:func:`launch_function` starts ``nprocs`` processes with ``torch.multiprocessing`` (spawn) and
supervises them itself; :func:`launch_script` hands a script to ``torch.distributed.run`` (the
elastic agent torchrun uses: multi-node rendezvous, restarts).

**Teardown policy** (one for every launched worker, whatever the outcome):

1. The outcome is saved first: the pickled result, or the error (traceback, timestamps, and
   whether it is a collective failure) as ``<rank>.err.json`` in the launch's directory.
2. On success the worker waits, bounded by the strategy's timeout, until every rank has saved an
   outcome (a file barrier, not a collective: it needs no working group and sees a failed peer
   at once), so no peer still uses the process groups.
3. It closes its sessions: ``polyparallel_session_finish`` hooks, then the runtime's finalizers.
   When every rank finished, the groups are destroyed. When this rank or a peer failed (or the
   barrier ran out), the runtime is first marked broken, so closing drops its references without
   destroying groups that a peer may still be blocked in.
4. It collects garbage (so objects that hold groups in reference cycles, such as DDP models, are
   freed while the interpreter is whole) and exits normally: ``atexit`` handlers run and open
   files are flushed. Exit code 0 on success, 1 on failure.

Step 4 is measured (2 gloo ranks training DDP, 20 launches per variant, torch 2.13): a normal
exit without that collection aborted 1 to 7 launches in 20 in gloo's threads ("terminate called
without an active exception"), barrier or not, groups destroyed or not; with it, none of 120
did (success and error, groups destroyed or kept, a DDP model kept in a module global).

**Error reporting.** Whichever process exits first, the launcher reports the root cause: after
the first failure it gives the other ranks :data:`GRACE_S` seconds to save their errors and exit,
stops the rest (SIGTERM, which a worker turns into the same teardown, then SIGKILL), and raises
:class:`polyparallel.LaunchError` with the earliest failure that is not a collective failure
(a peer's "Connection closed by peer" is a consequence), its full traceback, and one line per
other failed rank.

**Temporary directory.** Each launch works in ``$TMPDIR/polyparallel-launch-<pid>-<random>``,
removed when the launch ends. It holds a lock for the launcher's lifetime, so a directory left
by a killed launcher is recognised (its lock is free) and removed by the next launch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import polyparallel as pp
from polyparallel._errors import exception_summary

__all__ = ["launch_function", "launch_script", "free_port", "remove_stale_launch_dirs", "GRACE_S"]

GRACE_S = 5.0
"""Seconds the other ranks get, after the first failure, to save their errors and exit."""
_STOP_S = 5.0  # after SIGTERM, before SIGKILL
_DIR_PREFIX = "polyparallel-launch-"
_LOCK_NAME = "launcher.lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: launches work, stale directories are not judged
    fcntl = None  # type: ignore[assignment]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a local rendezvous)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- the worker ------------------------------------------------------------------------------------------------


class _Stopped(BaseException):
    """The launcher sent SIGTERM: another rank failed and this one is being stopped."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not interrupt the teardown
    raise _Stopped()


def _end_with_launcher(launcher: int) -> None:
    """SIGTERM when the launcher dies (torch asks for SIGINT, which a shell may have set to be
    ignored for background jobs, and which user code catches as KeyboardInterrupt)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before prctl took effect
        raise SystemExit(1)


def _worker(local_rank: int, fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int,
            port: int, outdir: str, args: tuple, kwargs: dict, launcher: int, trace_dir: str | None = None,
            trace_store: str | None = None) -> None:
    _end_with_launcher(launcher)
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    if trace_dir is not None:  # written when a collective fails and at exit (polyparallel._trace)
        from polyparallel import _trace

        _trace.configure(trace_dir, rank=local_rank, world_size=nprocs)
    if trace_store is not None:  # the hang reports' side channel (tracing.py), served by the launcher
        os.environ["POLYPARALLEL_TRACE_STORE"] = trace_store
    code = 1
    broken: str | None = "stopped by the launcher after another rank failed"
    try:
        broken = _run(local_rank, fn, strategy, outdir, args, kwargs)
        if broken is None:
            code = 0
            broken = _wait_for_peers(outdir, nprocs, strategy.timeout)
    except _Stopped:
        pass
    try:
        _close_sessions(strategy, broken)
    except _Stopped:
        code = 1
    except BaseException as exc:  # a session_finish hook failed: this rank's error, unless it has one
        if not os.path.exists(_error_path(outdir, local_rank)):
            _save_error(outdir, local_rank, exc)
        code = 1
    # Outside every except block: no traceback keeps fn's frames (and the models in them) alive.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)  # SystemExit passes torch's wrapper untouched: a normal interpreter exit


def _run(rank: int, fn: Callable[..., Any], strategy: pp.Strategy, outdir: str, args: tuple,
         kwargs: dict) -> str | None:
    """Run ``fn`` and save its outcome; ``None`` on success, else why the groups are unsafe."""
    try:
        # The launcher makes the runtime (process group, mesh) so that fn needs no setup call,
        # and a rank that skips an early collective still leaves its peers a group to time out in.
        from .runtime import get_runtime

        get_runtime(strategy.session())
        result = fn(*args, **kwargs)
        _save(outdir, f"{rank}.pkl", pickle.dumps(result))
        return None
    except _Stopped:
        raise
    except BaseException as exc:
        # Saved before any teardown: a peer that dies of our exit must not be reported instead of us.
        _save_error(outdir, rank, exc)
        return f"rank {rank} failed: {exception_summary(exc, first_line=False)}"


def _wait_for_peers(outdir: str, nprocs: int, timeout: float) -> str | None:
    """Wait until every rank saved an outcome; ``None`` if all succeeded, else why not."""
    deadline = time.monotonic() + timeout
    while True:
        names = set(os.listdir(outdir))
        failed = [r for r in range(nprocs) if f"{r}.err.json" in names]
        if failed:
            return f"rank {failed[0]} failed"
        if all(f"{r}.pkl" in names for r in range(nprocs)):
            return None
        if time.monotonic() > deadline:
            return f"a peer was still running {timeout:g} s after this rank finished"
        time.sleep(0.02)


def _close_sessions(strategy: pp.Strategy, broken: str | None) -> None:
    """Close every session of this process; with ``broken``, keep the groups (see the module doc)."""
    managers = [strategy.plugin_manager]
    if pp.get_plugin_manager() is not managers[0]:
        managers.append(pp.get_plugin_manager())
    if broken is not None:
        for runtime in _runtimes(managers):
            runtime.mark_broken(broken)
    errors = []
    for manager in managers:
        try:
            manager.close_sessions()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _runtimes(managers: list[Any]) -> Iterator[Any]:
    from .runtime import _STASH_KEY, TorchRuntime

    seen: set[int] = set()
    for manager in managers:
        for session in manager.sessions():
            runtime = session.peek(_STASH_KEY)  # get_runtime() stashes the shared runtime there
            if isinstance(runtime, TorchRuntime) and id(runtime) not in seen:
                seen.add(id(runtime))
                yield runtime


def _save(outdir: str, name: str, data: bytes) -> None:
    tmp = os.path.join(outdir, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(outdir, name))  # atomic: readers never see half a file


def _error_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"{rank}.err.json")


def _save_error(outdir: str, rank: int, exc: BaseException) -> None:
    record = {
        "rank": rank, "monotonic": time.monotonic(), "time": time.time(),
        "collective": _is_collective_failure(exc),
        "summary": exception_summary(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    with contextlib.suppress(OSError):  # the directory may be gone if the launcher was killed
        _save(outdir, f"{rank}.err.json", json.dumps(record).encode())


# Text of the errors gloo/nccl raise when a peer has gone (they arrive as RuntimeError or DistError).
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|third_party/gloo/|ProcessGroupGloo|"
                        r"ProcessGroupNCCL|NCCL (error|communicator)", re.IGNORECASE)


def _is_collective_failure(exc: BaseException) -> bool:
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


# -- the launcher -------------------------------------------------------------------------------------------------


def launch_function(fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int, args: tuple, kwargs: dict,
                    timeout: float | None = None, trace_dir: str | None = None) -> list[Any]:
    """Run ``fn`` in ``nprocs`` spawned processes; results by rank. See :func:`polyparallel.launch`
    and the module documentation (teardown, error reporting).

    Refuses, before any process starts, a ``timeout`` that is not a positive number of seconds
    and a communication backend this machine cannot run (``nccl`` without enough CUDA devices).
    With ``trace_dir``, every worker writes its collective trace there (``rank<r>.jsonl``).
    """
    timeout = _check_timeout(timeout)
    _check_backend(strategy.backend, nprocs)
    import torch.multiprocessing as mp

    remove_stale_launch_dirs()
    with _launch_dir() as outdir:
        context = None
        from polyparallel import _trace

        from .tracing import serve_store

        # The side channel's store lives here, so a rank's report still reaches its peers after
        # rank 0 (which holds the process group's store) has gone.
        store, endpoint = serve_store() if nprocs > 1 and _trace.enabled() else (None, None)
        try:
            context = mp.start_processes(
                _worker, args=(fn, strategy, nprocs, free_port(), outdir, args, kwargs, os.getpid(), trace_dir,
                               endpoint),
                nprocs=nprocs, join=False, start_method="spawn",
            )
            _supervise(context.processes, outdir, nprocs, timeout)
            return [_load_result(outdir, rank, context.processes[rank].exitcode) for rank in range(nprocs)]
        finally:
            if context is not None:
                _stop(context.processes)
                for process in context.processes:
                    # The pipes multiprocessing keeps per process, else open until garbage collection.
                    process.close()
            del store


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"launch(timeout=) must be a number of seconds or None. Received: {timeout!r} "
                        f"({type(timeout).__name__}).")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"launch(timeout=) must be a positive, finite number of seconds (or None: no limit). "
                         f"Received: {timeout!r}.")
    return float(timeout)


def _check_backend(backend: str | None, nprocs: int) -> None:
    """Refuse a communication backend this machine cannot run, before any process starts."""
    if backend is None:
        return
    import torch
    import torch.distributed as dist

    # "gloo", "nccl", or torch's per-device form "cpu:gloo,cuda:nccl".
    names = [part.split(":")[-1].strip() for part in backend.split(",")]
    for name in names:
        if name == "nccl":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus == 0:
                raise pp.TopologyError(
                    f"Strategy(backend={backend!r}) needs CUDA GPUs, but this machine has none visible to torch "
                    f"{torch.__version__} (torch.cuda.is_available() is False). Use backend='gloo', or leave "
                    "backend=None (gloo on CPU, nccl on GPU)."
                )
            if gpus < nprocs:
                raise pp.TopologyError(
                    f"Strategy(backend={backend!r}) needs one GPU per process: {nprocs} processes but {gpus} "
                    f"GPU(s) here. Launch at most {gpus} processes, or use backend='gloo'."
                )
        elif not dist.is_backend_available(name):
            raise pp.TopologyError(
                f"Strategy(backend={backend!r}): torch {torch.__version__} has no {name!r} backend here. "
                "Use 'gloo' (CPU), 'nccl' (CUDA), or None for the default."
            )


def _supervise(processes: list[Any], outdir: str, nprocs: int, timeout: float | None) -> None:
    """Wait for the processes; on the first failure, stop them and raise the root cause."""
    from multiprocessing.connection import wait

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running = [p for p in processes if p.exitcode is None]
        if any(p.exitcode not in (None, 0) for p in processes) or any(
                os.path.exists(_error_path(outdir, r)) for r in range(nprocs)):
            break
        if not running:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise pp.LaunchError(
                f"launch(): the {nprocs} processes did not finish within {timeout:g} s; they were "
                "terminated. A rank is probably waiting for a collective its peers never called."
            )
        wait([p.sentinel for p in running], timeout=0.2)
    # A rank failed: the others get a moment to save their own errors (a peer's collective error
    # may reach the parent first) and to run their teardown.
    grace_end = time.monotonic() + GRACE_S
    while time.monotonic() < grace_end:
        running = [p for p in processes if p.exitcode is None]
        if not running:
            break
        wait([p.sentinel for p in running], timeout=max(0.0, min(0.2, grace_end - time.monotonic())))
    stopped = {r for r, p in enumerate(processes) if p.exitcode is None}
    _stop(processes)
    raise _root_cause(processes, outdir, nprocs, stopped)


def _root_cause(processes: list[Any], outdir: str, nprocs: int, stopped: set[int]) -> pp.LaunchError:
    records: dict[int, dict[str, Any]] = {}
    for rank in range(nprocs):
        with contextlib.suppress(OSError, ValueError), open(_error_path(outdir, rank)) as f:
            records[rank] = json.load(f)
    crashed = [r for r in range(nprocs) if r not in records and r not in stopped
               and processes[r].exitcode not in (None, 0)]
    own = sorted((rec for rec in records.values() if not rec["collective"]), key=lambda rec: rec["monotonic"])
    collective = sorted((rec for rec in records.values() if rec["collective"]), key=lambda rec: rec["monotonic"])
    # A rank that died without a traceback (a signal, os._exit) is likelier the cause than a peer's
    # collective error, which is what its death looks like from the other side.
    if own:
        root: int = own[0]["rank"]
    elif crashed:
        root = crashed[0]
    elif collective:
        root = collective[0]["rank"]
    else:
        root = min(stopped) if stopped else 0
    others = []
    for rank in range(nprocs):
        if rank == root:
            continue
        if rank in records:
            kind = " (collective failure: probably a consequence)" if records[rank]["collective"] else ""
            others.append(f"  rank {rank}: {records[rank]['summary']}{kind}")
        elif rank in crashed:
            others.append(f"  rank {rank}: {_exit_text(processes[rank].exitcode)}, no traceback")
        elif rank in stopped:
            others.append(f"  rank {rank}: stopped by the launcher")
    tail = ("\nOther ranks:\n" + "\n".join(others)) if others else ""
    if root in records:
        text = records[root]["traceback"].rstrip()
        return pp.LaunchError(f"rank {root} of {nprocs} failed: {records[root]['summary']}\n{text}{tail}",
                              rank=root, traceback=text)
    return pp.LaunchError(f"rank {root} of {nprocs} {_exit_text(processes[root].exitcode)} without a "
                          f"traceback (killed, or it ended the process itself){tail}", rank=root)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _load_result(outdir: str, rank: int, exitcode: int | None) -> Any:
    path = os.path.join(outdir, f"{rank}.pkl")
    if not os.path.exists(path):
        raise pp.LaunchError(f"rank {rank} {_exit_text(exitcode)} without returning a result (did the function "
                             "end the process itself, e.g. with os._exit?).", rank=rank)
    with open(path, "rb") as f:
        return pickle.load(f)


def _stop(processes: list[Any]) -> None:
    """Stop what still runs: SIGTERM (the worker tears down as after a failure), then SIGKILL."""
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + _STOP_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


# -- the launch directory -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _launch_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    # Locked before it gets its name: another launcher's cleanup never sees it unlocked.
    lock = os.open(os.path.join(path, f".{_LOCK_NAME}"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel however this process ends
        os.rename(os.path.join(path, f".{_LOCK_NAME}"), os.path.join(path, _LOCK_NAME))
        yield path
    finally:
        os.close(lock)
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_launch_dirs(root: str | None = None) -> list[str]:
    """Remove this user's launch directories whose launcher is gone (killed before its cleanup).

    A directory is stale when nobody holds its lock; directories of running launches, of other
    users, or not made by this module are left alone. Returns the paths removed.
    """
    removed: list[str] = []
    if fcntl is None:  # pragma: no cover - without locks nothing can be judged stale
        return removed
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        try:
            if (not re.fullmatch(re.escape(_DIR_PREFIX) + r"\d+-\w+", entry.name)
                    or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid()):
                continue
            fd = os.open(os.path.join(entry.path, _LOCK_NAME), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its launcher is running
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


# -- polyparallel launch ------------------------------------------------------------------------------------------


def launch_script(command: list[str], options: dict[str, Any]) -> int:
    """``polyparallel launch``: hand the command to ``torch.distributed.run`` (torchrun).

    ``options`` are the command's, validated by it: with no ``rdzv_endpoint`` (or port 0) on one
    node, the rendezvous is 127.0.0.1 on a free port; ``rdzv_timeout`` bounds how long the agents
    wait for every node to join; ``trace_dir`` makes every worker write its collective trace there.

    Each worker runs the script through :mod:`polyparallel_torch.script`, which saves a failure
    for the agent instead of printing its traceback: when workers fail, this prints the report of
    the first failing rank (the earliest that is not a collective failure, as
    :func:`launch_function` does) and one line per other failed rank.
    """
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
        argv += ["--no-python", os.getenv("PYTHON_EXEC", sys.executable), "-u", *safe_path,
                 "-m", "polyparallel_torch.script"]
    trace_dir = options.get("trace_dir")
    saved = os.environ.get("POLYPARALLEL_TRACE_DIR")
    if trace_dir:  # the agent hands this process's environment to the workers
        os.environ["POLYPARALLEL_TRACE_DIR"] = os.path.abspath(trace_dir)
    try:
        torchrun.run(torchrun.parse_args([*argv, *command]))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError

        if isinstance(exc, ChildFailedError):
            print(f"polyparallel launch: {_first_failure(exc.failures)}", file=sys.stderr, flush=True)
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
        if trace_dir:
            if saved is None:
                os.environ.pop("POLYPARALLEL_TRACE_DIR", None)
            else:
                os.environ["POLYPARALLEL_TRACE_DIR"] = saved
    return 0


def _first_failure(failures: dict[int, Any]) -> str:
    """The report of torchrun's failed workers: the root cause's traceback (the earliest failure
    that is not a collective failure; else a rank that died without one; else the earliest), then
    one line per other failed rank."""
    records = {rank: f.error_file_data.get("polyparallel") for rank, f in failures.items()}
    own = sorted((r for r, rec in records.items() if rec and not rec["collective"]), key=lambda r: records[r]["time"])
    # SIGTERM is how the agent stops the other workers once one failed: a consequence, not a cause.
    stopped = sorted(r for r, rec in records.items() if not rec and failures[r].exitcode == -signal.SIGTERM)
    silent = sorted(r for r, rec in records.items() if not rec and r not in stopped)
    collective = sorted((r for r, rec in records.items() if rec and rec["collective"]),
                        key=lambda r: records[r]["time"])
    root = (own or silent or collective or stopped)[0]
    world = os.environ.get("WORLD_SIZE")  # not set in the agent; the failures name global ranks
    others = []
    for rank in sorted(failures):
        if rank == root:
            continue
        rec = records[rank]
        if rec:
            kind = " (collective failure: probably a consequence)" if rec["collective"] else ""
            others.append(f"  rank {rank}: {rec['summary']}{kind}")
        else:
            others.append(f"  rank {rank}: {failures[rank].message}")
    tail = ("\nOther failed ranks:\n" + "\n".join(others)) if others else ""
    rec = records[root]
    of = f" of {world}" if world else ""
    if rec:
        return f"rank {root}{of} failed: {rec['summary']}\n{rec['traceback'].rstrip()}{tail}"
    failure = failures[root]
    return f"rank {root}{of} failed (exit code {failure.exitcode}): {failure.message}{tail}"
