"""``polyparallel/_capabilities.py``: what a target can run, checked before launch."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import polyparallel as pp
from polyparallel import Capabilities, Topology, UnsupportedTopologyError


def test_defaults_are_data_parallel_only():
    caps = Capabilities("ignite")
    assert caps.axes == {"data"} and caps.features == frozenset() and caps.plugin == ""


def test_axes_and_features_become_frozensets():
    caps = Capabilities("torch", axes=["data", "tensor"], features=("no_sync",))
    assert caps.axes == frozenset({"data", "tensor"}) and isinstance(caps.axes, frozenset)
    assert caps.features == frozenset({"no_sync"}) and isinstance(caps.features, frozenset)
    assert hash(caps) == hash(Capabilities("torch", axes={"tensor", "data"}, features={"no_sync"}))


def test_unknown_axis_is_refused():
    with pytest.raises(ValueError, match=r"Capabilities\('x'\) names unknown axes \['expert'\]; expected a subset of"):
        Capabilities("x", axes={"data", "expert"})


@pytest.mark.parametrize("topology", [
    Topology(), Topology(data=8), Topology(data=-1), Topology(data=2, tensor=2), Topology(data=4, tensor=1, pipeline=1),
])
def test_check_admits_supported_topologies(topology):
    Capabilities("torch", axes={"data", "tensor"}).check(topology)  # no error


def test_check_refuses_with_a_message_that_says_what_to_do():
    caps = Capabilities("lightning", axes={"data"}, plugin="lightning-plugin")
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"'lightning' \(plugin 'lightning-plugin'\) cannot run pipeline=2, tensor=4: it supports "
                             r"parallelism along data only\. Set pipeline=1 and tensor=1, or use a target"):
        caps.check(Topology(data=2, tensor=4, pipeline=2))


def test_check_with_no_axis_and_an_inferred_axis():
    with pytest.raises(pp.UnsupportedTopologyError, match=r"cannot run data=-1: .* along no axis only"):
        Capabilities("serial", axes=()).check(Topology(data=-1))


def test_unsupported_topology_is_a_topology_error():
    assert issubclass(pp.UnsupportedTopologyError, pp.TopologyError)


def test_to_dict_is_json_ready():
    caps = Capabilities("torch", axes={"tensor", "data"}, features={"no_sync", "bucketing"}, plugin="torch")
    d = caps.to_dict()
    assert d == {"target": "torch", "axes": ["data", "tensor"], "features": ["bucketing", "no_sync"], "plugin": "torch",
                 "excludes": [], "imports": [], "backends": [], "priority": 0, "runtimes": [], "stages": [0], "stages_with": {},
                 "precisions": ["32"], "accumulation": False}
    runtime = Capabilities("rt", imports={"torch"}, backends={"nccl", "gloo"}, priority=3).to_dict()
    assert (runtime["imports"], runtime["backends"], runtime["priority"]) == (["torch"], ["gloo", "nccl"], 3)
    assert Capabilities("adapter", runtimes={"torch"}).to_dict()["runtimes"] == ["torch"]
    assert json.loads(json.dumps(d)) == d


def test_immutable_and_picklable():
    caps = Capabilities("torch", axes={"data", "tensor"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.axes = frozenset()  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(caps)) == caps


def test_excluded_axis_combinations_are_refused_together_but_not_alone():
    caps = Capabilities("rt", axes={"data", "tensor", "pipeline"}, excludes=({"tensor", "pipeline"},))
    caps.check(Topology(data=2, tensor=2))
    caps.check(Topology(data=2, pipeline=2))
    with pytest.raises(UnsupportedTopologyError, match="'rt' cannot combine pipeline=2 with tensor=2"):
        caps.check(Topology(tensor=2, pipeline=2))
    assert caps.to_dict()["excludes"] == [["pipeline", "tensor"]]
    with pytest.raises(ValueError, match="unknown axes"):
        Capabilities("rt", excludes=({"tensor", "expert"},))


# -- what a runtime declares: what it needs, its backends, its priority; what an adapter runs on ---------------


def test_runtime_fields_default_to_nothing_needed_and_become_frozensets():
    caps = Capabilities("rt", imports=["json"], backends=("gloo",), runtimes=["torch"])
    assert (caps.imports, caps.backends, caps.runtimes, caps.priority) == (
        frozenset({"json"}), frozenset({"gloo"}), frozenset({"torch"}), 0)
    assert Capabilities("rt").imports == frozenset() and Capabilities("rt").missing_imports() == []


def test_missing_imports_looks_modules_up_without_importing_them():
    import sys

    caps = Capabilities("rt", imports={"json", "polyparallel_no_such_module_xyz"})
    assert caps.missing_imports() == ["polyparallel_no_such_module_xyz"]
    assert "polyparallel_no_such_module_xyz" not in sys.modules


def test_imported_means_one_of_its_modules_is_already_imported(monkeypatch):
    import sys
    import types

    caps = Capabilities("rt", imports={"polyparallel_fake_framework_xyz"})
    assert not caps.imported()
    monkeypatch.setitem(sys.modules, "polyparallel_fake_framework_xyz", types.ModuleType("polyparallel_fake_framework_xyz"))
    assert caps.imported() and caps.missing_imports() == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"imports": "torch"}, r"Capabilities\('rt', imports=\) must be a collection of strings, e\.g\. \{'x'\}\. "
                           r"Received: 'torch'\."),
    ({"backends": "gloo"}, r"Capabilities\('rt', backends=\) must be a collection of strings"),
    ({"runtimes": [1]}, r"Capabilities\('rt', runtimes=\) must be a collection of strings.* Received: \[1\]"),
    ({"axes": "data"}, r"Capabilities\('rt', axes=\) must be a collection of strings"),
    ({"priority": "high"}, r"Capabilities\('rt', priority=\) must be an int\. Received: 'high'\."),
    ({"priority": True}, r"Capabilities\('rt', priority=\) must be an int\. Received: True\."),
])
def test_invalid_runtime_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Capabilities("rt", **kwargs)


@pytest.mark.parametrize("target", ["", None, 3])
def test_target_must_be_a_name(target):
    with pytest.raises(ValueError, match=r"Capabilities\(target=\) must be a non-empty string\. Received: "):
        Capabilities(target)


def test_stages_default_to_replication_and_are_checked():
    plain = pp.Capabilities("x")
    assert plain.stages == {0} and plain.to_dict()["stages"] == [0]
    plain.check(pp.Topology(data=2))
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'x' cannot run sharding stage zero=3: it runs stage\(s\) 0\."):
        plain.check(pp.Topology(data=2), 3)
    sharded = pp.Capabilities("y", stages=(0, 1, 3))
    for stage in (0, 1, 3):
        sharded.check(pp.Topology(data=2), stage)
    with pytest.raises(pp.UnsupportedTopologyError, match=r"runs stage\(s\) 0, 1, 3\."):
        sharded.check(pp.Topology(data=2), 2)
    for bad in ((), (0, 5), "0", (True,)):
        with pytest.raises(ValueError, match="stages="):
            pp.Capabilities("z", stages=bad)


def test_stages_with_an_axis_are_refused_with_the_reason():
    caps = pp.Capabilities("x", axes={"data", "pipeline"}, stages={0, 1, 2, 3},
                           stages_with={"pipeline": ({0, 1}, "the engine reduces gradients itself")})
    for stage in (0, 1, 2, 3):
        caps.check(pp.Topology(data=2), stage)
    caps.check(pp.Topology(data=2, pipeline=2), 1)
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"'x' cannot run sharding stage zero=2 with pipeline=2: the engine reduces gradients itself\. "
                             r"With pipeline > 1 it runs stage\(s\) 0, 1; set Strategy\(zero=\) to one of them, or pipeline=1\."):
        caps.check(pp.Topology(data=2, pipeline=2), 2)
    assert caps.to_dict()["stages_with"] == {"pipeline": [0, 1]}
    copy = dataclasses.replace(caps, plugin="p")  # the plugin manager's copy keeps the limits
    assert copy.plugin == "p" and copy.stages_with == caps.stages_with
    with pytest.raises(ValueError, match=r"not all among stages=\[0\]"):
        pp.Capabilities("y", stages_with={"pipeline": ({0, 1}, "why")})
    with pytest.raises(ValueError, match=r"maps an axis of .* to \(stages, reason\)"):
        pp.Capabilities("y", stages_with={"expert": ({0}, "why")})


def test_precisions_are_declared_and_checked_with_the_reason():
    from polyparallel import PrecisionPolicy

    caps = Capabilities("rt", precisions={"32", "bf16-mixed"}, precision_reasons={"fp16-mixed": "no float16 kernels here"})
    caps.check(Topology(data=2), precision=PrecisionPolicy("bf16-mixed"))
    caps.check(Topology(data=2), precision=None)  # no precision asked: the model's own dtypes
    with pytest.raises(UnsupportedTopologyError, match=r"'rt' cannot run precision PrecisionPolicy\('fp16-mixed'\): "
                                                        r"no float16 kernels here\. It runs '32', 'bf16-mixed'"):
        caps.check(Topology(data=2), precision=PrecisionPolicy("fp16-mixed"))
    with pytest.raises(UnsupportedTopologyError, match=r"cannot run precision PrecisionPolicy\(param_dtype="):
        caps.check(Topology(data=2), precision=PrecisionPolicy(reduce_dtype="bfloat16"))  # custom: not declared
    Capabilities("any", precisions={"32", "custom"}).check(Topology(), precision=PrecisionPolicy(reduce_dtype="bfloat16"))
    assert Capabilities("plain").precisions == {"32"} and caps.to_dict()["precisions"] == ["32", "bf16-mixed"]
    with pytest.raises(ValueError, match=r"precisions=\) names \['bf8'\]"):
        Capabilities("bad", precisions={"bf8"})
    with pytest.raises(ValueError, match=r"precision_reasons=\) names \['fp8'\]"):
        Capabilities("bad", precision_reasons={"fp8": "no"})


def test_accumulation_is_declared_and_refused_where_missing():
    Capabilities("acc", accumulation=True).check(Topology(data=2), accumulate=4)
    Capabilities("plain").check(Topology(data=2), accumulate=1)
    with pytest.raises(UnsupportedTopologyError, match=r"'plain' does not implement gradient accumulation, so it cannot "
                                                        r"run Strategy\(accumulate=4\)"):
        Capabilities("plain").check(Topology(data=2), accumulate=4)
    with pytest.raises(ValueError, match=r"accumulation=\) must be True or False"):
        Capabilities("bad", accumulation="yes")
