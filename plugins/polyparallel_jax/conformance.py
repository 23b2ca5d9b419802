"""Conformance checks for the JAX runtime: the JAX counterpart of polyparallel's generic kit.

Each ``check_*`` function runs in the calling process (one process with many devices, or every
process of a :func:`polyparallel_jax.launch.launch_processes` run) and raises ``AssertionError``
with the measured numbers when the runtime breaks the contract of DESIGN.md. Strategies must be
JAX strategies (``runtime="jax"``; see :func:`polyparallel_jax.runtime.as_jax_strategy`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import polyparallel as pp

from .runtime import runtime_for

__all__ = ["check_grads_match_single", "check_metrics_exact", "check_shards", "check_states_synced",
           "check_training_matches_single", "check_unsupported_topology", "dataset", "small_mlp"]


def dataset(n: int = 203, features: int = 12, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A reproducible classification set (``n`` need not divide by anything)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, :classes].argmax(axis=1) + (rng.random(n) < 0.1)).astype(np.int32) % classes
    return x, y


def small_mlp(features: int = 12, hidden: int = 16, classes: int = 4, batch_norm: bool = True, seed: int = 0) -> Any:
    """Linear (no bias before BatchNorm: its gradient is exactly 0 and only float noise is left) ->
    BatchNorm -> relu -> Linear -> relu -> Linear, as an NNX module."""
    import jax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(features, hidden, use_bias=not batch_norm, rngs=rngs)
            self.bn = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs) if batch_norm else None
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.l3 = nnx.Linear(hidden, classes, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            h = self.l1(x)
            if self.bn is not None:
                h = self.bn(h)
            return self.l3(jax.nn.relu(self.l2(jax.nn.relu(h))))

    return MLP(nnx.Rngs(seed))


def check_shards(strategy: pp.Strategy, n: int = 203, batch_size: int = 16) -> dict[str, Any]:
    """Shards are disjoint and complete (``uneven``), equal-length with every sample (``pad``);
    every device holds exactly its data coordinate's rows; tensor replicas hold identical rows."""
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    runtime = runtime_for(strategy)
    data_size = runtime.data_size
    uneven = strategy.shard_data(x, batch_size=batch_size, remainder="uneven")
    shards = uneven.indices(epoch=1)
    seen = np.concatenate(shards)
    assert len(seen) == n and set(seen.tolist()) == set(range(n)), f"uneven shards not a partition: {len(seen)} of {n}"
    padded = strategy.shard_data(x, batch_size=batch_size, remainder="pad").indices(epoch=1)
    assert len({len(s) for s in padded}) == 1 and set(np.concatenate(padded).tolist()) == set(range(n))
    assert not np.array_equal(uneven.indices(0)[0], shards[0]), "shuffling must depend on the epoch"
    data_axis = runtime.mesh.axis_names.index("data")
    position = {d.id: idx for idx, d in np.ndenumerate(runtime.mesh.devices)}
    rows_seen = 0
    for batch in uneven.batches(epoch=1):
        per_device = batch.size // data_size
        by_coord: dict[int, np.ndarray] = {}
        for shard in batch.data.addressable_shards:
            coord = position[shard.device.id][data_axis]
            rows = np.asarray(shard.data)[:, 0]
            expected = batch.indices[coord * per_device:(coord + 1) * per_device]
            assert np.array_equal(rows, expected), f"device {shard.device.id} (data={coord}) got rows {rows}, expected {expected}"
            if coord in by_coord:  # a replica along tensor/pipeline
                assert np.array_equal(by_coord[coord], rows), f"replicas of data={coord} got different rows"
            by_coord[coord] = rows
        rows_seen += int(np.asarray(batch.mask).sum()) if batch.mask.is_fully_addressable else 0
    if jax_process_count() == 1:
        assert rows_seen == n, f"uneven batches hold {rows_seen} real rows, expected {n}"
    return {"data": data_size, "samples": n, "shard_sizes": [len(s) for s in shards]}


def check_grads_match_single(strategy: pp.Strategy) -> float:
    """``sync_grads`` inside ``shard_map`` (with and without ``check_vma``) equals the single-device
    gradient of the global mean loss. Returns the largest absolute difference."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    runtime = runtime_for(strategy)
    x, y = dataset(16 * runtime.data_size)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(x.shape[1], 4)).astype(np.float32))

    def local_loss(w: Any, x: Any, y: Any) -> Any:
        logits = x @ w
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    expected = jax.grad(local_loss)(w, x, y)
    worst = 0.0
    for check_vma in (True, False):
        fn = jax.shard_map(lambda w, x, y: strategy.sync_grads(jax.grad(local_loss)(w, x, y)),
                           mesh=runtime.mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                           axis_names={"data"}, check_vma=check_vma)
        xs, ys = (jax.device_put(a, runtime.sharding("data")) for a in (x, y))
        got = jax.jit(fn)(jax.device_put(w, runtime.replicated), xs, ys)
        diff = float(np.abs(np.asarray(got) - np.asarray(expected)).max())
        assert diff < 1e-5, f"sync_grads (check_vma={check_vma}) differs from the single-device gradient by {diff}"
        worst = max(worst, diff)
    return worst


def check_metrics_exact(strategy: pp.Strategy, n: int = 203) -> dict[str, float]:
    """Count-weighted metrics over shards of unequal size equal the single-process mean, inside
    ``shard_map`` and (several processes) across processes."""
    import jax
    import jax.numpy as jnp

    # Plain values reduce by the metric policy: ask for max on "max".
    strategy = strategy.replace(metric_policy=pp.MetricPolicy(ops={"max": "max"}))
    runtime = runtime_for(strategy)
    values = np.random.default_rng(2).normal(size=n).astype(np.float32)
    expected = float(values.astype(np.float64).mean())
    data = strategy.shard_data(values, batch_size=runtime.data_size * 32, remainder="uneven", shuffle=False)
    from jax.sharding import PartitionSpec as P

    def per_device(v: Any, mask: Any) -> Any:
        return strategy.reduce_metrics({"value": pp.Mean(jnp.sum(v * mask), jnp.sum(mask)),
                                        "max": jnp.max(jnp.where(mask > 0, v, -jnp.inf))})

    fn = jax.jit(jax.shard_map(per_device, mesh=runtime.mesh, in_specs=(P("data"), P("data")), out_specs=P(),
                               axis_names={"data"}))
    total, count = 0.0, 0
    for batch in data.batches(0):
        got = fn(batch.data, batch.mask)
        batch_real = np.unique(batch.indices[np.asarray(_gather(batch.mask)) > 0])
        want = float(values[batch_real].astype(np.float64).mean())
        assert abs(float(got["value"]) - want) < 1e-5, f"batch mean {float(got['value'])} != {want}"
        assert abs(float(got["max"]) - float(values[batch_real].max())) < 1e-6
        total += float(got["value"]) * len(batch_real)
        count += len(batch_real)
    assert count == n and abs(total / count - expected) < 1e-5, f"epoch mean {total / count} != {expected}"
    out = {"in_program": total / count, "expected": expected}
    if jax_process_count() > 1:
        # Process-local partial means, as a user's host loop would hold them.
        mine = np.array_split(values, jax_process_count())[jax_process_index()]
        local = pp.Mean(jnp.asarray(mine.sum(), jnp.float32), jnp.asarray(len(mine), jnp.float32))
        reduced = float(strategy.reduce_metrics({"value": local})["value"])
        assert abs(reduced - expected) < 1e-5, f"cross-process mean {reduced} != {expected}"
        out["across_processes"] = reduced
    return out


def check_states_synced(strategy: pp.Strategy) -> dict[str, Any]:
    """``sync_states`` per policy: ``batch_stats`` averaged over data, ``rngs`` keys left local,
    ``params`` broadcast from data coordinate 0; tensor replicas agree."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    runtime = runtime_for(strategy)
    size = runtime.data_size

    def per_device(seed: Any) -> Any:
        index = jax.lax.axis_index("data").astype(jnp.float32)
        states = {"batch_stats": {"bn": {"mean": seed[0] + index}}, "rngs": {"dropout": {"key": seed[0] + index}},
                  "params": {"w": seed[0] + 10 * index + 1}}
        out = strategy.sync_states(states)
        return jax.tree.map(lambda a: a[None], out)

    fn = jax.jit(jax.shard_map(per_device, mesh=runtime.mesh, in_specs=P(), out_specs=P("data"), axis_names={"data"}))
    got = jax.tree.map(lambda a: np.asarray(_gather(a)), fn(jnp.zeros((1,), jnp.float32)))
    mean = np.asarray(got["batch_stats"]["bn"]["mean"])
    assert np.allclose(mean, (size - 1) / 2), f"batch_stats not averaged: {mean}"
    assert np.array_equal(np.asarray(got["rngs"]["dropout"]["key"]), np.arange(size, dtype=np.float32)), "rngs must stay local"
    assert np.allclose(np.asarray(got["params"]["w"]), 1.0), f"params not broadcast from data=0: {got['params']['w']}"
    return {"batch_stats": mean.tolist()}


def check_training_matches_single(strategy: pp.Strategy, epochs: int = 2, batch_size: int = 32,
                                  optimizer: Any = None) -> float:
    """``Model.fit`` under ``strategy`` ends with the parameters and BatchNorm statistics of
    single-device training on the same global batches. Returns the largest difference."""
    import jax
    import optax
    from flax import nnx

    from .model import Model

    # 200 samples divide over 8 data coordinates: remainder="pad" adds no repeated samples, so
    # the global batches are exactly the single-device ones.
    x, y = dataset(200)
    results = []
    for s in (None, strategy):
        model = Model(small_mlp(), loss="cross_entropy", optimizer=optimizer or optax.adam(1e-2), metrics=["accuracy"])
        model.fit(x, y, epochs=epochs, batch_size=batch_size, strategy=s, verbose=0)
        state = nnx.to_pure_dict(nnx.state(model.module, (nnx.Param, nnx.BatchStat)))
        results.append(jax.tree.map(lambda a: np.asarray(_gather(a)), state))
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), *results))
    worst = max(diffs)
    assert worst < 1e-5, f"training under {strategy!r} differs from single-device training by {worst}"
    return worst


def check_unsupported_topology(plugin_manager: pp.PluginManager | None = None) -> str:
    """A topology with a pipeline axis is refused before anything starts, naming the axis."""
    strategy = pp.Strategy(data=2, pipeline=2, runtime="jax", plugin_manager=plugin_manager)
    try:
        strategy.check("jax")
    except pp.UnsupportedTopologyError as exc:
        assert "pipeline=2" in str(exc), str(exc)
        return str(exc)
    raise AssertionError("Strategy(pipeline=2) was not refused by the jax runtime")


def _gather(x: Any) -> Any:
    import jax
    from jax.experimental import multihost_utils

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def jax_process_count() -> int:
    import jax

    return jax.process_count()


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def check_skipped_collective_times_out(strategy: pp.Strategy) -> str | None:
    """Process 1 skips a ``reduce_metrics`` that process 0 makes: process 0 must fail within
    ``strategy.timeout`` with a :class:`polyparallel.CollectiveTimeout` naming the operation, the
    axis and the rank, instead of hanging. Run it last: process 0 is left with a stuck collective."""
    import time

    import jax
    import jax.numpy as jnp

    if jax.process_index() != 0:
        return None
    start = time.monotonic()
    try:
        strategy.reduce_metrics({"loss": pp.Mean(jnp.asarray(1.0), jnp.asarray(1.0))})
    except pp.CollectiveTimeout as exc:
        waited = time.monotonic() - start
        assert waited < strategy.timeout + 10, f"timed out after {waited:.1f} s, timeout is {strategy.timeout}"
        assert exc.operation == "reduce_metrics" and exc.axis == "data" and exc.rank == 0, str(exc)
        return str(exc)
    raise AssertionError("a collective with a missing peer did not time out")


def multiprocess_suite(sizes: dict[str, int], with_timeout_check: bool = False) -> dict[str, Any]:
    """Every check in one process of a multi-process run (the function the tests launch)."""
    from . import plugin

    pm = pp.PluginManager(autoload=False)
    pm.register(plugin, name="jax")
    strategy = pp.Strategy(**sizes, runtime="jax", timeout=8.0, plugin_manager=pm)
    report: dict[str, Any] = {"process": jax_process_index(), "topology": repr(runtime_for(strategy).topology)}
    report["shards"] = check_shards(strategy)
    report["grads"] = check_grads_match_single(strategy)
    report["metrics"] = check_metrics_exact(strategy)
    report["states"] = check_states_synced(strategy)
    report["training"] = check_training_matches_single(strategy)
    if with_timeout_check:
        report["timeout"] = check_skipped_collective_times_out(strategy)
    return report
