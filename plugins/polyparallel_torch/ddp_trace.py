"""DDP's gradient all-reduces in polyparallel's trace and identity checks: a communication hook.

DDP's reducer all-reduces the gradients bucket by bucket during ``backward()``; those
collectives are torch's, not the runtime's, so without this module a rank that runs another
operation meanwhile (``self.log(..., sync_dist=True)`` of a key only one rank logs) pairs it
against a bucket all-reduce and the job ends with a raw backend timeout raised in
``backward()``, naming nothing.

:func:`install` registers one communication hook on a DDP model the runtime wraps. For each
backward (the hook of bucket 0, the first DDP reduces), it runs the runtime's identity check over
the data group (:meth:`~polyparallel_torch.identity_checks.CheckedCollectives.check`: one int64
all-reduce of a hash of the operation, its sequence number and bucket 0's numel and dtype), the
same check every polyparallel operation makes, so an out-of-step operation fails at once on both
ranks naming both sides ("self.log('only0', sync_dist=True) #1 on rank 0 vs DDP gradient
all-reduce #1 on rank 1"), and a silent peer makes the check time out with the hang report. The check is made
once per backward, not per bucket (DDP reduces its buckets in the same order on every rank), and
follows ``GradPolicy(check=)``: with ``check=False`` the backward is only recorded. One trace
entry covers the backward's buckets (its detail says the latest bucket: ``bucket 3: 1049600
float32``); it is finished when the last bucket's reduction completes.

Then the hook runs the reduction: DDP's default (``allreduce_hook``, average over the group), or
the precision policy's compress hook (:func:`polyparallel_torch.precision.ddp_comm_hook`), or a
hook the user (or Lightning's ``ddp_comm_hook=``) registers later: the model's
``register_comm_hook`` is replaced by one that installs the user's hook *inside* the recording
one (DDP accepts a single hook), refused as torch refuses a second hook.

``POLYPARALLEL_TRACE_DDP=0`` installs nothing (DDP's own reduction, unrecorded, unchecked).
"""

from __future__ import annotations

import os
import types
from typing import Any

from torch import nn

from polyparallel import _trace

__all__ = ["ENV", "OPERATION", "enabled", "install", "is_installed"]

ENV = "POLYPARALLEL_TRACE_DDP"
"""``0`` turns the hook off (the benchmarks' switch)."""
OPERATION = "DDP gradient all-reduce"
"""The operation's name in the trace, hang reports and desync errors."""


def enabled() -> bool:
    """Whether :func:`install` installs the hook (``POLYPARALLEL_TRACE_DDP`` not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _State:
    """The hook's state: the runtime, whether to check, the reduction it runs, the open entry."""

    __slots__ = ("rt", "check", "inner", "inner_state", "user", "entry")

    def __init__(self, rt: Any, check: bool, inner: Any, inner_state: Any):
        self.rt, self.check, self.inner, self.inner_state = rt, check, inner, inner_state
        self.user = False  # a hook registered through the model's register_comm_hook
        self.entry: _trace.Entry | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the model (copy.deepcopy, pickle) has no runtime: it only runs the reduction
        # (over the default group, as a copied DDP model does).
        return (_State, (None, False, self.inner, None))


class _RecordingHook:
    """The hook DDP calls (a module-level class: a model holding it can be copied and pickled);
    its name says which reduction runs inside (DDP's logging data records it)."""

    def __init__(self, inner: Any):
        self.__name__ = self.__qualname__ = f"polyparallel_recording_hook({getattr(inner, '__name__', inner)})"

    def __call__(self, state, bucket):  # no annotations: see polyparallel_recording_hook
        return polyparallel_recording_hook(state, bucket)


def _describe(bucket: Any) -> str:
    buffer = bucket.buffer()
    return f"bucket {bucket.index()}: {buffer.numel()} {str(buffer.dtype).removeprefix('torch.')}"


def _finish(entry: _trace.Entry | None) -> Any:
    def done(future: Any) -> Any:
        value = future.value()  # raises the reduction's error: the entry stays open
        _trace.Recorder.finish(entry)
        return value

    return done


# No annotations: DDP refuses a hook whose ``bucket`` annotation is not dist.GradBucket (a string here).
def polyparallel_recording_hook(state, bucket):
    """Record (and at bucket 0, identity-check) the bucket's all-reduce, then run the reduction."""
    rt = state.rt
    if rt is None:  # a copy of the model
        return state.inner(state.inner_state, bucket)
    if bucket.index() == 0:
        rec = rt._rec
        thread = None if rec is None else rec.thread  # keep the stack of the thread driving the step
        detail = _describe(bucket)
        if state.check:
            _, state.entry = rt._check(OPERATION, "data", detail)
        elif rec is not None:
            state.entry = rec.enter(OPERATION, "data", None, detail, skip=2)
            state.entry.state = "running"
        if rec is not None:
            rec.thread = thread
    elif state.entry is not None:
        state.entry.detail = _describe(bucket)
    future = state.inner(state.inner_state, bucket)
    if bucket.is_last() and state.entry is not None:
        entry, state.entry = state.entry, None
        future = future.then(_finish(entry))
    return future


def install(ddp: nn.parallel.DistributedDataParallel, rt: Any, check: bool, hook: Any = None) -> None:
    """Register the recording hook on ``ddp`` (over ``rt``'s data group), running ``hook`` (a
    comm hook taking the group as its state) or DDP's default all-reduce; with the hook off
    (:func:`enabled`), register ``hook`` alone, as DDP would."""
    group = rt.group("data")
    if not enabled():
        if hook is not None:
            ddp.register_comm_hook(group, hook)
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    own = _State(rt, check, hook or allreduce_hook, group)
    ddp.register_comm_hook(own, _RecordingHook(own.inner))
    ddp.register_comm_hook = types.MethodType(register_comm_hook, ddp)  # type: ignore[method-assign]


def register_comm_hook(ddp: nn.parallel.DistributedDataParallel, state: object, hook: Any) -> None:
    """``ddp.register_comm_hook`` on a model with the recording hook: DDP takes one hook, so the
    user's runs inside the recording one (refused, like torch's second hook, when one already does)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    own = next((s for _, s in ddp._comm_hooks if isinstance(s, _State)), None)
    if own is None:  # not ours (a copy's hook list): torch's own
        type(ddp).register_comm_hook(ddp, state, hook)
        return
    if own.user or own.inner is not allreduce_hook:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once (the model "
                           "already reduces through a communication hook: the Strategy's precision policy's, or one "
                           "registered earlier).")
    ddp._check_comm_hook(hook)
    own.inner, own.inner_state, own.user = hook, state, True


def is_installed(ddp: nn.Module) -> bool:
    """Whether ``ddp`` reduces through the recording hook."""
    return any(isinstance(state, _State) for _, state in getattr(ddp, "_comm_hooks", ()))

