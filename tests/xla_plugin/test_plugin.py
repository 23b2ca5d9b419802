"""``polyparallel_xla/plugin.py``: declared capabilities, runtime choice, CLI listings."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch_xla")
from click.testing import CliRunner  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel.cli import cli  # noqa: E402


def test_capabilities_data_axis_only_and_below_torch():
    caps = pp.get_plugin_manager().runtimes()["xla"]
    assert caps.axes == {"data"} and caps.imports == {"torch_xla"} and caps.plugin == "xla"
    assert caps.priority < pp.get_plugin_manager().runtimes()["torch"].priority
    with pytest.raises(pp.UnsupportedTopologyError, match=r"'xla' \(plugin 'xla'\) cannot run tensor=2"):
        caps.check(pp.Topology(data=2, tensor=2))


def test_torch_stays_the_automatic_choice_and_xla_is_asked_for_by_name():
    assert pp.Strategy(data=2).resolve_runtime() == "torch"
    assert pp.Strategy(data=2, runtime="xla").resolve_runtime() == "xla"


def test_other_runtimes_sessions_never_reach_the_xla_hooks():
    # The hooks carry no session.runtime guard: the core leaves the XLA plugin out of every other
    # runtime's calls, and the torch plugin out of XLA's.
    manager = pp.get_plugin_manager()
    assert manager.served_runtimes()["xla"] == {"xla"}
    for hook in ("polyparallel_reduce_metrics", "polyparallel_sync_grads", "polyparallel_shard_data",
                 "polyparallel_process_info", "polyparallel_launch"):
        on_torch = {impl.plugin_name for impl in manager._routed_caller(hook, "torch").get_hookimpls()}
        on_xla = {impl.plugin_name for impl in manager._routed_caller(hook, "xla").get_hookimpls()}
        assert "xla" not in on_torch and "xla" in on_xla and "torch" not in on_xla, hook


def test_cli_plugins_and_plan_show_the_xla_runtime():
    runner = CliRunner()
    listed = runner.invoke(cli, ["plugins", "--json"])
    assert listed.exit_code == 0, listed.output
    assert "xla" in listed.output and "torch_xla" in listed.output
    ok = runner.invoke(cli, ["plan", "--world", "2", "--runtime", "xla", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)
    refused = runner.invoke(cli, ["plan", "--world", "4", "--data", "2", "--tensor", "2", "--runtime", "xla"])
    assert refused.exit_code != 0 and "cannot run tensor=2" in refused.output
