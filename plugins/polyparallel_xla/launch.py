"""``polyparallel.launch`` on XLA devices: ``torch_xla.launch`` in a supervised process.

:func:`launch_function` writes the job (``fn``, the strategy, its arguments) to a temporary
directory and starts ``python -m polyparallel_xla.launch <dir>`` in a new process group; that
supervisor calls ``torch_xla.launch``, which runs one replica per XLA device (a process per
device on TPU, a thread per device on PJRT CPU). Each replica runs ``fn`` inside its own
:func:`polyparallel.session_scope` (its rank's sessions), saves its outcome (the pickled result,
or its traceback and whether it is a collective failure) as a file, closes its sessions, and
returns normally, so one replica's error never stops the others half-way through a collective:
they fail on their own at the next operation's check, within the strategy's timeout. The parent
waits for the supervisor (killing its process group after ``timeout``) and returns the results
by rank, or raises :class:`polyparallel.LaunchError` with the root cause: the earliest failure
that is not a collective failure, with its traceback, and one line per other failed rank.

``launch(trace_dir=)`` reaches the replicas as ``POLYPARALLEL_TRACE_DIR``: each replica's session
scope records its own rank's trace (:func:`polyparallel._trace.scope`) and writes
``rank<r>.jsonl`` there when the replica ends (and when a host check fails).

On PJRT CPU (``PJRT_DEVICE=CPU``: the replicas are threads of the supervisor) the launch applies
what such replicas need (:mod:`.cpu`, pytorch/xla issue 9089): the supervisor's environment gets
:data:`.cpu.CPU_ENV`'s settings where the user set none, and each replica installs the ordered
sync before ``fn`` runs.

Before anything starts, the device count is checked where it can be known without starting the
XLA runtime: with ``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES`` must equal ``nprocs`` (the parent's own
environment is left as it is: only the supervisor's gets the CPU settings). Elsewhere (TPU) each replica checks ``torch_xla.runtime.world_size()``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import polyparallel as pp
from polyparallel._errors import exception_summary

from . import cpu

__all__ = ["launch_function"]

_OUTPUT_TAIL = 4000


def _check_devices(nprocs: int) -> None:
    device = os.environ.get("PJRT_DEVICE", "")
    if device.upper() == "CPU":
        count = os.environ.get("CPU_NUM_DEVICES", "1")
        if count != str(nprocs):
            raise pp.TopologyError(
                f"launch(nprocs={nprocs}) on the XLA runtime runs one replica per XLA device, but PJRT_DEVICE=CPU "
                f"with CPU_NUM_DEVICES={count} gives {count} devices. Set CPU_NUM_DEVICES={nprocs}, or launch "
                f"nprocs={count}."
            )
    elif not device:
        raise pp.TopologyError(
            f"launch(nprocs={nprocs}) on the XLA runtime needs PJRT_DEVICE (TPU, CUDA, or CPU with "
            f"CPU_NUM_DEVICES={nprocs}) so that the number of XLA devices is known before anything starts."
        )


def launch_function(fn: Any, strategy: pp.Strategy, nprocs: int, args: tuple, kwargs: dict,
                    timeout: float | None, trace_dir: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` XLA replicas; the results by rank. With
    ``trace_dir``, every replica writes its collective trace there (``rank<r>.jsonl``: each
    replica thread has its own, :func:`polyparallel._trace.scope`) when a host check or
    collective fails and when the replica ends."""
    from polyparallel._payload import inspect_payload, refuse_interactive

    _check_devices(nprocs)
    refuse_interactive(inspect_payload(fn, args, kwargs), "xla", "its replicas in a fresh interpreter "
                       "(torch_xla.launch; the XLA runtime cannot be forked)")
    directory = tempfile.mkdtemp(prefix="polyparallel-xla-")
    try:
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None)
        if main_path and getattr(fn, "__module__", None) == "__main__":
            # A function of the script: the replicas load the script as multiprocessing's spawn does.
            with open(os.path.join(directory, "main.txt"), "w") as f:
                f.write(os.path.abspath(main_path))
        with open(os.path.join(directory, "job.pkl"), "wb") as f:
            pickle.dump((fn, strategy, nprocs, args, kwargs), f)
        # The supervisor imports what the parent can import (a test module's function, say).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if trace_dir is not None:  # every recorder of the replicas' process(es) writes there
            env["POLYPARALLEL_TRACE_DIR"] = os.path.abspath(trace_dir)
        if cpu.on_pjrt_cpu(env):  # what replica threads on PJRT CPU need (pytorch/xla#9089): see cpu.py
            env = cpu.launch_env(env)
        log_path = os.path.join(directory, "output.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "polyparallel_xla.launch", directory], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise pp.LaunchError(f"the XLA replicas did not finish within launch(timeout={timeout:g}) s and were "
                                     f"stopped.\n{_tail(log_path)}") from None
            except BaseException:
                _kill_group(proc)
                raise
        return _collect(directory, nprocs, code, log_path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "Output of the replicas (tail):\n" + text[-_OUTPUT_TAIL:] if text.strip() else ""


def _collect(directory: str, nprocs: int, code: int, log_path: str) -> list[Any]:
    results: dict[int, Any] = {}
    errors: list[dict[str, Any]] = []
    for rank in range(nprocs):
        ok, err = os.path.join(directory, f"{rank}.ok.pkl"), os.path.join(directory, f"{rank}.err.json")
        if os.path.exists(err):
            with open(err) as f:
                errors.append(json.load(f))
        elif os.path.exists(ok):
            with open(ok, "rb") as f:
                results[rank] = pickle.load(f)
    setup = os.path.join(directory, "setup.err.json")
    if os.path.exists(setup):
        with open(setup) as f:
            errors.append(json.load(f))
    if errors:
        errors.sort(key=lambda e: (e["collective"], e["time"]))
        root = errors[0]
        others = "".join(f"\n  rank {e['rank']}: {e['summary']}" for e in errors[1:])
        tail = f"\n{_tail(log_path)}" if root["rank"] == "launcher" else ""
        raise pp.LaunchError(f"XLA replica {root['rank']} failed: {root['summary']}\n{root['traceback']}"
                             + (f"\nOther failed replicas:{others}" if others else "") + tail,
                             rank=root["rank"] if isinstance(root["rank"], int) else None, traceback=root["traceback"])
    missing = [r for r in range(nprocs) if r not in results]
    if missing or code != 0:
        raise pp.LaunchError(f"the XLA replicas exited with code {code}; replicas {missing} saved no outcome "
                             f"(the process died: XLA aborts a process whose collective a peer never joins).\n"
                             f"{_tail(log_path)}")
    return [results[r] for r in range(nprocs)]


def _save_error(directory: str, name: str, rank: Any, exc: BaseException) -> None:
    record = {"rank": rank, "time": time.time(), "collective": isinstance(exc, pp.CollectiveError),
              "summary": exception_summary(exc),
              "traceback": "".join(traceback.format_exception(exc))}
    with open(os.path.join(directory, f"{name}.err.json"), "w") as f:
        json.dump(record, f)


_MAIN_LOCK = threading.Lock()


def _load_main(directory: str) -> None:
    path = os.path.join(directory, "main.txt")
    if not os.path.exists(path):
        return
    with _MAIN_LOCK:  # replica threads share the process: load the script once
        if getattr(sys.modules.get("__main__"), "__file__", None) == open(path).read():
            return
        from multiprocessing import spawn

        spawn._fixup_main_from_path(open(path).read())  # type: ignore[attr-defined]


def _replica(index: int, directory: str) -> None:
    """One replica (``torch_xla.launch`` calls it with the replica's index): run the job inside
    its own session scope, save the outcome, close its sessions. Never raises."""
    import torch_xla.runtime as xr

    rank: Any = index
    try:
        _load_main(directory)
        with open(os.path.join(directory, "job.pkl"), "rb") as f:
            fn, strategy, nprocs, args, kwargs = pickle.load(f)
        rank = xr.global_ordinal()
        if cpu.on_pjrt_cpu():
            cpu.install_ordered_sync()
        if xr.world_size() != nprocs:
            raise pp.TopologyError(f"launch(nprocs={nprocs}) on the XLA runtime, but torch_xla started "
                                   f"{xr.world_size()} replicas (one per XLA device): launch nprocs={xr.world_size()}.")
        with pp.session_scope(rank):
            result = fn(*args, **kwargs)
        data = pickle.dumps(result)
        with open(os.path.join(directory, f"{rank}.ok.pkl.tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(directory, f"{rank}.ok.pkl.tmp"), os.path.join(directory, f"{rank}.ok.pkl"))
    except BaseException as exc:  # saved for the parent; the other replicas go on to their own checks
        _save_error(directory, str(rank), rank, exc)


def main(directory: str) -> int:
    """The supervisor: ``torch_xla.launch`` of :func:`_replica` over every XLA device."""
    try:
        import torch_xla

        torch_xla.launch(_replica, args=(directory,))
    except BaseException as exc:
        _save_error(directory, "setup", "launcher", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
