"""The Strategy: the one object users build and hand to every framework."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _checkpoints, _routing
from ._errors import CheckpointError, NoPluginError, TopologyError
from ._manager import PluginManager, get_plugin_manager
from ._policies import DataPolicy, GradPolicy, Mean, MetricPolicy, PrecisionPolicy, ShardPolicy, StatePolicy
from ._topology import Topology

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["Strategy"]

_FIELDS = ("topology", "timeout", "seed", "backend", "runtime", "data_policy", "grad_policy", "metric_policy",
           "state_policy", "shard_policy", "precision")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")


class Strategy:
    """How to parallelise: a :class:`Topology` plus policies, immutable and picklable.

    :param data: the size of the data axis; one axis may be ``-1`` (inferred from the world size).
    :param tensor: the size of the tensor axis.
    :param pipeline: the size of the pipeline axis.
    :param topology: a :class:`Topology` instead of the three sizes.
    :param timeout: seconds every collective may wait before failing with an error that names
        the operation, axis and rank.
    :param seed: seeds data shuffling (with the epoch) and any random state a plugin makes.
    :param batch_size: the global batch size (shortcut for ``data_policy=DataPolicy(batch_size=)``).
    :param runtime: the runtime that runs the operations (``"torch"``, ``"jax"``, or any installed
        runtime plugin); ``None`` chooses automatically, once per process (see
        :meth:`resolve_runtime`).
    :param backend: the communication backend, for runtimes that have several (``"gloo"``,
        ``"nccl"`` for torch); ``None`` lets the runtime choose. Checked against the runtime's
        declared backends before any process starts; it never selects the runtime by itself
        except by narrowing the automatic choice to runtimes that offer it.
    :param zero: the sharding stage over the data axis, 0-3 (shortcut for
        ``shard_policy=ShardPolicy(stage=)``): 0 replicates, 1 shards optimizer state, 2 also
        gradients, 3 also parameters. Refused before launch by a target that cannot run it.
    :param precision: the numeric precision (a :class:`PrecisionPolicy` or a preset name:
        ``"32"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"fp16-mixed"``), mapped by every target to
        its framework's mechanism; ``None`` (the default) leaves the model's own dtypes and the
        framework's defaults alone. Refused before launch by a target that cannot run it.
    :param accumulate: micro-batches per optimizer step (shortcut for
        ``grad_policy=GradPolicy(accumulate=)``): the global batch ``batch_size`` is ``micro-batch
        x accumulate x data`` in every framework, and gradients are reduced once per step.
    :param data_policy: a :class:`DataPolicy` (how ``shard_data`` splits data).
    :param grad_policy: a :class:`GradPolicy` (how ``sync_grads`` reduces).
    :param metric_policy: a :class:`MetricPolicy` (how ``reduce_metrics`` reduces plain values).
    :param state_policy: a :class:`StatePolicy` (what ``sync_states`` does per state).
    :param shard_policy: a :class:`ShardPolicy` (the sharding stage).
    :param plugin_manager: the plugin manager operations dispatch through (default: the process's
        default manager). Not part of the value: it is neither compared nor pickled.

    The five operations dispatch to whichever plugin owns the object:

    >>> s = Strategy(data=-1, tensor=2, timeout=60.0)   # doctest: +SKIP
    >>> loader = s.shard_data(loader); model = s.wrap_model(model)   # doctest: +SKIP
    """

    __slots__ = (*_FIELDS, "_pm", "_hash", "_runtime_hint")

    topology: Topology
    timeout: float
    seed: int
    backend: str | None
    runtime: str | None
    data_policy: DataPolicy
    grad_policy: GradPolicy
    metric_policy: MetricPolicy
    state_policy: StatePolicy
    shard_policy: ShardPolicy
    precision: PrecisionPolicy | None
    _pm: PluginManager | None
    _hash: int
    _runtime_hint: str | None  # the runtime chosen by the process that pickled this strategy

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
        runtime: str | None = None,
        data_policy: DataPolicy | None = None,
        grad_policy: GradPolicy | None = None,
        metric_policy: MetricPolicy | None = None,
        state_policy: StatePolicy | Mapping[str, str] | None = None,
        shard_policy: ShardPolicy | None = None,
        zero: int | None = None,
        precision: PrecisionPolicy | str | None = None,
        accumulate: int | None = None,
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
        for name, value in (("backend", backend), ("runtime", runtime)):
            if value is not None and not (isinstance(value, str) and _NAME.match(value)):
                raise TopologyError(f"Strategy({name}=) must be a name (a non-empty string) or None. "
                                    f"Received: {value!r}.")
        if backend == "jax":  # once the way to ask for JAX; now a runtime, not a backend
            raise TopologyError("Strategy(backend='jax') is not a communication backend: JAX is a runtime. "
                                "Use Strategy(runtime='jax') and leave backend=None.")
        if plugin_manager is not None and not isinstance(plugin_manager, PluginManager):
            raise TopologyError(f"Strategy(plugin_manager=) must be a polyparallel.PluginManager or None. "
                                f"Received: {type(plugin_manager).__name__}.")
        if data_policy is None:
            data_policy = DataPolicy(batch_size=batch_size)
        elif not isinstance(data_policy, DataPolicy):
            raise TopologyError(f"Strategy(data_policy=) must be a DataPolicy. Received: {data_policy!r}.")
        elif batch_size is not None:
            data_policy = dataclasses.replace(data_policy, batch_size=batch_size)
        if state_policy is None or isinstance(state_policy, Mapping):
            state_policy = StatePolicy(state_policy or {})
        if shard_policy is None:
            try:
                shard_policy = ShardPolicy(stage=0 if zero is None else zero)
            except ValueError as exc:
                raise TopologyError(str(exc).replace("ShardPolicy.stage", "Strategy(zero=)")) from None
        elif not isinstance(shard_policy, ShardPolicy):
            raise TopologyError(f"Strategy(shard_policy=) must be a ShardPolicy. Received: {shard_policy!r}.")
        elif zero is not None and zero != shard_policy.stage:
            raise TopologyError(f"Strategy takes zero= or shard_policy=, not two different stages. Received zero={zero!r} "
                                f"and {shard_policy!r}.")
        if isinstance(precision, str):
            try:
                precision = PrecisionPolicy(precision)
            except ValueError as exc:
                raise TopologyError(str(exc).replace("PrecisionPolicy:", "Strategy(precision=):", 1)) from None
        elif precision is not None and not isinstance(precision, PrecisionPolicy):
            raise TopologyError(f"Strategy(precision=) must be a preset name ('32', 'bf16-mixed', 'bf16-true', "
                                f"'fp16-mixed'), a PrecisionPolicy, or None. Received: {precision!r}.")
        if grad_policy is None:
            grad_policy = GradPolicy()
        elif not isinstance(grad_policy, GradPolicy):
            raise TopologyError(f"Strategy(grad_policy=) must be a GradPolicy. Received: {grad_policy!r}.")
        if accumulate is not None:
            if grad_policy.accumulate not in (1, accumulate):
                raise TopologyError(f"Strategy takes accumulate= or grad_policy=GradPolicy(accumulate=), not two "
                                    f"different counts. Received accumulate={accumulate!r} and {grad_policy!r}.")
            try:
                grad_policy = dataclasses.replace(grad_policy, accumulate=accumulate)
            except ValueError as exc:
                raise TopologyError(str(exc).replace("GradPolicy.accumulate", "Strategy(accumulate=)")) from None
        values = dict(
            topology=topology, timeout=float(timeout), seed=seed, backend=backend, runtime=runtime,
            data_policy=data_policy, grad_policy=grad_policy,
            metric_policy=MetricPolicy() if metric_policy is None else metric_policy, state_policy=state_policy,
            shard_policy=shard_policy, precision=precision,
        )
        for name, kind in (("data_policy", DataPolicy), ("grad_policy", GradPolicy),
                           ("metric_policy", MetricPolicy), ("state_policy", StatePolicy)):
            if not isinstance(values[name], kind):
                raise TopologyError(f"Strategy({name}=) must be a {kind.__name__}. Received: {values[name]!r}.")
        _routing.check_batch(data_policy, topology, "Strategy", grad_policy.accumulate)
        for field, item in values.items():
            object.__setattr__(self, field, item)
        object.__setattr__(self, "_pm", plugin_manager)
        object.__setattr__(self, "_runtime_hint", None)
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
        # The plugin manager stays behind: each process has its own. The runtime this process
        # chose automatically travels along, so a launched process runs the same runtime even if
        # it imports other frameworks than its parent.
        pm = self._pm if self._pm is not None else _default_manager()
        hint = pm._resolved.get(self) if pm is not None else None
        return (_rebuild, (dict(zip(_FIELDS, self._values())), hint or self._runtime_hint))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in self.topology.sizes.items())
        extra = "".join(f", {name}={getattr(self, name)!r}" for name in ("runtime", "backend")
                        if getattr(self, name) is not None)
        if self.shard_policy.stage:
            extra += f", zero={self.shard_policy.stage}"
        if self.precision is not None:
            name = self.precision.name
            extra += f", precision={name!r}" if name else f", precision={self.precision!r}"
        if self.accumulate > 1:
            extra += f", accumulate={self.accumulate}"
        return f"Strategy({axes}, timeout={self.timeout:g}, seed={self.seed}{extra})"

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step (``grad_policy.accumulate``)."""
        return self.grad_policy.accumulate

    def replace(self, **changes: Any) -> Strategy:
        """A copy with some fields changed (``topology``, ``timeout``, ``runtime``, a policy, axis
        sizes, ``batch_size`` or ``zero``)."""
        values = dict(zip(_FIELDS, self._values()))
        if "batch_size" in changes:
            # Applied to the data policy (the given one, else this strategy's): batch_size=None
            # must drop the global batch, not read as "not given" by the constructor.
            policy = changes.pop("data_policy", values["data_policy"])
            if not isinstance(policy, DataPolicy):
                raise TopologyError(f"Strategy(data_policy=) must be a DataPolicy. Received: {policy!r}.")
            values["data_policy"] = dataclasses.replace(policy, batch_size=changes.pop("batch_size"))
        if "zero" in changes:
            if "shard_policy" in changes:
                raise TopologyError("Strategy.replace() takes zero= or shard_policy=, not both.")
            values.pop("shard_policy")
            values["zero"] = changes.pop("zero")
        if "accumulate" in changes:
            policy = changes.pop("grad_policy", values["grad_policy"])
            if not isinstance(policy, GradPolicy):
                raise TopologyError(f"Strategy(grad_policy=) must be a GradPolicy. Received: {policy!r}.")
            values["grad_policy"] = dataclasses.replace(policy, accumulate=1)
            values["accumulate"] = changes.pop("accumulate")
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
        replaced = Strategy(**values, plugin_manager=self._pm)
        # The runtime the launching process chose travels with the copy (a launched process that
        # builds strategy.replace(seed=1) runs where its parent decided), unless the copy names
        # its runtime or another backend, which the choice depends on.
        if replaced.runtime == self.runtime and replaced.backend == self.backend:
            object.__setattr__(replaced, "_runtime_hint", self._runtime_hint)
        return replaced

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

    def resolve_runtime(self) -> str:
        """The runtime this strategy runs on in this process, chosen once (then cached).

        ``Strategy(runtime=name)`` is that runtime (it must be installed). With ``runtime=None``:

        1. a strategy pickled by a process that had chosen already (``polyparallel.launch``)
           keeps that choice;
        2. the only installed runtime (one whose declared ``imports`` can be imported), among
           those that offer ``backend`` when one is given;
        3. else the only one whose framework is already imported in this process;
        4. else the one with the highest declared ``priority`` (torch before jax); a tie is an
           error asking for ``Strategy(runtime=)``. Never the order hooks were registered in.

        :raises NoPluginError: no runtime is installed (with the extra to install), or the one
            asked for is not, or its plugin failed to load (naming its error).
        :raises TopologyError: ``backend`` is not one the runtime declares.
        """
        return _routing.require(self.plugin_manager, self)

    def check(self, target: str | None = None, world_size: int | None = None) -> None:
        """Refuse, before anything starts, what cannot run.

        :param target: a runtime or adapter name whose capabilities must admit the topology
            (an adapter also needs this strategy's runtime to be one it runs on); ``None``
            checks against the runtime :meth:`resolve_runtime` chooses.
        :param world_size: also check that the topology fits that many ranks, and that the
            global batch size divides over the data axis.
        """
        topology = self.topology.resolve(world_size) if world_size is not None else self.topology
        pm = self.plugin_manager
        if target is None:
            runtime = _routing.require(pm, self)
            pm.runtimes()[runtime].check(topology, self.shard_policy.stage, self.precision, self.accumulate)
        else:
            if not isinstance(target, str) or not target:
                raise TypeError(f"check(target=) must be a runtime or adapter name. Received: {target!r}.")
            runtimes, adapters = pm.runtimes(), pm.adapters()
            if target not in runtimes and target not in adapters:
                known = sorted(set(runtimes) | set(adapters))
                named, others = _routing.broken_named(pm, target)
                hint = named or f"Install its extra: pip install 'polyparallel[{target}]'."
                raise NoPluginError(_routing.sentences(
                    f"No installed plugin provides the target {target!r}. Known targets: "
                    f"{', '.join(known) or 'none'}.", hint, others))
            if target in runtimes:
                runtimes[target].check(topology, self.shard_policy.stage, self.precision, self.accumulate)
                _routing.require(pm, self, {target: f"Strategy.check({target!r})"})
            if target in adapters:
                self._adapter_strategy(adapters[target], topology)
        if topology.is_resolved:
            _routing.check_batch(self.data_policy, topology, f"{self!r} on {topology.world_size} ranks", self.accumulate)

    def _adapter_strategy(self, adapter: Any, topology: Topology) -> Strategy:
        """Check ``adapter`` can run this strategy; the strategy its factory gets (the same, or
        one whose runtime is pinned to the adapter's when the automatic choice differs)."""
        caps = adapter.capabilities
        caps.check(topology, self.shard_policy.stage, self.precision, self.accumulate)
        if not caps.runtimes:
            return self
        who = f"the adapter {adapter.name!r} (plugin {adapter.plugin!r})"
        runtime = _routing.require(self.plugin_manager, self, {rt: who for rt in caps.runtimes})
        if self.runtime is None:
            try:
                own = self.plugin_manager.resolve_runtime(self)
            except TopologyError:
                own = None
            if own != runtime:
                return self.replace(runtime=runtime)
        return self

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

        Epochs: ``sampler.set_epoch(e)`` (Lightning and Ignite call it) pins the epoch, and
        every pass of a pinned loader uses it, so a rank that peeks at a batch does not move ahead
        of its replicas. Unpinned, each pass (each ``iter()``) is the next epoch, checked over all
        ranks first, so a rank that iterates once more than its replicas fails instead of feeding
        them other batches.
        """
        if overrides:
            policy = _routing.data_policy_with(self.data_policy, overrides)
            _routing.check_batch(policy, self.session().topology, "shard_data()", self.accumulate)
        else:
            policy = self.data_policy
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
        for name, value in metrics.items():
            _check_metric(name, value)
        return self._dispatch("reduce_metrics", metrics, metrics=dict(metrics))

    def sync_states(self, states: Any) -> Any:
        """Synchronise state collections per :attr:`state_policy` (mean / broadcast / local)."""
        return self._dispatch("sync_states", states, states=states)

    # -- checkpoints ------------------------------------------------------------------------------------
    def save(self, path: Any, **state: Any) -> str:
        """Save a training state as one portable checkpoint directory at ``path``; every rank calls
        it alike. Returns the absolute path, published only once every rank finished writing.

        :param path: the checkpoint directory (e.g. ``f"ckpts/step-{step:06d}"``, so that
            :func:`polyparallel.latest_checkpoint` finds the newest). An earlier checkpoint there
            is replaced; any other existing path is refused.
        :param model: the model ``wrap_model`` returned (or a plain one): its parameters and
            buffers, each shard written once.
        :param optimizer: its optimizer: its state and hyperparameters, per parameter name.
        :param loader: a loader ``shard_data`` returned: its epoch and the batches of it
            already consumed, with the global batch, seed and data set length it needs to resume.
        :param framework: a name recorded in the metadata (adapters pass theirs; default the runtime).
        :param extras: any other keyword: numbers, strings, booleans, ``None``, lists/tuples/dicts
            of them, and tensors of the runtime (rank 0's values are written); other objects are
            refused. The names ``epoch``, ``step``, ``global_step`` and ``load_report`` are ``load``'s.

        Each rank's RNG states (Python's ``random``, the runtime's, NumPy's if imported) are saved too.
        Atomic: the files are written into ``<path>.partial-<save id>``, which becomes ``path``
        (with its commit marker, recording the size and SHA-256 of every file) only after every
        rank finished; :meth:`load` refuses a directory without the marker. The refusals happen on
        every rank before any collective.

        :raises CheckpointError: on every rank alike, when writing failed on any rank (a full
            disk: the message names the path, the rank and the operating system's error). Nothing
            is published then, the staging directory is removed, and an earlier checkpoint stays.
        """
        path, state = _checkpoints.check_save(path, state)
        return self._dispatch("save_checkpoint", state.get("model", state), path=path, state=state,
                              options={"asynchronous": False})

    def async_save(self, path: Any, **state: Any) -> Any:
        """:meth:`save`, asynchronously (as ``torch.distributed.checkpoint.async_save``): returns
        once the state is staged (the torch runtime copies its tensors to CPU memory), while the
        files are written and committed in the background; training may change the model at once.

        :return: a ``concurrent.futures.Future``: ``result()`` (or ``wait()``) is the published path,
            or raises the save's :class:`CheckpointError` (the same on every rank); ``done()``.
            The commit stays atomic: the marker and the rename happen only after every rank's
            files are written. A following save or load waits for it; a following save whose
            predecessor failed unobserved raises that failure instead of starting. A runtime
            without asynchronous saves completes the save before returning (a finished future).
        """
        path, state = _checkpoints.check_save(path, state)
        result = self._dispatch("save_checkpoint", state.get("model", state), path=path, state=state,
                                options={"asynchronous": True})
        if isinstance(result, str):
            import concurrent.futures

            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(result)
            return done
        return result

    def load(self, path: Any, *, strict: bool = True, keys: Any = None, **state: Any) -> dict[str, Any]:
        """Restore a checkpoint :meth:`save` wrote, at this strategy's topology (any data size, a
        tensor/pipeline axis or none, one process): ``model``, ``optimizer`` and ``loader`` are
        restored in place, as are this rank's RNG states.

        :param path: a committed checkpoint directory (:func:`polyparallel.latest_checkpoint`
            picks the newest in a folder).
        :param model: the model to restore (optional).
        :param optimizer: its optimizer (optional).
        :param loader: a loader ``shard_data`` returned (optional). A ``loader``
            asks for exact resumption: its next pass continues the saved epoch after the batches
            already consumed, so the rest of the epoch is seen exactly once in the saved run's
            order, also at another data size with the same global batch.
        :param strict: ``False`` loads only the model's parameters and buffers the checkpoint
            holds with the same shape (fine-tuning: a backbone into a model with a new head); the
            rest keeps its values. Never the default: a mismatch is otherwise refused.
        :param keys: glob patterns over the model's state-dict names (``["backbone.*"]``) or a
            predicate: load only those (each must be in the checkpoint unless ``strict=False``).
            With ``strict=False`` or ``keys``, the model only (no optimizer or loader), and the
            result holds ``load_report``: ``loaded``, ``missing``, ``unexpected``, ``mismatched``
            (name -> both shapes) and ``excluded`` (left out by ``keys``).
        :return: ``{"epoch": e, "step": k, "global_step": g, **extras}``: continue with epoch
            ``e``, of which ``k`` batches were consumed (``k == 0`` when the saved epoch was
            complete: ``e`` is then the next one); ``g`` batches were consumed since the loader
            was made. The three are ``None`` when the checkpoint was saved without ``loader=``.
            Extras come back as saved (tensors as the runtime's tensors).
        :raises CheckpointError: on every rank, before any collective: the checkpoint is not
            committed (half-written), truncated or corrupt (a file whose SHA-256 differs from the
            one recorded when it was written: flipped bytes, a file of another checkpoint; the
            message names it), written by another runtime, holds another model (the message names
            the keys and shapes), or the loader's global batch, data set length, seed or shuffling
            differ from the saved ones.
        :raises FileNotFoundError: there is no directory at ``path``.
        """
        path, state = _checkpoints.check_load(path, state)
        options: dict[str, Any] = {}
        if strict is not True or keys is not None:
            if not isinstance(strict, bool):
                raise TypeError(f"Strategy.load(strict=) takes True or False. Received: {strict!r}.")
            if state.get("model") is None:
                raise TypeError("Strategy.load(strict=False / keys=) selects part of a model to load: pass model=.")
            if keys is not None and not callable(keys):
                patterns = [keys] if isinstance(keys, str) else keys
                if not isinstance(patterns, (list, tuple)) or not patterns or not all(
                        isinstance(p, str) for p in patterns):
                    raise TypeError("Strategy.load(keys=) takes glob patterns over the model's state-dict names (a "
                                    "str or a list of str, e.g. ['backbone.*']) or a predicate name -> bool. "
                                    f"Received: {keys!r}.")
                keys = list(patterns)
            options = {"strict": strict, "keys": keys}
        metadata = _checkpoints.read_marker(path)
        session = self.session()
        if metadata.get("runtime") != session.runtime:
            raise CheckpointError(f"Strategy.load: {path!r} was written by the {metadata.get('runtime')!r} runtime; "
                                  f"this strategy runs on {session.runtime!r}. Load it with "
                                  f"Strategy(runtime={metadata.get('runtime')!r}).")
        result = self._dispatch("load_checkpoint", state.get("model", state), path=path, state=state,
                                options=options)
        if options and _checkpoints.LOAD_REPORT not in result:
            # A runtime that does not know partial loads loaded everything or refused: say which.
            raise CheckpointError(f"Strategy.load(strict=False / keys=): the {session.runtime!r} runtime does not "
                                  f"load part of a model; it loaded {path!r} whole. Load it without strict=/keys=.")
        return dict(result)

    def adapt(self, name: str, **kwargs: Any) -> Any:
        """A framework-native object built from this strategy by the adapter registered as ``name``
        (``"lightning"``, ``"ignite"``, ...). The topology is checked against the adapter's
        capabilities first."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"adapt(name=) must be an adapter name such as 'lightning'. Received: {name!r}.")
        pm = self.plugin_manager
        adapters = pm.adapters()
        if name not in adapters:
            named, others = _routing.broken_named(pm, name)
            hint = named or f"Install its extra: pip install 'polyparallel[{name}]'."
            raise NoPluginError(_routing.sentences(
                f"No adapter named {name!r} is registered. Registered adapters: "
                f"{', '.join(sorted(adapters)) or 'none'}.", hint, others))
        adapter = adapters[name]
        strategy = self._adapter_strategy(adapter, self.topology)
        return adapter.factory(strategy, **kwargs)

    def _dispatch(self, operation: str, subject: Any, **kwargs: Any) -> Any:
        pm = self.plugin_manager
        return pm.dispatch(operation, subject, strategy=self, session=pm.session(self), **kwargs)


def _check_metric(name: Any, value: Any) -> None:
    # Cheap type checks only (this runs every step): what no runtime can reduce is refused here
    # with the fix, instead of "no plugin handles a dict" after the dispatch.
    if not isinstance(name, str):
        raise TypeError(f"reduce_metrics(): metric names must be strings. Received the name {name!r} "
                        f"({type(name).__name__}).")
    inner = value.total if isinstance(value, Mean) else value
    if isinstance(inner, (str, bytes, Mapping, list, tuple, set)) or inner is None:
        fix = f" Convert it first: float({inner!r})." if isinstance(inner, str) else ""
        raise TypeError(f"reduce_metrics(): metric {name!r} is {type(inner).__name__} {inner!r:.60}; expected a "
                        f"number, a polyparallel.Mean, or a scalar tensor/array of the runtime.{fix}")
    if isinstance(value, Mean) and isinstance(value.count, (str, bytes)):
        raise TypeError(f"reduce_metrics(): metric {name!r} is Mean(count={value.count!r}); the count must be a "
                        "number (or a tensor/array).")


def _default_manager() -> PluginManager | None:
    from . import _manager

    return _manager._default


def _rebuild(values: dict[str, Any], hint: str | None = None) -> Strategy:
    strategy = Strategy(**values)
    object.__setattr__(strategy, "_runtime_hint", hint)
    return strategy
