"""Ignite metrics reduced over the data group only, count-weighted, bounded in time.

Ignite's metrics reduce in ``compute()`` through ``ignite.distributed`` (``idist``): the
``@sync_all_reduce`` decorator calls ``idist.get_world_size()`` and ``idist.all_reduce(t)``
without a group, ``EpochMetric`` calls ``idist.all_gather`` and ``idist.broadcast(src=0)``.
All of them go through one object, ignite's *computation model* (``ComputationModel``; the
native, Horovod and XLA backends are subclasses) held in ``ignite.distributed.utils._model``.

The cleanest hook is therefore ignite's own abstraction: :class:`DataGroupModel` is a
``ComputationModel`` whose world *is this rank's data group* (rank = data coordinate, world
size = data size, every collective over the data group through the torch runtime's bounded
collectives). While a metric of an engine registered with :func:`register_engine` handles one of
the engine's events, that model is swapped in, so every built-in metric (``Accuracy``, ``Loss``,
``Precision``, ``ConfusionMatrix``, ``EpochMetric``, ``Frequency``, ``RunningAverage`` ...) sums
exactly its data shards: never tensor/pipeline replicas (no double counting), and a peer that
never joins raises :class:`polyparallel.CollectiveTimeout` naming the metric, the ``data`` axis
and the rank.

Scoped to the engines handed over, nothing process-wide:

- ignite's classes are not patched. :func:`register_engine` replaces, *in that engine's handler
  lists only*, each metric's ``iteration_completed`` and ``completed`` handler (the bound methods
  ``Metric.attach`` registered, whatever class defines them: ``Frequency`` overrides
  ``completed``) by a wrapper that keeps ignite's ``_parent`` protocol, so ``is_attached`` and
  ``detach`` behave as before. Metrics attached later are wrapped when the engine's run or an
  epoch starts. The same metric attached to another engine, and every other engine, run as ignite
  wrote them. :func:`unregister_engine` gives the engine its original handlers back.
- the computation model is swapped only for the duration of one handler call (and restored in
  ``finally``), from the engine's own thread. :func:`data_group_world` exposes the same swap for
  code that calls ``metric.compute()`` by hand.

``Frequency`` (items per second) reduces its item count and elapsed time over the data group, so
its value is the throughput of the whole data-parallel job, each sample counted once (ignite's
world-wide reduction would count each sample once per tensor/pipeline replica).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from numbers import Number
from typing import Any, cast

import torch
import torch.distributed as dist
from ignite.distributed.comp_models.base import ComputationModel

__all__ = ["DataGroupModel", "data_group_world", "is_registered", "register_engine", "unregister_engine"]

_OPS = {"SUM": "sum", "MAX": "max", "MIN": "min"}
#: The most dimensions a gathered tensor may have (the shapes exchanged first have a fixed size).
_MAX_DIMS = 8


class DataGroupModel(ComputationModel):
    """An ignite computation model whose world is this rank's data group.

    :param runtime: the :class:`polyparallel_torch.runtime.TorchRuntime` of the strategy.
    :param operation: how collectives are named in errors (``"ignite metric 'acc' (Accuracy)"``).
    """

    name = "polyparallel-data-group"
    available_backends = ("gloo", "nccl")

    def __init__(self, runtime: Any, operation: str = "ignite metric reduction", mean: bool = False):
        super().__init__()
        #: A sum (``all_reduce``'s default) is divided by the group's size: its mean.
        self.mean = mean
        self._rt = runtime
        self.operation = operation
        self._size = runtime.topology.size("data")
        self._coord = runtime.session.coords["data"]
        self._nproc_per_node = self._size
        self._nnodes, self._node = 1, 0

    # -- the world: the data group ---------------------------------------------------------------
    def _compute_nproc_per_node(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def get_rank(self) -> int:
        return self._coord

    def get_world_size(self) -> int:
        return self._size

    def get_nproc_per_node(self) -> int:
        return self._size

    def get_nnodes(self) -> int:
        return 1

    def get_node_rank(self) -> int:
        return 0

    def device(self) -> torch.device:
        return self._rt.device

    def backend(self) -> str | None:
        return self._rt.backend

    def finalize(self) -> None:
        """Nothing to release: the groups belong to the torch runtime."""

    @staticmethod
    def create_from_context() -> None:
        return None

    @staticmethod
    def create_from_backend(backend: str, **kwargs: Any) -> ComputationModel:
        raise NotImplementedError("DataGroupModel is made by polyparallel_ignite, never from a backend name.")

    @staticmethod
    def spawn(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("DataGroupModel cannot spawn processes: use polyparallel.launch or idist.Parallel.")

    # -- collectives, bounded by the strategy's timeout ---------------------------------------------
    def _explicit_group(self, group: Any) -> Any:
        if group is None:
            return None
        if isinstance(group, list):
            raise ValueError(
                f"{self.operation}: a metric passed group={group} (a list of ranks) while polyparallel reduces "
                "metrics over the data group; drop the group argument or compute this metric outside the adapter."
            )
        return group

    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor:
        group = self._explicit_group(group)
        if group is None and op in _OPS:
            out = self._rt.all_reduce(tensor, _OPS[op], self.operation, "data")
            return out / self._size if self.mean and op == "SUM" else out
        reduce_op = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN,
                     "PRODUCT": dist.ReduceOp.PRODUCT, "AND": dist.ReduceOp.BAND, "OR": dist.ReduceOp.BOR}
        if op not in reduce_op:
            raise ValueError(f"{self.operation}: unsupported reduction {op!r}; expected one of {sorted(reduce_op)}.")
        group = group if group is not None else self._rt.group("data")
        if group is None:
            return tensor
        with self._rt.collective(self.operation, "data"):
            work = dist.all_reduce(tensor, reduce_op[op], group=group, async_op=True)
        self._rt.wait(work, self.operation, "data")
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
        """The tensors of every rank of the group, concatenated along the first dimension. The
        ranks may hold different numbers of rows (an ``EpochMetric`` on shards of 12 and 11
        samples): their shapes are exchanged first, each tensor is padded to the longest, and
        the padding is cut off again after the gather."""
        group = self._explicit_group(group) or self._rt.group("data")
        if tensor.ndimension() == 0:
            tensor = tensor.unsqueeze(0)
        if group is None:
            return tensor
        size = group.size()
        shapes = self._gather_shapes(tensor, group, size)
        rows = [shape[0] for shape in shapes]
        if any(shape[1:] != shapes[0][1:] for shape in shapes):
            # Every rank sees the same shapes, so every rank raises here: nobody waits.
            raise ValueError(f"{self.operation}: all_gather of tensors whose shapes differ beyond the first "
                             f"dimension (shapes by data rank: {shapes}); only the number of rows may differ.")
        longest = max(rows)
        padded = tensor.contiguous()
        if tensor.shape[0] < longest:
            padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
        output = [torch.empty_like(padded) for _ in range(size)]
        with self._rt.collective(self.operation, "data"):
            work = dist.all_gather(output, padded, group=group, async_op=True)
        self._rt.wait(work, self.operation, "data")
        return torch.cat([part[:n] for part, n in zip(output, rows)], dim=0)

    def _gather_shapes(self, tensor: torch.Tensor, group: Any, size: int) -> list[tuple[int, ...]]:
        """Every rank's shape of ``tensor`` (one small fixed-size all_gather)."""
        if tensor.ndimension() > _MAX_DIMS:
            raise ValueError(f"{self.operation}: all_gather of a {tensor.ndimension()}-dimensional tensor; "
                             f"the adapter gathers tensors of at most {_MAX_DIMS} dimensions.")
        mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=tensor.device)
        mine[0] = tensor.ndimension()
        mine[1:1 + tensor.ndimension()] = torch.tensor(tensor.shape, dtype=torch.int64)
        shapes = [torch.empty_like(mine) for _ in range(size)]
        with self._rt.collective(f"{self.operation} (shapes)", "data"):
            work = dist.all_gather(shapes, mine, group=group, async_op=True)
        self._rt.wait(work, f"{self.operation} (shapes)", "data")
        out = []
        for s in shapes:
            ndim = int(s[0])
            out.append(tuple(int(d) for d in s[1:1 + ndim]))
        if len({len(shape) for shape in out}) > 1:
            raise ValueError(f"{self.operation}: all_gather of tensors with different numbers of dimensions on "
                             f"the data ranks (shapes by data rank: {out}).")
        return out

    def _do_all_gather_object(self, tensor: Any, group: Any | None = None) -> list[Any]:
        self._explicit_group(group)
        return self._rt.all_gather_object(tensor, self.operation, "data")

    def broadcast(self, tensor: Any, src: int = 0, safe_mode: bool = False) -> Any:
        """ignite's ``broadcast``, except that a number travels as float64 (ignite sends float32),
        so a value computed on one rank (an ``EpochMetric``'s sklearn score) arrives exact."""
        if safe_mode:  # as ignite: the ranks agree on the type first (one all_reduce)
            if tensor is None and self.get_rank() == src:
                raise ValueError("Source data can not be None")
            tensor = self._setup_placeholder(tensor, self.device(), self.get_rank() == src)
        if isinstance(tensor, Number) and not isinstance(tensor, bool):
            device = self.device()
            value = (torch.tensor([float(cast(float, tensor))], dtype=torch.float64, device=device) if self.get_rank() == src
                     else torch.empty(1, dtype=torch.float64, device=device))
            return self._do_broadcast(value, src).item()
        return super().broadcast(tensor, src=src)

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        # ``src`` is a rank of *this* world: a data coordinate.
        return self._rt.broadcast(tensor, self.operation, "data", src_coord=src)

    def barrier(self) -> None:
        self._rt.all_reduce(torch.zeros(1, device=self._rt.device), "sum", f"{self.operation} (barrier)", "data")

    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        return dist.new_group(ranks=ranks, **kwargs)

    def _rank_not_in_group(self, group: Any) -> bool:
        return group is not None and dist.get_rank(group) < 0


@contextlib.contextmanager
def _world(model: ComputationModel) -> Iterator[ComputationModel]:
    """``model`` is ignite's computation model inside the block; the previous one after it."""
    import ignite.distributed.utils as idist_utils

    saved = idist_utils._model, idist_utils._need_to_sync
    idist_utils._model, idist_utils._need_to_sync = model, False  # type: ignore[assignment]
    try:
        yield model
    finally:
        idist_utils._model, idist_utils._need_to_sync = saved


@contextlib.contextmanager
def data_group_world(runtime: Any, operation: str = "ignite metric reduction") -> Iterator[DataGroupModel]:
    """Inside this block, ``ignite.distributed`` sees this rank's data group as the world.

    For metrics computed by hand: ``with data_group_world(rt): value = metric.compute()``.
    The previous computation model is restored on exit, also on error.
    """
    with _world(DataGroupModel(runtime, operation)) as model:
        yield model  # type: ignore[misc]


# -- engines whose metrics reduce over the data group ------------------------------------------------
#: The metric methods an engine calls from its events: ``iteration_completed`` (``update``, where
#: e.g. ``RunningAverage`` reduces) and ``completed`` (``compute``, where most metrics reduce).
_WRAPPED_METHODS = {"iteration_completed": "update", "completed": "compute"}


class _Registration:
    """An engine registered with :func:`register_engine`: the runtime, and the handlers that wrap
    metrics attached later (before a run or an epoch starts)."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.models: dict[str, DataGroupModel] = {}  # by operation, for this runtime

    def model(self, operation: str, mean: bool = False) -> DataGroupModel:
        model = self.models.get(operation)
        if model is None:
            model = self.models[operation] = DataGroupModel(self.runtime, operation, mean=mean)
        return model


_ENGINES: weakref.WeakKeyDictionary[Any, _Registration] = weakref.WeakKeyDictionary()


def _metric_method(handler: Any) -> tuple[Any, str] | None:
    """``(metric, method name)`` when ``handler`` is a metric's ``iteration_completed`` or
    ``completed`` as ignite registered it: the bound method, or ignite's wrapper for a filtered
    event (``Events.ITERATION_COMPLETED(every=50)``), which points back to it through ``_parent``."""
    from ignite.metrics import Metric

    if hasattr(handler, "_polyparallel_original"):
        return None  # already ours
    parent = getattr(handler, "_parent", None)
    target = parent() if isinstance(parent, weakref.ref) else handler
    metric = getattr(target, "__self__", None)
    name = getattr(target, "__name__", None)
    if isinstance(metric, Metric) and name in _WRAPPED_METHODS:
        return metric, name
    if name == "_log_lr_and_loss" and type(metric).__name__ == "FastaiLRFinder":
        return metric, name  # its loss: the data group's mean (ignite sums it over the whole world)
    return None


def _wrap(engine: Any, handler: Any, metric: Any, method: str, name: str) -> Any:
    """``handler`` run with the data group as ignite's world while ``engine`` is registered.

    The wrapper answers ignite's ``_parent`` protocol (``has_event_handler``,
    ``remove_event_handler``), so ``metric.is_attached(engine)`` and ``metric.detach(engine)`` work
    as before."""
    engine_ref = weakref.ref(engine)
    mean = method == "_log_lr_and_loss"
    operation = (f"ignite FastaiLRFinder's loss ({type(metric).__name__}._log_lr_and_loss)" if mean else
                 f"ignite metric {name!r} ({type(metric).__name__}.{_WRAPPED_METHODS[method]})")

    def over_data_group(*args: Any, **kwargs: Any) -> Any:
        target = engine_ref()
        registration = _ENGINES.get(target) if target is not None else None
        if registration is None:  # unregistered since: ignite's own behaviour
            return handler(*args, **kwargs)
        with _world(registration.model(operation, mean)):
            return handler(*args, **kwargs)

    parent = getattr(handler, "_parent", None)
    # The closure holds `handler`, so a weak reference to the bound method stays alive with it.
    over_data_group._parent = parent if isinstance(parent, weakref.ref) else weakref.ref(handler)  # type: ignore[attr-defined]
    over_data_group._polyparallel_original = handler  # type: ignore[attr-defined]
    return over_data_group


def _wrap_metrics(engine: Any) -> None:
    """Wrap the metric handlers of ``engine`` not wrapped yet (an event handler of the engine:
    metrics attached after :func:`register_engine` are wrapped when the run or an epoch starts)."""
    handlers = engine._event_handlers  # ignite's registry: {event: [(handler, args, kwargs), ...]}
    names: dict[int, str] = {}
    for entries in handlers.values():
        for handler, args, _ in entries:
            found = _metric_method(handler) or _metric_method(getattr(handler, "_polyparallel_original", None))
            if found and found[1] == "completed" and args and isinstance(args[-1], str):
                names[id(found[0])] = args[-1]  # Metric.attach registers completed(engine, name)
    for event, entries in list(handlers.items()):
        if not any(_metric_method(handler) for handler, _, _ in entries):
            continue
        replaced = []
        for handler, args, kwargs in entries:
            found = _metric_method(handler)
            if found is not None:
                metric, method = found
                handler = _wrap(engine, handler, metric, method, names.get(id(metric), type(metric).__name__))
            replaced.append((handler, args, kwargs))
        # A new list: an event being fired keeps iterating over the one it started with.
        handlers[event] = replaced


def _unwrap_metrics(engine: Any) -> None:
    handlers = engine._event_handlers
    for event, entries in list(handlers.items()):
        if any(hasattr(handler, "_polyparallel_original") for handler, _, _ in entries):
            handlers[event] = [(getattr(handler, "_polyparallel_original", handler), args, kwargs)
                               for handler, args, kwargs in entries]


def register_engine(engine: Any, runtime: Any) -> None:
    """Make the metrics of ``engine`` (attached before or after this call, until the engine's run
    or epoch starts) reduce over ``runtime``'s data group. Only this engine changes: ignite's
    classes, other engines and the metrics' other engines are left alone. Undone by
    :func:`unregister_engine`; the engine is weakly referenced."""
    from ignite.engine import Events

    registration = _ENGINES.get(engine)
    if registration is None or registration.runtime is not runtime:
        _ENGINES[engine] = _Registration(runtime)
    for event in (Events.STARTED, Events.EPOCH_STARTED):
        if not engine.has_event_handler(_wrap_metrics, event):
            engine.add_event_handler(event, _wrap_metrics)
    _wrap_metrics(engine)


def unregister_engine(engine: Any) -> None:
    """Give ``engine`` back its handlers as ignite made them (idempotent)."""
    from ignite.engine import Events

    _ENGINES.pop(engine, None)
    for event in (Events.STARTED, Events.EPOCH_STARTED):
        if engine.has_event_handler(_wrap_metrics, event):
            engine.remove_event_handler(_wrap_metrics, event)
    _unwrap_metrics(engine)


def is_registered(engine: Any) -> bool:
    """Whether ``engine``'s metrics reduce over the data group."""
    return engine in _ENGINES
