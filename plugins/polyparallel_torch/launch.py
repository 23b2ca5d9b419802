"""Launching: ``polyparallel.launch`` on torch.multiprocessing, ``polyparallel launch`` on torchrun.

Both use PyTorch's own supervisors: ``torch.multiprocessing.start_processes`` (spawn; a failing
rank's traceback is re-raised and the other ranks are terminated) and
``torch.distributed.run`` (the elastic agent torchrun uses; multi-node rendezvous, restarts).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import polyparallel as pp

__all__ = ["launch_function", "launch_script", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker(local_rank: int, fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int,
            port: int, outdir: str, args: tuple, kwargs: dict) -> None:
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        # The launcher makes the runtime (process group, mesh) so that fn needs no setup call,
        # and a rank that skips an early collective still leaves its peers a group to time out in.
        from .runtime import get_runtime

        get_runtime(strategy.session())
        result = fn(*args, **kwargs)
        with open(os.path.join(outdir, f"{local_rank}.pkl.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(outdir, f"{local_rank}.pkl.tmp"), os.path.join(outdir, f"{local_rank}.pkl"))
    except BaseException:
        strategy.plugin_manager.close_sessions()
        raise
    # The result is safe on disk: end the process without tearing down the gloo groups. Destroying
    # them while peers are still exiting (or still waiting after a timeout) can abort the process
    # in gloo's threads ("terminate called without an active exception", torch 2.13), which would
    # turn a finished rank into a failed one; the OS releases the sockets either way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_function(fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int, args: tuple, kwargs: dict,
                    timeout: float | None = None) -> list[Any]:
    """Run ``fn`` in ``nprocs`` spawned processes; results by rank. See :func:`polyparallel.launch`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="polyparallel-launch-") as outdir:
        context = mp.start_processes(
            _worker, args=(fn, strategy, nprocs, free_port(), outdir, args, kwargs),
            nprocs=nprocs, join=False, start_method="spawn",
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not context.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise pp.LaunchError(
                        f"launch(): the {nprocs} processes did not finish within {timeout:g} s; they were "
                        "terminated. A rank is probably waiting for a collective its peers never called."
                    )
        except mp.ProcessRaisedException as exc:
            raise pp.LaunchError(f"rank {exc.error_index} of {nprocs} failed:\n{exc}", rank=exc.error_index,
                                 traceback=str(exc)) from None
        except mp.ProcessExitedException as exc:
            raise pp.LaunchError(f"rank {exc.error_index} of {nprocs} exited with code {exc.exit_code}",
                                 rank=exc.error_index) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(nprocs):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def launch_script(command: list[str], options: dict[str, Any]) -> int:
    """``polyparallel launch``: hand the command to ``torch.distributed.run`` (torchrun)."""
    from torch.distributed import run as torchrun

    endpoint = options.get("rdzv_endpoint") or "127.0.0.1:0"
    host, _, port = endpoint.rpartition(":")
    if port in ("", "0"):
        endpoint = f"{host or '127.0.0.1'}:{free_port(host or '127.0.0.1')}"
    argv = [
        f"--nproc-per-node={options.get('nproc_per_node', 1)}",
        f"--nnodes={options.get('nnodes', 1)}",
        f"--node-rank={options.get('node_rank', 0)}",
        f"--max-restarts={options.get('max_restarts', 0)}",
    ]
    argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    try:
        torchrun.main([*argv, *command])
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: torchrun already printed the failing rank's error
        print(f"polyparallel launch: {exc}", flush=True)
        return 1
    return 0
