"""The plugin's registration: cheap import, honest capabilities, the adapter and the demo entry."""

import subprocess
import sys

import pytest

import polyparallel as pp


def test_importing_the_plugin_imports_neither_torch_nor_ignite():
    code = ("import sys, polyparallel_ignite, polyparallel_ignite.plugin; "
            "print(any(m in sys.modules for m in ('torch', 'ignite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_adapter_registered_with_capabilities():
    pm = pp.get_plugin_manager()
    adapter = pm.adapters()["ignite"]
    assert adapter.capabilities.axes == {"data", "tensor", "pipeline"}
    assert pm.capabilities()["ignite"].plugin == "ignite"
    pp.Strategy(data=2, pipeline=2).check("ignite", world_size=4)
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot combine pipeline=2 with tensor=2"):
        pp.Strategy(data=1, tensor=2, pipeline=2).adapt("ignite")


def test_stages_follow_the_torch_runtime():
    """The adapter runs the sharding stages the torch runtime runs, and refuses the others."""
    pm = pp.get_plugin_manager()
    runtime_stages = pm.capabilities()["torch"].stages
    assert pm.adapters()["ignite"].capabilities.stages == runtime_stages
    for stage in range(4):
        strategy = pp.Strategy(data=2, zero=stage)
        if stage in runtime_stages:
            strategy.check("ignite", world_size=2)
        else:
            with pytest.raises(pp.UnsupportedTopologyError, match=f"cannot run sharding stage zero={stage}"):
                strategy.check("ignite", world_size=2)


def test_demo_entry_registered():
    from polyparallel_ignite.demo import run_demo

    entries = {}
    pp.get_plugin_manager().call("polyparallel_register_demos", register=entries.__setitem__)
    assert entries["ignite"] is run_demo


def test_every_public_name_resolves():
    import polyparallel_ignite

    for name in polyparallel_ignite.__all__:
        assert getattr(polyparallel_ignite, name) is not None, name


def test_auto_model_rejects_pipeline_options_without_a_pipeline():
    from torch import nn

    ignite = pp.Strategy(data=1).adapt("ignite")
    with pytest.raises(TypeError, match="only applies with pipeline > 1"):
        ignite.auto_model(nn.Sequential(nn.Linear(2, 2)), boundaries=[1])
