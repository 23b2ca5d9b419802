"""Model.fit / evaluate / predict / save under strategies, against single-device references."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import polyparallel as pp
from polyparallel_jax import Model
from polyparallel_jax.conformance import dataset, small_mlp


def _fit(strategy, **kwargs):
    x, y = dataset(200)
    model = Model(small_mlp(), optimizer=kwargs.pop("optimizer", optax.adam(1e-2)), metrics=["accuracy"])
    history = model.fit(x, y, epochs=kwargs.pop("epochs", 2), batch_size=32, strategy=strategy, verbose=0, **kwargs)
    return model, history


def _stats(model):
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model.module, nnx.BatchStat))}


def test_history_and_evaluate_match_single_device(jax_strategy):
    single, h1 = _fit(None)
    parallel, h2 = _fit(jax_strategy(data=4, tensor=2))
    np.testing.assert_allclose(h1["loss"], h2["loss"], atol=1e-5)
    np.testing.assert_allclose(h1["accuracy"], h2["accuracy"], atol=1e-6)
    x, y = dataset(203)  # evaluation counts every sample once, whatever the remainder
    e1, e2 = single.evaluate(x, y, batch_size=24), parallel.evaluate(x, y, batch_size=24)
    assert e1 == pytest.approx(e2, abs=1e-5)
    np.testing.assert_allclose(single.predict(x, batch_size=24), parallel.predict(x, batch_size=24), atol=1e-5)
    kernel = nnx.state(parallel.module, nnx.Param)["l1"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    mu = parallel._opt_state[0].mu["l1"]["kernel"][...]
    assert mu.sharding.spec == kernel.sharding.spec, "Adam's moments must be sharded like the parameter"


def test_uneven_fit_history_weights_batches_by_real_rows(jax_strategy):
    # lr=0 and no BatchNorm: the model is the same function at every step, so the epoch's loss
    # must equal evaluate() on the same data; weighting batches by rows including the mask-0
    # padding of remainder="uneven" (37 samples over data=8) makes them differ.
    x, y = dataset(37)
    model = Model(small_mlp(batch_norm=False), optimizer=optax.sgd(0.0), metrics=["accuracy"])
    strategy = jax_strategy(data=8, data_policy=pp.DataPolicy(remainder="uneven"))
    history = model.fit(x, y, epochs=1, batch_size=16, strategy=strategy, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=16)
    assert history["loss"][0] == pytest.approx(evaluated["loss"], abs=1e-6)
    assert history["accuracy"][0] == pytest.approx(evaluated["accuracy"], abs=1e-6)


def test_local_batch_stats_differ_and_eval_sync_recovers_global(jax_strategy):
    # lr=0: parameters stay fixed, so the single-device running mean is the EMA of global batch
    # means, which the average of per-device EMAs of local batch means must equal exactly.
    single, _ = _fit(None, optimizer=optax.sgd(0.0))
    strategy = jax_strategy(data=8, state_policy={"batch_stats*": "local"})
    local, _ = _fit(strategy, optimizer=optax.sgd(0.0))
    per_device = np.asarray(local.batch_stats_per_device["bn"]["mean"][...])
    assert per_device.shape[0] == 8 and np.abs(per_device - per_device.mean(0)).max() > 1e-3
    np.testing.assert_allclose(_stats(local)[("bn", "mean")], _stats(single)[("bn", "mean")], atol=1e-5)


@pytest.mark.parametrize("refit", [dict(data=4, tensor=2, state_policy={"batch_stats*": "local"}),
                                   dict(data=8)], ids=["local-data4xtensor2", "mean-data8"])
def test_local_batch_stats_are_averaged_and_dropped_when_the_strategy_changes(jax_strategy, refit):
    # lr=0, as above: the single-device running mean after two fits is the EMA of global batch
    # means, and so is the average of per-device EMAs if a new strategy starts every device from
    # the average of the old per-device copies. 8 per-device rows put into 4 devices (each keeping
    # the first of its pair), or kept under the "mean" policy, start from something else.
    x, y = dataset(200)
    single = Model(small_mlp(), optimizer=optax.sgd(0.0))
    single.fit(x, y, epochs=1, batch_size=32, verbose=0)
    single.fit(x, y, epochs=1, batch_size=32, verbose=0)
    model = Model(small_mlp(), optimizer=optax.sgd(0.0))
    model.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=8, state_policy={"batch_stats*": "local"}),
              verbose=0)
    model.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(**refit), verbose=0)
    per_device = model.batch_stats_per_device
    if "state_policy" in refit:
        assert np.asarray(per_device["bn"]["mean"][...]).shape[0] == 4  # one row per data coordinate now
    else:
        assert per_device is None  # synchronised BatchNorm keeps no per-device copies
    np.testing.assert_allclose(_stats(model)[("bn", "mean")], _stats(single)[("bn", "mean")], atol=1e-5)


def test_mean_policy_batch_stats_equal_single_device(jax_strategy):
    single, _ = _fit(None)
    parallel, _ = _fit(jax_strategy(data=8))
    for key, value in _stats(single).items():
        np.testing.assert_allclose(np.asarray(_stats(parallel)[key]), value, atol=1e-5)


def test_save_and_load_restore_parameters_and_optimizer(jax_strategy, tmp_path):
    model, _ = _fit(jax_strategy(data=8), epochs=1)
    path = model.save(str(tmp_path / "ckpt"))
    x, y = dataset(200)
    before = model.evaluate(x, y, batch_size=40)
    other = Model(small_mlp(seed=5), optimizer=optax.adam(1e-2), metrics=["accuracy"])
    other.load(path)
    assert other.evaluate(x, y, batch_size=40, strategy=jax_strategy(data=8)) == pytest.approx(before, abs=1e-6)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    other.fit(x, y, epochs=1, batch_size=32, verbose=0)  # resumes with the restored Adam moments
    assert other.history["loss"][-1] == pytest.approx(model.history["loss"][-1], abs=1e-5)


def test_progress_bar_prints_final_line_and_can_be_disabled(jax_strategy, capsys):
    x, y = dataset(64)
    model = Model(small_mlp(), metrics=["accuracy"])
    model.fit(x, y, epochs=1, batch_size=16, strategy=jax_strategy(data=8), verbose=1)
    assert "epoch 1/1" in capsys.readouterr().err
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("parallel", [False, True], ids=["one-device", "data=8"])
def test_the_users_module_keeps_its_batch_norm_axis_name_and_mode(jax_strategy, parallel):
    module = small_mlp()
    module.bn.axis_name = "batch"  # the user's own vmap/pmap axis
    module.eval()
    model = Model(module, optimizer=optax.adam(1e-2), metrics=["accuracy"])
    x, y = dataset(64)
    model.fit(x, y, epochs=1, batch_size=16, strategy=jax_strategy(data=8) if parallel else None, verbose=0)
    model.evaluate(x, y, batch_size=16)
    model.predict(x, batch_size=16)
    assert module.bn.axis_name == "batch" and module.bn.use_running_average is True
    # A plain use of flax afterwards: the user's axis synchronises the batch statistics, so two
    # halves mapped over it normalise like the whole batch at once.
    module.train()
    graphdef, state = nnx.split(module)
    halves = jax.vmap(lambda st, h: nnx.merge(graphdef, st)(h), in_axes=(None, 0),
                      axis_name="batch")(state, x[:32].reshape(2, 16, -1))
    whole = nnx.merge(graphdef, state)
    whole.bn.axis_name = None
    np.testing.assert_allclose(np.asarray(halves).reshape(32, -1), np.asarray(whole(x[:32])), atol=1e-5)


# -- bad input: clear errors before anything is compiled -----------------------------------------


def test_partition_rule_matching_nothing(jax_strategy):
    model = Model(small_mlp(), plan=[("decoder/kernel", (None, "tensor"))])
    x, y = dataset(64)
    with pytest.raises(ValueError, match=r"decoder/kernel.*match no parameter.*l1/kernel"):
        model.fit(x, y, batch_size=16, strategy=jax_strategy(data=4, tensor=2), verbose=0)


def test_partition_rule_that_does_not_divide(jax_strategy):
    model = Model(small_mlp(classes=3), plan=[("l3/kernel", (None, "tensor"))])
    x, y = dataset(64, classes=3)
    with pytest.raises(ValueError, match=r"l3/kernel.*\(16, 3\).*not a multiple of 2"):
        model.fit(x, y, batch_size=16, strategy=jax_strategy(data=4, tensor=2), verbose=0)


def test_axis_size_that_does_not_fit_the_devices(plugin_manager):
    x, y = dataset(64)
    with pytest.raises(pp.TopologyError, match=r"does not fit the 8 JAX device.*xla_force_host_platform_device_count"):
        Model(small_mlp()).fit(x, y, batch_size=16, strategy=pp.Strategy(data=3, tensor=2, plugin_manager=plugin_manager))


def test_batch_size_not_divisible_by_data_axis(jax_strategy):
    x, y = dataset(64)
    with pytest.raises(ValueError, match=r"global batch size 30 does not divide over data=8 ranks .*Use a multiple of 8"):
        Model(small_mlp()).fit(x, y, batch_size=30, strategy=jax_strategy(data=8), verbose=0)


def test_pipeline_axis_refused(plugin_manager):
    x, y = dataset(64)
    with pytest.raises(pp.UnsupportedTopologyError, match="pipeline=2"):
        Model(small_mlp()).fit(x, y, batch_size=16, strategy=pp.Strategy(data=4, pipeline=2, plugin_manager=plugin_manager))


def test_adapter_builds_a_bound_model(plugin_manager):
    strategy = pp.Strategy(data=8, plugin_manager=plugin_manager)
    for name in ("jax", "elegy"):
        model = strategy.adapt(name, module=small_mlp())
        assert isinstance(model, Model) and model.strategy is strategy
