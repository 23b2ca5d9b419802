"""Identity checks before collectives: the middle layer of :class:`polyparallel_torch.runtime.TorchRuntime`.

Every polyparallel operation (``sync_grads`` on a bare module, ``sync_states``, ``reduce_metrics``,
the parameter broadcast of ``wrap_model``, a pipeline step, and any direct
:meth:`~CheckedCollectives.all_reduce` / :meth:`~CheckedCollectives.broadcast` /
:meth:`~CheckedCollectives.all_gather_object` call) first runs :meth:`CheckedCollectives.check`:
one int64 all-reduce of ``[h, -h]`` with MAX over the operation's group, where ``h`` is a 62-bit
blake2b hash of (operation, axis, per-axis sequence number, shapes and dtypes). All ranks agree iff
``max(h) == min(h)``; otherwise every rank of the group gathers the descriptors and raises
:class:`polyparallel.CollectiveError` naming both sides and where each was called ("sync_states #3
on rank 0 vs sync_grads #3 on rank 1 (called at train.py:40 and train.py:42)"), before any payload
collective could mix a running mean with a gradient. The check cannot see a skipped operation at
the moment it is skipped (the skipping rank sends nothing): the ranks then pair one operation apart,
and the first pairing of two different operations (or shapes) is reported; if the ops are all
alike, the last one times out. Making the runtime is checked too, over the default group: ranks
that made it with another topology, backend or timeout fail at once naming both.
``GradPolicy(check=False)`` skips the check of ``sync_grads``, the one operation on the hot path.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary

from .collectives import BoundedCollectives

__all__ = ["CheckedCollectives", "hash62"]


def hash62(text: str) -> int:
    """A hash of ``text`` that is the same in every process (Python's ``hash()`` is salted per
    process); 62 bits so that both ``h`` and ``-h`` fit an int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class CheckedCollectives(BoundedCollectives):
    """Bounded collectives, each operation first checked to be the same on every rank of its group."""

    def __init__(self, session: pp.Session):
        super().__init__(session)
        self._seq: dict[str, int] = {}  # per-axis sequence number of checked operations

    # -- identity checks ---------------------------------------------------------------------------------
    def check(self, operation: str, axis: str, detail: str = "", refusal: str | None = None) -> str:
        """Check that every rank of ``axis``'s group is at the same operation, raising
        :class:`polyparallel.CollectiveError` on every rank of the group (naming both sides) if not.

        :param detail: what must match besides the name: shapes, dtypes, names (rank-independent).
        :param refusal: this rank cannot run the operation (an input error it found): the peers
            learn it through the check instead of waiting for a collective that never comes; the
            local rank then raises ``TypeError(refusal)``.
        :return: the operation's label in errors, ``"<operation> #<sequence number>"``.
        """
        label, entry = self._check(operation, axis, detail, refusal)
        _trace.Recorder.finish(entry)
        return label

    def _check(self, operation: str, axis: str, detail: str = "",
               refusal: str | None = None) -> tuple[str, _trace.Entry | None]:
        """:meth:`check`, returning the label and the operation's trace entry, left open (state
        ``running``) for the caller to finish."""
        return self.start_check(operation, axis, detail, refusal, skip=4)()

    def start_check(self, operation: str, axis: str, detail: str = "", refusal: str | None = None,
                    skip: int = 3) -> Callable[[], tuple[str, _trace.Entry | None]]:
        """:meth:`check` in two halves: start its all-reduce now and return the function that waits
        for it and answers as ``_check`` does; pass it as :meth:`operation`'s ``check``. The caller
        may do local work in between (``sync_grads`` packs gradients while the check travels) but
        must start no other collective before the answer."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            def agreed() -> tuple[str, _trace.Entry | None]:
                if refusal is not None:
                    raise TypeError(refusal)
                return operation, None

            return agreed
        seq = self._seq[axis] = self._seq.get(axis, 0) + 1
        entry = None if self._rec is None else self._rec.enter(operation, axis, seq, detail, skip=skip)
        h = hash62(f"{operation}\0{axis}\0{seq}\0{detail}\0{refusal or ''}")
        buf = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        name = f"{operation} #{seq}"
        try:
            with self.collective(operation, axis, name, record=False):
                work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        return lambda: self._finish_check(work, buf, group, operation, axis, seq, detail, refusal, entry)

    def _finish_check(self, work: Any, buf: torch.Tensor, group: Any, operation: str, axis: str, seq: int,
                      detail: str, refusal: str | None, entry: _trace.Entry | None) -> tuple[str, _trace.Entry | None]:
        name = f"{operation} #{seq}"
        try:
            self.wait(work, operation, axis, name, record=False)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        high, neg_low = buf.tolist()
        if high == -neg_low:
            if refusal is not None:
                _trace.Recorder.finish(entry, f"refused: {refusal}")
                raise TypeError(refusal)
            if entry is not None:
                entry.state = "running"
            return name, entry
        # Every rank of the group saw the mismatch: all of them gather the descriptors, with the
        # caller's location (found again here when the trace is off: this path is rare).
        from .tracing import mismatch_message, where_of

        where = where_of(entry)
        out: list[Any] = [None] * len(self.group_ranks(axis))
        mine = (self.rank, operation, seq, detail, refusal, where)
        try:
            with self.collective(operation, axis, f"{name} (identity check)", record=False):
                dist.all_gather_object(out, mine, group=group)
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        message = mismatch_message(mine, out, axis, self.group_ranks(axis))
        _trace.Recorder.finish(entry, message.splitlines()[0])
        self.mark_broken(message.splitlines()[0])
        if refusal is not None:
            raise TypeError(f"{refusal}\n{message}")
        error = pp.CollectiveError(message, operation=operation, axis=axis, rank=self.rank)
        error.peers_named = True  # type: ignore[attr-defined]  # it names both sides (launchers' root cause)
        raise error

    @contextlib.contextmanager
    def operation(self, name: str, axis: str, detail: str = "",
                  check: bool | Callable[[], tuple[str, _trace.Entry | None]] = True) -> Iterator[str]:
        """One polyparallel operation over ``axis``: :meth:`check` once (unless ``check`` is
        false; a function returned by :meth:`start_check` is finished instead), then the
        collectives of the body over that axis skip their own checks. Yields the operation's
        label; the trace holds one entry for the whole operation."""
        if callable(check):
            label, entry = check()
        elif check:
            label, entry = self._check(name, axis, detail)
        else:
            label = name
            entry = None
            if self._rec is not None and self.group(axis) is not None:
                entry = self._rec.enter(name, axis, None, detail, skip=3)
                entry.state = "running"
        previous = self._covered.get(axis)
        self._covered[axis] = label
        try:
            yield label
        except BaseException as exc:
            _trace.Recorder.finish(entry, exception_summary(exc))
            raise
        finally:
            if previous is None:
                self._covered.pop(axis, None)
            else:
                self._covered[axis] = previous
        _trace.Recorder.finish(entry)

    @contextlib.contextmanager
    def _checked(self, operation: str, axis: str, detail: str) -> Iterator[str]:
        # A direct collective: inside an operation on its axis it is covered by that operation's
        # check (and trace entry), else it is an operation of its own.
        covered = self._covered.get(axis)
        if covered is not None:
            yield covered
            return
        with self.operation(operation, axis, detail) as label:
            yield label

    # -- checked collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str, operation: str, axis: str) -> torch.Tensor:
        """In-place all-reduce over ``axis`` (``sum``, ``avg``, ``max``, ``min``); identity when the
        axis has size 1. Checked (:meth:`check`) unless inside an :meth:`operation` on ``axis``."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return tensor
        with self._checked(operation, axis, f"all_reduce {op} {tensor.dtype} {list(tensor.shape)}") as label:
            self._all_reduce(tensor, op, operation, axis, group, label)
        if op == "avg":
            tensor.div_(self.topology.size(axis))
        return tensor

    def broadcast(self, tensor: torch.Tensor, operation: str, axis: str, src_coord: int = 0) -> torch.Tensor:
        """In-place broadcast from the rank at coordinate ``src_coord`` of ``axis`` (checked like
        :meth:`all_reduce`)."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return tensor
        with self._checked(operation, axis, f"broadcast from {src_coord} {tensor.dtype} {list(tensor.shape)}") as label:
            src = self.group_ranks(axis)[src_coord]
            with self.collective(operation, axis, label):
                work = dist.broadcast(tensor, src=src, group=group, async_op=True)
            self.wait(work, operation, axis, label)
        return tensor

    def all_gather_object(self, obj: Any, operation: str, axis: str) -> list[Any]:
        """Gather a picklable object from every rank of ``axis`` (bounded by the group timeout,
        checked like :meth:`all_reduce`)."""
        self.ensure_usable(operation, axis)
        group = self.group(axis)
        if group is None:
            return [obj]
        out: list[Any] = [None] * self.topology.size(axis)
        with self._checked(operation, axis, "all_gather_object") as label, self.collective(operation, axis, label):
            dist.all_gather_object(out, obj, group=group)
        return out
