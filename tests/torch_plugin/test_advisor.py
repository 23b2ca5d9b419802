"""``plugins/polyparallel_torch/advisor.py``: the torch advisor against real runs.

The memory estimate (parameters + gradients + optimizer state of the rank holding the most) is
compared with the bytes each rank really holds after optimizer steps in real gloo processes, for
three topologies of each of two models (an MLP and a small transformer, ``examples/advisor_models.py``):
it must be within 10%. The CLI runs as a user runs it, from the repository root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel._advisor import estimate, load_links
from polyparallel_torch.advisor import TorchAdvisor, build
from polyparallel_torch.pipeline import split_sequential

ROOT = Path(__file__).resolve().parents[2]
MLP, TRANSFORMER = "examples.advisor_models:mlp", "examples.advisor_models:transformer"


@pytest.fixture(autouse=True)
def _repository_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))  # examples.advisor_models, in spawned ranks too
    monkeypatch.setenv("POLYPARALLEL_CACHE_DIR", str(tmp_path / "cache"))


def cli(*args: str, timeout: float = 400, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POLYPARALLEL_CACHE_DIR": str(cache)}
    return subprocess.run(["timeout", "-k", "10", str(int(timeout)), sys.executable, "-m", "polyparallel.cli", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30)


def test_profile_matches_the_real_model():
    profile = TorchAdvisor().profile(MLP, 16, None)
    assert profile is not None
    torch.manual_seed(0)
    real = build(MLP).model
    assert [layer.name for layer in profile.layers] == [name for name, _ in real.named_children()]
    for layer, (_, child) in zip(profile.layers, real.named_children()):
        assert layer.param_bytes() == sum(p.numel() * 4 for p in child.parameters())
    # Megatron pairs: layers 0 and 4 column-wise (weight and bias split), 2 and 6 row-wise (weight only)
    assert [layer.tensor_split for layer in profile.layers] == [True, False, True, False, True, False, True]
    assert profile.layers[2].params == ((512 * 128 * 4, True), (128 * 4, False))
    for p in (2, 3):
        sizes = [len(list(s.children())) for s in split_sequential(real, p)]
        assert profile.pipeline_cuts[p] == tuple(sum(sizes[:i]) for i in range(1, p))
    # 2 * in * out FLOPs per Linear forward, twice that backward (input and weight gradients), per sample;
    # the first layer's input needs no gradient.
    assert profile.layers[2].flops == 3 * 2 * 512 * 128
    assert profile.layers[0].flops == 2 * 2 * 512 * 128
    # refusals are wrap_model's own messages
    assert "needs at least 8 children" in profile.refuse(pp.Topology(pipeline=8), 0)
    assert profile.refuse(pp.Topology(data=2, tensor=2), 2) is None


def test_profile_of_the_transformer_uses_its_plan_and_inputs():
    profile = TorchAdvisor().profile(TRANSFORMER, 8, 16)
    assert profile is not None
    embed, *blocks, head = profile.layers
    assert not embed.tensor_split and not head.tensor_split and all(b.tensor_split for b in blocks)
    # per block and sample: the inputs of q, k, v and up (their gradients all-reduced in backward) and the
    # outputs of o and down (all-reduced in forward), 16 x 128 floats each
    assert all(b.tensor_allreduces == 6 and b.tensor_allreduce_bytes == 6 * 16 * 128 * 4 for b in blocks)
    assert head.out_bytes == 16 * 256 * 4
    assert profile.microbatches[2] == 2
    # a batch the micro-batches do not divide is refused naming the fix
    assert "microbatches=2" in TorchAdvisor().profile(TRANSFORMER, 6, 16).refuse(pp.Topology(data=2, pipeline=2), 0)


RUNS = {
    MLP: [(pp.Topology(data=2), 0), (pp.Topology(data=2), 1), (pp.Topology(tensor=2), 0)],
    TRANSFORMER: [(pp.Topology(data=2), 3), (pp.Topology(pipeline=2), 0), (pp.Topology(tensor=2), 0)],
}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", [MLP, TRANSFORMER])
def test_memory_estimate_within_ten_percent_of_measured(model):
    advisor, batch, seq = TorchAdvisor(), 8, 16
    profile = advisor.profile(model, batch, seq)
    assert profile is not None
    measured = advisor.measure(model, batch, seq, RUNS[model], steps=1, optimizer="adam", timeout=240)
    for (topology, stage), got in zip(RUNS[model], measured):
        est = estimate(profile, topology, stage, batch, load_links(topology.world_size))
        for part in ("parameters", "gradients", "optimizer"):
            real = got["memory_max"][part]
            assert real > 0 and abs(est.memory[part] - real) <= 0.10 * real, (topology, stage, part, est.memory, got)
        assert got["step_s"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_cli_bench_comm_then_plan_json_with_measure(tmp_path):
    cache = tmp_path / "cli-cache"
    bench = cli("bench-comm", "--world", "2", "--sizes", "4096,65536", "--iters", "3", "--json", cache=cache)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout)
    assert result["world"] == 2 and result["allreduce_busbw"] > 0 and result["flops"] > 0
    assert set(result["table"]) == {"all_reduce", "all_gather"} and Path(result["cache"]).parent == cache
    plan = cli("plan", "--model", MLP, "--world", "2", "--batch", "6", "--json", "--measure", "1", "--steps", "2",
               cache=cache)
    assert plan.returncode == 0, plan.stderr[-3000:]
    out = json.loads(plan.stdout)
    assert out["links"]["source"].startswith("measured") and out["links"]["allreduce_busbw"] == result["allreduce_busbw"]
    rows = {(c["data"], c["tensor"], c["pipeline"], c["zero"]): c for c in out["candidates"]}
    # tensor=2 splits 128/512-wide layers: accepted; zero=1 with data=2 accepted; 6 samples over a pipeline of 2
    # micro-batches: 6 % 2 == 0, accepted
    assert rows[(1, 2, 1, 0)]["refused"] is None and rows[(2, 1, 1, 1)]["refused"] is None
    (measured,) = out["measured"]
    best = next(c for c in out["candidates"] if c["refused"] is None)
    assert measured["candidate"] == best and measured["step_s"] > 0
    assert len(measured["memory_bytes"]) == 2  # one entry per rank


def test_cli_shows_refused_topologies_with_the_runtime_reason(tmp_path):
    plan = cli("plan", "--model", MLP, "--world", "8", "--batch", "12", cache=tmp_path, timeout=120)
    assert plan.returncode == 0, plan.stderr[-3000:]
    text = plan.stdout
    assert "refused:" in text
    assert "torch data=1 tensor=1 pipeline=8 zero=0: pipeline=8 needs at least 8 children" in text
    assert "does not divide over data=8" in text
    assert "cannot combine pipeline=2 with tensor=2" in text
    assert "run `polyparallel bench-comm --world 8`" in text
    bad = cli("plan", "--model", "examples.advisor_models:nothing", "--world", "2", "--batch", "2", cache=tmp_path,
              timeout=120)
    assert bad.returncode != 0 and "has no callable 'nothing'" in bad.stderr


RUNS_4 = [(pp.Topology(data=2, tensor=2), 2), (pp.Topology(data=2, pipeline=2), 3), (pp.Topology(data=4), 1)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_memory_estimate_on_four_ranks():
    """FSDP2 over data on the 2-D mesh after the tensor plan, pipeline stages sharded over data,
    and ZeroRedundancyOptimizer's sorted-greedy partition of whole parameters over 4 ranks."""
    advisor, batch, seq = TorchAdvisor(), 8, 16
    profile = advisor.profile(TRANSFORMER, batch, seq)
    assert profile is not None
    measured = advisor.measure(TRANSFORMER, batch, seq, RUNS_4, steps=1, optimizer="adam", timeout=300)
    for (topology, stage), got in zip(RUNS_4, measured):
        est = estimate(profile, topology, stage, batch, load_links(4))
        for part in ("parameters", "gradients", "optimizer"):
            real = got["memory_max"][part]
            assert real > 0 and abs(est.memory[part] - real) <= 0.10 * real, (topology, stage, part, est.memory, got)


class Scaled(torch.nn.Module):
    """A root that holds a parameter of its own beside its children."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def scaled() -> dict:
    return {"model": Scaled(), "inputs": lambda batch, seq: (torch.randn(batch, 8), torch.randn(batch, 8))}


def test_parameters_of_the_root_itself_are_counted():
    profile = TorchAdvisor().profile(f"{__name__}:scaled", 4, None)
    assert profile is not None
    assert sum(layer.param_bytes() for layer in profile.layers) == (8 * 8 + 8 + 8) * 4
    assert "pipeline=2 needs an nn.Sequential" in profile.refuse(pp.Topology(pipeline=2), 0)


def encoder() -> dict:
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return {"model": torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False),
            "inputs": lambda batch, seq: (torch.randn(batch, seq, 32), torch.randn(batch, seq, 32))}


def _reference_flops(factory, seq: int) -> float:
    """FlopCounterMode's own total for one sample's forward and backward (the advisor's loss)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        made = factory()
        x, y = made["inputs"](1, seq)
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.mse_loss(made["model"](x), y).backward()
    return float(counter.get_total_flops())


def test_layers_in_a_module_list_count_their_compute():
    # nn.TransformerEncoder holds its layers in an nn.ModuleList, whose forward never runs
    profile = TorchAdvisor().profile(f"{__name__}:encoder", 4, 8)
    assert profile is not None
    total = sum(layer.flops for layer in profile.layers)
    assert total > 0 and total == _reference_flops(encoder, 8), [(x.name, x.flops) for x in profile.layers]
    assert profile.layers[0].name == "layers" and profile.layers[0].flops == total


class OwnMatmul(torch.nn.Module):
    """A root that computes in its own forward, besides its child."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.proj = torch.nn.Parameter(torch.ones(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.proj


def own_matmul() -> dict:
    return {"model": OwnMatmul(), "inputs": lambda batch, seq: (torch.randn(batch, 16), torch.randn(batch, 16))}


def test_flops_in_the_root_s_own_forward_are_counted():
    profile = TorchAdvisor().profile(f"{__name__}:own_matmul", 4, None)
    assert profile is not None
    by_name = {layer.name: layer.flops for layer in profile.layers}
    assert sum(by_name.values()) == _reference_flops(own_matmul, 1), by_name
    # the root's matmul (forward, and the gradients of its input and of proj) is the root's own layer
    assert by_name["OwnMatmul (own parameters and computation)"] == 3 * 2 * 16 * 16, by_name


@pytest.mark.parametrize(("spec", "message"), [
    ("json:loads", "--model json:loads: calling the factory failed: TypeError: loads() missing 1 required positional"),
    ("no_such_module_here:f", "--model no_such_module_here:f: cannot import 'no_such_module_here'"),
    ("json", "--model must be MODULE:FACTORY"),
    ("json:dumps_nothing", "--model json:dumps_nothing: 'json' has no callable 'dumps_nothing'"),
])
def test_a_bad_model_is_a_usage_error_naming_the_option(spec, message):
    from click.testing import CliRunner

    from polyparallel.cli import cli

    result = CliRunner().invoke(cli, ["plan", "--model", spec, "--world", "2", "--batch", "4"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert message in result.output, result.output


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_bench_comm_refuses_a_timeout_that_is_not_a_positive_number_of_seconds(timeout):
    from click.testing import CliRunner

    from polyparallel.cli import cli

    result = CliRunner().invoke(cli, ["bench-comm", "--world", "2", "--timeout", timeout])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert "Invalid value for '--timeout': expected a positive, finite number of seconds" in result.output
    result = CliRunner().invoke(cli, ["plan", "--model", MLP, "--world", "2", "--batch", "4", "--measure", "1",
                                      "--timeout", timeout])
    assert result.exit_code == 2 and "'--timeout'" in result.output, result.output


def _bench_worker(strategy: pp.Strategy) -> dict:
    from polyparallel import _trace
    from polyparallel_torch.advisor import bench_rank

    result = bench_rank(strategy, [4096], 2)
    entries = [(e.operation, e.axis, e.state) for e in _trace.get_recorder().entries if e.axis == "data"]
    other = strategy.replace(timeout=21)  # a runtime of its own: the mismatch below breaks it
    try:  # the ranks disagree on the sizes: refused by the identity check, no payload mixed
        bench_rank(other, [4096] if strategy.rank == 0 else [8192], 2)
        error = None
    except pp.CollectiveError as exc:
        error = str(exc)
    return {"busbw": result["table"]["all_reduce"]["4096"]["busbw"], "entries": entries, "error": error}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_bench_collectives_run_through_the_runtime_checked_and_recorded(run):
    strategy = pp.Strategy(data=2, timeout=20)
    for r in run(_bench_worker, strategy, 2, strategy, timeout=150):
        assert r["busbw"] > 0, r
        assert r["entries"] == [("bench_comm", "data", "done")], r  # one checked entry for the whole benchmark
        assert r["error"] is not None and "bench_comm #" in r["error"] and "sizes [4096]" in r["error"] \
            and "sizes [8192]" in r["error"], r
