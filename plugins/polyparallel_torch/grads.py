"""``sync_grads`` for torch: bucketed all-reduce of gradients over the data group.

A DDP-wrapped module already reduced its gradients during ``backward()`` (DDP's reducer,
bucketed and overlapped with the backward pass): ``sync_grads`` is then a no-op that answers.

A bare module (tensor parallel with ``data > 1``, a pipeline stage, a module the user did not
wrap) is reduced here, with DDP's semantics for parameters without a gradient:

- The bucket layout follows the module's *trainable* parameters (``requires_grad``), re-checked on
  every call: a parameter unfrozen after the first step is reduced from then on, a frozen one is
  left alone. The check is cheap: the parameter list is cached (invalidated when torch registers a
  parameter or a module anywhere, through torch's registration hooks, installed only while a torch
  runtime that synced gradients is open) and compared by its ``requires_grad`` mask.
- Every rank runs the same collectives whatever its gradients: a gradient that is ``None`` on
  this rank contributes zeros. Which parameters have a gradient on *some* rank travels with the
  gradients (a presence tail, one element per parameter, at the end of the first flat bucket; a
  layout of single-tensor buckets only gets one tiny extra all-reduce for it): a parameter used on
  some rank gets the average with zeros from the others, one unused on every rank keeps
  ``grad=None`` (and the buckets holding only such parameters are skipped, on every rank alike).
- Gradients are packed into persistent flat buffers of at most ``GradPolicy.bucket_mb`` MB per
  dtype (25 MB by default) whose views become the parameters' ``.grad`` (DDP's "gradient as
  bucket view"): one collective per bucket, and no copy at all for a loop that zeroes gradients in
  place. A tensor as large as a bucket is reduced in place, uncopied.
- Fresh ``.grad`` tensors every step (``zero_grad()``'s default ``set_to_none=True``) are packed
  with no Python work per tensor: each bucket is ordered by shape, and each run of same-shape
  gradients is copied by one ``torch.stack`` into its block of the buffer (the rest by one
  ``_foreach_copy_``). For 2,000 small tensors this costs ~0.1 us per tensor, against ~0.4 us for
  ``_foreach_copy_`` and ~1.2 us for ``torch.cat`` of reshaped tensors. Fresh tensors are told
  from the buffer's own views by the first gradient of a bucket alone (a view among fresh ones
  makes ``torch.stack`` refuse the overlap, and the bucket is then copied tensor by tensor).
- When every gradient is present on this rank, all buckets' all-reduces start at once and the
  ``.grad`` re-pointing (and the release of the fresh tensors) runs while they travel. A rank
  missing some gradient reduces bucket by bucket instead (it needs the presence flags first);
  both run the same collectives in the same order: the flags' own all-reduce if any, then every
  bucket (none is skipped when some rank has every gradient). If a collective fails, the runtime
  is broken (restart the processes) and the ``.grad`` values are undefined.
- Why not DDP's design (per-parameter post-accumulate-grad hooks copying into buckets during
  backward, each bucket's all-reduce started as it fills): a Python hook costs ~1 us per parameter
  per backward even when it does nothing (``benchmarks/bench_torch.py --only grads``, row "flat + a
  no-op grad hook per parameter"), more than this packing costs in all; and a bucket that fills
  during backward on one rank and not on another (a branch unused on some ranks, another backward
  call still to come for accumulation) would start a collective the peers do not start, which the
  rule above (the same collectives whatever the gradients) and the identity check before any
  payload forbid. DDP itself needs ``find_unused_parameters`` and ``no_sync`` for those cases.
- Before any payload, one identity check (one 16-byte all-reduce) makes sure every rank of the
  data group is at the same ``sync_grads`` with the same layout and op; otherwise every rank
  raises naming both sides, with every ``.grad`` as it was. It travels while this rank reads and
  packs its gradients (:meth:`TorchRuntime.start_check`: local work into polyparallel's own
  buffers, no ``.grad`` changed, no other collective started), so its latency and a late peer's
  lateness hide behind that work instead of adding to it. The payload never starts before the
  check has answered: merging the two into one collective would pair a payload with another
  operation's check on a rank that is elsewhere (gloo aborts the process on such a size
  mismatch, NCCL can hang). ``GradPolicy(check=False)`` skips it.

A list of gradient tensors is packed per call; it cannot say which parameter a missing gradient
belongs to, so a ``None`` in it is refused (pass the module instead); the peers learn of the
refusal through the identity check instead of waiting for a collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import weakref
from collections import deque
from itertools import repeat
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import polyparallel as pp
from polyparallel import _trace
from polyparallel._errors import exception_summary

from .runtime import TorchRuntime
from .tensors import buckets, is_ddp, local_tensor

__all__ = ["no_sync", "sync_gradients"]

OPERATION = "sync_grads"
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _Bucket:
    """Parameters reduced by one collective: a flat buffer whose views are their gradients, or
    (``flat is None``) one tensor as large as a bucket, reduced where it is."""

    def __init__(self, params: list[torch.Tensor], indices: list[int], tail: int):
        self.params = params
        self.indices = indices  # positions in the layout (for the presence flags)
        self._pick = operator.itemgetter(*indices) if len(indices) > 1 else None
        self.sharded = [hasattr(p, "to_local") for p in params]
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.tail: torch.Tensor | None = None
        self.any_sharded = any(self.sharded)
        if len(params) == 1 and tail == 0:
            return
        locals_ = [local_tensor(p) for p in params]
        numels = [t.numel() for t in locals_]
        size = sum(numels)
        self.flat = torch.zeros(size + tail, dtype=locals_[0].dtype, device=locals_[0].device)
        self.views = [v.view(t.shape) for v, t in zip(self.flat[:size].split(numels), locals_)]
        if tail:
            self.tail = self.flat[size:]
        # Runs of same-shape gradients are packed by one torch.stack each into their block of the
        # buffer: one C++ call with no per-tensor dispatch (about 5x faster than _foreach_copy_ for
        # thousands of small tensors, which matters when .grad tensors are fresh every step).
        # The layout orders each bucket by shape to make the runs long.
        self.runs: list[tuple[int, int, torch.Tensor]] = []  # [start, end) and their block
        self.singles: list[int] = []
        start, offset = 0, 0
        while start < len(locals_) and not self.any_sharded:
            end = start
            while end < len(locals_) and locals_[end].shape == locals_[start].shape:
                end += 1
            span = sum(numels[start:end])
            if end - start > 1:
                self.runs.append((start, end, self.flat[offset:offset + span].view(end - start, *locals_[start].shape)))
            else:
                self.singles.append(start)
            start, offset = end, offset + span
        self.single_views = [self.views[i] for i in self.singles]

    def mine(self, grads: list[Any]) -> list[Any]:
        """This bucket's entries of a list in layout order."""
        return [grads[self.indices[0]]] if self._pick is None else list(self._pick(grads))

    def pack(self, grads: list[torch.Tensor]) -> None:
        """Copy a gradient per parameter (all present) into the buffer."""
        with torch.no_grad():  # a gradient made with create_graph=True may require grad
            if self.runs:
                try:
                    for start, end, block in self.runs:
                        torch.stack(grads[start:end], out=block)
                    if self.singles:
                        torch._foreach_copy_(self.single_views, [grads[i] for i in self.singles])
                    return
                except RuntimeError:  # whatever stack refuses, copying tensor by tensor does
                    pass
            torch._foreach_copy_(self.views, [local_tensor(g) for g in grads] if self.any_sharded else grads)


class _Layout:
    """The buckets of one module's trainable parameters, for one bucket size."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int):
        self.params = params
        self.bucket_bytes = bucket_bytes
        locals_ = [local_tensor(p) for p in params]
        position = {id(t): i for i, t in enumerate(locals_)}
        groups = [[position[id(t)] for t in bucket] for bucket in buckets(locals_, bucket_bytes)]
        for group in groups:  # same shapes side by side in the buffer (see _Bucket.runs)
            group.sort(key=lambda i: tuple(locals_[i].shape))
        # The presence flags ride at the end of the first bucket that is a flat buffer anyway;
        # reduced first, it tells which parameters have a gradient on some rank.
        carrier = next((i for i, g in enumerate(groups) if len(g) > 1), None)
        self.buckets = [_Bucket([params[i] for i in g], g, len(params) if i == carrier else 0)
                        for i, g in enumerate(groups)]
        if carrier is not None:
            self.buckets.insert(0, self.buckets.pop(carrier))
        self.presence: torch.Tensor | None = None  # its own buffer when no bucket carries it
        self.any_sharded = any(b.any_sharded for b in self.buckets)
        if carrier is None and params:
            self.presence = torch.zeros(len(params), dtype=torch.float32, device=locals_[0].device)
        shapes = ";".join(f"{t.dtype}{list(t.shape)}" for t in locals_)
        cuts = ",".join(str(len(b.params)) for b in self.buckets)
        self.digest = hashlib.blake2b(f"{shapes}|{cuts}".encode(), digest_size=12).hexdigest()
        total = sum(t.numel() for t in locals_)
        self.summary = f"{len(params)} gradients ({total:,} elements) in {len(self.buckets)} bucket(s)"

    def sync(self, rt: TorchRuntime, op: str, check: bool = True) -> None:
        # map() with C callables: these per-parameter passes cost ~0.05 us per parameter, not ~0.1
        grads = list(map(_GRAD, self.params))
        all_present = all(map(operator.is_not, grads, repeat(None)))
        detail = f"{self.summary}, op {op}, layout {self.digest}"
        # The identity check travels while this rank packs its gradients into its own buffers: local
        # work that changes no .grad and starts no collective, so a mismatch still raises before any
        # payload, and the check's latency (and the other ranks' lateness) hides behind the packing.
        pending = rt.start_check(OPERATION, "data", detail) if check else False
        try:
            mines = [bucket.mine(grads) for bucket in self.buckets]
            in_place = [bucket.flat is not None and self._fill(bucket, mine, all_present)
                        for bucket, mine in zip(self.buckets, mines)]
            for bucket in self.buckets:
                if bucket.tail is not None:
                    self._flags_into(bucket.tail, grads, all_present)
            if self.presence is not None:
                self._flags_into(self.presence, grads, all_present)
        except Exception as exc:
            raise _packing_failed(rt, pending, exc) from exc
        with rt.operation(OPERATION, "data", detail, check=pending) as label:
            if not self.buckets:
                return
            if all_present and not self.any_sharded:
                # Every parameter has a gradient here, so on some rank: nothing is skipped and nobody
                # needs the presence flags' result (the peers run the same collectives, see below).
                del grads
                self._reduce_present(rt, op, mines, in_place, label)
                return
            present: list[bool] | None = None
            if self.presence is not None:  # no flat bucket to carry the flags: one tiny all-reduce
                rt.all_reduce(self.presence, "max", OPERATION, "data")
                present = None if all_present else [f > 0 for f in self.presence.tolist()]
            for bucket, mine in zip(self.buckets, mines):
                if present is not None and not any(present[i] for i in bucket.indices):
                    continue  # no rank has a gradient for any of these: leave them None everywhere
                if bucket.flat is None:
                    self._sync_single(bucket, mine[0], rt, op)
                    continue
                rt.all_reduce(bucket.flat, op, OPERATION, "data")
                if bucket.tail is not None and not all_present:
                    present = [f > 0 for f in bucket.tail.tolist()]
                self._assign(bucket, mine, present)

    def _reduce_present(self, rt: TorchRuntime, op: str, mines: list[list[Any]], in_place: list[bool],
                        label: str) -> None:
        """Every gradient present on this rank: start every bucket's all-reduce at once, re-point
        ``.grad`` to the buffers' views and release the fresh tensors while they travel, then wait.
        The same collectives, in the same order, as the bucket-by-bucket path a rank missing some
        gradient takes (the presence flags first, no bucket skipped: this rank has them all)."""
        group = rt.group("data")
        tensors = ([self.presence] if self.presence is not None else []) + [
            local_tensor(mine[0]) if bucket.flat is None else bucket.flat for bucket, mine in zip(self.buckets, mines)]
        with rt.collective(OPERATION, "data", label):
            works = [dist.all_reduce(t, op=dist.ReduceOp.MAX if t is self.presence else dist.ReduceOp.SUM,
                                     group=group, async_op=True) for t in tensors]
        for bucket, already in zip(self.buckets, in_place):
            if bucket.flat is not None and not already:
                _set_grads(bucket.params, bucket.views)
        mines.clear()  # the fresh gradient tensors are freed here, while the all-reduces run
        for work in works:
            rt.wait(work, OPERATION, "data", label)
        if op == "avg":
            size = rt.axis_size("data")
            torch._foreach_div_([t for t in tensors if t is not self.presence], size)

    @staticmethod
    def _flags_into(flags: torch.Tensor, grads: list[Any], all_present: bool) -> None:
        if all_present:
            flags.fill_(1)
        else:
            flags.copy_(torch.tensor([g is not None for g in grads], dtype=flags.dtype))

    @staticmethod
    def _sync_single(bucket: _Bucket, grad: torch.Tensor | None, rt: TorchRuntime, op: str) -> None:
        if grad is not None:
            rt.all_reduce(local_tensor(grad), op, OPERATION, "data")
            return
        param = bucket.params[0]  # unused here, used elsewhere: contribute zeros, take the result
        zeros = torch.zeros_like(local_tensor(param))
        rt.all_reduce(zeros, op, OPERATION, "data")
        param.grad = _as_grad_of(param, zeros)

    @staticmethod
    def _fill(bucket: _Bucket, grads: list[Any], all_present: bool) -> bool:
        """Put this rank's gradients into the bucket's buffer (local work only: the buffer is not
        any ``.grad`` that this changes); true if they already were its views."""
        views = bucket.views
        if all_present or all(map(operator.is_not, grads, repeat(None))):
            if grads[0] is views[0] and all(map(operator.is_, grads, views)):
                return True  # gradients already live in the buffer (zeroed in place between steps)
            # Fresh gradient tensors (zero_grad(set_to_none=True)), told by the first one alone: no
            # pass over the others, whose cache lines backward has evicted. Should some of them be
            # views of the buffer after all, torch.stack refuses the overlap and pack copies tensor
            # by tensor (a view onto itself is a no-op): the same result.
            bucket.pack(grads)
            return False
        for g, v in zip(grads, views):
            if g is None:
                v.zero_()  # an unused parameter contributes zeros, as with DDP (v is not its .grad)
        fresh = [(local_tensor(g), v) for g, v in zip(grads, views) if g is not None and g is not v]
        if fresh:
            torch._foreach_copy_([v for _, v in fresh], [g for g, _ in fresh])
        return False

    @staticmethod
    def _assign(bucket: _Bucket, grads: list[Any], present: list[bool] | None) -> None:
        if present is None and not bucket.any_sharded:  # the common case, without a test per tensor
            _set_grads(bucket.params, bucket.views)
            return
        for p, g, v, i, sharded in zip(bucket.params, grads, bucket.views, bucket.indices, bucket.sharded):
            if g is None and present is not None and not present[i]:
                continue  # unused on every rank: stays None, as with DDP
            if not sharded:
                p.grad = v
            elif g is not None:  # a DTensor's .grad must stay a DTensor: copy back into its shard
                local_tensor(g).copy_(v)
            else:
                p.grad = _as_grad_of(p, v.clone())


def _packing_failed(rt: TorchRuntime, pending: Any, exc: Exception) -> pp.CollectiveError:
    """This rank could not pack its gradients (e.g. a ``.grad`` whose shape or device is not its
    parameter's) after its identity check started: the peers, who agreed, now start the payload
    all-reduces this rank will not join. Wait for the check (its all-reduce is in flight: leaving
    it would pair it with a later collective), close its trace entry with the error and mark the
    runtime broken, so that every later collective here is refused; the peers' all-reduces end at
    the strategy's timeout with a hang report naming this rank's failed ``sync_grads``. Returns
    the error to raise."""
    reason = exception_summary(exc)
    if callable(pending):
        with contextlib.suppress(Exception):  # the packing error is the one to raise
            _, entry = pending()
            _trace.Recorder.finish(entry, reason)
    rt.mark_broken(f"{OPERATION} could not pack this rank's gradients ({reason})")
    return pp.CollectiveError(
        f"{OPERATION} on rank {rt.rank} could not pack this rank's gradients into its buffers ({reason}). Every "
        "parameter's .grad must have the parameter's shape, dtype and device (a .grad replaced through .data?). "
        "The peers had already agreed to reduce them: they will time out in this sync_grads, and this runtime is "
        "now broken. Fix the gradients and restart the processes.",
        operation=OPERATION, axis="data", rank=rt.rank)


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``p.grad = g`` for each pair, driven from C (map + a zero-length deque): half the cost of a
    Python loop for thousands of parameters."""
    deque(map(setattr, params, repeat("grad"), grads), maxlen=0)


def _as_grad_of(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=param.shape, stride=param.stride())


# -- the per-module cache ---------------------------------------------------------------------------------
class _Entry:
    def __init__(self, registrations: int, params: list[torch.Tensor]):
        self.registrations = registrations
        self.params = params  # every parameter, trainable or not, in module.parameters() order
        self.mask = [p.requires_grad for p in params]
        self.layout: _Layout | None = None


_CACHE: weakref.WeakKeyDictionary[nn.Module, _Entry] = weakref.WeakKeyDictionary()
# Bumped whenever torch registers a parameter or a submodule anywhere, while the hooks are installed
# (installed on the first sync of a runtime, removed when the last such runtime closes): a cached
# parameter list is reused while the count is unchanged, which saves walking the module tree on
# every step (about 2 ms for 2,000 parameters here).
_registrations = [0]
_hooks: list[Any] = []
_hook_users: weakref.WeakSet[TorchRuntime] = weakref.WeakSet()


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


def _use_hooks(rt: TorchRuntime) -> None:
    if rt in _hook_users:
        return
    if not _hooks:
        _registrations[0] += 1  # whatever changed while they were off: every cached list is stale
        _hooks.append(nn.modules.module.register_module_parameter_registration_hook(_count_registration))
        _hooks.append(nn.modules.module.register_module_module_registration_hook(_count_registration))
    _hook_users.add(rt)
    rt.at_close(lambda: _release_hooks(rt))


def _release_hooks(rt: TorchRuntime) -> None:
    _hook_users.discard(rt)
    if not _hook_users:
        while _hooks:
            _hooks.pop().remove()
        _CACHE.clear()


def _layout_of(module: nn.Module, bucket_bytes: int, rt: TorchRuntime) -> _Layout:
    _use_hooks(rt)
    entry = _CACHE.get(module)
    if entry is None or entry.registrations != _registrations[0]:
        entry = _CACHE[module] = _Entry(_registrations[0], list(module.parameters()))
    mask = list(map(_REQUIRES_GRAD, entry.params))
    if entry.layout is None or mask != entry.mask or entry.layout.bucket_bytes != bucket_bytes:
        entry.mask = mask
        entry.layout = _Layout([p for p, m in zip(entry.params, mask) if m], bucket_bytes)
    return entry.layout


def sync_gradients(target: Any, rt: TorchRuntime, strategy: pp.Strategy) -> Any:
    """Average (or sum, per ``strategy.grad_policy.op``) gradients of ``target`` over the data
    group; see the module docstring for parameters without a gradient."""
    rt.ensure_usable(OPERATION, "data")
    if is_ddp(target):
        return target  # DDP's reducer already averaged them during backward()
    missing = [] if isinstance(target, nn.Module) else [i for i, g in enumerate(target) if g is None]
    refusal = None
    if missing:
        refusal = (
            f"sync_grads() got a list of {len(target)} gradients with None at position(s) {missing} on rank "
            f"{rt.rank}; a list cannot say which parameter a missing gradient belongs to, so the ranks could not "
            "agree on what to reduce. Pass the module instead (strategy.sync_grads(model)): a parameter unused on "
            "this rank then contributes zeros, as with DDP."
        )
    if rt.topology.size("data") == 1:  # nobody to average with (a list with None fails alike everywhere)
        if refusal is not None:
            raise TypeError(refusal)
        return target
    policy = strategy.grad_policy
    op = "avg" if policy.op == "mean" else "sum"
    bucket_bytes = policy.bucket_bytes()
    if isinstance(target, nn.Module):
        _layout_of(target, bucket_bytes, rt).sync(rt, op, policy.check)
        return target
    grads = [local_tensor(g) for g in target if g is not None]
    detail = ", ".join(f"{g.dtype}{list(g.shape)}" for g in grads) + f"; op {op}"
    if refusal is not None:  # raises on every rank of the group (the peers learn why)
        if not policy.check:  # no check to tell them: they will time out in the payload
            raise TypeError(refusal)
        rt.check(OPERATION, "data", detail, refusal=refusal)
    with rt.operation(OPERATION, "data", detail, check=policy.check):
        for bucket in buckets(grads, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            rt.all_reduce(flat, op, OPERATION, "data")
            torch._foreach_copy_(bucket, [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in bucket]), bucket)])
    return target


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Accumulate gradients without synchronising (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``; a no-op for bare modules, whose gradients are only
    synced when ``strategy.sync_grads`` is called)."""
    from .accumulation import no_sync as no_sync_

    return no_sync_(model)
