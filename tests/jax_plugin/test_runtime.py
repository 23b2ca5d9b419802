"""polyparallel_jax.runtime: a Topology as a jax Mesh; device-count errors; strategy marking."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import polyparallel as pp
from polyparallel_jax import runtime as rt
from polyparallel_jax.runtime import JaxRuntime


@pytest.mark.parametrize("sizes, shape", [(dict(data=8), (1, 8, 1)), (dict(data=4, tensor=2), (1, 4, 2)),
                                          (dict(data=-1, tensor=2), (1, 4, 2)), (dict(tensor=8), (1, 1, 8))])
def test_mesh_axis_names_and_shape_follow_the_topology(jax_strategy, sizes, shape):
    runtime = JaxRuntime.build(jax_strategy(**sizes))
    assert runtime.mesh.axis_names == ("pipeline", "data", "tensor")
    assert runtime.mesh.devices.shape == shape
    assert runtime.topology.shape == shape and runtime.data_size == shape[1]
    assert tuple(runtime.mesh.axis_types) == (AxisType.Auto,) * 3  # plain jnp code is partitioned by GSPMD
    assert sorted(d.id for d in runtime.mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_shardings_and_data_coordinates(jax_strategy):
    runtime = JaxRuntime.build(jax_strategy(data=4, tensor=2, timeout=7.0))
    assert runtime.timeout == 7.0
    assert runtime.sharding("data").spec == P("data") and runtime.sharding("data").mesh is runtime.mesh
    assert runtime.replicated.spec == P()
    assert runtime.local_data_coords() == [0, 1, 2, 3]  # one process holds every data coordinate
    assert runtime.representative_processes() == [0]


def test_single_device_runtime():
    runtime = JaxRuntime.single()
    assert runtime.mesh.devices.shape == (1, 1, 1) and runtime.data_size == 1
    assert runtime.mesh.devices.flat[0] == jax.local_devices()[0]


@pytest.mark.parametrize("sizes", [dict(data=3, tensor=2), dict(data=16), dict(data=-1, tensor=3)])
def test_axis_sizes_that_do_not_fit_the_device_count(sizes):
    with pytest.raises(pp.TopologyError, match=r"does not fit the 8 JAX device\(s\) \(1 process\(es\) x 8 cpu "
                                               r"device\(s\)\).*xla_force_host_platform_device_count=N"):
        rt.resolve_for_devices(pp.Topology(**sizes))


def test_build_raises_the_same_error(jax_strategy):
    with pytest.raises(pp.TopologyError, match="does not fit the 8 JAX device"):
        JaxRuntime.build(jax_strategy(data=3, tensor=2))


def test_resolve_infers_the_free_axis():
    assert rt.resolve_for_devices(pp.Topology(data=-1, tensor=2)).sizes == {"pipeline": 1, "data": 4, "tensor": 2}


def test_runtime_is_made_once_per_session(jax_strategy):
    strategy = jax_strategy(data=8)
    first = rt.runtime_for(strategy)
    assert rt.runtime_for(strategy) is first and rt.runtime_for(strategy, strategy.session()) is first


def test_process_info_counts_devices():
    info = rt.process_info()
    assert (info.rank, info.world_size, info.local_rank) == (0, 8, 0)


def test_jax_strategy_marking(plugin_manager):
    plain = pp.Strategy(data=8, plugin_manager=plugin_manager)
    assert rt.is_jax_strategy(plain)  # the automatic choice: JAX is the only runtime of this manager
    marked = rt.as_jax_strategy(plain)
    assert marked.runtime == "jax" and marked.backend is None
    assert rt.is_jax_strategy(marked) and rt.as_jax_strategy(marked) is marked
    assert not rt.is_jax_strategy(plain.replace(runtime="torch"))
    with pytest.raises(ValueError, match=r"A JAX model runs on the JAX runtime\. Received: "
                                         r"Strategy\(runtime='torch'\)\. Use Strategy\(runtime='jax'\)"):
        rt.as_jax_strategy(plain.replace(runtime="torch"))
    with pytest.raises(pp.TopologyError, match=r"it has no backend to choose, so backend must be None"):
        marked.replace(backend="gloo").session()
    with pytest.raises(TypeError, match="Received: dict"):
        rt.as_jax_strategy({"data": 8})


def test_ensure_distributed(monkeypatch):
    monkeypatch.delenv(rt.ENV_COORDINATOR, raising=False)
    rt.ensure_distributed()  # a single process: nothing to join
    assert not jax.distributed.is_initialized()
    monkeypatch.setenv(rt.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(rt.ENV_NUM_PROCESSES, "two")
    monkeypatch.setenv(rt.ENV_PROCESS_ID, "0")
    with pytest.raises(pp.TopologyError, match=r"POLYPARALLEL_JAX_NUM_PROCESSES='two'"):
        rt.ensure_distributed()
