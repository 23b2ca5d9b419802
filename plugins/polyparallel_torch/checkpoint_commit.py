"""Committing a torch checkpoint once every rank wrote its files, and failing alike on every rank.

The steps every save of the torch runtime ends with (``Strategy.save`` and ``Strategy.async_save``,
and any engine writing the same format), after each rank wrote its files into the staging
directory and recorded their sizes and SHA-256 while writing:

1. :func:`commit`: the ranks gather their file records (one collective); rank 0 checks that the
   staging directory holds exactly those files, writes the commit marker with them and renames
   the directory to its path (:func:`polyparallel._checkpoints.publish`); one more collective
   tells every rank rank 0's outcome. A failure raises the same :class:`polyparallel.CheckpointError`
   on every rank, and rank 0 removes the staging directory.
2. :func:`agree`: before any file is written by DCP, the ranks check that they are at the same
   save (operation, path, keys) and share what went wrong locally (a rank whose JSON file could
   not be written: a full disk) in one gathered collective, so that every rank raises alike
   instead of some waiting for a collective that never comes.

:func:`failure_text` finds the operating system's error (``[Errno 28] No space left on
device: '<file>'``) inside torch's ``CheckpointException`` (a ``BaseException`` whose message names
only the ranks) and :func:`dcp_failures` reads it per rank, the same on every rank: DCP gathers
every rank's outcome before it raises.

A :class:`Channel` runs these collectives either through the runtime (bounded by the strategy's
timeout, named in errors) or, for an asynchronous save's background thread, over a separate
gloo group (never interleaved with the training's collectives).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel._errors import exception_summary

__all__ = ["Channel", "agree", "commit", "dcp_failures", "fail", "failure_text"]


class Channel:
    """The collectives of one save: ``gather(obj, operation)`` -> every rank's ``obj``.

    :param runtime: the torch runtime (its bounded, checked ``all_gather_object``), or ``None``
        with ``group``: a process group of its own (the background thread of an async save).
    """

    def __init__(self, world_size: int, runtime: Any = None, group: Any = None):
        self.world_size, self.runtime, self.group = world_size, runtime, group

    def gather(self, obj: Any, operation: str) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        if self.group is None:
            return gather_world(self.runtime, obj, operation)
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def gather_world(runtime: Any, obj: Any, operation: str) -> list[Any]:
    """Every rank's ``obj`` over the runtime's default group (bounded by its timeout; a failure is
    the runtime's ``CollectiveError``), in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * runtime.world_size
    with runtime.collective(operation, "world"):
        dist.all_gather_object(out, obj, group=runtime.group("world"))
    return out


def failure_text(exc: BaseException) -> str:
    """The operating system's error inside ``exc`` (its causes, contexts and the per-rank failures
    of a DCP ``CheckpointException``), e.g. ``OSError: [Errno 28] No space left on device:
    '/ckpt/step-8.partial-…/__1_0.distcp'``; else ``exc`` in one line."""
    from torch.distributed.checkpoint import CheckpointException

    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return exception_summary(current)
        if isinstance(current, CheckpointException):
            stack.extend(_unwrap(v) for v in current.failures.values())
        if isinstance(current, pp.CheckpointError):
            return str(current).splitlines()[0]
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    if isinstance(exc, CheckpointException):
        inner = [_unwrap(v) for v in exc.failures.values()]
        if inner:
            return exception_summary(inner[0])
    return exception_summary(exc)


def _unwrap(wrapped: Any) -> BaseException:
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def dcp_failures(exc: BaseException, rank: int) -> dict[int, str]:
    """Rank -> what failed there, from a DCP ``CheckpointException`` (every rank holds the same
    one); any other exception is this ``rank``'s own."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return {int(r): failure_text(_unwrap(v)) for r, v in sorted(exc.failures.items())}
    return {rank: failure_text(exc)}


def message(operation: str, path: str, failures: Mapping[int, str]) -> str:
    """The error every rank raises for ``failures`` (rank -> text): the same text on every rank."""
    first = min(failures)
    others = sorted(r for r in failures if r != first)
    more = f" (and on rank(s) {others}: {failures[others[0]]})" if others else ""
    if operation == "save":
        after = (f"Nothing was published: {path!r} is as it was before this save (an earlier checkpoint there, or "
                 "in its folder, stays the latest), and the staging directory is removed. Fix the cause (free disk "
                 "space, permissions) and save again.")
        return f"Strategy.save: writing {path!r} failed on rank {first}: {failures[first]}{more}. {after}"
    return (f"Strategy.load: reading {path!r} failed on rank {first}: {failures[first]}{more}. Nothing was "
            "restored on any rank. Fix the cause, or load an earlier checkpoint.")


def fail(operation: str, path: str, staging: str | None, failures: Mapping[int, str], rank: int) -> pp.CheckpointError:
    """The :class:`polyparallel.CheckpointError` for ``failures`` (the same on every rank); rank 0
    removes the staging directory first (every rank is past its writes: the failures were agreed)."""
    if staging is not None and rank == 0:
        _checkpoints.remove_staging(staging)
    return pp.CheckpointError(message(operation, path, failures))


def agree(strategy: pp.Strategy, operation: str, path: str, keys: list[str], problem: str | None) -> dict[int, str]:
    """Check that every rank is at the same ``operation`` of ``path`` with the same ``keys`` (a
    mismatch raises ``CollectiveError`` on every rank), and gather what went wrong on each:
    rank -> problem (empty when all went well). Two collectives, bounded by the strategy's timeout;
    none in one process."""
    from .runtime import get_runtime

    session = strategy.session()
    rt = get_runtime(session)
    rt.ensure_usable(operation, "world")
    if session.world_size == 1:
        return {0: problem} if problem else {}
    digest = hashlib.blake2b(";".join(keys).encode(), digest_size=8).hexdigest()
    with rt.operation(operation, "world", f"{path}, {len(keys)} keys {digest}"):
        gathered = gather_world(rt, problem, operation)
    return {r: p for r, p in enumerate(gathered) if p}


def commit(channel: Channel, rank: int, staging: str, path: str, metadata: dict[str, Any],
           records: Mapping[str, tuple[int, str]], arrays: list[dict[str, Any]] | None = None) -> str:
    """Steps 1 of the module docstring: every rank calls it with the records of the files it wrote
    (``relative path -> (size, sha256)``); rank 0 writes the marker (with ``arrays``, the tensor
    listing, when given) and publishes. Returns ``path`` on every rank once it is published.

    :raises polyparallel.CheckpointError: on every rank, when rank 0 could not commit.
    """
    parts = channel.gather(dict(records), "save_checkpoint (files written)")
    outcome = None
    if rank == 0:
        merged: dict[str, tuple[int, str]] = {}
        for part in parts:
            merged.update(part)
        try:
            if arrays is not None:
                metadata = {**metadata, "arrays": arrays}
            _checkpoints.write_marker(staging, metadata, merged)
            _checkpoints.publish(staging, path)
        except pp.CheckpointError as exc:
            outcome = str(exc)
        except Exception as exc:  # noqa: BLE001 - told to every rank, which else waits for the timeout
            outcome = failure_text(exc)
    outcome = channel.gather(outcome, "save_checkpoint (commit)")[0]
    if outcome is not None:
        raise fail("save", path, staging, {0: f"committing it: {outcome}"}, rank)
    return path

