"""``polyparallel/_advisor_cli.py``: ``plan --model`` and ``bench-comm`` around the advisor hook.

In-process with click's runner and a plugin manager holding a framework-free runtime whose
advisor profiles a model described by hand; the torch advisor, for real, is tested in
``tests/torch_plugin/test_advisor.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

import polyparallel as pp
from polyparallel import cli as cli_module
from polyparallel._advisor import LayerProfile, ModelProfile


class HandAdvisor:
    """Profiles any ``module:factory`` as two layers; refuses pipelines."""

    def __init__(self) -> None:
        self.profiled: list[tuple[str, int, int | None]] = []

    def profile(self, model: str, batch: int, seq_len: int | None) -> ModelProfile:
        self.profiled.append((model, batch, seq_len))
        layers = [LayerProfile("a", ((4000, True),), act_bytes=40, flops=1e6, tensor_split=True,
                               tensor_allreduce_bytes=40, tensor_allreduces=2),
                  LayerProfile("b", ((4000, False),), act_bytes=40, flops=1e6)]
        return ModelProfile(model, "hand", layers, refuse=lambda t, s: "no pipelines by hand"
                            if t.size("pipeline") > 1 else None)


class HandRuntime:
    def __init__(self) -> None:
        self.advisor = HandAdvisor()

    @pp.hookimpl
    def polyparallel_capabilities(self) -> pp.Capabilities:
        return pp.Capabilities("hand", axes={"data", "tensor", "pipeline"}, stages={0, 2, 3})

    @pp.hookimpl
    def polyparallel_register_advisors(self, register: Any) -> None:
        register("hand", self.advisor)


@pytest.fixture
def invoke(manager, monkeypatch, tmp_path):
    monkeypatch.setenv("POLYPARALLEL_CACHE_DIR", str(tmp_path))
    runtime = HandRuntime()
    manager.register(runtime, name="hand")
    monkeypatch.setattr(cli_module, "get_plugin_manager", lambda: manager)
    runner = CliRunner()

    def run(*args: str) -> Any:
        result = runner.invoke(cli_module.cli, list(args), prog_name="polyparallel")
        result.advisor = runtime.advisor
        return result
    return run


def test_json_lists_every_candidate_estimated_or_refused_with_the_reason(invoke):
    result = invoke("plan", "--model", "any:thing", "--world", "4", "--batch", "8", "--seq-len", "3", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert result.advisor.profiled == [("any:thing", 8, 3)]
    assert out["world"] == 4 and out["optimizer"] == "adam" and out["optimizer_states"] == 2
    assert out["links"]["source"].startswith("defaults")
    rows = out["candidates"]
    accepted = [r for r in rows if r["refused"] is None]
    steps = [r["time_s"]["step"] for r in accepted]
    assert steps == sorted(steps)
    refused = {(r["data"], r["tensor"], r["pipeline"], r["zero"]): r["refused"] for r in rows if r["refused"]}
    # the runtime's capabilities (no stage 1) and the model's own refusal (no pipelines)
    assert "cannot run sharding stage zero=1" in refused[(4, 1, 1, 1)]
    assert refused[(2, 1, 2, 0)] == "no pipelines by hand"
    d4 = next(r for r in accepted if (r["data"], r["zero"]) == (4, 3))
    assert d4["memory_bytes"]["parameters"] == 8000 / 4 and d4["memory_bytes"]["optimizer"] == 2 * 8000 / 4


def test_text_output_and_fixed_axes_and_optimizer(invoke):
    result = invoke("plan", "--model", "any:thing", "--world", "4", "--batch", "8", "--tensor", "2",
                    "--zero", "0", "--optimizer", "sgd")
    assert result.exit_code == 0, result.output
    assert "optimizer sgd (0 state(s) per parameter)" in result.output
    assert "run `polyparallel bench-comm --world 4`" in result.output
    lines = [line for line in result.output.splitlines() if "tensor=" in line]
    assert lines and all("tensor=2" in line for line in lines)
    assert any("refused:" in line for line in result.output.splitlines())
    assert "no pipelines by hand" in result.output  # data=1 tensor=2 pipeline=2


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "any:thing", "--world", "4"], "--batch B"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--seq-len", "0"], "expected a positive int"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--measure", "-1"], "--measure must be >= 0"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--zero", "5"], "0<=x<=3"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--optimizer", "lion"], "'lion' is not one of"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--tensor", "3"], "need a multiple of 3 ranks"),
    (["--model", "any:thing", "--world", "4", "--batch", "8", "--runtime", "jax"], "'jax' is not an installed runtime"),
])
def test_bad_plan_input_is_refused_before_anything_runs(invoke, args, message):
    result = invoke("plan", *args)
    assert result.exit_code != 0 and message in result.output, result.output
    assert result.advisor.profiled == []


def test_no_accepted_topology_exits_non_zero_after_listing_the_refusals(invoke):
    # every candidate pipelines (pinned), and the hand advisor refuses pipelines
    for extra in ([], ["--json"]):
        result = invoke("plan", "--model", "any:thing", "--world", "4", "--batch", "8", "--pipeline", "2", *extra)
        assert result.exit_code == 1, result.output
        assert "no pipelines by hand" in result.output
        assert "no topology of 4 ranks is accepted for --model any:thing" in result.output


def test_no_advisor_installed(manager, monkeypatch):
    monkeypatch.setattr(cli_module, "get_plugin_manager", lambda: manager)
    result = CliRunner().invoke(cli_module.cli, ["plan", "--model", "a:b", "--world", "2", "--batch", "2"])
    assert result.exit_code != 0 and "no installed runtime registers a topology advisor" in result.output
    result = CliRunner().invoke(cli_module.cli, ["bench-comm", "--world", "2"])
    assert result.exit_code != 0 and "registers no advisor" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--world", "1"], "--world >= 2"),
    (["--sizes", "4096,x"], "integers separated by commas"),
    (["--iters", "0"], "--iters >= 1"),
])
def test_bad_bench_comm_input(invoke, args, message):
    result = invoke("bench-comm", *args)
    assert result.exit_code != 0 and message in result.output, result.output


def test_plain_plan_keeps_its_behaviour(invoke):
    result = invoke("plan", "--world", "4", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["zero"] == 0
    assert result.advisor.profiled == []
