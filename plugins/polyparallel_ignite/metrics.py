"""Ignite metrics reduced over the data group only, count-weighted, bounded in time.

Ignite's metrics reduce in ``compute()`` through ``ignite.distributed`` (``idist``): the
``@sync_all_reduce`` decorator calls ``idist.get_world_size()`` and ``idist.all_reduce(t)``
without a group, ``EpochMetric`` calls ``idist.all_gather`` and ``idist.broadcast(src=0)``.
All of them go through one object, ignite's *computation model* (``ComputationModel``; the
native, Horovod and XLA backends are subclasses) held in ``ignite.distributed.utils._model``.

The cleanest hook is therefore ignite's own abstraction: :class:`DataGroupModel` is a
``ComputationModel`` whose world *is this rank's data group* (rank = data coordinate, world
size = data size, every collective over the data group through the torch runtime's bounded
collectives). While a metric of an engine attached with :func:`register_engine` computes, that
model is swapped in, so every built-in metric (``Accuracy``, ``Loss``, ``Precision``,
``ConfusionMatrix``, ``EpochMetric`` ...) sums exactly its data shards: never tensor/pipeline
replicas (no double counting), and a peer that never joins raises
:class:`polyparallel.CollectiveTimeout` naming the metric, the ``data`` axis and the rank.

The patch, kept narrow and reversible:

- one method, ``ignite.metrics.Metric.completed`` (what ``Metric.attach`` registers at
  ``EPOCH_COMPLETED``), replaced by :func:`install` with a wrapper that behaves exactly as the
  original for engines not registered here; :func:`uninstall` restores the original. It must be
  installed *before* metrics are attached (``attach`` stores the bound method), which
  ``strategy.adapt("ignite")`` does.
- the computation model is swapped only for the duration of that one ``completed`` call (and
  restored in ``finally``), from the engine's own thread. :func:`data_group_world` exposes the
  same swap for code that calls ``metric.compute()`` by hand.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from ignite.distributed.comp_models.base import ComputationModel

import polyparallel as pp

__all__ = ["DataGroupModel", "data_group_world", "install", "uninstall", "installed", "register_engine",
           "is_registered"]

_OPS = {"SUM": "sum", "MAX": "max", "MIN": "min"}


class DataGroupModel(ComputationModel):
    """An ignite computation model whose world is this rank's data group.

    :param runtime: the :class:`polyparallel_torch.runtime.TorchRuntime` of the strategy.
    :param operation: how collectives are named in errors (``"ignite metric 'acc' (Accuracy)"``).
    """

    name = "polyparallel-data-group"
    available_backends = ("gloo", "nccl")

    def __init__(self, runtime: Any, operation: str = "ignite metric reduction"):
        super().__init__()
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
            return self._rt.all_reduce(tensor, _OPS[op], self.operation, "data")
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
        group = self._explicit_group(group) or self._rt.group("data")
        if tensor.ndimension() == 0:
            tensor = tensor.unsqueeze(0)
        if group is None:
            return tensor
        output = [torch.zeros_like(tensor) for _ in range(group.size())]
        with self._rt.collective(self.operation, "data"):
            work = dist.all_gather(output, tensor, group=group, async_op=True)
        self._rt.wait(work, self.operation, "data")
        return torch.cat(output, dim=0)

    def _do_all_gather_object(self, tensor: Any, group: Any | None = None) -> list[Any]:
        self._explicit_group(group)
        return self._rt.all_gather_object(tensor, self.operation, "data")

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
def data_group_world(runtime: Any, operation: str = "ignite metric reduction") -> Iterator[DataGroupModel]:
    """Inside this block, ``ignite.distributed`` sees this rank's data group as the world.

    For metrics computed by hand: ``with data_group_world(rt): value = metric.compute()``.
    The previous computation model is restored on exit, also on error.
    """
    import ignite.distributed.utils as idist_utils

    saved = idist_utils._model, idist_utils._need_to_sync
    model = DataGroupModel(runtime, operation)
    idist_utils._model, idist_utils._need_to_sync = model, False
    try:
        yield model
    finally:
        idist_utils._model, idist_utils._need_to_sync = saved


# -- the one patched method ---------------------------------------------------------------------------
_ENGINES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_ORIGINAL: dict[str, Any] = {}


def _completed(self: Any, engine: Any, name: str) -> None:
    """``Metric.completed`` that reduces over the data group for engines registered here."""
    original = _ORIGINAL.get("completed") or _original_completed()
    runtime = _ENGINES.get(engine)
    if runtime is None:
        return original(self, engine, name)
    with data_group_world(runtime, f"ignite metric {name!r} ({type(self).__name__}.compute)"):
        return original(self, engine, name)


def _original_completed() -> Any:
    from ignite.metrics import Metric

    completed = Metric.__dict__["completed"]
    return getattr(completed, "__wrapped_by_polyparallel__", completed)


def install() -> None:
    """Patch ``ignite.metrics.Metric.completed`` (idempotent). Engines not registered with
    :func:`register_engine` see ignite's behaviour unchanged."""
    from ignite.metrics import Metric

    if "completed" in _ORIGINAL:
        return
    _ORIGINAL["completed"] = Metric.__dict__["completed"]
    _completed.__wrapped_by_polyparallel__ = _ORIGINAL["completed"]  # type: ignore[attr-defined]
    _completed.__doc__ = (_ORIGINAL["completed"].__doc__ or "") + (
        "\n\n        Patched by polyparallel_ignite: reduces over the data group for engines attached "
        "with strategy.adapt('ignite').attach(engine).")
    Metric.completed = _completed  # type: ignore[method-assign]


def uninstall() -> None:
    """Restore ignite's ``Metric.completed``. Metrics attached while the patch was installed keep
    the wrapper bound (ignite stored the bound method), which then behaves as the original for
    engines no longer registered."""
    from ignite.metrics import Metric

    original = _ORIGINAL.pop("completed", None)
    if original is not None:
        Metric.completed = original  # type: ignore[method-assign]
    _ENGINES.clear()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return "completed" in _ORIGINAL


def register_engine(engine: Any, runtime: Any) -> None:
    """Make ``engine``'s metrics reduce over ``runtime``'s data group (weakly referenced)."""
    if not installed():
        raise pp.PolyparallelError("polyparallel_ignite.metrics.install() must run before engines are registered.")
    _ENGINES[engine] = runtime


def is_registered(engine: Any) -> bool:
    """Whether ``engine``'s metrics reduce over the data group."""
    return engine in _ENGINES
