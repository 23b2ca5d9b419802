"""The five operations for JAX objects (called by the hooks in :mod:`polyparallel_jax.plugin`).

Two contexts, one meaning:

- *per device* — inside ``jax.shard_map`` with the ``data`` axis manual (where
  :class:`polyparallel_jax.Model` computes gradients, metrics and states), values are each device's
  own and the operations are JAX collectives over ``data`` (``psum``/``pmean``), free of any host
  round trip;
- *per process* — outside, a global ``jax.Array`` already is one value for the whole mesh
  (GSPMD reduced it), so single-process calls return it unchanged; with several processes,
  process-local values (a metric over the process's own rows) are gathered across processes,
  bounded by ``strategy.timeout``; ``reduce_metrics`` compares its metrics' names and shapes
  between the processes first (:func:`metric_signature`), and ``sync_states`` its states' names,
  actions, shapes and dtypes, so different keys fail on every process at once, naming both
  sides, instead of being paired by position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import polyparallel as pp

from .partition import param_specs, path_name
from .runtime import JaxRuntime

__all__ = [
    "ShardedModule", "bounded", "collection_name", "describe", "gather_rows", "inside_data_axis", "is_jax_tree",
    "metric_signature", "reduce_metrics",
    "sync_grads", "sync_states", "wrap_model",
]

DATA = "data"


# -- ownership and context ----------------------------------------------------------------------


def is_jax_tree(tree: Any) -> bool:
    """A pytree with at least one leaf, all ``jax.Array`` (tracers included)."""
    import jax

    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.Array) for x in leaves)


def inside_data_axis() -> bool:
    """Whether we are tracing inside a ``shard_map`` whose ``data`` axis is manual."""
    from jax.sharding import get_abstract_mesh

    return DATA in getattr(get_abstract_mesh(), "manual_axes", ())


def _checks_vma() -> bool:
    # shard_map(check_vma=False) tracks no varying-axis types; every value must then be
    # treated as per-device. The flag is only exposed as a config state.
    from jax._src import config

    state = getattr(config, "_check_vma", None)
    return bool(state.value) if state is not None else True


def _varies_over_data(x: Any) -> bool:
    import jax

    if not _checks_vma():
        return True
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.manual_axis_type.varying
    return DATA in vma


def bounded(fn: Callable[[], Any], *, timeout: float, operation: str, axis: str, rank: int, detail: str = "") -> Any:
    """Run a blocking cross-process collective, failing after ``timeout`` seconds, recorded in
    the process's collective trace (:mod:`polyparallel._trace`: one entry, ``done`` or
    ``failed``; the trace is written to its directory when one fails).

    XLA collectives wait forever for a peer that skipped them; the wait runs in a daemon thread
    so this process can raise :class:`polyparallel.CollectiveTimeout` naming the operation, axis
    and rank (the stuck computation cannot be cancelled: end the process after this error).
    """
    import jax

    from polyparallel._errors import exception_summary

    recorder = _recorder()
    entry = recorder.enter(operation, axis, None, detail, skip=3) if recorder is not None else None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = jax.block_until_ready(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"polyparallel-{operation}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        error = pp.CollectiveTimeout(
            f"{operation} over axis {axis!r} timed out after {timeout:g} s on rank {rank} (JAX process "
            f"{jax.process_index()} of {jax.process_count()}): a peer process did not join the collective. "
            "Every process must call the operation the same number of times; raise Strategy(timeout=) if "
            "the peers are only slow.", operation=operation, axis=axis, rank=rank)
        _failed(recorder, entry, f"timed out after {timeout:g} s", str(error).splitlines()[0])
        raise error
    if "error" in box:
        _failed(recorder, entry, exception_summary(box["error"]), f"{operation} failed")
        raise box["error"]
    if recorder is not None:
        recorder.finish(entry)
    return box["value"]


def _recorder() -> Any:
    """This process's trace recorder, its rank and world set to this JAX process's (a trace file
    is one process: ``rank<process index>.jsonl``); ``None`` when tracing is off."""
    import jax

    from polyparallel import _trace

    recorder = _trace.get_recorder()
    if recorder is not None:
        recorder.rank, recorder.world_size = jax.process_index(), jax.process_count()
    return recorder


def _failed(recorder: Any, entry: Any, why: str, reason: str) -> None:
    if recorder is not None:
        recorder.finish(entry, why)
        recorder.dump(reason, failed=True)


def describe(tree: Any) -> str:
    """A cheap summary of a tree's arrays for the trace: ``3 arrays: float32[8], int32[]...``."""
    import jax

    leaves = jax.tree.leaves(tree)
    shown = ", ".join(f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}" for x in leaves[:4])
    return f"{len(leaves)} array(s): {shown}{', ...' if len(leaves) > 4 else ''}"


def _gather_processes(tree: Any, runtime: JaxRuntime, operation: str, rank: int, signature: str | None = None) -> Any:
    """``tree`` of every process (stacked on a new first axis), bounded and traced. With a
    ``signature`` (what the tree holds, by name: :func:`metric_signature`, or ``sync_states``' names,
    actions, shapes and dtypes), the processes first
    exchange their signatures (a buffer of one fixed shape on every process, so the exchange
    itself never mismatches) and, when they differ, every process raises the same
    :class:`polyparallel.CollectiveError` naming both sides before any value travels: a gather of
    ``{"loss"}`` on one process and ``{"acc"}`` on another would pair the two silently."""
    from jax.experimental import multihost_utils

    where = ""
    if signature is not None:
        from polyparallel import _trace
        from polyparallel._trace_report import location

        site, user = _trace.caller(2)
        fmt = lambda loc: None if loc is None else f"{loc[0]}:{loc[1]}"  # noqa: E731
        where = location({"site": fmt(site), "user": fmt(user)})

    def gather() -> Any:
        if signature is not None:
            _check_signatures(signature, where, operation, rank)
        return multihost_utils.process_allgather(tree)

    detail = describe(tree) if signature is None else f"{signature}; {describe(tree)}"
    return bounded(gather, timeout=runtime.timeout, operation=operation, axis=DATA, rank=rank, detail=detail[:300])


SIGNATURE_BYTES = 512
"""How much of a signature (and the caller's location) the processes exchange to show in a
mismatch's message; the comparison itself is of a SHA-256 digest of the whole signature."""


def metric_signature(metrics: Mapping[str, Any], policy: pp.MetricPolicy, spanning: Collection[str] = ()) -> str:
    """What a host-side ``reduce_metrics`` gathers, by sorted name: ``acc:mean[], loss:weighted[]``
    (the name, the reduction: ``weighted`` for a :class:`~polyparallel.Mean`, ``global`` for a value
    spanning processes, not gathered, else the metric policy's op, and the shape): what the
    processes compare before they gather, as the torch runtime's identity check compares its
    metrics' names."""
    import numpy as np

    parts = []
    for name in sorted(metrics):
        value = metrics[name]
        if name in spanning:
            op, shape = "global", np.shape(value.total if isinstance(value, pp.Mean) else value)
        elif isinstance(value, pp.Mean):
            op, shape = "weighted", np.shape(value.total)
        else:
            op, shape = policy.op_for(name), np.shape(value)
        parts.append(f"{name}:{op}{list(shape)}")
    return ", ".join(parts)


_MISMATCH = {
    "reduce_metrics": ("reduce different metrics", "Every process must reduce the same metric names, with the same "
                       "shapes, in each reduce_metrics (a key only some processes log, or a rank-dependent branch "
                       "around the call); no value was exchanged. Each process reduced:"),
    "sync_states": ("synchronise different states", "Every process must synchronise the same states (the same names, "
                    "actions, shapes and dtypes) in each sync_states (a state only some processes hold, or a "
                    "rank-dependent branch around the call); no value was exchanged. Each process synchronised:"),
}
"""What a signature mismatch of each host-side operation says: the headline, and the advice."""


def _check_signatures(signature: str, where: str, operation: str, rank: int) -> None:
    """Exchange ``signature`` (and ``where``: the caller's location) between the processes; raise
    the same :class:`polyparallel.CollectiveError` on every process when they differ."""
    import hashlib

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    text = f"{where}\n{signature}".encode()
    buffer = np.zeros(32 + SIGNATURE_BYTES, np.uint8)
    buffer[:32] = np.frombuffer(hashlib.sha256(signature.encode()).digest(), np.uint8)
    shown = text[:SIGNATURE_BYTES]
    buffer[32:32 + len(shown)] = np.frombuffer(shown, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(buffer))
    if all((row[:32] == buffer[:32]).all() for row in everyone):
        return
    me = jax.process_index()

    def side(process: int) -> tuple[str, str]:
        raw = bytes(everyone[process][32:]).rstrip(b"\0").decode("utf-8", "replace")
        at, _, sig = raw.partition("\n")
        truncated = everyone[process][-1] != 0
        return (sig or "no metrics") + (" ..." if truncated else ""), at or "?"

    other = next(p for p in range(len(everyone)) if not (everyone[p][:32] == buffer[:32]).all())
    first, second = sorted((me, other))
    (sig_a, at_a), (sig_b, at_b) = side(first), side(second)
    headline, advice = _MISMATCH.get(operation, _MISMATCH["reduce_metrics"])
    lines = [
        (f"{operation} over the {DATA!r} axis refused on rank {rank} (JAX process {me} of {len(everyone)}): the "
         f"processes {headline}: {{{sig_a}}} on process {first} vs {{{sig_b}}} on process {second} "
         f"(called at {at_a} and {at_b})."),
        advice,
        *(f"  process {p}: {{{sig}}} at {at}" for p, (sig, at) in enumerate(map(side, range(len(everyone))))),
    ]
    raise pp.CollectiveError("\n".join(lines), operation=operation, axis=DATA, rank=rank)


def gather_rows(array: Any, runtime: JaxRuntime, operation: str, rank: int) -> Any:
    """A global array spanning several processes as one host-side array in every process
    (rows in order), bounded and traced."""
    from jax.experimental import multihost_utils

    return bounded(lambda: multihost_utils.process_allgather(array, tiled=True), timeout=runtime.timeout,
                   operation=operation, axis=DATA, rank=rank, detail=describe(array))


# -- wrap_model -------------------------------------------------------------------------------


@dataclass
class ShardedModule:
    """An NNX module whose state was placed on the mesh by ``Strategy.wrap_model``.

    :ivar module: the module itself (its variables now hold mesh-sharded arrays).
    :ivar specs: parameter path -> partition spec tuple (``()``: replicated).
    :ivar runtime: the :class:`~polyparallel_jax.runtime.JaxRuntime` (mesh, topology).
    """

    module: Any
    specs: dict[str, tuple[Any, ...]]
    runtime: JaxRuntime
    optimizer_dtype: Any = None  #: the precision's optimizer dtype (``None``: the optimizer's own)

    def optimizer(self, tx: Any) -> Any:
        """``tx`` as it runs under the strategy's precision: its parameter-shaped state kept in
        the optimizer dtype (:func:`polyparallel_jax.precision.optimizer`); ``tx`` itself
        without a precision."""
        from . import precision

        return tx if self.optimizer_dtype is None else precision.optimizer(tx, self.optimizer_dtype)

    def shardings(self, state: Any) -> Any:
        """A pytree of ``NamedSharding`` for ``state`` (an ``nnx.State`` of this module): params
        per their spec, everything else replicated."""
        import jax

        return jax.tree_util.tree_map_with_path(
            lambda path, _: self.runtime.sharding(*self.specs.get(path_name(path), ())), state)

    def init_optimizer(self, tx: Any, params: Any) -> Any:
        """``tx.init(params)`` with every parameter-shaped state (Adam's moments) sharded like its
        parameter and the rest (step counts) replicated. ``jit(tx.init)`` alone would replicate
        the moments: ``zeros_like`` does not carry a sharding through GSPMD."""
        import jax
        import optax

        param_shardings = self.shardings(params)
        shapes = jax.eval_shape(tx.init, params)
        out = optax.tree_map_params(tx, lambda _, sharding: sharding, shapes, param_shardings,
                                    transform_non_params=lambda _: self.runtime.replicated)
        return jax.jit(tx.init, out_shardings=out)(params)


def wrap_model(runtime: JaxRuntime, module: Any, plan: Any = None, param_dtype: Any = None,
               optimizer_dtype: Any = None) -> ShardedModule:
    """Place an NNX module's state on the mesh: parameters replicated over ``data`` and split
    over ``tensor`` by ``plan`` (see :mod:`polyparallel_jax.partition`), other state replicated.
    ``param_dtype`` (the precision's): the floating parameters are cast to it first, and kept
    in it; ``optimizer_dtype``: what :meth:`ShardedModule.optimizer` keeps the optimizer state
    in. Errors in the plan are raised before anything is compiled or moved."""
    import jax
    from flax import nnx

    from . import precision

    params = nnx.state(module, nnx.Param)
    if param_dtype is not None:
        params = precision.cast(params, param_dtype)
        nnx.update(module, params)
    shapes = {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    specs = param_specs(shapes, plan, runtime.topology.sizes)
    wrapped = ShardedModule(module, {k: v for k, v in specs.items() if v}, runtime, optimizer_dtype)
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, wrapped.shardings(state)))
    return wrapped


# -- sync_grads -------------------------------------------------------------------------------


def sync_grads(strategy: pp.Strategy, grads: Any) -> Any:
    """Mean (or sum, per ``strategy.grad_policy``) of per-device gradients over ``data``.

    Pass the gradients of each device's *local* loss. Inside ``shard_map(check_vma=True)`` JAX
    already summed the gradient of a replicated parameter over the axis (the transpose of the
    implicit ``pvary`` is a ``psum``), so such leaves are divided by the axis size, not
    ``pmean``-ed again; leaves still varying over ``data`` are ``pmean``-ed. Outside ``shard_map``
    gradients of a global loss are already global (GSPMD): a documented no-op.

    Under ``Strategy(precision=)`` the varying leaves are reduced in its ``reduce_dtype`` (cast,
    reduced, cast back to the gradient's dtype). Leaves JAX already summed in backward were
    reduced in their own dtype: take the gradient with respect to per-device copies
    (``jax.lax.pcast(params, "data", to="varying")``, as :class:`polyparallel_jax.Model` does)
    so that the one reduction is this one.
    """
    import jax
    import jax.numpy as jnp

    from . import precision

    if not inside_data_axis():
        return grads
    size = jax.lax.axis_size(DATA)
    mean = strategy.grad_policy.op == "mean"
    dtypes = precision.dtypes(strategy.precision)
    reduce = dtypes.reduce if dtypes is not None else None

    def one(g: Any) -> Any:
        if _varies_over_data(g):
            wire = reduce if reduce is not None and jnp.issubdtype(g.dtype, jnp.floating) else g.dtype
            out = _psum(g.astype(wire))
            return (out / size if mean else out).astype(g.dtype)
        return g / size if mean else g

    return jax.tree.map(one, grads)


def _psum(x: Any) -> Any:
    """``psum`` over ``data`` in ``x``'s dtype. A bfloat16 all-reduce on CPU is summed in float32
    and rounded back, written out here: XLA's CPU compiler does the same by itself
    (``AllReducePromotion``) but aborts the process doing it inside a partially manual
    ``shard_map`` (a ``tensor`` axis left to GSPMD puts a sharding constraint in the reducer)."""
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jax.lax.psum(x.astype(jnp.float32), DATA).astype(x.dtype)
    return jax.lax.psum(x, DATA)


# -- reduce_metrics ---------------------------------------------------------------------------


def is_jax_metric(value: Any) -> bool:
    """A ``jax.Array`` or a :class:`polyparallel.Mean` with a ``jax.Array`` total or count."""
    import jax

    if isinstance(value, pp.Mean):
        return isinstance(value.total, jax.Array) or isinstance(value.count, jax.Array)
    return isinstance(value, jax.Array)


_LAX_OPS = {"mean": "pmean", "sum": "psum", "max": "pmax", "min": "pmin"}


def reduce_metrics(strategy: pp.Strategy, runtime: JaxRuntime | None, rank: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Count-weighted for :class:`~polyparallel.Mean`, ``metric_policy`` op for plain values, over
    ``data`` only (tensor replicas hold the same value and are not counted twice)."""
    import jax
    import jax.numpy as jnp

    if inside_data_axis():
        out = {}
        for name, value in metrics.items():
            if isinstance(value, pp.Mean):
                total, count = (jax.lax.psum(v, DATA) if _varies_over_data(v) else v
                                for v in (jnp.asarray(value.total), jnp.asarray(value.count)))
                out[name] = total / count
            else:
                value = jnp.asarray(value)
                op = getattr(jax.lax, _LAX_OPS[strategy.metric_policy.op_for(name)])
                out[name] = op(value, DATA) if _varies_over_data(value) else value
        return out
    if runtime is None or jax.process_count() == 1:
        return {n: (jnp.asarray(v.total) / v.count if isinstance(v, pp.Mean) else v) for n, v in metrics.items()}
    # Several processes: each holds a process-local value; combine one per data replica.
    # (A value spanning processes is a global array: already reduced, taken as it is.)
    spanning = {n for n, v in metrics.items()
                if not all(_process_local(x) for x in ((v.total, v.count) if isinstance(v, pp.Mean) else (v,)))}
    local = {n: ((jnp.asarray(v.total, jnp.float32), jnp.asarray(v.count, jnp.float32)) if isinstance(v, pp.Mean)
                 else jnp.asarray(v, jnp.float32)) for n, v in metrics.items() if n not in spanning}
    signature = metric_signature(metrics, strategy.metric_policy, spanning)
    gathered = _gather_processes(local, runtime, "reduce_metrics", rank, signature=signature)
    keep = runtime.representative_processes()
    reducers: dict[str, Callable[..., Any]] = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    out = {}
    for name, value in metrics.items():
        if name in spanning:
            out[name] = value.total / value.count if isinstance(value, pp.Mean) else value
        elif isinstance(value, pp.Mean):
            totals, counts = gathered[name]
            out[name] = jnp.sum(totals[keep]) / jnp.sum(counts[keep])
        else:
            values = gathered[name][keep]
            out[name] = reducers[strategy.metric_policy.op_for(name)](values, axis=0)
    return out


def _process_local(x: Any) -> bool:
    return getattr(x, "is_fully_addressable", True)


# -- sync_states ------------------------------------------------------------------------------


_COLLECTIONS = {"Param": "params", "BatchStat": "batch_stats", "RngKey": "rngs", "RngCount": "rngs", "Cache": "cache"}


def collection_name(variable: Any) -> str:
    """The Linen-style collection of an NNX variable (``params``, ``batch_stats``, ``rngs``...),
    so ``StatePolicy`` patterns read the same for every framework (``batch_stats*``)."""
    for kind in type(variable).__mro__:
        if kind.__name__ in _COLLECTIONS:
            return _COLLECTIONS[kind.__name__]
    return type(variable).__name__.lower()


def state_names(states: Any) -> Any:
    """A pytree like ``states`` whose leaves are the dotted names the policy is matched against:
    ``batch_stats.bn.mean``, ``rngs.dropout.key``, ``params.linear.kernel``."""
    import jax
    from flax import nnx

    def name(path: Any, leaf: Any) -> str:
        dotted = path_name(path).replace("/", ".")
        return f"{collection_name(leaf)}.{dotted}" if isinstance(leaf, nnx.Variable) else dotted

    return jax.tree_util.tree_map_with_path(name, states, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sync_states(strategy: pp.Strategy, runtime: JaxRuntime | None, rank: int, states: Any) -> Any:
    """Apply ``strategy.state_policy`` to each state: ``mean`` over ``data``, ``broadcast`` from
    data coordinate 0, ``local`` unchanged. ``states`` is an NNX module (updated in place and
    returned), an ``nnx.State`` or a mapping of named collections."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if isinstance(states, nnx.Module):
        nnx.update(states, sync_states(strategy, runtime, rank, nnx.state(states)))
        return states
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    names = state_names(states)
    actions = jax.tree.map(lambda n: strategy.state_policy.action_for(n), names)

    def value_of(leaf: Any) -> Any:
        return leaf.get_value() if is_var(leaf) else leaf

    def rebuild(leaf: Any, value: Any) -> Any:
        return leaf.replace(value) if is_var(leaf) else value

    if inside_data_axis():
        def one(leaf: Any, action: str) -> Any:
            x = value_of(leaf)
            if action == "local" or not _varies_over_data(x):
                return leaf
            if action == "mean":
                return rebuild(leaf, jax.lax.pmean(x, DATA))
            first = jax.lax.axis_index(DATA) == 0
            return rebuild(leaf, jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), DATA))

        return jax.tree.map(one, states, actions, is_leaf=is_var)
    if runtime is None or jax.process_count() == 1:
        return states  # a global array is one value for the whole mesh
    leaves, treedef = jax.tree.flatten(states, is_leaf=is_var)
    acts = jax.tree.leaves(actions)
    # Arrays spanning several processes are already one global value, and ``local`` states stay
    # as they are: only process-local values (each process's own copy) with a ``mean`` or
    # ``broadcast`` action are gathered and combined.
    combine = [i for i, (leaf, action) in enumerate(zip(leaves, acts))
               if action != "local" and _process_local(value_of(leaf))]
    if not combine:
        return states
    values = [jnp.asarray(value_of(leaves[i])) for i in combine]
    # Compared before the gather, as reduce_metrics' names are: a gather pairs leaves by position,
    # so {"bn.mean"} on one process and {"bn.var"} on another would be averaged together.
    named = jax.tree.leaves(names)
    signature = ", ".join(sorted(f"{named[i]}:{acts[i]}{list(v.shape)}{v.dtype}" for i, v in zip(combine, values)))
    gathered = _gather_processes(values, runtime, "sync_states", rank, signature=signature)
    keep = runtime.representative_processes()
    owner = keep[0]  # holds data coordinate 0: processes are laid out in mesh order
    out = list(leaves)
    for i, stacked in zip(combine, gathered):
        if acts[i] == "mean":
            out[i] = rebuild(leaves[i], jnp.mean(stacked[keep], axis=0).astype(stacked.dtype))
        else:  # broadcast
            out[i] = rebuild(leaves[i], stacked[owner])
    return jax.tree.unflatten(treedef, out)
