"""The ``polyparallel`` command: ``plan``, ``plugins``, ``launch``, ``demo``, ``checkpoint``, ``trace``, ``bench-comm``."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import click

from . import hookspecs
from ._advisor import OPTIMIZER_STATES
from ._advisor_cli import bench_comm as _bench_comm
from ._advisor_cli import plan_model
from ._errors import PolyparallelError
from ._manager import get_plugin_manager
from ._routing import check_batch
from ._strategy import Strategy
from ._text import table
from ._topology import AXES, Topology
from ._trace_cli import trace

__all__ = ["main", "cli"]


def _axis_options(fn: Any) -> Any:
    for axis in reversed(AXES):
        fn = click.option(f"--{axis}", type=int, default=-1 if axis == "data" else 1, show_default=True,
                          help=f"size of the {axis} axis (-1: inferred from the world size)")(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polyparallel")
def cli() -> None:
    """One parallel-training strategy for every framework."""


@cli.command()
@click.option("--world", "world_size", type=int, required=True, help="number of ranks")
@_axis_options
@click.option("--runtime", default=None, help="also check the topology against this runtime or adapter "
                                               "(its declared capabilities), as launch does; with --model, "
                                               "advise for this runtime only")
@click.option("--batch-size", "--batch", "batch_size", type=int, default=None,
              help="also check that this global batch divides over the data axis (with --model: the batch estimated)")
@click.option("--zero", type=click.IntRange(0, 3), default=None,
              help="sharding stage over the data axis (0-3; default 0); with --runtime, checked against what it runs; "
                   "with --model, only this stage is advised [default with --model: all]")
@click.option("--precision", default=None, metavar="PRESET",
              help="numeric precision ('32', 'bf16-mixed', 'bf16-true', 'fp16-mixed'); with --runtime, checked "
                   "against what it runs")
@click.option("--accumulate", type=click.IntRange(min=1), default=1, show_default=True,
              help="micro-batches per optimizer step (the global --batch-size is micro-batch x accumulate x data)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
@click.option("--model", default=None, metavar="MODULE:FACTORY",
              help="advise a topology for this model: estimate memory, communication and step time of every "
                   "topology of --world ranks the installed runtimes accept (docs/operations/plan.md)")
@click.option("--seq-len", type=int, default=None, help="with --model: sequence length handed to the model's inputs")
@click.option("--optimizer", type=click.Choice(sorted(OPTIMIZER_STATES)), default="adam", show_default=True,
              help="with --model: optimizer whose states are estimated (adam: 2 per parameter, momentum: 1, sgd: 0)")
@click.option("--measure", type=int, default=0, show_default=True,
              help="with --model: run the K best candidates for real and print measured vs estimated")
@click.option("--steps", type=int, default=5, show_default=True, help="with --measure: timed steps per candidate")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="with --measure: seconds per candidate")
@click.pass_context
def plan(ctx: click.Context, world_size: int, as_json: bool, runtime: str | None, batch_size: int | None,
         zero: int | None, precision: str | None, accumulate: int, model: str | None, seq_len: int | None,
         optimizer: str, measure: int, steps: int, timeout: float, **sizes: int) -> None:
    """Show the rank grid, the groups of every axis and the rank roles; with --model, rank the
    topologies of --world ranks for that model."""
    if model is not None:
        fixed = {a: v for a, v in sizes.items()
                 if ctx.get_parameter_source(a) is not click.core.ParameterSource.DEFAULT}
        if world_size < 1 or any(v < 1 for v in fixed.values()):
            raise click.BadParameter(f"expected a positive --world and axis sizes. Received: world={world_size}, "
                                     f"{fixed}.")
        plan_model(get_plugin_manager(), model, world_size, batch_size, seq_len, [zero] if zero is not None
                   else [0, 1, 2, 3], fixed, optimizer, measure, steps, timeout, as_json, runtime)
        return
    zero = zero or 0
    try:
        strategy = Strategy(topology=Topology(**sizes), batch_size=batch_size, zero=zero, precision=precision,
                            accumulate=accumulate)
        topology = strategy.topology.resolve(world_size)
        if runtime is not None:
            strategy.check(runtime, world_size=world_size)  # capabilities, runtime, batch size
        else:
            check_batch(strategy.data_policy, topology, f"--batch-size {batch_size}", accumulate)
    except (PolyparallelError, ValueError) as exc:  # policies raise ValueError naming the field
        raise click.ClickException(str(exc)) from None
    policy = strategy.precision
    micro = batch_size // (topology.size("data") * accumulate) if batch_size else None
    if as_json:
        extra = {"precision": {"name": policy.name, **policy.dtypes(), "loss_scaling": policy.loss_scaling}
                 if policy is not None else None, "accumulate": accumulate,
                 "batch_size": batch_size, "micro_batch_per_rank": micro}
        click.echo(json.dumps({**topology.to_dict(), "zero": zero, **extra, **({"runtime": runtime} if runtime else {})},
                              indent=2))
        return
    click.echo(f"{topology!r}  world size {topology.world_size}" + (f"  zero={zero}" if zero else "")
               + (f"  (runs on {runtime!r})" if runtime else ""))
    if policy is not None:
        dtypes = ", ".join(f"{role} {dtype}" for role, dtype in policy.dtypes().items())
        click.echo(f"precision {policy.name or 'custom'}: {dtypes}" + (", dynamic loss scaling" if policy.loss_scaling else ""))
    if batch_size is not None or accumulate > 1:
        click.echo(f"global batch {batch_size if batch_size is not None else '(the loaders)'} = "
                   f"micro-batch {micro if micro is not None else '?'} x accumulate {accumulate} x data {topology.size('data')}")
    click.echo("")
    header = ["rank", *AXES, "roles"]
    rows = [[str(r), *(str(topology.coords(r)[a]) for a in AXES), ", ".join(sorted(topology.roles(r))) or "-"]
            for r in range(topology.world_size)]
    click.echo(table(header, rows))
    for axis in AXES:
        groups = topology.groups(axis)
        click.echo(f"\n{axis} groups ({len(groups)} of size {topology.size(axis)}): "
                   + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--all", "show_all", is_flag=True, help="include the core's own default plugin")
@click.option("--hook", "hook_name", default=None, help="only plugins implementing this hook")
def plugins(as_json: bool, show_all: bool, hook_name: str | None) -> None:
    """List installed plugins (name, version, hooks, adapters, capabilities), the runtimes with
    what they need, and the plugins that failed to load."""
    pm = get_plugin_manager()
    infos = [p for p in pm.plugins() if show_all or p.name != "polyparallel.core"]
    broken = pm.broken()
    if hook_name:
        known = sorted(n for n in vars(hookspecs) if n.startswith("polyparallel_"))
        full = hook_name if hook_name.startswith("polyparallel_") else f"polyparallel_{hook_name}"
        if full not in known:
            raise click.ClickException(f"--hook {hook_name!r} is not a polyparallel hook. Hooks: "
                                       f"{', '.join(h.removeprefix('polyparallel_') for h in known)}.")
        infos = [p for p in infos if full in p.hooks]
        broken = []
    try:
        adapters = pm.adapters()
        runtimes = pm.runtimes()
        caps = pm.capabilities()
    except PolyparallelError as exc:
        raise click.ClickException(str(exc)) from None
    records: list[dict[str, Any]] = []
    for p in infos:
        declared = [c.to_dict() for c in caps.values() if c.plugin == p.name]
        for entry in declared:
            if entry["target"] in runtimes and runtimes[entry["target"]].plugin == p.name:
                entry["missing_imports"] = runtimes[entry["target"]].missing_imports()
        records.append({
            "name": p.name, "module": p.module, "distribution": p.dist, "version": p.version,
            "hooks": list(p.hooks),
            "adapters": sorted(a.name for a in adapters.values() if a.plugin == p.name),
            "capabilities": declared, "error": None,
        })
    for b in broken:
        records.append({"name": b.name, "module": b.value, "distribution": b.dist, "version": b.version, "hooks": [],
                        "adapters": [], "capabilities": [], "error": b.error})
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    if not records:
        click.echo("no plugins installed")
        return
    rows = [[r["name"], r["version"] or "-", ", ".join(h.removeprefix("polyparallel_") for h in r["hooks"]) or "-",
             ", ".join(r["adapters"]) or "-",
             "; ".join(f"{c['target']}: {'/'.join(c['axes'])}" for c in r["capabilities"]) or "-",
             "; ".join(f"{c['target']}: {','.join(map(str, c['stages']))}" for c in r["capabilities"]) or "-"]
            for r in records if r["error"] is None]
    click.echo(table(["plugin", "version", "hooks", "adapters", "axes", "stages"], rows))
    if runtimes and not hook_name:
        click.echo("")
        click.echo(table(["runtime", "plugin", "installed", "imported", "backends", "priority"], [
            [name, c.plugin, "yes" if not c.missing_imports() else f"no (needs {', '.join(c.missing_imports())})",
             "yes" if c.imported() else "no", ", ".join(sorted(c.backends)) or "-", str(c.priority)]
            for name, c in sorted(runtimes.items())]))
        try:
            chosen = pm.resolve_runtime(Strategy())
            click.echo(f"\nautomatic choice here (Strategy(runtime=None)): {chosen or 'none: no runtime is installed'}")
        except PolyparallelError as exc:
            click.echo(f"\nautomatic choice here (Strategy(runtime=None)): none ({exc})")
    for r in records:
        if r["error"] is not None:
            click.echo(f"\nfailed to load: {r['name']} ({r['module']} from {r['distribution'] or '-'} "
                       f"{r['version'] or ''}): {r['error']}".rstrip())


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc-per-node", default="1", show_default=True,
              help="processes per node: a positive int, or auto/cpu/gpu/xpu")
@click.option("--nnodes", default="1", show_default=True, help="number of nodes, or MIN:MAX for elastic jobs")
@click.option("--node-rank", type=int, default=0, show_default=True, help="this node's rank, 0 to nnodes-1")
@click.option("--rdzv-endpoint", default=None,
              help="HOST:PORT of the rendezvous, the same on every node; required with --nnodes > 1 "
                   "[default: 127.0.0.1 and a free port, one node only]")
@click.option("--rdzv-timeout", type=float, default=300.0, show_default=True,
              help="seconds to wait for every node to join before giving up")
@click.option("--max-restarts", type=int, default=0, show_default=True)
@click.option("--trace-dir", type=click.Path(file_okay=False), default=None,
              help="every rank writes its collective trace here (read it with `polyparallel trace DIR`)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_context
def launch(ctx: click.Context, command: tuple[str, ...], **options: Any) -> None:
    """Run SCRIPT [ARGS] in many processes (delegates to the runtime's launcher, e.g. torchrun).

    Every option is checked before any process starts. Multi-node jobs run the same command on
    every node with its own --node-rank and one shared --rdzv-endpoint (a host all nodes reach,
    e.g. node 0's address, and a free port there). Under srun (one task per node), --nnodes,
    --node-rank and --rdzv-endpoint come from SLURM unless given.
    """
    from ._slurm import launch_options

    explicit = frozenset(name for name in ("nnodes", "node_rank", "rdzv_endpoint")
                         if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT)
    try:
        options = launch_options(options, explicit=explicit)
    except PolyparallelError as exc:
        raise click.ClickException(str(exc)) from None
    _check_launch_options(options)
    code = get_plugin_manager().call("polyparallel_launch_script", command=list(command), options=options)
    if code is None:
        raise click.ClickException("no installed plugin can launch scripts; install one: pip install 'polyparallel[torch]'")
    sys.exit(code)


_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's names for "one per device"


def _check_launch_options(options: dict[str, Any]) -> None:
    """Refuse bad ``launch`` options with a message naming the option and the fix."""
    def bad(option: str, message: str) -> click.BadParameter:
        return click.BadParameter(message, param_hint=f"'{option}'")

    nproc = str(options["nproc_per_node"])
    if not (nproc in _NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1)):
        raise bad("--nproc-per-node",
                  f"expected a positive int or one of {', '.join(_NPROC_WORDS)}. Received: {nproc!r}.")
    nnodes = str(options["nnodes"])
    parts = nnodes.split(":")
    if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)
            and int(parts[0]) <= int(parts[-1])):
        raise bad("--nnodes", f"expected a positive int N or MIN:MAX with 1 <= MIN <= MAX. Received: {nnodes!r}.")
    max_nodes = int(parts[-1])
    if not 0 <= options["node_rank"] < max_nodes:
        raise bad("--node-rank",
                  f"expected 0 to {max_nodes - 1} for --nnodes {nnodes}. Received: {options['node_rank']}.")
    if options["max_restarts"] < 0:
        raise bad("--max-restarts", f"expected 0 or more. Received: {options['max_restarts']}.")
    timeout = options["rdzv_timeout"]
    if not timeout > 0 or timeout == float("inf"):
        raise bad("--rdzv-timeout", f"expected a positive number of seconds. Received: {timeout!r}.")
    endpoint = options["rdzv_endpoint"]
    if endpoint is None:
        if max_nodes > 1:
            raise bad("--rdzv-endpoint", f"--nnodes {nnodes} needs an explicit HOST:PORT that every node reaches "
                      "(e.g. --rdzv-endpoint node0.example.com:29400, the same on each node); without it each "
                      "node would pick its own port and the nodes would never meet.")
        return
    host, port = _split_endpoint(endpoint)
    if host is None or port is None:
        raise bad("--rdzv-endpoint",
                  f"expected HOST:PORT (e.g. 127.0.0.1:29400 or [::1]:29400). Received: {endpoint!r}.")
    if max_nodes > 1 and port == 0:
        raise bad("--rdzv-endpoint", f"port 0 means 'any free port', which each of the {nnodes} nodes would pick "
                  f"differently: give a fixed port. Received: {endpoint!r}.")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise bad("--rdzv-endpoint", f"cannot resolve host {host!r} ({exc.strerror or exc}): use a host name or "
                  f"address this node can reach. Received: {endpoint!r}.") from None


def _split_endpoint(endpoint: str) -> tuple[str | None, int | None]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None, None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address needs brackets, or its last group reads as the port
        return None, None
    return host, int(port)


@cli.command()
@click.option("--nprocs", type=int, default=2, show_default=True, help="processes per framework")
@_axis_options
@click.option("--only", multiple=True, help="run only these demo entries (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="print JSON rows (with each entry's per-step losses)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="demo-output", show_default=True,
              help="folder for the table (results.txt), the rows (results.json), the loss curves (loss-curves.png) "
                   "and the frameworks' own output (demo-warnings.log)")
@click.option("--show-output", is_flag=True, help="let the frameworks print their warnings and banners on the terminal "
                                                  "instead of logging them to demo-warnings.log")
def demo(nprocs: int, only: tuple[str, ...], as_json: bool, out_dir: str, show_output: bool, **sizes: int) -> None:
    """Train the demo problem with one Strategy through every installed plugin, side by side: a
    progress line per framework, the results table, and every framework's loss curve on one plot."""
    from . import _demo_report

    entries: dict[str, Any] = {}
    get_plugin_manager().call("polyparallel_register_demos", register=lambda name, run: entries.__setitem__(name, run))
    if only:
        missing = sorted(set(only) - set(entries))
        if missing:
            raise click.ClickException(f"unknown demo entries {missing}; installed: {sorted(entries) or 'none'}")
        entries = {k: v for k, v in entries.items() if k in only}
    if not entries:
        raise click.ClickException("no installed plugin registers a demo; install one: pip install 'polyparallel[torch]'")
    try:
        strategy = Strategy(topology=Topology(**sizes), timeout=120.0, seed=0)
        strategy.topology.resolve(nprocs)
    except PolyparallelError as exc:
        raise click.ClickException(str(exc)) from None
    out = Path(out_dir)
    reports = _demo_report.run_entries(entries, strategy, nprocs, out, show_output=show_output)
    rows = [r.row for r in reports]

    def fmt(v: Any, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) else str(v)
    text = table(["framework", "topology", "final loss", "accuracy", "step time (ms)", "error"], [
        [r["framework"], r["topology"], fmt(r.get("final_loss", "-"), ".4f"), fmt(r.get("accuracy", "-"), ".4f"),
         fmt(r.get("step_time_ms", "-"), ".2f"), r.get("error", "")] for r in rows])
    _demo_report.write_results(rows, text, out)
    title = f"polyparallel demo: one Strategy, {strategy.topology.resolve(nprocs)!r} on {nprocs} processes"
    after = [_demo_report.draw_loss_curves(rows, out / _demo_report.PLOT_NAME, title),
             f"table and rows: {out / _demo_report.TABLE_NAME}, {out / _demo_report.RESULTS_NAME}",
             *_demo_report.summary_lines(reports, out, show_output)]
    if as_json:  # stdout holds the JSON alone
        for line in after:
            click.echo(line, err=True)
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(text)
        click.echo()
        for line in after:
            click.echo(line)
    if any(r.failed for r in reports):
        sys.exit(1)


@cli.group()
def checkpoint() -> None:
    """Look into (inspect) and consolidate (export) checkpoints written by Strategy.save."""


@checkpoint.command("inspect")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
@click.option("--no-tensors", is_flag=True, help="do not list the tensors")
@click.option("--no-verify", is_flag=True, help="check the files' sizes only, not their SHA-256 (reads nothing)")
def checkpoint_inspect(path: str, as_json: bool, no_tensors: bool, no_verify: bool) -> None:
    """What the checkpoint PATH holds (topology written at, progress, tensors and shapes), or
    the checkpoints of the folder PATH. Verifies every file against the size and SHA-256 recorded
    when it was written. Exits 1 for a checkpoint that is not committed (a staging directory
    included) or whose files do not match."""
    from ._checkpoint_info import describe, render

    info = describe(path, tensors=not no_tensors, verify=not no_verify)
    click.echo(json.dumps(info, indent=1, default=str) if as_json else render(info))
    if info["kind"] == "uncommitted" or "problem" in info:
        sys.exit(1)


@checkpoint.command("export")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--to", "to", type=click.Choice(["torch", "safetensors"]), required=True,
              help="torch: model, optimizer and extras in one torch.load(weights_only=True) file; "
                   "safetensors: the model's tensors")
@click.option("-o", "--output", default=None, help="the file to write (default: PATH.pt / PATH.safetensors)")
def checkpoint_export(path: str, to: str, output: str | None) -> None:
    """Write the committed checkpoint PATH, written at any topology, as one consolidated file that
    loads without polyparallel (after verifying every file's SHA-256)."""
    import os

    from ._checkpoint_export import export
    from ._errors import CheckpointError

    try:
        written = export(path, to, output, plugin_manager=get_plugin_manager())
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written} ({os.path.getsize(written)} bytes)")


@cli.command("bench-comm")
@click.option("--world", type=int, default=2, show_default=True, help="processes to measure on")
@click.option("--sizes", default="4096,262144,4194304", show_default=True, help="message sizes in bytes, comma-separated")
@click.option("--iters", type=int, default=20, show_default=True, help="timed repetitions per size")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="seconds before the run is stopped")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def bench_comm(world: int, sizes: str, iters: int, timeout: float, as_json: bool) -> None:
    """Measure all-reduce / all-gather bus bandwidth and latency (and the FLOP rate) on this machine,
    and cache it for `plan --model` ($POLYPARALLEL_CACHE_DIR, else $XDG_CACHE_HOME/polyparallel)."""
    try:
        parsed = [int(x) for x in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected integers separated by commas. Received: {sizes!r}.",
                                 param_hint="'--sizes'") from None
    _bench_comm(get_plugin_manager(), world, parsed, iters, timeout, as_json)


cli.add_command(trace)  # polyparallel trace DIR (_trace_cli.py)


def main() -> None:
    """Entry point of the ``polyparallel`` script."""
    cli(prog_name="polyparallel")


if __name__ == "__main__":
    main()
