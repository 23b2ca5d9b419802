"""The compiled train and eval steps of :class:`polyparallel_jax.Model`.

A step is one ``jax.jit`` program: a ``shard_map`` manual over ``data`` and automatic (GSPMD)
over ``tensor`` (parameters split by partition rules), followed by the optax update on the
sharded parameters. Per device, the parameters are made per-device copies (``pcast`` to
*varying* over ``data``), so the gradient of each micro-batch is the device's own and nothing is
communicated in backward; with ``Strategy(accumulate=N)`` a ``lax.scan`` runs the N
micro-batches of the step one after the other, adding their gradients (in the parameters'
dtype). Then ``strategy.sync_grads`` reduces the sum over ``data`` once (in the precision's
reduce dtype), and the optimizer steps once. Losses and metrics are summed over the
micro-batches and reduced count-weighted by ``strategy.reduce_metrics``; BatchNorm statistics
run through the micro-batches in order and are synchronised by ``strategy.sync_states``, or,
under the ``local`` policy, kept per device (a leading axis over ``data``, one row per device).
Under a precision the parameters and inputs are cast to the compute dtype inside the step
(:mod:`polyparallel_jax.precision`).
"""

from __future__ import annotations

from typing import Any

import polyparallel as pp

from . import precision as _precision

__all__ = ["DATA", "Plain", "average", "build", "run_epoch", "split_configured", "split_state", "weighted"]

DATA = "data"


def split_state(module: Any) -> tuple[Any, Any, Any, Any]:
    """``nnx.split`` of ``module`` into (graphdef, parameters, BatchNorm statistics, the rest)."""
    from flax import nnx

    graphdef, params, *states = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    stats, rest = states  # three filters, so exactly two more states (flax's type says "any number")
    return graphdef, params, stats, rest


#: Static module attributes a step sets for itself (:func:`split_configured`), and gives back afterwards.
STEP_ATTRIBUTES = ("axis_name", "use_running_average", "deterministic")


def split_configured(module: Any, train: bool, sync: bool) -> tuple[Any, Any, Any, Any]:
    """:func:`split_state` of ``module`` configured for a step: train or eval mode, BatchNorm
    synchronised over ``data`` when ``sync``. The configuration lives in the graphdef (static
    attributes); the user's module gets its own attributes back."""
    from flax import nnx

    saved = [(sub, {name: vars(sub)[name] for name in STEP_ATTRIBUTES if name in vars(sub)})
             for _, sub in nnx.iter_modules(module)]
    try:
        for _, sub in nnx.iter_modules(module):
            if isinstance(sub, nnx.BatchNorm):
                sub.axis_name = DATA if sync else None
        module.train() if train else module.eval()
        return split_state(module)
    finally:
        for sub, attributes in saved:
            for name, value in attributes.items():
                setattr(sub, name, value)


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


def _sum(values: Any) -> Any:
    """A sum of per-sample values in at least float32 (bfloat16 sums of a history lose digits)."""
    import jax.numpy as jnp

    return jnp.sum(values.astype(jnp.promote_types(values.dtype, jnp.float32)))


def _where(condition: Any, new: Any, old: Any) -> Any:
    """``new`` where ``condition``, else ``old``, leaf by leaf (RNG keys, unchanged by a call, new)."""
    import jax
    import jax.numpy as jnp

    def one(a: Any, b: Any) -> Any:
        return a if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else jnp.where(condition, a, b)

    return jax.tree.map(one, new, old)


def _per_device(graphdef: Any, ops: Any, loss_fn: Any, metric_fns: dict[str, Any], *, train: bool,
                local_stats: bool, fold_rngs: bool, dtypes: _precision.Dtypes | None, accumulate: int) -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def forward(params: Any, stats: Any, rest: Any, x: Any, y: Any, mask: Any, scale: Any) -> Any:
        """One micro-batch: (scaled loss, (predictions, sums, new stats, new rest))."""
        model = nnx.merge(graphdef, _precision.for_compute(params, dtypes), stats, rest, copy=True)
        predictions = model(_precision.for_compute(x, dtypes))
        if dtypes is not None and dtypes.mixed:  # the loss in the parameters' dtype, as autocast does
            predictions = _precision.cast(predictions, dtypes.param)
        sums = {"loss": _sum(loss_fn(predictions, y) * mask)}
        for name, fn in metric_fns.items():
            sums[name] = _sum(fn(predictions, y) * mask)
        _, _, new_stats, new_rest = split_state(model)
        # The local sum scaled so that sync_grads' mean over devices is the gradient of the
        # global mean loss over the whole step, exactly, even for shards of unequal size.
        return sums["loss"] * scale, (predictions, sums, new_stats, new_rest)

    def body(params: Any, stats: Any, rest: Any, x: Any, y: Any, mask: Any) -> Any:
        if local_stats:
            stats = jax.tree.map(lambda s: s[0], stats)  # (1, ...) per device -> (...)
        keys_in = rest
        if fold_rngs:
            index = jax.lax.axis_index(DATA)
            rest = jax.tree.map(lambda v: v.replace(jax.random.fold_in(v.get_value(), index))
                                if isinstance(v, nnx.RngKey) else v, rest,
                                is_leaf=lambda v: isinstance(v, nnx.Variable))
        # Real rows of each micro-batch over all devices (one all-reduce for the whole step).
        counts = jnp.sum(mask, axis=-1) if accumulate > 1 else jnp.sum(mask)
        counts = jax.lax.psum(counts, DATA) if _in_data() else counts
        count = jnp.sum(mask)  # this device's real rows of the whole step
        scale = (jax.lax.axis_size(DATA) if _in_data() else 1) / jnp.maximum(jnp.sum(counts), 1)
        if train:
            # Per-device copies: each micro-batch's gradient stays on its device (no reduction
            # in backward); sync_grads reduces the step's sum once.
            local = jax.lax.pcast(params, DATA, to="varying") if _in_data() else params
            grad_fn = jax.value_and_grad(forward, has_aux=True)

            def micro(carry: Any, batch: Any) -> Any:
                grads, sums, stats, rest = carry
                *rows, real = batch
                (_, (predictions, new_sums, new_stats, new_rest)), g = grad_fn(local, stats, rest, *rows, scale)
                grads = jax.tree.map(lambda a, b: (a + b).astype(a.dtype), grads, g)
                sums = jax.tree.map(jnp.add, sums, new_sums)
                # A micro-batch of padding only (the end of a partial step) leaves statistics and
                # RNG counters as they were; its gradient and sums are zero already.
                stats, rest = _where(real > 0, (new_stats, new_rest), (stats, rest))
                return (grads, sums, stats, rest), predictions

            if accumulate == 1:
                (_, (predictions, sums, new_stats, new_rest)), grads = grad_fn(local, stats, rest, x, y, mask, scale)
            else:  # x, y, mask: (accumulate, micro-batch, ...) per device
                zeros = jax.tree.map(jnp.zeros_like, local)
                shapes = jax.eval_shape(grad_fn, local, stats, rest, x[0], y[0], mask[0], scale)[0][1][1]
                no_sums = {name: jnp.zeros((), s.dtype) for name, s in shapes.items()}
                no_sums = jax.lax.pcast(no_sums, DATA, to="varying") if _in_data() else no_sums
                (grads, sums, new_stats, new_rest), predictions = jax.lax.scan(
                    micro, (zeros, no_sums, stats, rest), (x, y, mask, counts))
            grads = ops.sync_grads(grads)
        else:
            _, (predictions, sums, new_stats, new_rest) = forward(params, stats, rest, x, y, mask, scale)
            grads = None
        metrics = ops.reduce_metrics({name: pp.Mean(value, count) for name, value in sums.items()})
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
    ``local_stats``: the statistics come and go with a leading axis sharded over ``data``.
    ``optimizer`` is the transformation as it runs (already keeping the precision's optimizer
    dtype). Under ``strategy.accumulate > 1`` the train step takes the batch with a leading
    micro-batch axis, as ``shard_data`` gives it (``(accumulate, micro-batch x data, ...)``)."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    accumulate = strategy.accumulate if strategy is not None and train else 1
    dtypes = _precision.dtypes(strategy.precision if strategy is not None else None)
    if strategy is None:
        mapped = _per_device(graphdef, Plain(), loss_fn, metric_fns, train=train, local_stats=False, fold_rngs=False,
                             dtypes=None, accumulate=1)
    else:
        body = _per_device(graphdef, strategy, loss_fn, metric_fns, train=train, local_stats=local_stats,
                           fold_rngs=True, dtypes=dtypes, accumulate=accumulate)
        stats_spec = P(DATA) if local_stats else P()
        rows = P(None, DATA) if accumulate > 1 else P(DATA)
        mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={DATA},
                               in_specs=(P(), stats_spec, P(), rows, rows, rows),
                               out_specs=(P(), stats_spec, P(), P(), rows))

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


def weighted(host: list[tuple[dict[str, Any], int]]) -> dict[str, float]:
    """Per-batch metric means (host values) weighted by their real rows: the mean over every row."""
    total = sum(c for _, c in host)
    if not host or total == 0:
        return {}
    return {name: float(sum(float(m[name]) * c for m, c in host) / total) for name in host[0][0]}


_AVERAGE: Any = None  # the jitted mean, built on first use (jax is imported lazily)


def average(stacked: Any) -> Any:
    """The mean over the leading (data) axis of per-device statistics."""
    global _AVERAGE
    if _AVERAGE is None:
        import jax
        import jax.numpy as jnp

        # A GSPMD mean over the data-sharded leading axis: the all-reduce of per-device statistics.
        _AVERAGE = jax.jit(lambda s: jax.tree.map(lambda a: jnp.mean(a, axis=0), s))
    return _AVERAGE(stacked)


def run_epoch(step: Any, data: Any, epoch: int, first: int, state: tuple[Any, ...], results: list[Any],
              sync_every: int, bar: Any, after_step: Any) -> tuple[Any, ...]:
    """Drive the train ``step`` over ``data``'s batches of ``epoch`` from batch ``first``:
    ``state`` is ``(params, stats, rest, opt_state)`` (donated, so only the returned one is
    valid); each step's ``(metrics, real rows)`` goes to ``results``; one wait every
    ``sync_every`` steps bounds the queue of collective steps (several CPU devices in one
    process deadlock past ~35 queued); ``after_step(state)`` runs after every step but the
    epoch's last (``fit(checkpoint_every=)``)."""
    import jax

    pending = None
    for i, batch in enumerate(data.batches(epoch, start=first), start=first):
        bx, by = batch.data
        *state, metrics = step(*state, bx, by, batch.mask)
        results.append((metrics, batch.count))  # real rows: padding has mask 0
        if (i + 1) % sync_every == 0:
            if pending is not None:
                jax.block_until_ready(pending)
                bar.update(i, pending)
            pending = metrics
        if i + 1 < len(data):
            after_step(tuple(state))
    return tuple(state)
