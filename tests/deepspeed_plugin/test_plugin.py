"""The plugin module: registered as the adapter 'deepspeed' with its capabilities, cheap to import
(neither torch nor deepspeed), and its hooks answer only for DeepSpeed engines."""

import json
import subprocess
import sys

import pytest

import polyparallel as pp


def test_importing_the_plugin_imports_no_framework():
    code = ("import sys, polyparallel_deepspeed, polyparallel_deepspeed.plugin, polyparallel_deepspeed.config; "
            "print([m for m in ('torch', 'deepspeed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_registered_with_its_capabilities():
    pytest.importorskip("deepspeed")
    caps = pp.get_plugin_manager().adapters()["deepspeed"].capabilities
    assert caps.axes == {"data", "pipeline"} and caps.stages == {0, 1, 2, 3} and caps.runtimes == {"torch"}
    for stage in (0, 1, 2, 3):
        pp.Strategy(data=2, zero=stage).check("deepspeed")
    pp.Strategy(data=2, pipeline=2, zero=1).check("deepspeed")
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot run tensor=2"):
        pp.Strategy(data=2, tensor=2).check("deepspeed")


def test_listed_by_the_cli():
    pytest.importorskip("deepspeed")
    out = subprocess.run([sys.executable, "-m", "polyparallel.cli", "plugins", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    listing = {p["name"]: p for p in json.loads(out.stdout)}
    assert listing["deepspeed"]["adapters"] == ["deepspeed"]
    assert listing["deepspeed"]["capabilities"][0]["stages"] == [0, 1, 2, 3]


def test_hooks_leave_other_objects_to_other_plugins():
    torch = pytest.importorskip("torch")
    from polyparallel_deepspeed.plugin import is_engine, polyparallel_sync_grads, polyparallel_sync_states

    module = torch.nn.Linear(2, 2)
    assert not is_engine(module) and not is_engine(None)
    session = pp.Strategy(data=1).session()
    assert polyparallel_sync_grads(pp.Strategy(data=1), session, module) is None
    assert polyparallel_sync_states(pp.Strategy(data=1), session, module) is None


def test_the_core_routes_only_torch_sessions_to_it_and_its_checkpoint_hooks_take_options():
    """No session.runtime guard in the hooks: the core asks this plugin on torch sessions only (its
    adapter's runtime); the checkpoint hooks declare options (async saves, partial loads), so the
    core passes them instead of saving synchronously or loading whole."""
    import inspect

    pytest.importorskip("deepspeed")
    from polyparallel_deepspeed import plugin

    assert pp.get_plugin_manager().served_runtimes()["deepspeed"] == frozenset({"torch"})
    for hook in (plugin.polyparallel_save_checkpoint, plugin.polyparallel_load_checkpoint):
        params = inspect.signature(hook).parameters
        assert "options" in params and "session" not in params, (hook.__name__, list(params))
    assert "session.runtime" not in inspect.getsource(plugin)


def test_without_deepspeed_adapt_says_what_to_install(monkeypatch):
    """The plugin loads without DeepSpeed (the entry point is the core's); adapt() then names the
    extra to install instead of failing inside an import."""
    import importlib.util

    if "deepspeed" not in pp.get_plugin_manager().adapters():
        pytest.skip("the deepspeed entry point is not installed in this environment (tools/env.sh installs it)")
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)  # restored after the test
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    with pytest.raises(pp.NoPluginError, match=r"needs DeepSpeed, which is not installed here: DS_BUILD_OPS=0 pip install"):
        pp.Strategy(data=2, batch_size=8).adapt("deepspeed", model=None)


def _never_called() -> None:
    raise AssertionError("launch started a process")


def test_launch_without_runtime_names_the_adapter_that_runs_pipeline_zero1():
    """pp.launch without runtime= checks the torch runtime, which runs no ZeRO-1 under a pipeline;
    the DeepSpeed adapter does, so the refusal names it and runtime="deepspeed" (issue 19)."""
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    strategy = pp.Strategy(pipeline=2, data=2, zero=1, batch_size=8)
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'torch' .*cannot run sharding stage zero=1 with pipeline=2.* "
                                                          r"The installed adapter 'deepspeed' runs it on the 'torch' "
                                                          r"runtime.*pp.launch\(fn, strategy, runtime='deepspeed'\)"):
        pp.launch(_never_called, strategy, nprocs=4)
