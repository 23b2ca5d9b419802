"""Asynchronous saves of the torch runtime (``Strategy.async_save``): training goes on while the
files are written; the commit stays atomic.

What blocks the caller: the checks and the agreement of every save, writing the rank's JSON file,
and DCP's staging of the tensors (``dcp.async_save`` copies them to CPU memory first, so the
training may change its parameters at once). Then a background thread of this process waits for
DCP's writes, gathers every rank's file records and commits (:func:`.checkpoint_commit.commit`):
the marker is written and the directory renamed only after every rank's files are written and
synced. Its collectives run over a gloo process group of their own, made at the first
asynchronous save (every rank makes it in step) and bounded by the strategy's timeout, so they
never interleave with the training's collectives.

- A second save (sync or async) or a load waits for the save in flight first; a save whose
  asynchronous predecessor failed without anyone retrieving its error (``future.result()``)
  raises that error instead of starting (a failure is never silent).
- When the runtime closes (the last session of the process), it waits for the save in flight
  before its groups go; an interpreter that exits waits for the (non-daemon) thread. A process
  killed meanwhile leaves the staging directory, never published: ``Strategy.load`` and
  ``polyparallel.latest_checkpoint`` never take it, and the next save of the folder removes it.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
import weakref
from typing import Any

import polyparallel as pp

from .checkpoint_commit import Channel, commit, dcp_failures, fail, failure_text

__all__ = ["CheckpointFuture", "start", "wait_in_flight"]


class CheckpointFuture(concurrent.futures.Future):
    """What ``Strategy.async_save`` returns: a ``concurrent.futures.Future`` (as DCP's ``async_save``
    does) whose ``result()`` is the published path, or raises the save's
    :class:`polyparallel.CheckpointError` (the same on every rank).

    :ivar path: the checkpoint directory being saved.
    """

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.retrieved = False

    def result(self, timeout: float | None = None) -> str:
        self.retrieved = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.retrieved = True
        return super().exception(timeout)

    def wait(self, timeout: float | None = None) -> str:
        """``result()``: block until the checkpoint is published (or raise why it was not)."""
        return self.result(timeout)


class _State:
    """One process's asynchronous saves of one runtime: their process group and the save in flight."""

    def __init__(self) -> None:
        self.group: Any = None
        self.future: CheckpointFuture | None = None
        self.thread: threading.Thread | None = None


_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def wait_in_flight(runtime: Any = None, consume: bool = True) -> str | None:
    """Wait for the asynchronous save in flight of ``runtime`` (default: of any runtime of this
    process; nothing is created), if any. With ``consume`` (a save about to start) it is
    forgotten, and its error is returned when it failed and no one retrieved it: the next save
    refuses to start with it (never silent). Without (a load), its error stays for the next save."""
    if runtime is None:
        found = [wait_in_flight(rt, consume) for rt in list(_STATES)]
        return next((f for f in found if f is not None), None)
    state = _STATES.get(runtime)
    if state is None or state.future is None:
        return None
    future = state.future
    concurrent.futures.wait([future])
    if state.thread is not None:
        state.thread.join()
    if not consume:
        return None
    state.future, state.thread = None, None
    error = super(CheckpointFuture, future).exception()
    if error is None or future.retrieved:
        return None
    future.retrieved = True
    return (f"the previous asynchronous save, of {future.path!r}, failed and no one retrieved its error (its "
            f"future's result()): {str(error).splitlines()[0]} This save was not started; save again")


def _group(strategy: pp.Strategy, runtime: Any) -> Any:
    """The gloo group of this runtime's asynchronous saves (made once, by every rank in step)."""
    state = _STATES.setdefault(runtime, _State())
    if state.group is None and strategy.session().world_size > 1:
        import torch.distributed as dist

        with runtime.collective("async_save (its process group)", "world"):
            state.group = dist.new_group(backend="gloo", timeout=runtime.timeout)
        runtime.at_close(lambda: _close(runtime))
    return state.group


def _close(runtime: Any) -> None:
    wait_in_flight(runtime, consume=False)
    state = _STATES.pop(runtime, None)
    if state is not None and state.group is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(state.group)


def start(strategy: pp.Strategy, runtime: Any, path: str, staging: str, tensors: dict[str, Any], writer: Any,
          metadata: dict[str, Any], rank_record: tuple[str, int, str],
          arrays: Any) -> CheckpointFuture:
    """Stage ``tensors`` (blocking) and write and commit them in the background (module docstring).

    :param arrays: ``arrays(dcp_metadata)`` -> the marker's tensor listing.
    """
    import torch.distributed.checkpoint as dcp

    session = strategy.session()
    rank, world = session.rank, session.world_size
    group = _group(strategy, runtime)
    future = CheckpointFuture(path)
    options: dict[str, Any] = {"storage_writer": writer, "process_group": group}
    if world == 1 and "no_dist" in inspect.signature(dcp.async_save).parameters:
        options["no_dist"] = True
    try:
        # Copies the tensors to CPU memory, then returns a future of DCP's Metadata.
        written: Any = dcp.async_save(tensors, **options)
    except BaseException as exc:
        raise fail("save", path, staging, dcp_failures(exc, rank), rank) from None
    channel = Channel(world, group=group)

    def finish() -> None:
        try:
            try:
                dcp_metadata = written.result()
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                raise fail("save", path, staging, dcp_failures(exc, rank), rank) from None
            records = writer.records.complete(staging)
            rel, size, digest = rank_record
            records[rel] = (size, digest)
            commit(channel, rank, staging, path, metadata, records, arrays(dcp_metadata))
        except pp.CheckpointError as exc:
            future.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001 - a collective of the thread failed (a peer died)
            future.set_exception(pp.CheckpointError(f"Strategy.async_save: saving {path!r} failed on rank {rank}: "
                                                    f"{failure_text(exc)}. It was not published."))
        else:
            future.set_result(path)

    state = _STATES.setdefault(runtime, _State())
    thread = threading.Thread(target=finish, name=f"polyparallel async_save {path}", daemon=False)
    state.future, state.thread = future, thread
    thread.start()
    return future
