"""``polyparallel/_launch.py``: validate before any process starts, then hand over to a runtime.

The runtime is a fake that runs ``fn`` serially in this process; real multi-process launching is
the runtime plugins' tests' business.
"""

from __future__ import annotations

import pickle

import pytest

import polyparallel as pp
from polyparallel import Strategy


def square_plus(x, *, offset=0):
    return x * x + offset


class SerialLauncher:
    """Runs ``fn`` once per rank in this process; records what it was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    @pp.hookimpl
    def polyparallel_launch(self, fn, strategy, runtime, nprocs, args, kwargs, timeout):
        if runtime != "serial":
            return None
        self.calls.append({"strategy": strategy, "runtime": runtime, "nprocs": nprocs, "args": args,
                           "kwargs": kwargs, "timeout": timeout})
        # What the processes would get: the pickled strategy, carrying the parent's runtime choice.
        self.calls[-1]["pickled"] = pickle.loads(pickle.dumps(strategy))
        return tuple(fn(*args, **kwargs) for _ in range(nprocs))  # any sequence: launch() lists it


class Runtime:
    @pp.hookimpl
    def polyparallel_capabilities(self):
        return pp.Capabilities("serial", axes={"data"})


@pytest.fixture
def launcher(manager):
    plugin = SerialLauncher()
    manager.register(plugin, name="serial")
    manager.register(Runtime(), name="serial-runtime")
    return plugin


def test_results_are_returned_per_rank(manager, launcher):
    s = Strategy(plugin_manager=manager)
    assert pp.launch(square_plus, s, nprocs=3, args=[4], kwargs={"offset": 1}) == [17, 17, 17]
    (call,) = launcher.calls
    pickled = call.pop("pickled")
    assert call == {"strategy": s, "runtime": "serial", "nprocs": 3, "args": (4,), "kwargs": {"offset": 1},
                    "timeout": None}
    assert pickled == s and pickled._runtime_hint == "serial"


def test_timeout_is_handed_to_the_runtime(manager, launcher):
    pp.launch(square_plus, Strategy(plugin_manager=manager), 2, (1,), timeout=30.0)
    assert launcher.calls[0]["timeout"] == 30.0


def test_a_runtime_may_take_a_subset_of_the_arguments(manager):
    class Minimal:
        @pp.hookimpl
        def polyparallel_launch(self, fn, nprocs):
            return [fn(rank) for rank in range(nprocs)]

    manager.register(Runtime(), name="serial-runtime")
    manager.register(Minimal(), name="minimal")
    assert pp.launch(square_plus, Strategy(plugin_manager=manager), nprocs=3) == [0, 1, 4]


def test_the_first_runtime_that_can_launch_does(manager, launcher):
    class CannotLaunch:
        @pp.hookimpl
        def polyparallel_launch(self, nprocs):
            return None  # e.g. the XLA runtime outside a TPU host

    manager.register(CannotLaunch(), name="cannot")
    assert pp.launch(square_plus, Strategy(plugin_manager=manager), 2, (3,)) == [9, 9]


@pytest.mark.parametrize("nprocs", [0, -2, 2.0, True, "2", None])
def test_invalid_nprocs(manager, launcher, nprocs):
    with pytest.raises(pp.TopologyError, match=rf"launch\(nprocs=\) must be a positive int\. Received: {nprocs!r}\."):
        pp.launch(square_plus, Strategy(plugin_manager=manager), nprocs)
    assert launcher.calls == []


def test_fn_must_be_callable(manager, launcher):
    with pytest.raises(TypeError, match=r"launch\(fn=\) must be a callable \(a module-level function\)\. Received: "
                                        r"str 'train\.py'\. For a script, use `polyparallel launch script\.py`"):
        pp.launch("train.py", Strategy(plugin_manager=manager), 2)


def test_a_topology_that_does_not_fit_is_refused_before_any_process_starts(manager, launcher):
    with pytest.raises(pp.TopologyError, match=r"needs 4 ranks but the world size is 3"):
        pp.launch(square_plus, Strategy(data=2, tensor=2, plugin_manager=manager), nprocs=3)
    with pytest.raises(pp.TopologyError, match=r"does not divide world size 3"):
        pp.launch(square_plus, Strategy(tensor=2, plugin_manager=manager), nprocs=3)
    assert launcher.calls == []


def test_runtime_capabilities_are_checked_before_any_process_starts(manager, launcher):
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'serial' \(plugin 'serial-runtime'\) cannot run tensor=2"):
        pp.launch(square_plus, Strategy(tensor=2, plugin_manager=manager), nprocs=4, runtime="serial")
    with pytest.raises(pp.NoPluginError, match=r"No installed plugin provides the target 'tpu'"):
        pp.launch(square_plus, Strategy(plugin_manager=manager), nprocs=4, runtime="tpu")
    assert launcher.calls == []
    assert pp.launch(square_plus, Strategy(plugin_manager=manager), 2, (2,), runtime="serial") == [4, 4]


def test_a_precision_or_accumulation_the_runtime_does_not_run_is_refused_before_any_process_starts(manager, launcher):
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'serial' \(plugin 'serial-runtime'\) cannot run precision "
                                                          r"PrecisionPolicy\('bf16-mixed'\)\. It runs '32'"):
        pp.launch(square_plus, Strategy(precision="bf16-mixed", plugin_manager=manager), nprocs=2, args=(1,))
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'serial' .* does not implement gradient accumulation"):
        pp.launch(square_plus, Strategy(batch_size=8, accumulate=2, plugin_manager=manager), nprocs=2, args=(1,))
    assert launcher.calls == []
    assert pp.launch(square_plus, Strategy(precision="32", plugin_manager=manager), 2, (3,)) == [9, 9]


def test_no_runtime_installed_is_refused_with_the_install_hint(manager):
    with pytest.raises(pp.NoPluginError, match=r"launch\(\) needs a runtime, but no runtime is installed\. "
                                               r"Install one: pip install 'polyparallel\[torch\]'"):
        pp.launch(square_plus, Strategy(plugin_manager=manager), 2)


def test_a_runtime_that_cannot_launch(manager):
    manager.register(Runtime(), name="serial-runtime")
    with pytest.raises(pp.NoPluginError, match=r"The runtime 'serial' \(plugin 'serial-runtime'\) cannot launch "
                                               r"processes: no plugin implements polyparallel_launch for it\."):
        pp.launch(square_plus, Strategy(plugin_manager=manager), 2)


def test_capabilities_are_checked_without_runtime_argument(manager, launcher):
    # The runtime is resolved in the parent and its capabilities always checked (serial: data only).
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'serial' \(plugin 'serial-runtime'\) cannot run tensor=2"):
        pp.launch(square_plus, Strategy(tensor=2, plugin_manager=manager), nprocs=4)
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'serial' .*cannot run pipeline=2"):
        pp.launch(square_plus, Strategy(data=-1, pipeline=2, plugin_manager=manager), nprocs=4)
    assert launcher.calls == []


class ShardingAdapter:
    """An adapter that shards by itself on the serial runtime (as DeepSpeed runs ZeRO-1 under its
    pipeline engine, which the torch runtime's own wrap_model does not)."""

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        register("sharder", lambda strategy, **kwargs: None,
                 capabilities=pp.Capabilities("sharder", axes={"data"}, stages={0, 1}, runtimes={"serial"}))


def test_a_stage_only_an_installed_adapter_runs_is_refused_naming_the_adapter(manager, launcher):
    """launch() cannot see which adapter fn will use: without runtime= the stage is the runtime's
    to run, and the refusal names the adapter that would run it and how to say so."""
    manager.register(ShardingAdapter(), name="sharder")
    strategy = Strategy(data=2, zero=1, plugin_manager=manager)
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"'serial' \(plugin 'serial-runtime'\) cannot run sharding stage zero=1: .* The installed "
                             r"adapter 'sharder' runs it on the 'serial' runtime, sharding by itself: if fn uses it, "
                             r"name it, pp.launch\(fn, strategy, runtime='sharder'\)"):
        pp.launch(square_plus, strategy, nprocs=2, args=(3,))
    assert launcher.calls == []
    assert pp.launch(square_plus, strategy, nprocs=2, args=(3,), runtime="sharder") == [9, 9]
    # A stage no installed target runs is refused as before, naming none.
    with pytest.raises(pp.UnsupportedTopologyError, match=r"cannot run sharding stage zero=2: it runs stage\(s\) 0\. ") as info:
        pp.launch(square_plus, strategy.replace(zero=2), nprocs=2, args=(3,))
    assert "installed adapter" not in str(info.value)


class WideRuntime:
    @pp.hookimpl
    def polyparallel_capabilities(self):
        return pp.Capabilities("wide", axes={"data"}, precisions={"32", "bf16-mixed"})


class Sharders:
    """Two adapters sharding by themselves on the 'wide' runtime, one of them in bf16 too."""

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        for name, precisions in (("sharder32", {"32"}), ("sharderbf16", {"32", "bf16-mixed"})):
            register(name, lambda strategy, **kwargs: None,
                     capabilities=pp.Capabilities(name, axes={"data"}, stages={0, 1}, runtimes={"wide"},
                                                  precisions=precisions))


def test_the_adapters_named_run_the_strategys_precision_and_a_refused_precision_names_none(manager, launcher):
    """The refusal naming adapters names only those whose capabilities admit the whole strategy
    (what launch(runtime=<adapter>) would check); a precision or accumulation the runtime does not
    run is refused as such, before the stage."""
    manager.register(WideRuntime(), name="wide-runtime")
    manager.register(Sharders(), name="sharders")
    strategy = Strategy(data=2, zero=1, runtime="wide", plugin_manager=manager)
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"The installed adapters 'sharder32', 'sharderbf16' run it on the 'wide' runtime"):
        pp.launch(square_plus, strategy, nprocs=2, args=(3,))
    with pytest.raises(pp.UnsupportedTopologyError,
                       match=r"The installed adapter 'sharderbf16' runs it on the 'wide' runtime.*"
                             r"runtime='sharderbf16'") as info:
        pp.launch(square_plus, strategy.replace(precision="bf16-mixed"), nprocs=2, args=(3,))
    assert "sharder32" not in str(info.value)
    manager.register(ShardingAdapter(), name="sharder")
    serial = Strategy(data=2, zero=1, batch_size=8, runtime="serial", plugin_manager=manager)
    for refused, match in ((serial.replace(precision="bf16-mixed"), "cannot run precision"),
                           (serial.replace(accumulate=2), "does not implement gradient accumulation")):
        with pytest.raises(pp.UnsupportedTopologyError, match=match) as info:
            pp.launch(square_plus, refused, nprocs=2, args=(3,))
        assert "installed adapter" not in str(info.value)
    assert launcher.calls == []


def test_the_batch_size_is_checked_against_the_launched_data_axis(manager, launcher):
    with pytest.raises(pp.TopologyError, match=r"launch\(Strategy\(pipeline=1, data=-1, tensor=1, timeout=60, seed=0\), "
                                               r"nprocs=3\): the global batch size 8 does not divide over data=3 ranks"):
        pp.launch(square_plus, Strategy(batch_size=8, plugin_manager=manager), nprocs=3)
    assert launcher.calls == []
    assert pp.launch(square_plus, Strategy(batch_size=8, plugin_manager=manager), 4, (1,)) == [1] * 4


def test_the_runtime_is_resolved_in_the_parent_and_travels_with_the_strategy(manager, launcher):
    class Other:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("other", axes={"data"}, priority=-1)

    manager.register(Other(), name="other-runtime")
    s = Strategy(plugin_manager=manager)
    assert pp.launch(square_plus, s, 2, (2,)) == [4, 4]  # serial: the higher priority
    assert launcher.calls[-1]["runtime"] == "serial" and launcher.calls[-1]["pickled"]._runtime_hint == "serial"
    # A runtime named by launch(runtime=) pins the strategy the processes get.
    with pytest.raises(pp.NoPluginError, match=r"The runtime 'other' \(plugin 'other-runtime'\) cannot launch"):
        pp.launch(square_plus, s, 2, runtime="other")


def test_launch_refuses_a_strategy_whose_runtime_is_not_the_one_asked(manager, launcher):
    class Other:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("other", axes={"data"})

    manager.register(Other(), name="other-runtime")
    with pytest.raises(pp.UnsupportedTopologyError, match=r"launch\(runtime='serial'\)|Strategy.check\('serial'\) "
                                                          r"runs on the 'serial' runtime, but this strategy's runtime "
                                                          r"is 'other'"):
        pp.launch(square_plus, Strategy(runtime="other", plugin_manager=manager), 2, runtime="serial")
    assert launcher.calls == []


def test_a_failing_rank_is_reported_as_launch_error(manager):
    class FailingLauncher:
        @pp.hookimpl
        def polyparallel_launch(self, nprocs):
            raise pp.LaunchError("rank 1 failed: ZeroDivisionError", rank=1, traceback="Traceback ...")

    manager.register(Runtime(), name="serial-runtime")
    manager.register(FailingLauncher(), name="failing")
    with pytest.raises(pp.LaunchError, match="rank 1 failed") as info:
        pp.launch(square_plus, Strategy(plugin_manager=manager), 2)
    assert info.value.rank == 1
    assert info.value.__notes__ == ["raised by plugin 'failing' in polyparallel_launch"]


def test_a_trace_dir_is_refused_for_a_runtime_that_records_nothing(manager, launcher, tmp_path):
    # A runtime that records no collectives: trace_dir= would be silently ignored; refused before any process.
    s = Strategy(plugin_manager=manager)
    with pytest.raises(TypeError, match=r"the 'serial' runtime does not record its collectives \(its capabilities "
                                        r"lack the 'collective_trace' feature\)"):
        pp.launch(square_plus, s, nprocs=2, args=[3], trace_dir=tmp_path / "trace")
    assert launcher.calls == [] and not (tmp_path / "trace").exists()


def test_a_trace_dir_reaches_a_runtime_that_records(manager, tmp_path):
    class Recording:
        @pp.hookimpl
        def polyparallel_capabilities(self):
            return pp.Capabilities("recording", axes={"data"}, features={"collective_trace"})

        @pp.hookimpl
        def polyparallel_launch(self, runtime, nprocs, trace_dir):
            return [trace_dir] * nprocs if runtime == "recording" else None

    manager.register(Recording(), name="recording")
    s = Strategy(plugin_manager=manager)
    assert pp.launch(square_plus, s, nprocs=2, args=[3], trace_dir=tmp_path) == [str(tmp_path)] * 2
