"""The JAX conformance kit at data=8 and data=4 x tensor=2 on 8 CPU devices (one process)."""

from __future__ import annotations

import time

import pytest

import polyparallel as pp
from polyparallel_jax import conformance

TOPOLOGIES = [pytest.param(dict(data=8), id="data8"), pytest.param(dict(data=4, tensor=2), id="data4xtensor2")]


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_shards_disjoint_complete_and_replicas_identical(jax_strategy, sizes):
    report = conformance.check_shards(jax_strategy(**sizes), n=203, batch_size=16)
    assert sum(report["shard_sizes"]) == 203


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_sync_grads_equals_single_device_gradient(jax_strategy, sizes):
    assert conformance.check_grads_match_single(jax_strategy(**sizes)) < 1e-5


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_metrics_reduce_exactly(jax_strategy, sizes):
    report = conformance.check_metrics_exact(jax_strategy(**sizes))
    assert report["in_program"] == pytest.approx(report["expected"], abs=1e-5)


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_states_synced_per_policy(jax_strategy, sizes):
    conformance.check_states_synced(jax_strategy(**sizes))


@pytest.mark.parametrize("sizes", TOPOLOGIES)
def test_training_equals_single_device(jax_strategy, sizes):
    assert conformance.check_training_matches_single(jax_strategy(**sizes)) < 1e-5


def _must_not_run() -> None:
    raise AssertionError("launch() started a process for a topology the runtime refuses")


def test_unsupported_topology_refused_before_launch(plugin_manager):
    message = conformance.check_unsupported_topology(plugin_manager)
    assert "pipeline=2" in message
    begin = time.perf_counter()
    with pytest.raises(pp.UnsupportedTopologyError):
        pp.launch(_must_not_run, pp.Strategy(data=1, pipeline=2, runtime="jax", plugin_manager=plugin_manager),
                  nprocs=2, runtime="jax")
    assert time.perf_counter() - begin < 2.0, "refused only after starting processes"
