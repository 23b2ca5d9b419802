"""Bad input to the core's public API, refused clearly before any process starts.

One probe per public argument (and the usual mistakes with it) of ``Strategy``, ``Topology``, the
policies, the operations, ``adapt``/``check``, ``launch`` and the ``plan``/``plugins`` commands.
Each must raise a polyparallel error (or the ``TypeError``/``ValueError`` Python users expect)
whose message says what was received, what was expected, or what to do, matched here; and a
launch probe must not have reached the runtime's launcher. This module is the probe list
across modules; each module's own tests cover its behaviour in depth.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

import polyparallel as pp
from polyparallel import DataPolicy, GradPolicy, Mean, MetricPolicy, StatePolicy, Strategy, Topology
from polyparallel import cli as cli_module

Probe = tuple[str, Callable[[Any], Any], type, str]


def train(x: int = 0) -> int:
    return x


class Serial:
    """A runtime ("serial", data axis only) whose launcher records being reached."""

    def __init__(self) -> None:
        self.launched = 0

    @pp.hookimpl
    def polyparallel_capabilities(self):
        return pp.Capabilities("serial", axes={"data"}, backends={"ring"})

    @pp.hookimpl
    def polyparallel_launch(self, fn, nprocs, args, kwargs):
        self.launched += 1
        return [fn(*args, **kwargs) for _ in range(nprocs)]

    @pp.hookimpl
    def polyparallel_register_adapters(self, register):
        register("loop", lambda strategy: strategy, capabilities=pp.Capabilities("loop", runtimes={"serial"}))


class CommandFailed(Exception):
    """A ``polyparallel`` command that exited non-zero; the message is its output."""


def command(*args: str) -> None:
    result = CliRunner().invoke(cli_module.cli, list(args))
    if result.exit_code != 0:
        raise CommandFailed(f"exit {result.exit_code}: {result.output}")


def S(pm: pp.PluginManager, *args: Any, **kwargs: Any) -> Strategy:
    return Strategy(*args, plugin_manager=pm, **kwargs)


PROBES: list[Probe] = [
    # -- Strategy ------------------------------------------------------------------------------------------------
    ("strategy-data-zero", lambda pm: S(pm, data=0), pp.TopologyError,
     r"Topology axis 'data' must be a positive size or -1 \(inferred from the world size\)\. Received: data=0\."),
    ("strategy-data-str", lambda pm: S(pm, data="2"), pp.TopologyError,
     r"Topology axis 'data' must be an int .* Received: data='2' of type str\."),
    ("strategy-two-inferred", lambda pm: S(pm, tensor=-1, pipeline=-1), pp.TopologyError,
     r"At most one topology axis may be -1 .* Give all but one a fixed size\."),
    ("strategy-sizes-and-topology", lambda pm: S(pm, data=2, topology=Topology()), pp.TopologyError,
     r"Strategy takes axis sizes or topology=, not both\. Received \{'data': 2\}"),
    ("strategy-topology-dict", lambda pm: S(pm, topology={"data": 2}), pp.TopologyError,
     r"Strategy\(topology=\) must be a Topology\. Received: dict\."),
    ("strategy-five-positional", lambda pm: Strategy(2, 2, 2, 2), TypeError,
     r"takes from 1 to 4 positional arguments but 5 were given"),
    ("strategy-timeout-zero", lambda pm: S(pm, timeout=0), pp.TopologyError,
     r"Strategy\(timeout=\) must be a positive number of seconds\. Received: 0\."),
    ("strategy-timeout-str", lambda pm: S(pm, timeout="60"), pp.TopologyError,
     r"Strategy\(timeout=\) must be a positive number of seconds\. Received: '60'\."),
    ("strategy-seed-str", lambda pm: S(pm, seed="0"), pp.TopologyError, r"Strategy\(seed=\) must be an int\. Received: '0'\."),
    ("strategy-batch-zero", lambda pm: S(pm, batch_size=0), ValueError,
     r"DataPolicy\.batch_size must be a positive int or None\. Received: 0\."),
    ("strategy-batch-str", lambda pm: S(pm, batch_size="64"), ValueError,
     r"DataPolicy\.batch_size must be a positive int or None\. Received: '64'\."),
    ("strategy-batch-not-dividing", lambda pm: S(pm, data=4, batch_size=10), pp.TopologyError,
     r"the global batch size 10 does not divide over data=4 ranks .* Use a multiple of 4 \(8 or 12\)"),
    ("strategy-backend-int", lambda pm: S(pm, backend=1), pp.TopologyError,
     r"Strategy\(backend=\) must be a name \(a non-empty string\) or None\. Received: 1\."),
    ("strategy-backend-jax", lambda pm: S(pm, backend="jax"), pp.TopologyError,
     r"Strategy\(backend='jax'\) is not a communication backend: JAX is a runtime\. Use Strategy\(runtime='jax'\)"),
    ("strategy-backend-unknown", lambda pm: S(pm, backend="mpi").check(), pp.TopologyError,
     r"Strategy\(backend='mpi'\) is not a backend of the runtime 'serial' \(plugin 'serial'\): it accepts 'ring'\. "
     r"Use one of them, or backend=None to let the runtime choose\."),
    ("strategy-backend-of-explicit-runtime", lambda pm: S(pm, runtime="serial", backend="nccl").session(),
     pp.TopologyError, r"Strategy\(backend='nccl'\) is not a backend of the runtime 'serial' \(plugin 'serial'\): "
                       r"it accepts 'ring'\."),
    ("strategy-runtime-empty", lambda pm: S(pm, runtime=""), pp.TopologyError,
     r"Strategy\(runtime=\) must be a name \(a non-empty string\) or None\. Received: ''\."),
    ("strategy-runtime-unknown", lambda pm: S(pm, runtime="tpu").session(), pp.NoPluginError,
     r"Strategy\(runtime='tpu'\) names the runtime 'tpu', which no installed plugin provides\. Runtimes: serial\."),
    ("strategy-data-policy", lambda pm: S(pm, data_policy=GradPolicy()), pp.TopologyError,
     r"Strategy\(data_policy=\) must be a DataPolicy\. Received: GradPolicy"),
    ("strategy-grad-policy", lambda pm: S(pm, grad_policy="sum"), pp.TopologyError,
     r"Strategy\(grad_policy=\) must be a GradPolicy\. Received: 'sum'\."),
    ("strategy-metric-policy", lambda pm: S(pm, metric_policy={"op": "sum"}), pp.TopologyError,
     r"Strategy\(metric_policy=\) must be a MetricPolicy\."),
    ("strategy-state-policy", lambda pm: S(pm, state_policy=[("*", "local")]), pp.TopologyError,
     r"Strategy\(state_policy=\) must be a StatePolicy\."),
    ("strategy-state-policy-action", lambda pm: S(pm, state_policy={"bn.*": "avg"}), ValueError,
     r"StatePolicy action for 'bn\.\*' must be one of 'mean', 'broadcast', 'local'\. Received: 'avg'\."),
    ("strategy-plugin-manager", lambda pm: Strategy(plugin_manager="default"), pp.TopologyError,
     r"Strategy\(plugin_manager=\) must be a polyparallel\.PluginManager or None\. Received: str\."),
    ("strategy-zero-out-of-range", lambda pm: S(pm, zero=4), pp.TopologyError,
     r"Strategy\(zero=\) must be one of 0, 1, 2, 3 \(0 replicate, 1 optimizer state, 2 \+ gradients, 3 \+ parameters\)\. "
     r"Received: 4\."),
    ("strategy-zero-bool", lambda pm: S(pm, zero=True), pp.TopologyError, r"Strategy\(zero=\) must be one of .* Received: True\."),
    ("strategy-shard-policy", lambda pm: S(pm, shard_policy=3), pp.TopologyError,
     r"Strategy\(shard_policy=\) must be a ShardPolicy\. Received: 3\."),
    ("strategy-zero-and-shard-policy", lambda pm: S(pm, zero=1, shard_policy=pp.ShardPolicy(stage=2)), pp.TopologyError,
     r"Strategy takes zero= or shard_policy=, not two different stages\. Received zero=1 and ShardPolicy\(stage=2\)\."),
    ("strategy-zero-unsupported", lambda pm: S(pm, data=2, zero=3).check(), pp.UnsupportedTopologyError,
     r"'serial' \(plugin 'serial'\) cannot run sharding stage zero=3: it runs stage\(s\) 0\. Set Strategy\(zero=\) "
     r"to one of them"),
    ("launch-zero-unsupported", lambda pm: pp.launch(train, S(pm, data=2, zero=2), nprocs=2),
     pp.UnsupportedTopologyError, r"'serial' \(plugin 'serial'\) cannot run sharding stage zero=2"),
    ("adapt-zero-unsupported", lambda pm: S(pm, data=2, zero=1).adapt("loop"), pp.UnsupportedTopologyError,
     r"cannot run sharding stage zero=1: it runs stage\(s\) 0\."),
    ("shard-policy-stage", lambda pm: pp.ShardPolicy(stage="3"), ValueError,
     r"ShardPolicy\.stage must be one of 0, 1, 2, 3 .* Received: '3'\."),
    ("capabilities-stages", lambda pm: pp.Capabilities("x", stages={4}), ValueError,
     r"Capabilities\('x', stages=\) must be a non-empty collection of stages from \(0, 1, 2, 3\)\. Received: \{4\}\."),
    ("plan-zero", lambda pm: command("plan", "--world", "2", "--zero", "5"), CommandFailed,
     r"Invalid value for '--zero': 5 is not in the range 0<=x<=3"),
    ("replace-unknown-field", lambda pm: S(pm).replace(batch=1), TypeError,
     r"Strategy\.replace\(\) got unknown fields \['batch'\]; expected"),
    ("replace-batch-not-dividing", lambda pm: S(pm, data=2, batch_size=8).replace(data=3), pp.TopologyError,
     r"the global batch size 8 does not divide over data=3 ranks"),
    # -- Topology ------------------------------------------------------------------------------------------------
    ("topology-unknown-axis", lambda pm: Topology(expert=2), pp.TopologyError,
     r"Unknown topology axis expert\. Expected axes: pipeline, data, tensor\."),
    ("topology-positional", lambda pm: Topology(2), TypeError, r"takes 1 positional argument but 2 were given"),
    ("topology-resolve-mismatch", lambda pm: Topology(data=2).resolve(3), pp.TopologyError,
     r"Topology\(pipeline=1, data=2, tensor=1\) needs 2 ranks but the world size is 3\. Launch 2 processes, or set "
     r"one axis to -1"),
    ("topology-resolve-str", lambda pm: Topology(data=-1).resolve("4"), pp.TopologyError,
     r"world size must be a positive int\. Received: '4'\."),
    ("topology-coords-range", lambda pm: Topology(data=2).coords(5), pp.TopologyError,
     r"rank 5 is out of range for Topology\(pipeline=1, data=2, tensor=1\); expected an int in \[0, 2\)\."),
    ("topology-groups-axis", lambda pm: Topology(data=2).groups("dp"), pp.TopologyError,
     r"Unknown topology axis 'dp'\. Expected one of: pipeline, data, tensor\."),
    ("topology-rank-of-range", lambda pm: Topology(data=2).rank_of(data=2), pp.TopologyError,
     r"rank_of\(\): coordinate data=2 is out of range .* expected an int in \[0, 2\)\."),
    ("topology-unresolved", lambda pm: Topology(data=-1).world_size, pp.TopologyError,
     r"has an axis of size -1; call \.resolve\(world_size\) before world_size\."),
    ("topology-role", lambda pm: Topology(data=2).ranks_with_role("leader"), pp.TopologyError,
     r"Unknown role 'leader'\. Expected one of: logger, loss, metrics, checkpoint\."),
    # -- policies ------------------------------------------------------------------------------------------------
    ("grad-bucket-str", lambda pm: GradPolicy(bucket_mb="25"), ValueError,
     r"GradPolicy\.bucket_mb must be a number of megabytes \(> 0\) or None\. Received: '25' \(str\)\."),
    ("grad-bucket-zero", lambda pm: GradPolicy(bucket_mb=0), ValueError, r"GradPolicy\.bucket_mb must be > 0\. Received: 0\."),
    ("grad-bucket-inf", lambda pm: GradPolicy(bucket_mb=float("inf")), ValueError,
     r"GradPolicy\.bucket_mb must be > 0\. Received: inf\."),
    ("grad-op", lambda pm: GradPolicy(op="max"), ValueError, r"GradPolicy\.op must be one of 'mean', 'sum'\. Received: 'max'\."),
    ("metric-op", lambda pm: MetricPolicy("median"), ValueError,
     r"MetricPolicy\.op must be one of 'mean', 'sum', 'max', 'min'\. Received: 'median'\."),
    ("metric-ops-str", lambda pm: MetricPolicy(ops="sum"), ValueError,
     r"MetricPolicy\(ops=\) must be a mapping of metric name \(str\) -> op, e\.g\. \{'samples': 'sum'\}, or a list of "
     r"such pairs\. Received: 'sum'\."),
    ("metric-ops-pairs", lambda pm: MetricPolicy(ops=[("samples",)]), ValueError,
     r"MetricPolicy\(ops=\) must be a mapping .* Received: \[\('samples',\)\]\."),
    ("metric-ops-twice", lambda pm: MetricPolicy(ops=[("a", "sum"), ("a", "max")]), ValueError,
     r"MetricPolicy\(ops=\) names a metric twice"),
    ("metric-ops-value", lambda pm: MetricPolicy(ops={"acc": "avg"}), ValueError,
     r"MetricPolicy\.ops\['acc'\] must be one of 'mean', 'sum', 'max', 'min'\. Received: 'avg'\."),
    ("state-rules-str", lambda pm: StatePolicy("mean"), ValueError,
     r"StatePolicy\(rules=\) must be a mapping of name pattern \(str\) -> action, .* Received: 'mean'\."),
    ("state-default", lambda pm: StatePolicy(default="sum"), ValueError,
     r"StatePolicy\.default must be one of 'mean', 'broadcast', 'local'\. Received: 'sum'\."),
    ("state-use-defaults", lambda pm: StatePolicy(use_defaults="no"), ValueError,
     r"StatePolicy\.use_defaults must be True or False\. Received: 'no'\."),
    ("data-remainder", lambda pm: DataPolicy(remainder="wrap"), ValueError,
     r"DataPolicy\.remainder must be one of 'pad', 'drop', 'uneven'\. Received: 'wrap'\."),
    ("mean-str", lambda pm: Mean("0.5", 1), TypeError,
     r"Mean\(total=\) must be a number or a scalar tensor/array\. Received: '0\.5'; convert it first: float\('0\.5'\)\."),
    ("mean-count-none", lambda pm: Mean(1.0, None), TypeError, r"Mean\(count=\) must be a number .* Received: None\."),
    # -- the operations ------------------------------------------------------------------------------------------
    ("reduce-str-value", lambda pm: S(pm).reduce_metrics({"loss": "0.5"}), TypeError,
     r"reduce_metrics\(\): metric 'loss' is str '0\.5'; expected a number, a polyparallel\.Mean, or a scalar "
     r"tensor/array of the runtime\. Convert it first: float\('0\.5'\)\."),
    ("reduce-list-value", lambda pm: S(pm).reduce_metrics({"loss": [0.5, 0.4]}), TypeError,
     r"reduce_metrics\(\): metric 'loss' is list \[0\.5, 0\.4\]; expected a number"),
    ("reduce-none-value", lambda pm: S(pm).reduce_metrics({"loss": None}), TypeError,
     r"reduce_metrics\(\): metric 'loss' is NoneType None; expected a number"),
    ("reduce-name", lambda pm: S(pm).reduce_metrics({1: 0.5}), TypeError,
     r"reduce_metrics\(\): metric names must be strings\. Received the name 1 \(int\)\."),
    ("reduce-not-mapping", lambda pm: S(pm).reduce_metrics([("loss", 0.5)]), TypeError,
     r"reduce_metrics\(\) takes a mapping of name -> value\. Received: list\."),
    ("shard-unknown-option", lambda pm: S(pm).shard_data(range(8), shufle=False), TypeError,
     r"shard_data\(\) got unknown option\(s\) shufle; the options are the DataPolicy fields: batch_size, shuffle, "
     r"remainder\."),
    ("shard-bad-remainder", lambda pm: S(pm).shard_data(range(8), remainder="wrap"), ValueError,
     r"DataPolicy\.remainder must be one of"),
    ("shard-batch-not-dividing", lambda pm: (os.environ.update(WORLD_SIZE="2"),  # restored after the test
                                             S(pm).shard_data(range(8), batch_size=7)), pp.TopologyError,
     r"shard_data\(\): the global batch size 7 does not divide over data=2 ranks"),
    ("adapt-name-type", lambda pm: S(pm).adapt(3), TypeError,
     r"adapt\(name=\) must be an adapter name such as 'lightning'\. Received: 3\."),
    ("adapt-unknown", lambda pm: S(pm).adapt("keras"), pp.NoPluginError,
     r"No adapter named 'keras' is registered\. Registered adapters: loop\. Install its extra: "
     r"pip install 'polyparallel\[keras\]'\."),
    ("check-target-type", lambda pm: S(pm).check(3), TypeError,
     r"check\(target=\) must be a runtime or adapter name\. Received: 3\."),
    ("check-unknown-target", lambda pm: S(pm).check("tpu"), pp.NoPluginError,
     r"No installed plugin provides the target 'tpu'\. Known targets: loop, serial\."),
    ("check-world-size", lambda pm: S(pm).check("serial", world_size=0), pp.TopologyError,
     r"world size must be a positive int\. Received: 0\."),
    # -- launch --------------------------------------------------------------------------------------------------
    ("launch-strategy-str", lambda pm: pp.launch(train, "data=2", 2), TypeError,
     r"launch\(strategy=\) must be a polyparallel\.Strategy\. Received: str 'data=2'\. Build one, e\.g\. "
     r"polyparallel\.Strategy\(data=2\)\."),
    ("launch-fn-str", lambda pm: pp.launch("train.py", S(pm), 2), TypeError,
     r"launch\(fn=\) must be a callable .* For a script, use `polyparallel launch script\.py` instead\."),
    ("launch-nprocs-zero", lambda pm: pp.launch(train, S(pm), 0), pp.TopologyError,
     r"launch\(nprocs=\) must be a positive int\. Received: 0\."),
    ("launch-nprocs-str", lambda pm: pp.launch(train, S(pm), "2"), pp.TopologyError,
     r"launch\(nprocs=\) must be a positive int\. Received: '2'\."),
    ("launch-timeout-str", lambda pm: pp.launch(train, S(pm), 2, timeout="60"), pp.TopologyError,
     r"launch\(timeout=\) must be None \(no limit\) or a positive, finite number of seconds\. Received: '60'\."),
    ("launch-timeout-zero", lambda pm: pp.launch(train, S(pm), 2, timeout=0), pp.TopologyError,
     r"launch\(timeout=\) must be None .* Received: 0\."),
    ("launch-timeout-inf", lambda pm: pp.launch(train, S(pm), 2, timeout=float("inf")), pp.TopologyError,
     r"launch\(timeout=\) must be None .* Received: inf\."),
    ("launch-timeout-bool", lambda pm: pp.launch(train, S(pm), 2, timeout=True), pp.TopologyError,
     r"launch\(timeout=\) must be None .* Received: True\."),
    ("launch-args-int", lambda pm: pp.launch(train, S(pm), 2, args=5), TypeError,
     r"launch\(args=\) must be a tuple or list of arguments for fn\. Received: int 5\. For one argument write "
     r"args=\(value,\)\."),
    ("launch-args-str", lambda pm: pp.launch(train, S(pm), 2, args="ab"), TypeError,
     r"launch\(args=\) must be a tuple or list .* Received: str 'ab'\."),
    ("launch-kwargs-list", lambda pm: pp.launch(train, S(pm), 2, kwargs=[1]), TypeError,
     r"launch\(kwargs=\) must be a mapping of argument name \(str\) -> value, or None\. Received: \[1\]\."),
    ("launch-kwargs-keys", lambda pm: pp.launch(train, S(pm), 2, kwargs={1: 2}), TypeError,
     r"launch\(kwargs=\) must be a mapping of argument name \(str\) -> value"),
    ("launch-lambda", lambda pm: pp.launch(lambda: 1, S(pm), 2), TypeError,
     r"launch\(\): fn, args and kwargs must be picklable to reach the processes: fn is a lambda, which cannot be "
     r"pickled: define it with `def` at the top level of a module"),
    ("launch-world-mismatch", lambda pm: pp.launch(train, S(pm, data=2), 3), pp.TopologyError,
     r"Topology\(pipeline=1, data=2, tensor=1\) needs 2 ranks but the world size is 3"),
    ("launch-batch", lambda pm: pp.launch(train, S(pm, batch_size=8), 3), pp.TopologyError,
     r"nprocs=3\): the global batch size 8 does not divide over data=3 ranks"),
    ("launch-capabilities", lambda pm: pp.launch(train, S(pm, tensor=2), 4), pp.UnsupportedTopologyError,
     r"'serial' \(plugin 'serial'\) cannot run tensor=2: it supports parallelism along data only\. Set tensor=1"),
    ("launch-runtime-type", lambda pm: pp.launch(train, S(pm), 2, runtime=3), TypeError,
     r"launch\(runtime=\) must be a runtime or adapter name, or None\. Received: 3\."),
    ("launch-runtime-unknown", lambda pm: pp.launch(train, S(pm), 2, runtime="tpu"), pp.NoPluginError,
     r"No installed plugin provides the target 'tpu'"),
    ("launch-backend", lambda pm: pp.launch(train, S(pm, backend="nccl"), 2), pp.TopologyError,
     r"Strategy\(backend='nccl'\) is not a backend of the runtime 'serial' \(plugin 'serial'\): it accepts 'ring'"),
    # -- commands ------------------------------------------------------------------------------------------------
    ("plan-world-zero", lambda pm: command("plan", "--world", "0"), CommandFailed,
     r"exit 1: Error: world size must be a positive int\. Received: 0\."),
    ("plan-world-str", lambda pm: command("plan", "--world", "eight"), CommandFailed,
     r"(?s)exit 2: .*Invalid value for '--world': 'eight' is not a valid integer"),
    ("plan-axis", lambda pm: command("plan", "--world", "8", "--tensor", "0"), CommandFailed,
     r"Error: Topology axis 'tensor' must be a positive size or -1"),
    ("plan-not-dividing", lambda pm: command("plan", "--world", "8", "--tensor", "3"), CommandFailed,
     r"Error: Topology\(pipeline=1, tensor=3\) does not divide world size 8"),
    ("plan-batch", lambda pm: command("plan", "--world", "4", "--batch-size", "6"), CommandFailed,
     r"Error: --batch-size 6: the global batch size 6 does not divide over data=4 ranks"),
    ("plan-runtime", lambda pm: command("plan", "--world", "4", "--runtime", "no_such_runtime"), CommandFailed,
     r"Error: No installed plugin provides the target 'no_such_runtime'"),
    ("plugins-hook", lambda pm: command("plugins", "--hook", "shard_dat"), CommandFailed,
     r"Error: --hook 'shard_dat' is not a polyparallel hook\. Hooks: adapter_bridge, capabilities,"),
]


@pytest.mark.parametrize(("probe", "error", "message"), [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_bad_input_is_refused_clearly_before_any_process_starts(manager, monkeypatch, probe, error, message):
    serial = Serial()
    manager.register(serial, name="serial")
    monkeypatch.setattr(pp._manager, "_default", manager)  # Strategy() without plugin_manager= uses it too
    with pytest.raises(error, match=message):
        probe(manager)
    assert serial.launched == 0


def test_every_probe_is_distinct():
    assert len({p[0] for p in PROBES}) == len(PROBES)
