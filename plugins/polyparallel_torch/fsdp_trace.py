"""FSDP2's all-gathers and reduce-scatters in polyparallel's trace and hang reports: recording comms.

FSDP2 (``fully_shard``, ``Strategy(zero=2|3)``) all-gathers each unit's parameters in forward
(and, at zero=3, again in backward) and reduce-scatters its gradients in backward; those
collectives are torch's, not the runtime's, so without this module a rank that runs another
operation meanwhile (``strategy.reduce_metrics(...)`` on one rank while the other runs forward)
ends with a raw gloo/NCCL timeout raised inside FSDP's hooks, and the peer's hang report says the
rank's last collective was an earlier polyparallel one.

:func:`install` sets, on every FSDP unit polyparallel's ``shard_module`` makes, torch's custom
comm API (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch >= 2.9)
to :class:`RecordingAllGather` / :class:`RecordingReduceScatter`: subclasses of torch's own
``DefaultAllGather`` / ``DefaultReduceScatter`` that record the collective and run torch's
default inside, unchanged (same ``allocate``, same ``dist.all_gather_single`` /
``dist.reduce_scatter_single`` with FSDP's tensors, reduce op and ``async_op``: the numerics and
memory are FSDP's; the mixed precision ``reduce_dtype`` and the divide factors are applied by FSDP
outside the comm). Being subclasses of the defaults, torch's ``set_allocate_memory_from_process_group``
and ``set_symm_mem`` still accept them (they replace the comm: that unit is then unrecorded), as a
later ``set_custom_*`` call does.

**One entry per forward and per backward** of a model, not per unit: the collectives of one
phase (the forward's all-gathers; a backward's all-gathers and reduce-scatters, told apart by the
autograd graph task they run in) continue the same trace entry while it is still the process's
latest, so a 32-layer model adds two entries per step to the 256-entry ring buffer, not ~100,
and only the first collective of a phase walks the stack for the caller's location (the user's
``model(x)`` or ``loss.backward()`` line). The entry's operation is the latest collective's
(``FSDP all-gather`` / ``FSDP reduce-scatter``), its detail the unit, size and count (``unit layers.1:
1056 float32, 3rd collective of this backward``); it has no sequence number (no identity check:
a check would add an all-reduce and a device synchronisation per phase). It is finished when the
collective returns (on CUDA: when it is enqueued; an ``async_op`` all-gather when its work
completes).

A failure of the collective (a peer that never joins: gloo's timeout) is raised as the runtime's
:class:`polyparallel.CollectiveTimeout` naming the FSDP collective and, through the side
channel, what every rank of the data group was doing, and the runtime is marked broken, as for
any runtime collective; a broken or closed runtime refuses the next FSDP collective.

Not recorded: the all-reduce over the replicate dimension of HSDP (:func:`.sharding.replicate_module`):
torch calls ``dist.all_reduce`` for it itself (no custom comm, torch 2.9 and 2.13), and its one
hook there, ``set_all_reduce_hook``, runs after the all-reduce returned (it could not show a rank
waiting in it) and is the user's only slot.

``POLYPARALLEL_TRACE_FSDP=0`` installs nothing (FSDP's own comms, unrecorded). Where torch lacks
the API (older torch), nothing is installed either (:func:`supported`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from polyparallel import _trace
from polyparallel._errors import exception_summary

__all__ = ["ALL_GATHER", "ENV", "REDUCE_SCATTER", "enabled", "install", "is_installed", "supported"]

ENV = "POLYPARALLEL_TRACE_FSDP"
"""``0`` turns the recording comms off (the benchmarks' switch)."""
ALL_GATHER = "FSDP all-gather"
"""The operation's name of an all-gather in the trace and hang reports."""
REDUCE_SCATTER = "FSDP reduce-scatter"
"""The operation's name of a reduce-scatter in the trace and hang reports."""
AXIS = "data"


def enabled() -> bool:
    """Whether :func:`install` installs the comms (``POLYPARALLEL_TRACE_FSDP`` not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _defaults() -> tuple[type, type] | None:
    """torch's default FSDP2 comms, or ``None`` where this torch has no custom comm API."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None
    if not (hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")):
        return None
    return DefaultAllGather, DefaultReduceScatter


def supported() -> bool:
    """Whether this torch offers FSDP2's custom comm API (``set_custom_all_gather`` and
    ``set_custom_reduce_scatter``)."""
    return _defaults() is not None


class _Shared:
    """One model's recording state: the runtime and the open entry of the current phase."""

    __slots__ = ("rt", "entry", "phase", "count", "gen")

    def __init__(self, rt: Any):
        self.rt = rt
        self.entry: _trace.Entry | None = None
        self.phase = -2  # the autograd graph task of the entry (-1: forward, outside any backward)
        self.count = 0  # collectives in the entry
        self.gen = 0  # bumped at each collective: an async work's completion finishes only its own

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the model (copy.deepcopy, pickle) has no runtime: its comms only run torch's default.
        return (_Shared, (None,))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _enter(shared: _Shared, operation: str, unit: str, tensor: torch.Tensor) -> _trace.Entry | None:
    """Open (or continue) the phase's entry for a collective that starts now."""
    rt = shared.rt
    rec = rt._rec
    if rec is None or AXIS in rt._covered:  # trace off, or inside a runtime operation (its entry covers it)
        return None
    phase = torch._C._current_graph_task_id()
    entry = shared.entry
    if entry is not None and phase == shared.phase and rec.entries and rec.entries[-1] is entry:
        shared.count += 1
        entry.operation, entry.state, entry.t1, entry.error = operation, "entered", None, None
    else:
        thread = rec.thread  # keep the stack of the thread driving the step (backward may run elsewhere)
        entry = shared.entry = rec.enter(operation, AXIS, None, "", skip=4)
        rec.thread = thread
        shared.phase, shared.count = phase, 1
    entry.detail = (f"unit {unit}: {tensor.numel()} {str(tensor.dtype).removeprefix('torch.')}, "
                    f"{_ordinal(shared.count)} collective of this {'forward' if phase < 0 else 'backward'}")
    return entry


def _done(shared: _Shared, entry: _trace.Entry | None, work: Any) -> None:
    if entry is None:
        return
    if work is None:
        _trace.Recorder.finish(entry)
        return
    gen = shared.gen

    def finished(future: Any) -> None:
        if shared.gen == gen and shared.entry is entry:
            try:
                future.value()
            except Exception as exc:  # noqa: BLE001  # FSDP's wait raises it; the entry says it
                _trace.Recorder.finish(entry, exception_summary(exc))
                return
            _trace.Recorder.finish(entry)

    try:
        work.get_future().add_done_callback(finished)
    except Exception:  # noqa: BLE001  # a backend without futures: the next collective continues the entry
        pass


def _run(comm: Any, operation: str, tensor: torch.Tensor, collective: Any) -> Any:
    """Record ``collective()`` (torch's default comm) in the runtime's trace and bound its failure."""
    shared: _Shared = comm._shared
    rt = shared.rt
    if rt is None:  # a copy of the model
        return collective()
    rt.ensure_usable(operation, AXIS)
    shared.gen += 1
    entry = _enter(shared, operation, comm._unit, tensor)
    try:
        work = collective()
    except BaseException as exc:
        _trace.Recorder.finish(entry, exception_summary(exc))
        rt._collective_failed(exc, operation, AXIS, f"{operation} of unit {comm._unit}")
        raise
    _done(shared, entry, work)
    return work


_CLASSES: tuple[type, type] | None = None


def _classes() -> tuple[type, type] | None:
    """The recording comm classes (made once, subclassing torch's defaults), or ``None``."""
    global _CLASSES, RecordingAllGather, RecordingReduceScatter
    if _CLASSES is not None:
        return _CLASSES
    defaults = _defaults()
    if defaults is None:
        return None
    default_all_gather, default_reduce_scatter = defaults

    class RecordingAllGather(default_all_gather):  # type: ignore[valid-type,misc]
        """torch's ``DefaultAllGather``, recorded in polyparallel's trace."""

        def __init__(self, shared: _Shared, unit: str):
            super().__init__()
            self._shared, self._unit = shared, unit

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            call = super().__call__
            return _run(self, ALL_GATHER, output_tensor,
                        lambda: call(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                                     async_op=async_op))

    class RecordingReduceScatter(default_reduce_scatter):  # type: ignore[valid-type,misc]
        """torch's ``DefaultReduceScatter``, recorded in polyparallel's trace."""

        def __init__(self, shared: _Shared, unit: str):
            super().__init__()
            self._shared, self._unit = shared, unit

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            call = super().__call__
            return _run(self, REDUCE_SCATTER, input_tensor,
                        lambda: call(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                                     async_op=async_op))

    RecordingAllGather.__module__ = RecordingReduceScatter.__module__ = __name__
    _CLASSES = (RecordingAllGather, RecordingReduceScatter)
    return _CLASSES


RecordingAllGather: Any = None
"""The recording all-gather comm class (``None`` until :func:`install` first runs, or without the API)."""
RecordingReduceScatter: Any = None
"""The recording reduce-scatter comm class (as :data:`RecordingAllGather`)."""


def install(model: nn.Module, rt: Any) -> int:
    """Set the recording comms on every FSDP unit of ``model`` (``model`` and its submodules that
    ``fully_shard`` was applied to), over ``rt``'s data group. Returns how many units record: 0
    when switched off (:func:`enabled`), when torch lacks the API (:func:`supported`), or for
    units torch refuses a custom comm (several parameter groups)."""
    if not enabled():
        return 0
    classes = _classes()
    if classes is None:
        return 0
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = classes
    shared = _Shared(rt)
    units = 0
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        unit = name or "root"
        try:
            module.set_custom_all_gather(all_gather(shared, unit))
            module.set_custom_reduce_scatter(reduce_scatter(shared, unit))
        except ValueError:  # several parameter groups (shard_placement_fn meshes): torch's own comms
            continue
        units += 1
    return units


def is_installed(model: nn.Module) -> bool:
    """Whether some FSDP unit of ``model`` all-gathers through the recording comm."""
    classes = _classes()
    if classes is None:
        return False
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        fsdp_state = state()
        groups = getattr(fsdp_state, "_fsdp_param_groups", None)  # torch 2.13; 2.9: one, or None
        if groups is None:
            groups = [g for g in (getattr(fsdp_state, "_fsdp_param_group", None),) if g is not None]
        for group in groups:
            if isinstance(getattr(group, "_all_gather_comm", None), classes[0]):
                return True
    return False
