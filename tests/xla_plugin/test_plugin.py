"""``polyparallel_xla/plugin.py``: declared capabilities, runtime choice, CLI listings."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch_xla")
from click.testing import CliRunner  # noqa: E402

import polyparallel as pp  # noqa: E402
import polyparallel_xla.plugin as xla_plugin  # noqa: E402
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
    class Fake:
        runtime = "torch"

    assert xla_plugin.polyparallel_reduce_metrics(None, Fake(), {"x": 1.0}) is None
    assert xla_plugin.polyparallel_process_info(pp.Strategy(), "torch") is None


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
