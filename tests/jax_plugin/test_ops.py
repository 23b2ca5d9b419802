"""polyparallel_jax.ops: the collectives inside shard_map against single-device numpy references."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import polyparallel as pp
from polyparallel_jax import ops
from polyparallel_jax.conformance import small_mlp
from polyparallel_jax.runtime import JaxRuntime

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.normal(size=(32,)).astype(np.float32)
W = RNG.normal(size=(5,)).astype(np.float32)


def _strategy(jax_strategy, **kwargs):
    strategy = jax_strategy(data=8, **kwargs)
    return strategy, JaxRuntime.build(strategy)


def _local_mse(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def _reference_grad():
    # d/dw mean((Xw - Y)^2) over the global batch, in numpy
    return 2 * X.T @ (X @ W - Y) / len(X)


# -- sync_grads -------------------------------------------------------------------------------


@pytest.mark.parametrize("check_vma", [True, False])
def test_sync_grads_equals_the_single_device_gradient(jax_strategy, check_vma):
    strategy, runtime = _strategy(jax_strategy)

    def body(w, x, y):
        return ops.sync_grads(strategy, jax.grad(_local_mse)(w, x, y))

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=(P(), P("data"), P("data")),
                           out_specs=P(), check_vma=check_vma)
    np.testing.assert_allclose(np.asarray(jax.jit(mapped)(W, X, Y)), _reference_grad(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_sync_grads_sum_policy_sums_the_local_gradients(jax_strategy, check_vma):
    strategy, runtime = _strategy(jax_strategy, grad_policy=pp.GradPolicy(op="sum"))

    def body(w, x, y):
        return ops.sync_grads(strategy, jax.grad(_local_mse)(w, x, y))

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=(P(), P("data"), P("data")),
                           out_specs=P(), check_vma=check_vma)
    np.testing.assert_allclose(np.asarray(jax.jit(mapped)(W, X, Y)), 8 * _reference_grad(), rtol=1e-5, atol=1e-5)


def test_sync_grads_averages_leaves_that_still_vary_over_data(jax_strategy):
    strategy, runtime = _strategy(jax_strategy)

    def body(x):
        return ops.sync_grads(strategy, {"per_device": jnp.sum(x, axis=0)})["per_device"]

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=P("data"), out_specs=P())
    expected = X.reshape(8, 4, 5).sum(axis=1).mean(axis=0)
    np.testing.assert_allclose(np.asarray(mapped(X)), expected, rtol=1e-5, atol=1e-6)


def test_sync_grads_outside_shard_map_is_a_no_op(jax_strategy):
    strategy, _ = _strategy(jax_strategy)
    grads = {"w": jnp.asarray(W)}
    assert ops.sync_grads(strategy, grads) is grads
    assert not ops.inside_data_axis()


# -- reduce_metrics ---------------------------------------------------------------------------


def test_mean_metrics_are_count_weighted_over_uneven_shards(jax_strategy):
    strategy, runtime = _strategy(jax_strategy)
    values = RNG.normal(size=32).astype(np.float32)
    mask = (RNG.random(32) < 0.6).astype(np.float32)  # a different count of real rows per device

    def body(v, m):
        return ops.reduce_metrics(strategy, None, 0, {"loss": pp.Mean(jnp.sum(v * m), jnp.sum(m))})["loss"]

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=(P("data"), P("data")),
                           out_specs=P())
    assert float(mapped(values, mask)) == pytest.approx(values[mask == 1].mean(), rel=1e-5)
    per_device_mean_of_means = np.mean([values[i:i + 4][mask[i:i + 4] == 1].mean() for i in range(0, 32, 4)
                                        if mask[i:i + 4].any()])
    assert float(mapped(values, mask)) != pytest.approx(per_device_mean_of_means, rel=1e-3)


def test_plain_metrics_follow_the_metric_policy_ops(jax_strategy):
    policy = pp.MetricPolicy(op="mean", ops={"total": "sum", "worst": "max", "best": "min"})
    strategy, runtime = _strategy(jax_strategy, metric_policy=policy)
    values = RNG.normal(size=8).astype(np.float32)

    def body(v):
        v = v[0]
        out = ops.reduce_metrics(strategy, None, 0, {"avg": v, "total": v, "worst": v, "best": v,
                                                     "constant": jnp.asarray(2.0)})
        return jnp.stack([out[k] for k in ("avg", "total", "worst", "best", "constant")])

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=P("data"), out_specs=P())
    got = np.asarray(mapped(values))
    # a value already the same on every device (not varying over data) is not summed 8 times
    np.testing.assert_allclose(got, [values.mean(), values.sum(), values.max(), values.min(), 2.0], rtol=1e-5)


def test_reduce_metrics_outside_shard_map_divides_means(jax_strategy):
    strategy, runtime = _strategy(jax_strategy)
    out = ops.reduce_metrics(strategy, runtime, 0, {"m": pp.Mean(jnp.asarray(6.0), jnp.asarray(4.0)),
                                                    "v": jnp.asarray(3.0)})
    assert float(out["m"]) == 1.5 and float(out["v"]) == 3.0
    assert strategy.reduce_metrics({"m": pp.Mean(jnp.asarray(6.0), jnp.asarray(4.0))})["m"] == pytest.approx(1.5)


# -- sync_states ------------------------------------------------------------------------------


def test_sync_states_mean_broadcast_and_local(jax_strategy):
    strategy, runtime = _strategy(jax_strategy)
    per_device = RNG.normal(size=(8, 3)).astype(np.float32)

    def body(v):
        v = v[0]
        states = {"batch_stats": {"bn": {"mean": v}}, "params": {"w": v * 2}, "counter": {"count": v * 3}}
        out = ops.sync_states(strategy, None, 0, states)
        return jnp.stack([out["batch_stats"]["bn"]["mean"], out["params"]["w"], out["counter"]["count"]])[None]

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=P("data"), out_specs=P("data"))
    got = np.asarray(mapped(per_device))  # (device, state, 3)
    np.testing.assert_allclose(got[:, 0], np.broadcast_to(per_device.mean(0), (8, 3)), rtol=1e-5)  # batch_stats*: mean
    np.testing.assert_allclose(got[:, 1], np.broadcast_to(2 * per_device[0], (8, 3)), rtol=1e-6)  # default: broadcast
    np.testing.assert_allclose(got[:, 2], 3 * per_device, rtol=1e-6)  # *count*: local


def test_sync_states_user_rule_overrides_the_defaults(jax_strategy):
    strategy, runtime = _strategy(jax_strategy, state_policy={"batch_stats*": "local"})
    per_device = RNG.normal(size=(8, 2)).astype(np.float32)

    def body(v):
        return ops.sync_states(strategy, None, 0, {"batch_stats": {"m": v[0]}})["batch_stats"]["m"][None]

    mapped = jax.shard_map(body, mesh=runtime.mesh, axis_names={"data"}, in_specs=P("data"), out_specs=P("data"))
    np.testing.assert_allclose(np.asarray(mapped(per_device)), per_device)


def test_sync_states_outside_shard_map_keeps_global_values(jax_strategy):
    strategy, runtime = _strategy(jax_strategy)
    states = {"batch_stats": {"m": jnp.ones(3)}}
    assert ops.sync_states(strategy, runtime, 0, states) is states
    module = small_mlp()
    before = np.asarray(module.bn.mean[...])
    assert ops.sync_states(strategy, runtime, 0, module) is module
    np.testing.assert_array_equal(np.asarray(module.bn.mean[...]), before)


def test_state_names_use_linen_collections():
    names = ops.state_names(nnx.state(small_mlp()))
    flat = {n for n in jax.tree.leaves(names)}
    assert {"batch_stats.bn.mean", "batch_stats.bn.var", "params.l1.kernel", "params.l3.bias"} <= flat
    assert ops.collection_name(nnx.BatchStat(jnp.zeros(1))) == "batch_stats"
    assert ops.collection_name(nnx.Param(jnp.zeros(1))) == "params"


# -- wrap_model, ownership, bounded -------------------------------------------------------------


def test_wrap_model_splits_over_tensor_and_keeps_values(jax_strategy):
    strategy = jax_strategy(data=4, tensor=2)
    module = small_mlp()
    kernel = np.asarray(module.l1.kernel[...])
    wrapped = ops.wrap_model(JaxRuntime.build(strategy), module)
    assert isinstance(wrapped, ops.ShardedModule) and wrapped.module is module
    # l1 column, l2 row, l3 (4 classes) column again; l2's bias and BatchNorm stay replicated
    assert wrapped.specs == {"l1/kernel": (None, "tensor"), "l2/kernel": ("tensor", None),
                             "l3/kernel": (None, "tensor"), "l3/bias": ("tensor",)}
    placed = module.l1.kernel[...]
    assert placed.sharding.spec == P(None, "tensor") and module.l2.bias[...].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(placed), kernel)


def test_ownership_checks():
    assert ops.is_jax_tree({"a": jnp.ones(2)}) and not ops.is_jax_tree({}) and not ops.is_jax_tree({"a": np.ones(2)})
    assert ops.is_jax_metric(pp.Mean(jnp.ones(()), 2)) and ops.is_jax_metric(jnp.ones(()))
    assert not ops.is_jax_metric(pp.Mean(1.0, 2)) and not ops.is_jax_metric(1.0)


def test_bounded_returns_reraises_and_times_out():
    assert float(ops.bounded(lambda: jnp.asarray(3.0), timeout=10, operation="op", axis="data", rank=0)) == 3.0
    with pytest.raises(ZeroDivisionError):
        ops.bounded(lambda: 1 / 0, timeout=10, operation="op", axis="data", rank=0)
    with pytest.raises(pp.CollectiveTimeout, match=r"reduce_metrics over axis 'data' timed out after 0.05 s on rank 3"):
        ops.bounded(lambda: time.sleep(1.0), timeout=0.05, operation="reduce_metrics", axis="data", rank=3)
