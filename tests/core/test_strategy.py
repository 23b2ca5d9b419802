"""``polyparallel/_strategy.py``: the value users build, its validation and its dispatch."""

from __future__ import annotations

import pickle
import types
from typing import Any

import pytest

import polyparallel as pp
from polyparallel import AXES, DataPolicy, GradPolicy, MetricPolicy, StatePolicy, Strategy, Topology


class Box:
    """A type no real plugin owns: only :class:`BoxPlugin` answers for it."""

    def __init__(self, payload: Any = None):
        self.payload = payload


class BoxPlugin:
    """Implements the five operations for :class:`Box` and records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _answer(self, operation: str, subject: Any, **kwargs: Any) -> Any:
        if not isinstance(subject, Box) and not (isinstance(subject, dict) and subject.get("box")):
            return None
        self.calls.append((operation, kwargs))
        return (operation, subject)

    @pp.hookimpl
    def polyparallel_shard_data(self, strategy, session, data, policy):
        return self._answer("shard_data", data, strategy=strategy, session=session, policy=policy)

    @pp.hookimpl
    def polyparallel_wrap_model(self, strategy, session, model, options):
        return self._answer("wrap_model", model, strategy=strategy, session=session, options=options)

    @pp.hookimpl
    def polyparallel_sync_grads(self, strategy, session, target):
        return self._answer("sync_grads", target, strategy=strategy, session=session)

    @pp.hookimpl
    def polyparallel_reduce_metrics(self, strategy, session, metrics):
        return self._answer("reduce_metrics", metrics, strategy=strategy, session=session)

    @pp.hookimpl
    def polyparallel_sync_states(self, strategy, session, states):
        return self._answer("sync_states", states, strategy=strategy, session=session)


class TargetsPlugin:
    """Declares two runtimes and registers adapters whose factories record their calls."""

    def __init__(self) -> None:
        self.built: list[tuple[str, Strategy, dict[str, Any]]] = []

    @pp.hookimpl
    def polyparallel_capabilities(self):
        return [pp.Capabilities("fakeruntime", axes={"data", "tensor"}, features={"no_sync"}, backends={"ring"},
                                priority=1),
                pp.Capabilities("otherruntime", axes={"data"}, priority=0)]

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        def factory(name):
            def build(strategy, **kwargs):
                self.built.append((name, strategy, kwargs))
                return types.SimpleNamespace(adapter=name, strategy=strategy, **kwargs)
            return build
        register("dataonly", factory("dataonly"), capabilities=pp.Capabilities("dataonly", axes={"data"}))
        register("everything", factory("everything"), capabilities=pp.Capabilities("everything", axes=set(AXES)))
        register("onother", factory("onother"), capabilities=pp.Capabilities("onother", runtimes={"otherruntime"}))


@pytest.fixture
def boxes(manager):
    plugin = BoxPlugin()
    manager.register(plugin, name="boxes")
    return plugin


@pytest.fixture
def targets(manager):
    plugin = TargetsPlugin()
    manager.register(plugin, name="targets")
    return plugin


# -- construction ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "sizes"), [
    ({}, {"pipeline": 1, "data": -1, "tensor": 1}),  # data inferred from the world size
    ({"tensor": 2}, {"pipeline": 1, "data": -1, "tensor": 2}),
    ({"data": 2}, {"pipeline": 1, "data": 2, "tensor": 1}),
    ({"tensor": -1, "pipeline": 2}, {"pipeline": 2, "data": 1, "tensor": -1}),  # -1 elsewhere: data is 1
    ({"data": -1, "tensor": 2, "pipeline": 1}, {"pipeline": 1, "data": -1, "tensor": 2}),
    ({"topology": Topology(data=2, tensor=2)}, {"pipeline": 1, "data": 2, "tensor": 2}),
])
def test_topology_from_sizes(kwargs, sizes):
    assert Strategy(**kwargs).topology.sizes == sizes


def test_positional_sizes_are_data_tensor_pipeline():
    assert Strategy(2, 4, 1).topology == Topology(data=2, tensor=4, pipeline=1)


def test_defaults():
    s = Strategy()
    assert (s.timeout, s.seed, s.backend, s.runtime) == (60.0, 0, None, None)
    assert (s.data_policy, s.grad_policy, s.metric_policy, s.state_policy) == (
        DataPolicy(), GradPolicy(), MetricPolicy(), StatePolicy())


def test_batch_size_shortcut():
    assert Strategy(batch_size=64).data_policy == DataPolicy(batch_size=64)
    # batch_size= overrides the policy's, keeping its other fields.
    s = Strategy(batch_size=32, data_policy=DataPolicy(batch_size=8, shuffle=False, remainder="drop"))
    assert s.data_policy == DataPolicy(batch_size=32, shuffle=False, remainder="drop")


def test_state_policy_from_a_mapping():
    assert Strategy(state_policy={"encoder.*": "local"}).state_policy == StatePolicy({"encoder.*": "local"})


def test_timeout_is_a_float():
    s = Strategy(timeout=5)
    assert s.timeout == 5.0 and isinstance(s.timeout, float)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"timeout": 0}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number of seconds\. Received: 0\."),
    ({"timeout": -1.0}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number .* Received: -1\.0\."),
    ({"timeout": float("inf")}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number .* Received: inf\."),
    ({"timeout": float("nan")}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number .* Received: nan\."),
    ({"timeout": True}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number .* Received: True\."),
    ({"timeout": "60"}, pp.TopologyError, r"Strategy\(timeout=\) must be a positive number .* Received: '60'\."),
    ({"seed": 1.5}, pp.TopologyError, r"Strategy\(seed=\) must be an int\. Received: 1\.5\."),
    ({"seed": True}, pp.TopologyError, r"Strategy\(seed=\) must be an int\. Received: True\."),
    ({"seed": "0"}, pp.TopologyError, r"Strategy\(seed=\) must be an int\. Received: '0'\."),
    ({"backend": 3}, pp.TopologyError, r"Strategy\(backend=\) must be a name \(a non-empty string\) or None\. "
                                       r"Received: 3\."),
    ({"backend": ""}, pp.TopologyError, r"Strategy\(backend=\) must be a name .* Received: ''\."),
    ({"backend": "jax"}, pp.TopologyError, r"Strategy\(backend='jax'\) is not a communication backend: JAX is a "
                                           r"runtime\. Use Strategy\(runtime='jax'\) and leave backend=None\."),
    ({"runtime": 1}, pp.TopologyError, r"Strategy\(runtime=\) must be a name .* Received: 1\."),
    ({"runtime": "to rch"}, pp.TopologyError, r"Strategy\(runtime=\) must be a name .* Received: 'to rch'\."),
    ({"plugin_manager": "default"}, pp.TopologyError,
     r"Strategy\(plugin_manager=\) must be a polyparallel\.PluginManager or None\. Received: str\."),
    ({"data": 4, "batch_size": 10}, pp.TopologyError,
     r"Strategy: the global batch size 10 does not divide over data=4 ranks .* Use a multiple of 4 \(8 or 12\)"),
    ({"data_policy": "shuffle", "batch_size": 8}, pp.TopologyError, r"Strategy\(data_policy=\) must be a DataPolicy\."),
    ({"data": 2, "topology": Topology(data=2)}, pp.TopologyError,
     r"Strategy takes axis sizes or topology=, not both\. Received \{'data': 2\} and Topology\("),
    ({"topology": {"data": 2}}, pp.TopologyError, r"Strategy\(topology=\) must be a Topology\. Received: dict\."),
    ({"data_policy": GradPolicy()}, pp.TopologyError, r"Strategy\(data_policy=\) must be a DataPolicy\. Received: GradPolicy"),
    ({"grad_policy": "sum"}, pp.TopologyError, r"Strategy\(grad_policy=\) must be a GradPolicy\. Received: 'sum'\."),
    ({"grad_policy": ""}, pp.TopologyError, r"Strategy\(grad_policy=\) must be a GradPolicy\. Received: ''\."),
    ({"metric_policy": {"op": "sum"}}, pp.TopologyError, r"Strategy\(metric_policy=\) must be a MetricPolicy\."),
    ({"state_policy": [("*", "local")]}, pp.TopologyError, r"Strategy\(state_policy=\) must be a StatePolicy\."),
    ({"data": 0}, pp.TopologyError, r"axis 'data' must be a positive size or -1"),
    ({"data": 2.5}, pp.TopologyError, r"axis 'data' must be an int"),
    ({"tensor": -1, "pipeline": -1}, pp.TopologyError, r"At most one topology axis may be -1"),
    ({"batch_size": 0}, ValueError, r"DataPolicy\.batch_size must be a positive int or None\. Received: 0\."),
    ({"state_policy": {"bn.*": "avg"}}, ValueError, r"StatePolicy action for 'bn\.\*' must be one of"),
])
def test_invalid_strategy(kwargs, error, message):
    with pytest.raises(error, match=message):
        Strategy(**kwargs)


# -- value semantics -------------------------------------------------------------------------------------


def full_strategy(**extra: Any) -> Strategy:
    return Strategy(data=2, tensor=2, pipeline=2, timeout=12.5, seed=7, backend="gloo", runtime="torch",
                    data_policy=DataPolicy(batch_size=64, shuffle=False, remainder="uneven"),
                    grad_policy=GradPolicy(op="sum", bucket_mb=4.0),
                    metric_policy=MetricPolicy("sum", {"acc": "mean"}),
                    state_policy=StatePolicy({"encoder.*": "local"}, default="mean"), **extra)


def test_equality_and_hash_ignore_the_plugin_manager():
    one, two = pp.PluginManager(autoload=False), pp.PluginManager(autoload=False)
    a, b = full_strategy(plugin_manager=one), full_strategy(plugin_manager=two)
    assert a == b and hash(a) == hash(b)
    assert a.plugin_manager is one and b.plugin_manager is two
    assert {a: "session"}[b] == "session"
    assert a != full_strategy().replace(seed=8)
    assert a != "Strategy"


@pytest.mark.parametrize("make", [Strategy, full_strategy], ids=["default", "full"])
def test_pickle_round_trip_leaves_the_plugin_manager_behind(make, manager):
    strategy = make(plugin_manager=manager)
    clone = pickle.loads(pickle.dumps(strategy))
    assert clone == strategy and hash(clone) == hash(strategy) and repr(clone) == repr(strategy)
    for field in ("topology", "timeout", "seed", "backend", "runtime", "data_policy", "grad_policy", "metric_policy",
                  "state_policy"):
        assert getattr(clone, field) == getattr(strategy, field)
    assert clone.plugin_manager is pp.get_plugin_manager()  # each process has its own


def test_immutable():
    s = Strategy(data=2)
    with pytest.raises(AttributeError, match=r"Strategy is immutable; use strategy\.replace\(timeout=\.\.\.\)"):
        s.timeout = 1.0
    with pytest.raises(AttributeError, match="immutable"):
        s.anything = 1
    with pytest.raises(AttributeError, match="immutable"):
        del s.timeout
    with pytest.raises(AttributeError, match="immutable"):
        del s.topology
    assert s.timeout == 60.0 and s.topology == Topology(data=2)


def test_replace(manager):
    s = full_strategy(plugin_manager=manager)
    r = s.replace(data=4, timeout=30.0)
    assert r.topology == Topology(data=4, tensor=2, pipeline=2) and r.timeout == 30.0
    assert (r.seed, r.data_policy, r.state_policy) == (s.seed, s.data_policy, s.state_policy)
    assert r.plugin_manager is manager
    assert s.topology == Topology(data=2, tensor=2, pipeline=2) and s.timeout == 12.5  # unchanged
    assert s.replace(tensor=-1).topology.sizes == {"pipeline": 2, "data": 2, "tensor": -1}
    assert s.replace(grad_policy=GradPolicy()).grad_policy == GradPolicy()
    assert s.replace(topology=Topology()).topology == Topology()
    assert s.replace() == s


def test_replace_validates():
    s = Strategy(data=2)
    with pytest.raises(TypeError, match=r"Strategy\.replace\(\) got unknown fields \['batch', 'plugin'\]; expected"):
        s.replace(batch=1, plugin=None)
    with pytest.raises(pp.TopologyError, match=r"Strategy\(timeout=\) must be a positive number"):
        s.replace(timeout=0)
    with pytest.raises(pp.TopologyError, match="At most one topology axis may be -1"):
        s.replace(data=-1, tensor=-1)
    with pytest.raises(pp.TopologyError, match=r"Strategy\.replace\(\) takes axis sizes or topology=, not both"):
        s.replace(topology=Topology(tensor=2), data=2)


def test_repr():
    assert repr(Strategy(tensor=2, timeout=30, seed=3)) == "Strategy(pipeline=1, data=-1, tensor=2, timeout=30, seed=3)"
    assert repr(Strategy(data=2, runtime="torch", backend="gloo")) == (
        "Strategy(pipeline=1, data=2, tensor=1, timeout=60, seed=0, runtime='torch', backend='gloo')")


def test_runtime_and_backend_are_separate_parts_of_the_value():
    s = Strategy(data=2, runtime="jax")
    assert (s.runtime, s.backend) == ("jax", None)
    assert s != Strategy(data=2) and s == Strategy(data=2, runtime="jax") and hash(s) == hash(s.replace())
    assert s.replace(runtime=None) == Strategy(data=2)
    assert Strategy(backend="nccl").runtime is None  # a backend never names the runtime


def test_replace_batch_size_is_checked_against_the_data_axis():
    s = Strategy(data=4, batch_size=8, data_policy=DataPolicy(shuffle=False))
    assert s.replace(batch_size=16).data_policy == DataPolicy(batch_size=16, shuffle=False)
    with pytest.raises(pp.TopologyError, match="the global batch size 8 does not divide over data=3 ranks"):
        s.replace(data=3)
    assert Strategy(data=-1, batch_size=10).data_policy.batch_size == 10  # checked once the world is known


def test_replace_batch_size_none_drops_the_global_batch():
    # Before: batch_size=None meant "not given" inside replace, so the old 64 stayed.
    s = Strategy(data=2, batch_size=64)
    assert s.replace(batch_size=None).data_policy.batch_size is None
    assert s.replace(batch_size=None) == Strategy(data=2)
    assert s.replace(batch_size=None, data_policy=DataPolicy(shuffle=True)).data_policy == DataPolicy(shuffle=True)
    assert s.replace(batch_size=8, data_policy=DataPolicy(shuffle=True)).data_policy == DataPolicy(batch_size=8, shuffle=True)
    assert s.replace(seed=1).data_policy.batch_size == 64  # untouched unless named


def test_replace_keeps_the_runtime_the_launching_process_chose(manager, monkeypatch):
    # Before: a strategy unpickled in a launched process carried its parent's runtime choice, but
    # strategy.replace(...) dropped it, so the copy could choose another runtime there.
    import pickle

    from polyparallel import _manager

    class Runtime:
        def __init__(self, name, priority):
            self.caps = pp.Capabilities(name, priority=priority)

        @pp.hookimpl
        def polyparallel_capabilities(self):
            return self.caps

    manager.register(Runtime("a", 1), name="a-plugin")
    parent = Strategy(plugin_manager=manager)
    assert parent.resolve_runtime() == "a"
    child_pm = pp.PluginManager(autoload=False)  # the child would choose b by itself
    child_pm.register(Runtime("a", 1), name="a-plugin")
    child_pm.register(Runtime("b", 2), name="b-plugin")
    monkeypatch.setattr(_manager, "_default", child_pm)
    child = pickle.loads(pickle.dumps(parent))
    assert child.resolve_runtime() == "a"
    assert child.replace(seed=5).resolve_runtime() == "a"
    assert child.replace(timeout=5.0, batch_size=4).resolve_runtime() == "a"
    assert child.replace(runtime="b").resolve_runtime() == "b"  # an explicit choice wins
    assert child.replace(backend="tree")._runtime_hint is None  # another backend: chosen again


def test_precision_and_accumulate_are_part_of_the_value():
    s = Strategy(data=2, batch_size=64, precision="bf16-mixed", accumulate=2)
    assert s.precision == pp.PrecisionPolicy("bf16-mixed") and s.accumulate == 2 and s.grad_policy.accumulate == 2
    assert s == Strategy(data=2, batch_size=64, precision=pp.PrecisionPolicy(compute_dtype="bfloat16"),
                         grad_policy=pp.GradPolicy(accumulate=2))
    assert s != s.replace(precision=None) and s != s.replace(accumulate=1)
    assert repr(s) == "Strategy(pipeline=1, data=2, tensor=1, timeout=60, seed=0, precision='bf16-mixed', accumulate=2)"
    assert Strategy().precision is None and Strategy().accumulate == 1  # unset: the model's own dtypes, no accumulation
    import pickle

    assert pickle.loads(pickle.dumps(s)) == s and hash(pickle.loads(pickle.dumps(s))) == hash(s)
    assert s.replace(accumulate=4, batch_size=128).accumulate == 4
    assert s.replace(grad_policy=pp.GradPolicy(op="sum"), accumulate=4).grad_policy == pp.GradPolicy(op="sum", accumulate=4)


def test_precision_and_accumulate_are_validated_at_construction():
    with pytest.raises(pp.TopologyError, match=r"Strategy\(precision=\): unknown preset 'bf8'"):
        Strategy(precision="bf8")
    with pytest.raises(pp.TopologyError, match=r"Strategy\(precision=\) must be a preset name .* Received: 16"):
        Strategy(precision=16)
    with pytest.raises(pp.TopologyError, match=r"Strategy\(accumulate=\) must be a positive int"):
        Strategy(accumulate=0)
    with pytest.raises(pp.TopologyError, match=r"accumulate= or grad_policy=GradPolicy\(accumulate=\), not two"):
        Strategy(accumulate=2, grad_policy=pp.GradPolicy(accumulate=3))
    with pytest.raises(pp.TopologyError, match=r"the global batch size 48 does not divide over data=4 ranks x "
                                               r"accumulate=8 micro-batches .* multiple of 32 \(32 or 64\)"):
        Strategy(data=4, batch_size=48, accumulate=8)
    with pytest.raises(pp.TopologyError, match=r"does not divide over accumulate=4 micro-batches"):
        Strategy(batch_size=6, accumulate=4)  # data inferred later: the micro-batches alone must divide it


# -- check and adapt: refuse before anything starts ------------------------------------------------------


def test_check_admits_a_supported_topology(manager, targets):
    Strategy(data=2, tensor=2, plugin_manager=manager).check("fakeruntime")
    Strategy(data=2, pipeline=-1, plugin_manager=manager).check("fakeruntime", world_size=2)  # pipeline=1


def test_check_refuses_an_unsupported_topology(manager, targets):
    s = Strategy(data=2, tensor=2, pipeline=2, plugin_manager=manager)
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"'fakeruntime' \(plugin 'targets'\) cannot run pipeline=2: it supports parallelism "
                             r"along data, tensor only\. Set pipeline=1"):
        s.check("fakeruntime")
    # An inferred axis may be > 1: refused unless the world size pins it to 1.
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot run pipeline=-1"):
        Strategy(data=2, pipeline=-1, plugin_manager=manager).check("fakeruntime")
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot run pipeline=2"):
        Strategy(data=2, pipeline=-1, plugin_manager=manager).check("fakeruntime", world_size=4)


def test_check_knows_adapters_as_targets(manager, targets):
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'dataonly' \(plugin 'targets'\) cannot run tensor=2"):
        Strategy(tensor=2, plugin_manager=manager).check("dataonly")


def test_check_with_a_world_size_that_does_not_fit(manager, targets):
    with pytest.raises(pp.TopologyError, match="needs 4 ranks but the world size is 8"):
        Strategy(data=2, tensor=2, plugin_manager=manager).check("fakeruntime", world_size=8)


def test_check_of_an_unknown_target(manager, targets):
    with pytest.raises(pp.NoPluginError, match=r"No installed plugin provides the target 'jax'\. Known targets: "
                                               r"dataonly, everything, fakeruntime, onother, otherruntime\. Install "
                                               r"its extra: pip install 'polyparallel\[jax\]'\."):
        Strategy(plugin_manager=manager).check("jax")


def test_check_without_a_target_uses_the_chosen_runtime(manager, targets):
    Strategy(data=2, tensor=2, plugin_manager=manager).check()  # fakeruntime: the higher priority
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'otherruntime' \(plugin 'targets'\) cannot run tensor=2"):
        Strategy(data=2, tensor=2, runtime="otherruntime", plugin_manager=manager).check()
    with pytest.raises(pp.TopologyError, match="the global batch size 6 does not divide over data=4 ranks"):
        Strategy(data=-1, batch_size=6, plugin_manager=manager).check(world_size=4)
    with pytest.raises(pp.NoPluginError, match=r"This strategy needs a runtime, but no runtime is installed\. Install one: "
                                               r"pip install 'polyparallel\[torch\]'"):
        Strategy(plugin_manager=pp.PluginManager(autoload=False)).check()


def test_check_a_runtime_target_checks_the_backend_and_the_strategy_runtime(manager, targets):
    Strategy(backend="ring", plugin_manager=manager).check("fakeruntime")
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='ring'\) is not a backend of the runtime "
                                               r"'otherruntime' \(plugin 'targets'\): it has no backend to choose"):
        Strategy(backend="ring", plugin_manager=manager).check("otherruntime")
    with pytest.raises(pp.UnsupportedTopologyError, match=r"Strategy.check\('otherruntime'\) runs on the "
                                                          r"'otherruntime' runtime, but this strategy's runtime is "
                                                          r"'fakeruntime' \(Strategy\(runtime='fakeruntime'\)\)"):
        Strategy(runtime="fakeruntime", plugin_manager=manager).check("otherruntime")


def test_adapt_builds_the_adapter_with_keyword_arguments(manager, targets):
    s = Strategy(data=2, tensor=2, pipeline=2, plugin_manager=manager)
    built = s.adapt("everything", precision="bf16")
    assert (built.adapter, built.strategy, built.precision) == ("everything", s, "bf16")
    assert targets.built == [("everything", s, {"precision": "bf16"})]


def test_adapt_refuses_an_unsupported_topology_before_building(manager, targets):
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'dataonly' \(plugin 'targets'\) cannot run tensor=2"):
        Strategy(data=2, tensor=2, plugin_manager=manager).adapt("dataonly")
    assert targets.built == []


def test_adapt_with_an_unknown_name(manager, targets):
    with pytest.raises(pp.NoPluginError, match=r"No adapter named 'keras' is registered\. Registered adapters: "
                                               r"dataonly, everything, onother\. Install its extra: "
                                               r"pip install 'polyparallel\[keras\]'"):
        Strategy(plugin_manager=manager).adapt("keras")


def test_adapt_with_no_adapter_at_all(manager):
    with pytest.raises(pp.NoPluginError, match="Registered adapters: none"):
        Strategy(plugin_manager=manager).adapt("lightning")


def test_adapt_refuses_a_strategy_whose_runtime_the_adapter_does_not_run_on(manager, targets):
    with pytest.raises(pp.UnsupportedTopologyError, match=(
            r"The adapter 'onother' \(plugin 'targets'\) runs on the 'otherruntime' runtime, but this strategy's "
            r"runtime is 'fakeruntime' \(Strategy\(runtime='fakeruntime'\)\)\. Use Strategy\(runtime='otherruntime'\), "
            r"or runtime=None to choose automatically\.")):
        Strategy(runtime="fakeruntime", plugin_manager=manager).adapt("onother")
    assert targets.built == []


def test_adapt_narrows_the_automatic_runtime_to_the_adapters(manager, targets):
    s = Strategy(data=2, plugin_manager=manager)
    assert s.resolve_runtime() == "fakeruntime"  # the higher priority
    built = s.adapt("onother")
    assert built.strategy == s.replace(runtime="otherruntime")  # pinned: the factory's strategy runs there
    assert built.strategy.plugin_manager is manager
    assert s.adapt("dataonly").strategy is s  # an adapter for any runtime gets the strategy as it is
    explicit = s.replace(runtime="otherruntime")
    assert explicit.adapt("onother").strategy is explicit


# -- the five operations dispatch -----------------------------------------------------------------------


def test_shard_data_dispatches_with_the_policy_and_overrides(manager, boxes):
    s = Strategy(batch_size=8, plugin_manager=manager)
    box = Box()
    assert s.shard_data(box) == ("shard_data", box)
    assert s.shard_data(box, remainder="uneven", shuffle=False) == ("shard_data", box)
    (_, first), (_, second) = boxes.calls
    assert first["policy"] == DataPolicy(batch_size=8)
    assert second["policy"] == DataPolicy(batch_size=8, shuffle=False, remainder="uneven")
    assert first["strategy"] is s and first["session"] is s.session()
    assert s.data_policy == DataPolicy(batch_size=8)  # overrides are per call


def test_shard_data_overrides_are_validated(manager, boxes):
    with pytest.raises(ValueError, match=r"DataPolicy\.remainder must be one of"):
        Strategy(plugin_manager=manager).shard_data(Box(), remainder="wrap")
    assert boxes.calls == []


def test_wrap_model_passes_options(manager, boxes):
    model = Box("model")
    assert Strategy(plugin_manager=manager).wrap_model(model, plan={"fc": "colwise"}) == ("wrap_model", model)
    assert boxes.calls[0][1]["options"] == {"plan": {"fc": "colwise"}}


def test_sync_grads_and_sync_states(manager, boxes):
    s = Strategy(plugin_manager=manager)
    grads, states = Box("grads"), Box("states")
    assert s.sync_grads(grads) == ("sync_grads", grads)
    assert s.sync_states(states) == ("sync_states", states)
    assert [op for op, _ in boxes.calls] == ["sync_grads", "sync_states"]


def test_reduce_metrics_passes_a_plain_dict(manager, boxes):
    s = Strategy(plugin_manager=manager)
    operation, metrics = s.reduce_metrics(types.MappingProxyType({"box": True, "loss": pp.Mean(3.0, 2)}))
    assert operation == "reduce_metrics"
    assert type(metrics) is dict and metrics == {"box": True, "loss": pp.Mean(3.0, 2)}


def test_reduce_metrics_needs_a_mapping(manager, boxes):
    with pytest.raises(TypeError, match=r"reduce_metrics\(\) takes a mapping of name -> value\. Received: list\."):
        Strategy(plugin_manager=manager).reduce_metrics([("loss", 1.0)])
    assert boxes.calls == []


@pytest.mark.parametrize("operation", ["shard_data", "wrap_model", "sync_grads", "sync_states"])
def test_an_object_nobody_owns(manager, boxes, operation):
    with pytest.raises(pp.NoPluginError, match=f"No polyparallel plugin handles {operation} for an object of "
                                               f"type builtins.object"):
        getattr(Strategy(plugin_manager=manager), operation)(object())


# -- per-process state -------------------------------------------------------------------------------------


def test_rank_and_world_size_come_from_the_session(manager, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    s = Strategy(tensor=2, plugin_manager=manager)
    assert (s.rank, s.world_size) == (3, 4)
    assert s.session().topology == Topology(data=2, tensor=2)
    assert s.topology == Topology(data=-1, tensor=2)  # the value itself stays unresolved


def test_the_default_plugin_manager():
    assert Strategy().plugin_manager is pp.get_plugin_manager()


def test_zero_is_a_value_field_with_a_policy_shortcut():
    s = Strategy(data=2, zero=3)
    assert s.shard_policy == pp.ShardPolicy(stage=3)
    assert s == Strategy(data=2, shard_policy=pp.ShardPolicy(stage=3)) != Strategy(data=2)
    assert Strategy(data=2).shard_policy.stage == 0 and "zero" not in repr(Strategy(data=2))
    assert "zero=3" in repr(s)
    assert pickle.loads(pickle.dumps(s)) == s
    assert s.replace(zero=1).shard_policy.stage == 1 and s.replace(data=4).shard_policy.stage == 3
    assert Strategy(data=2, zero=2, shard_policy=pp.ShardPolicy(stage=2)).shard_policy.stage == 2
