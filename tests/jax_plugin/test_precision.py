"""Strategy(precision=) on JAX: each PrecisionPolicy field mapped, what is refused and why,
bfloat16 runs at data=2 against one process, and the memory of bf16-true against float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import polyparallel as pp
from polyparallel_jax import Model, precision
from polyparallel_jax.conformance import dataset, small_mlp
from polyparallel_jax.ops import sync_grads
from polyparallel_jax.runtime import runtime_for

from ._runs import fit, fit_in_process, max_diff

#: bfloat16 tolerances, data=2 against one process (SGD, lr 0.1, 14 steps, parameters of size
#: ~1). bf16-mixed: a gradient summed over two halves of the batch in bfloat16 matmuls rounds
#: differently from one sum over the whole batch, then the float32 parameters move by lr x that
#: (measured: at most 1.2e-3). bf16-true: the parameters themselves are bfloat16, so a
#: difference is a whole ulp: 2^-7 ~ 7.8e-3 for values in [1, 2) (measured: 3.9e-3).
BF16_TOLERANCE = {"bf16-mixed": 3e-3, "bf16-true": 2.0 ** -7}


def test_the_plugin_declares_what_it_runs_and_why_not_fp16(plugin_manager):
    declared = [plugin_manager.runtimes()["jax"], *(plugin_manager.adapters()[a].capabilities for a in ("jax", "elegy"))]
    for caps in declared:
        assert caps.precisions == {"32", "bf16-mixed", "bf16-true", "custom"} and caps.accumulation
        assert "loss scaling" in dict(caps.precision_reasons)["fp16-mixed"]
    for target in ("jax", "elegy"):
        pp.Strategy(data=8, precision="bf16-true", plugin_manager=plugin_manager).check(target)
        with pytest.raises(pp.UnsupportedTopologyError, match=r"cannot run precision PrecisionPolicy\('fp16-mixed'\): "
                                                              r"its dynamic loss scaling is not implemented on JAX"):
            pp.Strategy(data=8, precision="fp16-mixed", plugin_manager=plugin_manager).check(target)


def _touch(path):
    open(path, "w").close()


def test_fp16_and_custom_loss_scaling_are_refused_before_any_process_starts(jax_strategy, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(pp.UnsupportedTopologyError, match="fp16-mixed"):
        pp.launch(_touch, jax_strategy(data=2, precision="fp16-mixed"), 2, args=(str(marker),))
    # float16 compute and reduction, with loss scaling (the default for float16 compute): no
    # preset, so "custom" to the capabilities; the plugin's launch refuses it before any process.
    scaled = pp.PrecisionPolicy(compute_dtype="float16", reduce_dtype="float16")
    with pytest.raises(pp.UnsupportedTopologyError, match=r"launch\(\) cannot run .*dynamic loss scaling is not "
                                                          r"implemented.*loss_scaling=False"):
        pp.launch(_touch, jax_strategy(data=2, precision=scaled), 2, args=(str(marker),))
    assert not marker.exists()


def test_the_model_refuses_before_compiling(jax_strategy):
    x, y = dataset(64)
    model = Model(small_mlp())
    with pytest.raises(pp.UnsupportedTopologyError, match=r"polyparallel_jax.Model cannot run .*loss scaling"):
        model.fit(x, y, batch_size=16, strategy=jax_strategy(data=8, precision=pp.PrecisionPolicy(compute_dtype="float16", reduce_dtype="float16")))
    wide = pp.PrecisionPolicy(param_dtype="float64")
    with pytest.raises(pp.UnsupportedTopologyError, match=r"float64 param needs jax_enable_x64"):
        model.fit(x, y, batch_size=16, strategy=jax_strategy(data=8, precision=wide))
    assert model.placed_strategy is None and model._steps == {}  # nothing placed, nothing compiled


def _dtypes(tree):
    return {str(leaf.dtype) for leaf in jax.tree.leaves(tree)}


@pytest.mark.parametrize(("name", "params", "moments"), [("32", "float32", "float32"), ("bf16-mixed", "float32", "float32"),
                                                         ("bf16-true", "bfloat16", "bfloat16")])
def test_parameters_and_optimizer_state_are_kept_in_their_dtypes(jax_strategy, name, params, moments):
    x, y = dataset(96)
    model = Model(small_mlp(), optimizer=optax.adam(1e-2))
    model.fit(x, y, epochs=2, batch_size=16, strategy=jax_strategy(data=4, tensor=2, precision=name), verbose=0)
    assert _dtypes(nnx.state(model.module, nnx.Param)) == {params}
    assert _dtypes(nnx.state(model.module, nnx.BatchStat)) == {"float32"}  # statistics are not parameters
    adam = model.checkpoint_state()["optimizer"][0]
    assert _dtypes(adam.mu) == _dtypes(adam.nu) == {moments} and _dtypes(adam.count) == {"int32"}


def test_a_custom_optimizer_dtype_stays_after_updates(jax_strategy):
    # optax promotes bfloat16 moments and float32 gradients to float32 in update(); the
    # precision's wrapper casts them back every step (after 6 steps they are still bfloat16).
    x, y = dataset(96)
    model = Model(small_mlp(), optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    policy = pp.PrecisionPolicy(optimizer_dtype="bfloat16")
    model.fit(x, y, batch_size=16, strategy=jax_strategy(data=8, precision=policy), verbose=0)
    assert _dtypes(nnx.state(model.module, nnx.Param)) == {"float32"}
    adam = model.checkpoint_state()["optimizer"][1][0]
    assert _dtypes(adam.mu) == {"bfloat16"} and _dtypes(adam.count) == {"int32"}


class Recorder(nnx.Module):
    """A Linear that records, at trace time, the dtypes its input and kernel arrive in."""

    seen: list = []

    def __init__(self):
        self.kernel = nnx.Param(jnp.full((12, 4), 0.1))

    def __call__(self, x):
        Recorder.seen.append((str(x.dtype), str(self.kernel[...].dtype)))
        return x @ self.kernel[...]


@pytest.mark.parametrize(("name", "compute", "out"), [("32", "float32", "float32"), ("bf16-mixed", "bfloat16", "float32"),
                                                      ("bf16-true", "bfloat16", "bfloat16")])
def test_forward_runs_in_the_compute_dtype(jax_strategy, name, compute, out):
    x, y = dataset(64)
    Recorder.seen = []
    model = Model(Recorder(), optimizer=optax.sgd(0.1))
    model.fit(x, y, batch_size=16, strategy=jax_strategy(data=8, precision=name), verbose=0)
    predictions = model.predict(x, batch_size=16)
    assert set(Recorder.seen) == {(compute, compute)}  # train and eval steps both traced
    assert str(predictions.dtype) == out  # handed back in the parameters' dtype


def test_the_gradient_reduction_runs_in_the_reduce_dtype(jax_strategy):
    # Per-device gradients 1 + d * 2^-10 (d = 0..7) are not bfloat16 numbers: reduced in
    # bfloat16 each is 1.0 first (bfloat16 has 8 significant bits), so the mean is exactly 1;
    # reduced in float32 the mean is 1 + 3.5 * 2^-10. The result keeps the gradients' dtype.
    grads = jnp.asarray(1 + np.arange(8, dtype=np.float32) * 2.0 ** -10)
    means = {}
    for reduce in ("float32", "bfloat16"):
        strategy = jax_strategy(data=8, precision=pp.PrecisionPolicy(reduce_dtype=reduce))
        mesh = runtime_for(strategy).mesh
        mapped = jax.jit(jax.shard_map(lambda g, s=strategy: sync_grads(s, {"w": g})["w"], mesh=mesh,
                                       in_specs=P("data"), out_specs=P(), axis_names={"data"}))
        means[reduce] = mapped(grads)
    assert means["float32"].dtype == means["bfloat16"].dtype == jnp.float32
    assert float(means["float32"][0]) == pytest.approx(1 + 3.5 * 2.0 ** -10, abs=1e-7)
    assert float(means["bfloat16"][0]) == 1.0


def test_precision_32_equals_no_precision_at_float32(jax_strategy):
    none = fit(dict(data=8))
    thirty_two = fit(dict(data=8, precision="32"))
    assert max_diff(none["params"], thirty_two["params"]) == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["bf16-mixed", pytest.param("bf16-true", marks=pytest.mark.slow)])
def test_bfloat16_at_data2_equals_one_process_within_the_stated_tolerance(name):
    # Both runs in processes of their own: 2 CPU devices at data=2, 1 device at data=1, the
    # same precision, global batch, data order and seed; BatchNorm synchronised.
    one = fit_in_process(1, dict(data=1, precision=name), batch_norm=True)
    two = fit_in_process(2, dict(data=2, precision=name), batch_norm=True)
    assert one["param_dtypes"] == two["param_dtypes"] == ["bfloat16" if name == "bf16-true" else "float32"]
    assert max_diff(one["params"], two["params"]) <= BF16_TOLERANCE[name]
    np.testing.assert_allclose(one["history"]["loss"], two["history"]["loss"], atol=1e-3)
    # And it did compute in bfloat16: float32 at data=1 is farther away than float32 noise.
    reference = fit(None, batch_norm=True)
    assert max_diff(one["params"], reference["params"]) > 1e-4


def _memory(strategy):
    x, y = dataset(64)
    model = Model(small_mlp(hidden=256), optimizer=optax.adam(1e-3))
    model.fit(x, y, batch_size=16, strategy=strategy, verbose=0)
    params = nnx.state(model.module, nnx.Param)
    grads = jax.eval_shape(lambda p: jax.grad(lambda q: sum(jnp.sum(v) for v in jax.tree.leaves(q)))(p), params)
    sizes = {"params": precision.bytes_per_device(params),
             "grads": sum(np.dtype(g.dtype).itemsize * g.size for g in jax.tree.leaves(grads)),  # param-shaped, param dtype
             "optimizer": precision.bytes_per_device(model.checkpoint_state()["optimizer"])}
    return sizes | {"total": sum(sizes.values())}


def test_bf16_true_halves_the_memory_of_parameters_gradients_and_optimizer_state(jax_strategy):
    # Per device at data=8 (all replicated): parameters, their gradients (parameter-shaped, in
    # the parameters' dtype) and Adam's state (two moments and a step count).
    full = _memory(jax_strategy(data=8, precision="32"))
    half = _memory(jax_strategy(data=8, precision="bf16-true"))
    print(f"\nper device, bytes: 32 {full}; bf16-true {half}")
    assert half["params"] * 2 == full["params"] and half["grads"] * 2 == full["grads"]
    assert half["optimizer"] * 2 == full["optimizer"] + 4  # the int32 step count stays 4 bytes
    assert half["total"] / full["total"] == pytest.approx(0.5, abs=1e-4)


def test_the_runtimes_own_operations_map_their_part_for_a_hand_written_loop(jax_strategy):
    # wrap_model keeps the parameters in param_dtype and hands out the optimizer that keeps its
    # state in optimizer_dtype; for_compute casts for the forward; sync_grads reduces (above).
    strategy = jax_strategy(data=4, tensor=2, precision=pp.PrecisionPolicy(param_dtype="bfloat16", compute_dtype="bfloat16",
                                                                           optimizer_dtype="float32"))
    wrapped = strategy.wrap_model(small_mlp())
    params = nnx.state(wrapped.module, nnx.Param)
    assert _dtypes(params) == {"bfloat16"}
    adam = wrapped.init_optimizer(wrapped.optimizer(optax.adam(1e-3)), params)[0]
    assert _dtypes(adam.mu) == {"float32"}
    assert _dtypes(precision.for_compute({"x": jnp.ones(3), "ids": jnp.ones(3, jnp.int32)}, strategy.precision)) == {
        "bfloat16", "int32"}
    tx = optax.adam(1e-3)
    assert jax_strategy(data=8).wrap_model(small_mlp()).optimizer(tx) is tx  # no precision: the optimizer itself
