"""Function mode: ``polyparallel.launch(fn, strategy, nprocs)`` runs ``fn`` in ``nprocs`` processes
on this machine, started by ``torch.multiprocessing`` and supervised by the caller.

:func:`launch_function` refuses bad arguments before any process starts, makes the launch
directory (:mod:`.launch_dir`), starts the workers, supervises them (:mod:`.supervise`: on the
first failure the others are stopped and :class:`polyparallel.LaunchError` reports the root
cause, :mod:`.root_cause`) and returns the results by rank. Each worker (:func:`_worker`) gets
its rank's environment (:func:`.base.rank_environment`), ends with the launcher (parent-death
signal) or when stopped (SIGTERM), makes the runtime, runs ``fn``, saves the outcome and tears
down (:mod:`.teardown`).
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable
from typing import Any

import polyparallel as pp
from polyparallel._errors import exception_summary

from ..tracing import set_outcome
from .base import Stopped, end_with_parent, free_port, rank_environment, stop_on_sigterm, write_atomically
from .launch_dir import error_path, launch_dir, remove_stale_launch_dirs, result_path
from .records import write_failure
from .root_cause import exit_text
from .supervise import stop, supervise
from .teardown import close_sessions, end_process, wait_for_peers

__all__ = ["START_METHOD", "launch_function"]

START_METHOD = "spawn"
"""How the workers start: a fresh interpreter each, which imports ``fn`` by its module and name.
A payload an interactive ``__main__`` defines (a notebook cell, ``python -``) cannot be imported
there: its workers start by ``fork`` instead (:func:`start_method`), where that is safe."""


def launch_function(fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int, args: tuple, kwargs: dict,
                    timeout: float | None = None, trace_dir: str | None = None) -> list[Any]:
    """Run ``fn`` in ``nprocs`` processes; results by rank. See :func:`polyparallel.launch`, and
    :mod:`.teardown` and :mod:`.supervise` for how the workers end and how a failure is reported.

    Refuses, before any process starts, a ``timeout`` that is not a positive number of seconds
    and a communication backend this machine cannot run (``nccl`` without enough CUDA devices).
    With ``trace_dir``, every worker writes its collective trace there (``rank<r>.jsonl``).
    """
    timeout = _check_timeout(timeout)
    _check_backend(strategy.backend, nprocs)
    method = start_method(fn, args, kwargs)
    import torch.multiprocessing as mp

    remove_stale_launch_dirs()
    with launch_dir() as outdir:
        context = None
        from polyparallel import _trace

        from ..tracing import serve_store

        # The side channel's store lives here, so a rank's report still reaches its peers after
        # rank 0 (which holds the process group's store) has gone.
        store, endpoint = serve_store() if nprocs > 1 and _trace.enabled() else (None, None)
        try:
            context = mp.start_processes(
                _worker, args=(fn, strategy, nprocs, free_port(), outdir, args, kwargs, os.getpid(), trace_dir,
                               endpoint, method == "fork"),
                nprocs=nprocs, join=False, start_method=method,
            )
            supervise(context.processes, outdir, nprocs, timeout)
            return [_load_result(outdir, rank, context.processes[rank].exitcode) for rank in range(nprocs)]
        finally:
            if context is not None:
                stop(context.processes)
                for process in context.processes:
                    # The pipes multiprocessing keeps per process, else open until garbage collection.
                    process.close()
            del store


def start_method(fn: Callable[..., Any], args: tuple, kwargs: dict) -> str:
    """``"spawn"``, or ``"fork"`` when the payload lives in an interactive ``__main__`` (which a
    spawned interpreter cannot import). Forking is refused, before any process starts, where the
    copy would be broken: CUDA initialised here (a forked process cannot use it), a live
    torch.distributed process group here (the copy would hold the parent's connections), or a
    platform without ``fork``; each refusal names what to move into the function."""
    from polyparallel._payload import inspect_payload

    payload = inspect_payload(fn, args, kwargs)
    if not payload.main_names:
        return START_METHOD
    import multiprocessing
    import sys

    names = ", ".join(payload.main_names[:5])
    where = (f"launch(): {names} {'is' if len(payload.main_names) == 1 else 'are'} defined in an interactive "
             "__main__ (a notebook cell, `python -`), which a fresh process cannot import, so the processes are "
             "started by fork, a copy of this one; ")
    in_a_file = (" Or put the function in a file next to the notebook and import it from there (the processes "
                 "are then started fresh).")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise pp.LaunchError(where + f"this platform ({sys.platform}) cannot fork." + in_a_file)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise pp.LaunchError(where + "but CUDA is initialised in this process (a tensor or model was put on a GPU, "
                             "or torch.cuda was queried), and a forked process cannot use CUDA. Restart the kernel "
                             "and move every CUDA use (building the model, .cuda(), .to('cuda')) into the function."
                             + in_a_file)
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        raise pp.LaunchError(where + "but this process has a live torch.distributed process group (init_process_group "
                             "was called here, or a strategy's operation ran here), and a copy of it would share "
                             "its connections. Restart the kernel and call only pp.launch here: the strategy's "
                             "operations belong inside the function, where each process has its own group."
                             + in_a_file)
    return "fork"


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


# -- the worker ------------------------------------------------------------------------------------------------


def _worker(local_rank: int, fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int,
            port: int, outdir: str, args: tuple, kwargs: dict, launcher: int, trace_dir: str | None = None,
            trace_store: str | None = None, forked: bool = False) -> None:
    stop_on_sigterm()
    end_with_parent(launcher)
    if forked:  # a copy of the launcher: start from the state a spawned worker has
        from polyparallel import _fork

        _fork.forget_parent()
        strategy, args, kwargs = _fresh_strategies(strategy, args, kwargs)
        # One CPU thread per process, as torchrun gives its workers: the copy inherits the kernel's
        # OpenMP pool without its threads, and a parallel region would wait for them forever.
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(rank_environment(local_rank, nprocs, local_rank, nprocs, "127.0.0.1", port))
    if trace_dir is not None:  # written when a collective fails and at exit (polyparallel._trace)
        from polyparallel import _trace

        _trace.configure(trace_dir, rank=local_rank, world_size=nprocs)
    if trace_store is not None:  # the hang reports' side channel (tracing.py), served by the launcher
        os.environ["POLYPARALLEL_TRACE_STORE"] = trace_store
    code = 1
    broken: str | None = "stopped by the launcher after another rank failed"
    try:
        broken = _run(local_rank, fn, strategy, outdir, nprocs, args, kwargs)
        if broken is None:
            code = 0
            broken = wait_for_peers(outdir, nprocs, strategy.timeout)
    except Stopped:
        pass
    try:
        close_sessions(strategy, broken)
    except Stopped:
        code = 1
    except BaseException as exc:  # a session_finish hook failed: this rank's error, unless it has one
        if not os.path.exists(error_path(outdir, local_rank)):
            write_failure(error_path(outdir, local_rank), exc, local_rank, nprocs)
        code = 1
    end_process(code, forked)  # outside every except block (see its doc)


def _fresh_strategies(strategy: pp.Strategy, args: tuple, kwargs: dict) -> tuple[pp.Strategy, tuple, dict]:
    """The strategy, and the strategies among the arguments, as a spawned worker gets them:
    pickled copies, bound to this process's plugin manager (not the parent's sessions)."""
    def fresh(value: Any) -> Any:
        return pickle.loads(pickle.dumps(value)) if isinstance(value, pp.Strategy) else value

    return fresh(strategy), tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def _run(rank: int, fn: Callable[..., Any], strategy: pp.Strategy, outdir: str, nprocs: int, args: tuple,
         kwargs: dict) -> str | None:
    """Run ``fn`` and save its outcome; ``None`` on success, else why the groups are unsafe."""
    try:
        # The launcher makes the runtime (process group, mesh) so that fn needs no setup call,
        # and a rank that skips an early collective still leaves its peers a group to time out in.
        from ..runtime import get_runtime

        get_runtime(strategy.session())
        result = fn(*args, **kwargs)
        set_outcome(None)  # the peers' reports: "rank 1 finished"
        write_atomically(result_path(outdir, rank), pickle.dumps(result))
        return None
    except Stopped:
        raise
    except BaseException as raised:
        from ..ddp_trace import explained

        # A backend error DDP raised out of a recorded backward becomes the runtime's own
        # CollectiveTimeout/Error, with the hang report (the raw one is its cause).
        exc = explained(raised) or raised
        set_outcome(exc)  # the peers' reports: "rank 1 failed in f (x.py:3) with ValueError"
        # Saved before any teardown: a peer that dies of our exit must not be reported instead of us.
        write_failure(error_path(outdir, rank), exc, rank, nprocs)
        return f"rank {rank} failed: {exception_summary(exc, first_line=False)}"


def _load_result(outdir: str, rank: int, exitcode: int | None) -> Any:
    path = result_path(outdir, rank)
    if not os.path.exists(path):
        raise pp.LaunchError(f"rank {rank} {exit_text(exitcode)} without returning a result (did the function "
                             "end the process itself, e.g. with os._exit?).", rank=rank)
    with open(path, "rb") as f:
        return pickle.load(f)
