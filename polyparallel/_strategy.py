"""The Strategy: the one object users build and hand to every framework."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._errors import NoPluginError, TopologyError
from ._manager import get_plugin_manager
from ._policies import DataPolicy, GradPolicy, MetricPolicy, StatePolicy
from ._topology import Topology

if TYPE_CHECKING:
    from ._manager import PluginManager
    from ._session import Session

__all__ = ["Strategy"]

_FIELDS = ("topology", "timeout", "seed", "backend", "data_policy", "grad_policy", "metric_policy", "state_policy")


class Strategy:
    """How to parallelise: a :class:`Topology` plus policies, immutable and picklable.

    :param data, tensor, pipeline: axis sizes; one may be ``-1`` (inferred from the world size).
    :param topology: a :class:`Topology` instead of the three sizes.
    :param timeout: seconds every collective may wait before failing with an error that names
        the operation, axis and rank.
    :param seed: seeds data shuffling (with the epoch) and any random state a plugin makes.
    :param batch_size: the global batch size (shortcut for ``data_policy=DataPolicy(batch_size=)``).
    :param backend: communication backend for runtimes that have several (``"gloo"``, ``"nccl"``);
        ``None`` picks automatically.
    :param data_policy, grad_policy, metric_policy, state_policy: see :mod:`polyparallel` policies.
    :param plugin_manager: the plugin manager operations dispatch through (default: the process's
        default manager). Not part of the value: it is neither compared nor pickled.

    The five operations dispatch to whichever plugin owns the object:

    >>> s = Strategy(data=-1, tensor=2, timeout=60.0)   # doctest: +SKIP
    >>> loader = s.shard_data(loader); model = s.wrap_model(model)   # doctest: +SKIP
    """

    __slots__ = (*_FIELDS, "_pm", "_hash")

    topology: Topology
    timeout: float
    seed: int
    backend: str | None
    data_policy: DataPolicy
    grad_policy: GradPolicy
    metric_policy: MetricPolicy
    state_policy: StatePolicy

    def __init__(
        self,
        data: int | None = None,
        tensor: int | None = None,
        pipeline: int | None = None,
        *,
        topology: Topology | None = None,
        timeout: float = 60.0,
        seed: int = 0,
        batch_size: int | None = None,
        backend: str | None = None,
        data_policy: DataPolicy | None = None,
        grad_policy: GradPolicy | None = None,
        metric_policy: MetricPolicy | None = None,
        state_policy: StatePolicy | Mapping[str, str] | None = None,
        plugin_manager: PluginManager | None = None,
    ):
        sizes = {k: v for k, v in (("data", data), ("tensor", tensor), ("pipeline", pipeline)) if v is not None}
        if topology is not None:
            if sizes:
                raise TopologyError(f"Strategy takes axis sizes or topology=, not both. Received {sizes} and {topology!r}.")
            if not isinstance(topology, Topology):
                raise TopologyError(f"Strategy(topology=) must be a Topology. Received: {type(topology).__name__}.")
        else:
            topology = Topology(**{"data": -1, **sizes}) if "data" not in sizes and -1 not in sizes.values() else Topology(**sizes)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise TopologyError(f"Strategy(timeout=) must be a positive number of seconds. Received: {timeout!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TopologyError(f"Strategy(seed=) must be an int. Received: {seed!r}.")
        if backend is not None and not isinstance(backend, str):
            raise TopologyError(f"Strategy(backend=) must be a string or None. Received: {backend!r}.")
        if data_policy is None:
            data_policy = DataPolicy(batch_size=batch_size)
        elif batch_size is not None:
            data_policy = dataclasses.replace(data_policy, batch_size=batch_size)
        if state_policy is None or isinstance(state_policy, Mapping):
            state_policy = StatePolicy(state_policy or {})
        values = dict(
            topology=topology, timeout=float(timeout), seed=seed, backend=backend,
            data_policy=data_policy, grad_policy=GradPolicy() if grad_policy is None else grad_policy,
            metric_policy=MetricPolicy() if metric_policy is None else metric_policy, state_policy=state_policy,
        )
        for name, kind in (("data_policy", DataPolicy), ("grad_policy", GradPolicy),
                           ("metric_policy", MetricPolicy), ("state_policy", StatePolicy)):
            if not isinstance(values[name], kind):
                raise TopologyError(f"Strategy({name}=) must be a {kind.__name__}. Received: {values[name]!r}.")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_pm", plugin_manager)
        object.__setattr__(self, "_hash", hash(tuple(values.values())))

    # -- value semantics ------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Strategy is immutable; use strategy.replace({name}=...)")

    def __delattr__(self, name: str) -> None:
        # __slots__ descriptors would otherwise let `del strategy.timeout` through.
        raise AttributeError(f"Strategy is immutable; cannot delete {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in _FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and other._values() == self._values()

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # The plugin manager stays behind: each process has its own.
        return (_rebuild, (dict(zip(_FIELDS, self._values())),))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in self.topology.sizes.items())
        return f"Strategy({axes}, timeout={self.timeout:g}, seed={self.seed})"

    def replace(self, **changes: Any) -> Strategy:
        """A copy with some fields changed (``topology``, ``timeout``, a policy, or axis sizes)."""
        values = dict(zip(_FIELDS, self._values()))
        axes = {a: changes.pop(a) for a in ("data", "tensor", "pipeline") if a in changes}
        if axes and "topology" in changes:
            raise TopologyError(
                f"Strategy.replace() takes axis sizes or topology=, not both. Received {axes} and "
                f"{changes['topology']!r}."
            )
        if axes:
            values["topology"] = Topology(**{**values["topology"].sizes, **axes})
        unknown = set(changes) - set(_FIELDS)
        if unknown:
            raise TypeError(f"Strategy.replace() got unknown fields {sorted(unknown)}; expected {_FIELDS}.")
        values.update(changes)
        return Strategy(**values, plugin_manager=self._pm)

    # -- per-process state ------------------------------------------------------------------------
    @property
    def plugin_manager(self) -> PluginManager:
        """The plugin manager this strategy dispatches through."""
        return self._pm if self._pm is not None else get_plugin_manager()

    def session(self) -> Session:
        """This process's :class:`Session` (rank, resolved topology, runtime objects), made on first use."""
        return self.plugin_manager.session(self)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.session().rank

    @property
    def world_size(self) -> int:
        """Number of launched processes."""
        return self.session().world_size

    def check(self, target: str, world_size: int | None = None) -> None:
        """Refuse, before anything starts, a topology that ``target`` (a runtime or adapter name)
        declared it cannot run. ``world_size`` also checks that the topology fits that many ranks."""
        topology = self.topology.resolve(world_size) if world_size is not None else self.topology
        caps = self.plugin_manager.capabilities()
        if target not in caps:
            raise NoPluginError(
                f"No installed plugin provides the target {target!r}. Known targets: "
                f"{', '.join(sorted(caps)) or 'none'}. Install its extra: pip install 'polyparallel[{target}]'."
            )
        caps[target].check(topology)

    # -- the five operations ------------------------------------------------------------------------
    def shard_data(self, data: Any, **overrides: Any) -> Any:
        """Shard ``data`` (a data set or loader) over the data axis.

        Keyword arguments override fields of :attr:`data_policy` for this call
        (``batch_size=``, ``shuffle=``, ``remainder=``).

        Every plugin splits with :func:`polyparallel.shard_indices`: data coordinate ``d`` gets
        ``order[d::data]`` of an order fixed by ``(seed, epoch)``; tensor/pipeline replicas get
        the same samples.

        Batch size: a loader's own ``batch_size`` is *per rank* unless the Strategy (or this
        call) sets ``batch_size``, which is *global* (summed over the data axis, so each data
        rank gets ``batch_size // data``); a data set without a loader needs the global one.

        Shuffling: ``shuffle=None`` (the default) keeps a loader's choice (``shuffle=True`` /
        a ``RandomSampler`` shuffles, ``shuffle=False`` / a ``SequentialSampler`` keeps the
        order) and shuffles a data set given without a loader; ``True``/``False`` decide. A
        sampler whose meaning a shard cannot keep (weighted, with replacement, a subset, a
        custom ``Sampler`` or ``batch_sampler``) is refused, never silently replaced.

        Epochs: the torch sampler advances its epoch only after a full pass, or follows
        ``sampler.set_epoch(e)``, so a rank that peeks at a batch stays in step with its replicas.
        """
        policy = dataclasses.replace(self.data_policy, **overrides) if overrides else self.data_policy
        return self._dispatch("shard_data", data, data=data, policy=policy)

    def wrap_model(self, model: Any, **options: Any) -> Any:
        """Parallelise ``model``: data-parallel replicas over the data group, tensor-parallel
        partitions (``plan=``), pipeline stages."""
        return self._dispatch("wrap_model", model, model=model, options=options)

    def sync_grads(self, target: Any) -> Any:
        """Average gradients over the data group (a no-op where the model's wrapper already did)."""
        return self._dispatch("sync_grads", target, target=target)

    def reduce_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Reduce ``name -> value`` over the data group; :class:`Mean` values count-weighted."""
        if not isinstance(metrics, Mapping):
            raise TypeError(f"reduce_metrics() takes a mapping of name -> value. Received: {type(metrics).__name__}.")
        return self._dispatch("reduce_metrics", metrics, metrics=dict(metrics))

    def sync_states(self, states: Any) -> Any:
        """Synchronise state collections per :attr:`state_policy` (mean / broadcast / local)."""
        return self._dispatch("sync_states", states, states=states)

    def adapt(self, name: str, **kwargs: Any) -> Any:
        """A framework-native object built from this strategy by the adapter registered as ``name``
        (``"lightning"``, ``"ignite"``, ...). The topology is checked against the adapter's
        capabilities first."""
        adapters = self.plugin_manager.adapters()
        if name not in adapters:
            raise NoPluginError(
                f"No adapter named {name!r} is registered. Registered adapters: "
                f"{', '.join(sorted(adapters)) or 'none'}. Install its extra: pip install 'polyparallel[{name}]'."
            )
        adapter = adapters[name]
        adapter.capabilities.check(self.topology)
        return adapter.factory(self, **kwargs)

    def _dispatch(self, operation: str, subject: Any, **kwargs: Any) -> Any:
        pm = self.plugin_manager
        return pm.dispatch(operation, subject, strategy=self, session=pm.session(self), **kwargs)


def _rebuild(values: dict[str, Any]) -> Strategy:
    return Strategy(**values)
