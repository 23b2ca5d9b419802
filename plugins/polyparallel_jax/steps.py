"""The compiled train and eval steps of :class:`polyparallel_jax.Model`.

A step is one ``jax.jit`` program: a ``shard_map`` manual over ``data`` (each device computes the
gradient of its own rows; ``strategy.sync_grads`` averages them) and automatic (GSPMD) over
``tensor`` (parameters split by partition rules), followed by the optax update on the sharded
parameters. Metrics and losses are reduced count-weighted by ``strategy.reduce_metrics``;
BatchNorm statistics are synchronised by ``strategy.sync_states``, or, under the ``local``
policy, kept per device (a leading axis over ``data``, one row per device).
"""

from __future__ import annotations

from typing import Any

import polyparallel as pp

__all__ = ["DATA", "Plain", "build", "split_state"]

DATA = "data"


def split_state(module: Any) -> tuple[Any, Any, Any, Any]:
    """``nnx.split`` of ``module`` into (graphdef, parameters, BatchNorm statistics, the rest)."""
    from flax import nnx

    graphdef, params, *states = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    stats, rest = states  # three filters, so exactly two more states (flax's type says "any number")
    return graphdef, params, stats, rest


class Plain:
    """Stand-in for a strategy on one device: the same step code, no collectives."""

    def sync_grads(self, grads: Any) -> Any:
        return grads

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {k: v.total / v.count for k, v in metrics.items()}

    def sync_states(self, states: Any) -> Any:
        return states


def _in_data() -> bool:
    from .ops import inside_data_axis

    return inside_data_axis()


def _per_device(graphdef: Any, ops: Any, loss_fn: Any, metric_fns: dict[str, Any], train: bool, local_stats: bool,
                fold_rngs: bool) -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def body(params: Any, stats: Any, rest: Any, x: Any, y: Any, mask: Any) -> Any:
        if local_stats:
            stats = jax.tree.map(lambda s: s[0], stats)  # (1, ...) per device -> (...)
        keys_in = rest
        if fold_rngs:
            index = jax.lax.axis_index(DATA)
            rest = jax.tree.map(lambda v: v.replace(jax.random.fold_in(v.get_value(), index))
                                if isinstance(v, nnx.RngKey) else v, rest,
                                is_leaf=lambda v: isinstance(v, nnx.Variable))
        count = jnp.sum(mask)
        total_count = jax.lax.psum(count, DATA) if _in_data() else count
        scale = jax.lax.axis_size(DATA) if _in_data() else 1

        def objective(params: Any) -> Any:
            model = nnx.merge(graphdef, params, stats, rest, copy=True)
            predictions = model(x)
            per_sample = loss_fn(predictions, y)
            loss_sum = jnp.sum(per_sample * mask)
            _, _, new_stats, new_rest = split_state(model)
            # Local sum scaled so that sync_grads' mean over devices is the gradient of the
            # global mean loss, exactly, even for shards of unequal size.
            return loss_sum * scale / jnp.maximum(total_count, 1), (predictions, loss_sum, new_stats, new_rest)

        if train:
            (_, (predictions, loss_sum, new_stats, new_rest)), grads = jax.value_and_grad(objective, has_aux=True)(params)
            grads = ops.sync_grads(grads)
        else:
            _, (predictions, loss_sum, new_stats, new_rest) = objective(params)
            grads = None
        values = {"loss": pp.Mean(loss_sum, count)}
        for name, fn in metric_fns.items():
            values[name] = pp.Mean(jnp.sum(fn(predictions, y) * mask), count)
        metrics = ops.reduce_metrics(values)
        if local_stats:
            new_stats = jax.tree.map(lambda s: s[None], new_stats)
        else:
            new_stats = ops.sync_states(new_stats)
        if fold_rngs:  # keys go back unfolded; counters advanced identically everywhere
            new_rest = jax.tree.map(lambda new, old: new.replace(old.get_value()) if isinstance(new, nnx.RngKey) else new,
                                    new_rest, keys_in, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return grads, new_stats, new_rest, metrics, predictions

    return body


def build(graphdef: Any, strategy: pp.Strategy | None, runtime: Any, loss_fn: Any, metric_fns: dict[str, Any],
          optimizer: Any, *, train: bool, local_stats: bool) -> Any:
    """The jitted train step ``(params, stats, rest, opt_state, x, y, mask) -> (params, stats,
    rest, opt_state, metrics)`` or eval step ``(params, stats, rest, x, y, mask) -> (metrics,
    predictions)`` of ``graphdef`` on ``runtime``'s mesh (``strategy`` ``None``: one device).
    ``local_stats``: the statistics come and go with a leading axis sharded over ``data``."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    if strategy is None:
        mapped = _per_device(graphdef, Plain(), loss_fn, metric_fns, train, False, False)
    else:
        body = _per_device(graphdef, strategy, loss_fn, metric_fns, train, local_stats, True)
        stats_spec = P(DATA) if local_stats else P()
        mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={DATA},
                               in_specs=(P(), stats_spec, P(), P(DATA), P(DATA), P(DATA)),
                               out_specs=(P(), stats_spec, P(), P(), P(DATA)))

    if train:
        def train_step(params: Any, stats: Any, rest: Any, opt_state: Any, x: Any, y: Any, mask: Any) -> Any:
            grads, stats, rest, metrics, _ = mapped(params, stats, rest, x, y, mask)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), stats, rest, opt_state, metrics
        return jax.jit(train_step, donate_argnums=(0, 1, 3))

    def eval_step(params: Any, stats: Any, rest: Any, x: Any, y: Any, mask: Any) -> Any:
        _, _, _, metrics, predictions = mapped(params, stats, rest, x, y, mask)
        return metrics, predictions
    return jax.jit(eval_step)
