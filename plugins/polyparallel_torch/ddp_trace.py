"""DDP's gradient all-reduces in polyparallel's trace and identity checks, without a communication hook.

DDP's reducer all-reduces the gradients bucket by bucket during ``backward()``; those
collectives are torch's, not the runtime's, so without this module a rank that runs another
operation meanwhile (``self.log(..., sync_dist=True)`` of a key only one rank logs) pairs it
against a bucket all-reduce and the job ends with a raw backend timeout raised in
``backward()``, naming nothing.

:func:`install` registers one forward hook on a DDP model the runtime wraps. After a forward that
prepares a synchronising backward (grad enabled and ``require_backward_grad_sync``: not under
``no_sync``), it puts a gradient hook on the output tensors. The first of those to fire is the
start of that backward, before any gradient exists and so before any bucket is reduced: there the
backward's trace entry opens, ``DDP gradient all-reduce`` at the user's ``loss.backward()``
line (``#N``, its sequence number, when checked), and it stays open until DDP has waited for its
last bucket (an autograd final callback queued after DDP's own). DDP's buckets travel over a
second group of the data ranks (:meth:`~polyparallel_torch.runtime.TorchRuntime.ddp_group`), so an operation a rank runs while
its peer is in a backward (``self.log(..., sync_dist=True)`` of a key only one rank logs) never
pairs with a bucket: it waits, and its timeout's hang report names the peer's backward, its line
and its stack. (On one group it would pair with a bucket of another size, and gloo aborts the
process.) When the backward is the side that times out, DDP raises gloo's error from C++;
:func:`explained` turns it into the runtime's ``CollectiveTimeout`` with that report.

With ``GradPolicy(check_backward=True)`` the runtime also runs its identity check over the data
group at the backward's start
(:meth:`~polyparallel_torch.identity_checks.CheckedCollectives.check`: one int64 all-reduce of a
hash of the operation, its sequence number and the gradients' size and dtype), the same check
every polyparallel operation makes, answered when the gradients are computed, so an out-of-step
operation fails at once on both ranks naming both sides ("self.log('only0', sync_dist=True) #1 on
rank 0 vs DDP gradient all-reduce #1 on rank 1"). It is opt-in because it costs one more
all-reduce a step, waited for after the backward (docs/operations/hangs.md has the figures).

Why not a communication hook (the first design): DDP runs its default reduction in C++; any
Python hook moves every bucket's all-reduce and its completion callback into Python, on the
autograd and the backend's threads (7% of an 8 ms step here, and 16% with the recording),
and the hook slot is the user's (``ddp_comm_hook=``, the precision policy's compress hook). Here
the buckets are reduced exactly as DDP reduces them (a comm hook the precision policy or the
user registers is DDP's own business), and the cost is four Python calls per backward (the forward
hook, the gradient hook, two final callbacks; docs/operations/hangs.md has what they cost).

``POLYPARALLEL_TRACE_DDP=0`` installs nothing (DDP's own reduction, unrecorded, unchecked).
With the recording off ``wrap_model`` puts DDP on the data group itself, as torch's and
Lightning's own DDP are (the second group, connections and three threads a process, serves the
recording: an out-of-step operation that waits into the hang report instead of pairing with a
bucket, and the checked backward's late answer; docs/benchmarks.md has what it measured).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary

__all__ = ["ENV", "OPERATION", "enabled", "explained", "install", "is_installed"]

ENV = "POLYPARALLEL_TRACE_DDP"
"""``0`` turns the recording off (the benchmarks' switch)."""
OPERATION = "DDP gradient all-reduce"
"""The operation's name in the trace, hang reports and desync errors."""


def enabled() -> bool:
    """Whether :func:`install` installs the recording (``POLYPARALLEL_TRACE_DDP`` not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


_IN_FLIGHT: list[Any] = [None]
"""``(entry, runtime)`` of the recorded backward whose buckets DDP has not finished waiting for
(``None`` otherwise): what :func:`explained` names when DDP's wait raises out of ``backward()``."""


def explained(exc: BaseException) -> BaseException | None:
    """The polyparallel error that explains ``exc``, a backend failure raised out of a recorded
    DDP backward (gloo's "Timed out waiting 20000ms for recv", "Connection closed by peer"): a
    :class:`polyparallel.CollectiveTimeout` (or ``CollectiveError``) naming the operation, with
    the hang report of what every rank of the data group was doing, as the runtime's own
    collectives raise, carrying ``exc``'s traceback (so the peers' reports name the user's line).
    ``None`` when ``exc`` is not such a failure (no backward in flight, not a backend error) or
    when no report naming the peers can be had (the runtime closed, the side channel gone): the
    launchers then report ``exc`` as the backend said. DDP raises it from C++, in the reducer's
    wait, where no hook of ours runs; the launchers (``pp.launch``, ``polyparallel launch``) call
    this on what a worker raised before they report it. It never raises."""
    from .backend_errors import is_collective_failure

    flight = _IN_FLIGHT[0]
    if flight is None:
        return None
    entry, rt = flight
    try:
        if isinstance(exc, pp.PolyparallelError) or not isinstance(exc, RuntimeError) \
                or not is_collective_failure(exc) or getattr(rt, "closed", True):
            return None  # the backward ended with this error (its entry is finished below)
        # The entry still open: the report says this rank waits in its backward.
        rt._collective_failed(exc, OPERATION, "data", None if entry.seq is None else f"{OPERATION} #{entry.seq}")
    except pp.CollectiveError as error:
        # Only a report that names what the peers did says more than gloo's own words.
        return error.with_traceback(exc.__traceback__) if getattr(error, "peers_named", False) else None
    except BaseException:  # noqa: BLE001  (called in the launchers' except blocks: nothing may raise there)
        return None
    finally:
        _finish(entry, exception_summary(exc))
    return None


def _finish(entry: _trace.Entry | None, error: str | None = None) -> None:
    """Mark ``entry`` done (or failed), and empty :data:`_IN_FLIGHT` if it holds that entry."""
    _trace.Recorder.finish(entry, error)
    flight = _IN_FLIGHT[0]
    if flight is not None and flight[0] is entry:
        _IN_FLIGHT[0] = None


def _finish_after(entry: _trace.Entry | None) -> Any:
    """A final callback that queues the one finishing ``entry``: queued at the start of backward,
    it runs before DDP's finalize (queued when the last bucket is ready), and the one it queues
    runs after it, once every bucket's reduction is waited for (not at all if that raises: then
    :func:`explained`, or the next recorded forward, finishes it)."""

    def finish() -> None:
        _finish(entry)

    def requeue() -> None:
        torch.autograd.Variable._execution_engine.queue_callback(finish)

    return requeue


class _Recording:
    """The forward hook on the DDP model (a module-level class: a model holding it can be copied
    and pickled; a copy records nothing: it has no runtime)."""

    def __init__(self, rt: Any, check: bool, detail: str):
        self.rt, self.check, self.detail = rt, check, detail
        self.started = False  # this forward's backward has started (several outputs, one start)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Recording, (None, False, self.detail))

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.rt is None or not (torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True)):
            return
        stale = _IN_FLIGHT[0]
        if stale is not None and torch._C._current_autograd_node() is None:
            # A backward that raised and was caught (not one running now: a recomputed forward).
            _finish(stale[0], "the backward raised before DDP finished waiting for its buckets")
        leaves = [t for t in torch.utils._pytree.tree_leaves(output)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if not leaves:
            return
        self.started = False
        for tensor in leaves:
            tensor.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        if self.started:
            return
        self.started = True
        rt = self.rt
        rec = rt._rec
        thread = None if rec is None else rec.thread  # keep the stack of the thread driving the step
        if self.check:
            # Started now, over the data group, before any bucket exists; answered once the
            # gradients are computed (DDP's buckets travel over their own group meanwhile).
            answer = rt.start_check(OPERATION, "data", self.detail, skip=3)
            callback = _answer_then_finish(answer, rt)
        elif rec is not None:
            entry = rec.enter(OPERATION, "data", None, self.detail, skip=2)
            entry.state = "running"
            _IN_FLIGHT[0] = (entry, rt)
            callback = _finish_after(entry)
        else:
            return
        if rec is not None:
            rec.thread = thread
        torch.autograd.Variable._execution_engine.queue_callback(callback)


def _answer_then_finish(answer: Any, rt: Any) -> Any:
    """The final callback of a checked backward: wait for the check's answer (raising the desync
    error or the timeout out of ``backward()``), then queue the one finishing its entry."""

    def callback() -> None:
        _, entry = answer()
        if entry is not None:
            _IN_FLIGHT[0] = (entry, rt)
        _finish_after(entry)()

    return callback


def _describe(ddp: nn.parallel.DistributedDataParallel) -> str:
    """The gradients DDP reduces (the same on every rank): their count, elements and dtypes."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    return f"{len(params)} gradients, {sum(p.numel() for p in params)} {'/'.join(dtypes)}"


def install(ddp: nn.parallel.DistributedDataParallel, rt: Any, check: bool, hook: Any = None) -> None:
    """Record each synchronising backward of ``ddp`` (and with ``check``, the policy's
    ``check_backward``, identity-check it over ``rt``'s data group), unless :func:`enabled` says
    not; register ``hook`` (a comm hook taking the group as its state: the precision policy's)
    when given, as DDP's own."""
    if hook is not None:
        ddp.register_comm_hook(ddp.process_group, hook)
    if enabled():
        ddp.register_forward_hook(_Recording(rt, check, _describe(ddp)))


def is_installed(ddp: nn.Module) -> bool:
    """Whether ``ddp``'s backwards are recorded."""
    return any(isinstance(h, _Recording) for h in getattr(ddp, "_forward_hooks", {}).values())
