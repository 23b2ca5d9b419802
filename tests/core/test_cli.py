"""``polyparallel/cli.py``: the ``polyparallel`` command.

Invoked as a user would (``python -m polyparallel.cli`` and the console script, in a subprocess,
against the really installed plugins); the behaviour of ``launch`` and ``demo`` around their hooks
is tested in-process with click's runner and a plugin manager holding fake plugins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import polyparallel as pp
from polyparallel import AXES, Topology
from polyparallel import cli as cli_module

#: What `plan --json` adds to the topology when no precision, accumulation or batch is asked for.
NO_PRECISION = {"precision": None, "accumulate": 1, "batch_size": None, "micro_batch_per_rank": None}


def run_cli(python, *args, **env):
    return python("-m", "polyparallel.cli", *args, **env)


# -- plan ------------------------------------------------------------------------------------------------------


def test_plan_prints_the_rank_grid_groups_and_roles(python):
    result = run_cli(python, "plan", "--world", "8", "--tensor", "2", "--pipeline", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    t = Topology(data=2, tensor=2, pipeline=2)
    assert lines[0] == "Topology(pipeline=2, data=2, tensor=2)  world size 8"
    assert lines[2].split() == ["rank", "pipeline", "data", "tensor", "roles"]
    assert set(lines[3].replace(" ", "")) == {"-"}
    for rank, line in enumerate(lines[4:12]):
        cells = line.split(maxsplit=4)
        assert cells[:4] == [str(rank), *(str(t.coords(rank)[a]) for a in AXES)]
        assert cells[4] == (", ".join(sorted(t.roles(rank))) or "-")
    assert "tensor groups (4 of size 2): [0,1] [2,3] [4,5] [6,7]" in lines
    assert "data groups (4 of size 2): [0,2] [1,3] [4,6] [5,7]" in lines
    assert "pipeline groups (4 of size 2): [0,4] [1,5] [2,6] [3,7]" in lines


def test_plan_json_is_the_topology_description(python):
    result = run_cli(python, "plan", "--world", "8", "--tensor", "2", "--pipeline", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {**Topology(data=2, tensor=2, pipeline=2).to_dict(), "zero": 0, **NO_PRECISION}


@pytest.mark.parametrize(("args", "message"), [
    (["--world", "8", "--tensor", "3"], "does not divide world size 8"),
    (["--world", "8", "--data", "2", "--tensor", "2"], "needs 4 ranks but the world size is 8"),
    (["--world", "8", "--data", "0"], "axis 'data' must be a positive size or -1"),
    (["--world", "0"], "world size must be a positive int"),
])
def test_an_invalid_plan_exits_non_zero_with_the_message(python, args, message):
    result = run_cli(python, "plan", *args)
    assert result.returncode != 0
    assert "Error: " in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--world", "4", "--tensor", "2", "--pipeline", "2", "--runtime", "torch"],
     "'torch' (plugin 'torch') cannot combine pipeline=2 with tensor=2"),
    (["--world", "4", "--pipeline", "2", "--runtime", "lightning"], "'lightning' (plugin 'lightning') cannot run pipeline=2"),
    (["--world", "4", "--runtime", "tpu"], "No installed plugin provides the target 'tpu'"),
    (["--world", "4", "--batch-size", "6"], "--batch-size 6: the global batch size 6 does not divide over data=4 ranks"),
    (["--world", "4", "--batch-size", "6", "--runtime", "torch"], "the global batch size 6 does not divide over data=4"),
    (["--world", "4", "--batch-size", "0"], "DataPolicy.batch_size must be a positive int or None. Received: 0."),
])
def test_plan_checks_a_runtime_and_a_batch_size(python, args, message):
    result = run_cli(python, "plan", *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_plan_for_a_runtime_that_runs_it(python):
    result = run_cli(python, "plan", "--world", "4", "--tensor", "2", "--runtime", "torch", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "Topology(pipeline=1, data=2, tensor=2)  world size 4  (runs on 'torch')"
    as_json = json.loads(run_cli(python, "plan", "--world", "4", "--runtime", "torch", "--json").stdout)
    assert as_json == {**Topology(data=4).to_dict(), "zero": 0, **NO_PRECISION, "runtime": "torch"}


def test_plan_requires_the_world_size(python):
    result = run_cli(python, "plan", "--tensor", "2")
    assert result.returncode == 2 and "Missing option '--world'" in result.stderr


# -- plugins -----------------------------------------------------------------------------------------------------


def test_plugins_json_lists_the_installed_records_plugin(python):
    result = run_cli(python, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    listing = {p["name"]: p for p in json.loads(result.stdout)}
    assert "polyparallel.core" not in listing  # only with --all
    records = listing["records"]
    assert records["module"] == "polyparallel_records"
    assert records["distribution"] == "polyparallel-records" and records["version"] == "0.1.0"
    assert records["hooks"] == ["polyparallel_register_adapters", "polyparallel_shard_data"]
    assert records["adapters"] == ["records"]
    assert records["capabilities"] == [{"target": "records", "axes": ["data"], "features": [], "plugin": "records",
                                        "excludes": [], "imports": [], "backends": [], "priority": 0,
                                        "runtimes": [], "stages": [0], "stages_with": {},
                                        "precisions": ["32"], "accumulation": False}]


def test_plugins_table(python):
    result = run_cli(python, "plugins")
    assert result.returncode == 0, result.stderr
    header, rule, *rows = result.stdout.splitlines()
    assert header.split() == ["plugin", "version", "hooks", "adapters", "axes", "stages"]
    (records,) = [row for row in rows if row.startswith("records ")]
    assert records.split() == ["records", "0.1.0", "register_adapters,", "shard_data", "records", "records:", "data", "records:", "0"]


def test_plugins_filtered_by_hook(python):
    implementing = json.loads(run_cli(python, "plugins", "--json", "--hook", "shard_data").stdout)
    assert "records" in [p["name"] for p in implementing]
    assert all("polyparallel_shard_data" in p["hooks"] for p in implementing)
    full_name = json.loads(run_cli(python, "plugins", "--json", "--hook", "polyparallel_register_adapters").stdout)
    assert "records" in [p["name"] for p in full_name]
    not_implementing = json.loads(run_cli(python, "plugins", "--json", "--hook", "session_finish").stdout)
    assert "records" not in [p["name"] for p in not_implementing]


def test_plugins_all_includes_the_core(python):
    listing = json.loads(run_cli(python, "plugins", "--json", "--all").stdout)
    assert listing[0]["name"] == "polyparallel.core"
    assert listing[0]["hooks"] == ["polyparallel_process_info"]


def test_plugins_lists_the_runtimes_and_the_automatic_choice(python):
    result = run_cli(python, "plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("runtime ")))
    assert lines[header].split() == ["runtime", "plugin", "installed", "imported", "backends", "priority"]
    rows = {line.split()[0]: line.split() for line in lines[header + 2:header + 4]}
    assert rows["torch"] == ["torch", "torch", "yes", "no", "gloo,", "nccl", "10"]
    assert rows["jax"] == ["jax", "jax", "yes", "no", "-", "0"]
    assert "automatic choice here (Strategy(runtime=None)): torch" in lines
    listing = {p["name"]: p for p in json.loads(run_cli(python, "plugins", "--json").stdout)}
    (torch_caps,) = listing["torch"]["capabilities"]
    assert (torch_caps["imports"], torch_caps["backends"], torch_caps["missing_imports"]) == (
        ["torch"], ["gloo", "nccl"], [])
    assert listing["torch"]["error"] is None


def test_plugins_shows_a_plugin_that_failed_to_load(python, tmp_path):
    (tmp_path / "exploding_plugin_xyz.py").write_text("raise ImportError('a dependency is missing')\n")
    result = run_cli(python, "plugins", POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD="1", POLYPARALLEL_PLUGINS="exploding_plugin_xyz",
                     PYTHONPATH=f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    assert result.returncode == 0, result.stderr
    assert "failed to load: exploding_plugin_xyz (exploding_plugin_xyz from - ): ImportError: a dependency is " \
           "missing" in result.stdout.replace("  ", " ")
    listing = json.loads(run_cli(python, "plugins", "--json", POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD="1",
                                 POLYPARALLEL_PLUGINS="exploding_plugin_xyz",
                                 PYTHONPATH=f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}").stdout)
    assert listing == [{"name": "exploding_plugin_xyz", "module": "exploding_plugin_xyz", "distribution": None,
                        "version": None, "hooks": [], "adapters": [], "capabilities": [],
                        "error": "ImportError: a dependency is missing"}]


def test_plugins_refuses_an_unknown_hook(python):
    result = run_cli(python, "plugins", "--hook", "shard_dat")
    assert result.returncode == 1
    assert ("Error: --hook 'shard_dat' is not a polyparallel hook. Hooks: adapter_bridge, capabilities, export_checkpoint, "
            "launch") in result.stderr


def test_plugins_with_autoload_disabled(python):
    result = run_cli(python, "plugins", POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD="1")
    assert result.returncode == 0 and result.stdout.strip() == "no plugins installed"


# -- launch, demo, and the script itself ------------------------------------------------------------------------


def test_launch_help(python):
    result = run_cli(python, "launch", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-timeout",
                   "--max-restarts"):
        assert option in result.stdout
    assert "COMMAND..." in result.stdout


def test_demo_help(python):
    result = run_cli(python, "demo", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--nprocs", "--data", "--tensor", "--pipeline", "--only", "--json"):
        assert option in result.stdout


def test_the_console_script(python):
    script = Path(sys.executable).with_name("polyparallel")
    assert script.exists(), "the [project.scripts] entry is not installed"
    result = python.command(str(script), "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: polyparallel" in result.stdout
    for command in ("plan", "plugins", "launch", "demo"):
        assert command in result.stdout
    version = python.command(str(script), "--version")
    assert version.stdout.strip() == f"polyparallel, version {pp.__version__}"
    plan = python.command(str(script), "plan", "--world", "4", "--json")
    assert json.loads(plan.stdout) == {**Topology(data=4).to_dict(), "zero": 0, **NO_PRECISION}


# -- launch and demo around their hooks (in-process) ------------------------------------------------------------


@pytest.fixture
def invoke(manager, monkeypatch, tmp_path):
    """Run the CLI in this process against ``manager`` (fake plugins only), in a temporary folder
    (the demo writes its outputs into ./demo-output)."""
    monkeypatch.setattr(cli_module, "get_plugin_manager", lambda: manager)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    return lambda *args: runner.invoke(cli_module.cli, list(args), prog_name="polyparallel")


class ScriptLauncher:
    def __init__(self, exit_code: int):
        self.exit_code, self.calls = exit_code, []

    @pp.hookimpl
    def polyparallel_launch_script(self, command, options):
        self.calls.append((command, options))
        return self.exit_code


def test_launch_hands_the_script_and_options_to_the_runtime(manager, invoke):
    launcher = ScriptLauncher(exit_code=3)
    manager.register(launcher, name="launcher")
    result = invoke("launch", "--nproc-per-node", "4", "--max-restarts", "2", "train.py", "--lr", "0.1", "--tensor", "2")
    assert result.exit_code == 3  # the script's exit code is ours
    (command, options), = launcher.calls
    assert command == ["train.py", "--lr", "0.1", "--tensor", "2"]  # the script's own options stay its own
    assert options == {"nproc_per_node": "4", "nnodes": "1", "node_rank": 0, "rdzv_endpoint": None,
                       "rdzv_timeout": 300.0, "max_restarts": 2, "trace_dir": None}


def test_launch_multi_node_options_reach_the_runtime(manager, invoke):
    launcher = ScriptLauncher(exit_code=0)
    manager.register(launcher, name="launcher")
    result = invoke("launch", "--nnodes", "1:2", "--node-rank", "1", "--rdzv-endpoint", "localhost:29400",
                    "--rdzv-timeout", "30", "train.py")
    assert result.exit_code == 0, result.output
    (_, options), = launcher.calls
    assert options["nnodes"] == "1:2" and options["node_rank"] == 1
    assert options["rdzv_endpoint"] == "localhost:29400" and options["rdzv_timeout"] == 30.0


@pytest.mark.parametrize(("args", "option", "message"), [
    # Old code: torchrun failed with an empty message ("polyparallel launch: ").
    (["--nproc-per-node", "0"], "--nproc-per-node",
     "expected a positive int or one of auto, cpu, gpu, xpu. Received: '0'."),
    (["--nproc-per-node", "two"], "--nproc-per-node", "Received: 'two'."),
    (["--nnodes", "0"], "--nnodes", "expected a positive int N or MIN:MAX with 1 <= MIN <= MAX. Received: '0'."),
    (["--nnodes", "3:2"], "--nnodes", "Received: '3:2'."),
    (["--node-rank", "1"], "--node-rank", "expected 0 to 0 for --nnodes 1. Received: 1."),
    (["--max-restarts", "-1"], "--max-restarts", "expected 0 or more. Received: -1."),
    (["--rdzv-timeout", "0"], "--rdzv-timeout", "expected a positive number of seconds. Received: 0.0."),
    # Old code: each node picked its own random port, and the nodes never met.
    (["--nnodes", "2"], "--rdzv-endpoint", "--nnodes 2 needs an explicit HOST:PORT that every node reaches"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0"], "--rdzv-endpoint",
     "port 0 means 'any free port', which each of the 2 nodes would pick differently"),
    # Old code: hung.
    (["--rdzv-endpoint", "notahost"], "--rdzv-endpoint", "expected HOST:PORT (e.g. 127.0.0.1:29400 or [::1]:29400). "
                                                          "Received: 'notahost'."),
    (["--rdzv-endpoint", "notahost.invalid:29400"], "--rdzv-endpoint", "cannot resolve host 'notahost.invalid'"),
    (["--rdzv-endpoint", "127.0.0.1:70000"], "--rdzv-endpoint", "Received: '127.0.0.1:70000'."),
    (["--rdzv-endpoint", "::1:29400"], "--rdzv-endpoint", "Received: '::1:29400'."),
])
def test_launch_refuses_bad_options_before_any_process(manager, invoke, args, option, message):
    launcher = ScriptLauncher(exit_code=0)
    manager.register(launcher, name="launcher")
    result = invoke("launch", *args, "train.py")
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output
    assert message in " ".join(result.output.split())  # click wraps long lines
    assert launcher.calls == []  # refused before the runtime was asked to start anything


def test_launch_accepts_an_ipv6_endpoint(manager, invoke):
    launcher = ScriptLauncher(exit_code=0)
    manager.register(launcher, name="launcher")
    result = invoke("launch", "--rdzv-endpoint", "[::1]:29400", "train.py")
    assert result.exit_code == 0, result.output
    assert launcher.calls[0][1]["rdzv_endpoint"] == "[::1]:29400"


def test_launch_without_a_runtime(invoke):
    result = invoke("launch", "train.py")
    assert result.exit_code == 1
    assert "no installed plugin can launch scripts; install one: pip install 'polyparallel[torch]'" in result.output


class Demos:
    def __init__(self):
        self.runs = []

    @pp.hookimpl
    def polyparallel_register_demos(self, register):
        def run(name, loss):
            def train(strategy, nprocs):
                self.runs.append((name, strategy, nprocs))
                if loss is None:
                    raise RuntimeError("diverged")
                return {"framework": name, "topology": repr(strategy.topology.resolve(nprocs)), "final_loss": loss,
                        "accuracy": 0.75, "step_time_ms": 1.5}
            return train
        register("alpha", run("alpha", 0.25))
        register("beta", run("beta", 0.5))
        register("broken", run("broken", None))


def test_demo_runs_every_entry_with_one_strategy(manager, invoke):
    demos = Demos()
    manager.register(demos, name="demos")
    result = invoke("demo", "--nprocs", "4", "--tensor", "2", "--only", "alpha", "--only", "beta", "--json")
    assert result.exit_code == 0, result.output
    assert "[1/2] alpha: training on 4 processes ..." in result.stderr  # progress goes to stderr, data to stdout
    assert "[2/2] beta: training on 4 processes: done in " in result.stderr
    rows = json.loads(result.stdout)
    assert [r["framework"] for r in rows] == ["alpha", "beta"]
    assert rows[0]["topology"] == "Topology(pipeline=1, data=2, tensor=2)"
    (_, first, nprocs), (_, second, _) = demos.runs
    assert first is second and nprocs == 4  # the same Strategy drives every framework
    assert first == pp.Strategy(tensor=2, timeout=120.0, seed=0)


def test_demo_reports_a_failing_entry_and_keeps_the_others(manager, invoke):
    manager.register(Demos(), name="demos")
    result = invoke("demo", "--nprocs", "2")
    assert result.exit_code == 1
    table = result.output.splitlines()
    assert any(line.startswith("alpha ") and "0.2500" in line and "0.7500" in line for line in table)
    assert any(line.startswith("broken ") and "RuntimeError: diverged" in line for line in table)


def test_demo_refuses_unknown_entries_and_bad_topologies(manager, invoke):
    manager.register(Demos(), name="demos")
    result = invoke("demo", "--only", "keras")
    assert result.exit_code == 1 and "unknown demo entries ['keras']; installed: ['alpha', 'beta', 'broken']" in result.output
    result = invoke("demo", "--nprocs", "3", "--tensor", "2")
    assert result.exit_code == 1 and "does not divide world size 3" in result.output


def test_demo_without_any_entry(invoke):
    result = invoke("demo")
    assert result.exit_code == 1 and "no installed plugin registers a demo" in result.output
