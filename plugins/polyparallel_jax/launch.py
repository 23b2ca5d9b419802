"""Start JAX processes on this machine, joined by ``jax.distributed`` (gloo collectives on CPU).

``launch_processes(fn, nprocs)`` pickles ``fn`` and its arguments, starts ``nprocs`` fresh
interpreters (``python -m polyparallel_jax.launch``) with the coordinator on 127.0.0.1, and
returns their results by process. Every wait is bounded: a process that fails or does not finish
in ``timeout`` seconds stops the others and raises :class:`polyparallel.LaunchError`. Each
process's output goes to a file in the launch's directory (never a pipe that could fill up and
block it); the end of it is quoted when the process fails without a traceback.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import polyparallel as pp

from .runtime import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ensure_distributed

__all__ = ["launch_processes", "process_env"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, nprocs: int, port: int, devices_per_process: int,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one launched JAX process (CPU devices, coordinator on 127.0.0.1)."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.update({
        ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(nprocs), ENV_PROCESS_ID: str(process_id),
        "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip(),
    })
    return env


def launch_processes(fn: Callable[..., Any], nprocs: int, args: tuple = (), kwargs: dict | None = None, *,
                     devices_per_process: int = 1, timeout: float = 120.0, trace_dir: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` JAX processes; return the results by process.

    :param fn: a picklable (module-level) callable.
    :param devices_per_process: CPU devices each process gets.
    :param timeout: seconds for the whole run; past it every process is killed.
    :param trace_dir: every process writes its collective trace there (``rank<process>.jsonl``)
        when a collective fails and when it ends; ``polyparallel trace DIR`` reads them.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise pp.TopologyError(f"nprocs must be a positive int. Received: {nprocs!r}.")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="polyparallel-jax-") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((fn, tuple(args), dict(kwargs or {}), trace_dir), f)
        procs: list[subprocess.Popen[bytes]] = []

        def failed_process() -> int | None:
            # A process that wrote its result (before the final barrier) has succeeded even if it
            # died afterwards: once process 0 exits, the coordination service is gone and a peer
            # still on its way out may be aborted by JAX's error poller (seen under load).
            return next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)
                         and not os.path.exists(os.path.join(tmp, f"result_{i}.pkl"))), None)

        try:
            for i in range(nprocs):
                # Output goes to a file, not a pipe: a pipe nobody reads until the end fills up
                # (64 KiB) and blocks a chatty process, which then looks like a hang.
                with open(_output_path(tmp, i), "wb") as out:
                    procs.append(subprocess.Popen([sys.executable, "-m", "polyparallel_jax.launch", tmp, str(i)],
                                                  env=process_env(i, nprocs, port, devices_per_process),
                                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            failed: int | None = None
            while any(p.poll() is None for p in procs):
                failed = failed_process()
                if failed is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            failed = failed if failed is not None else failed_process()
        finally:
            for p in procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        if failed is None and not all(os.path.exists(os.path.join(tmp, f"result_{i}.pkl")) for i in range(nprocs)):
            output = _tail(tmp, 0)
            raise pp.LaunchError(f"JAX processes did not finish within {timeout:g} s; killed. Output of process 0:\n"
                                 f"{output}", rank=None, traceback=output)
        if failed is not None:
            path = os.path.join(tmp, f"error_{failed}.txt")
            if os.path.exists(path):
                with open(path) as error_file:
                    text = error_file.read()
            else:
                text = _tail(tmp, failed)
            raise pp.LaunchError(f"JAX process {failed} of {nprocs} failed:\n{text}", rank=failed, traceback=text)
        results = []
        for i in range(nprocs):
            with open(os.path.join(tmp, f"result_{i}.pkl"), "rb") as result_file:
                results.append(pickle.load(result_file))
        return results


def _output_path(tmp: str, process_id: int) -> str:
    return os.path.join(tmp, f"output_{process_id}.txt")


def _tail(tmp: str, process_id: int, size: int = 3000) -> str:
    """The last ``size`` bytes a process printed."""
    with open(_output_path(tmp, process_id), "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - size))
        return f.read().decode(errors="replace")


def _child(tmp: str, process_id: int) -> int:
    from polyparallel import _trace

    try:
        ensure_distributed()  # before anything touches a device
        with open(os.path.join(tmp, "job.pkl"), "rb") as f:
            fn, args, kwargs, trace_dir = pickle.load(f)
        if trace_dir is not None:  # written when a collective fails (ops.bounded) and below
            _trace.configure(trace_dir, rank=process_id, world_size=int(os.environ[ENV_NUM_PROCESSES]))
        result = fn(*args, **kwargs)
        path = os.path.join(tmp, f"result_{process_id}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)  # whole or absent: the launcher treats it as success
        _dump("exit")  # the process ends with os._exit: no atexit dump
        _barrier("polyparallel-jax-done")
        return 0
    except BaseException as exc:
        with open(os.path.join(tmp, f"error_{process_id}.txt"), "w") as f:
            f.write(traceback.format_exc())
        _dump(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", failed=True)
        return 1


def _dump(reason: str, failed: bool = False) -> None:
    from polyparallel import _trace

    recorder = _trace.get_recorder()
    if recorder is not None and recorder.trace_dir:
        recorder.dump(reason, failed=failed)


def _barrier(name: str, timeout_s: int = 60) -> None:
    # Wait for the peers through the coordination service (not a device collective, which would
    # queue behind a stuck one), so process 0 does not take the coordinator down while a peer
    # still needs it.
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is not None:
            client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)
    except Exception:  # a peer that failed already is reported by the launcher
        pass


if __name__ == "__main__":
    code = _child(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process whose peer skipped a collective still has a blocked
    # XLA thread, and jax.distributed's shutdown barrier would wait for a peer that has left.
    os._exit(code)
