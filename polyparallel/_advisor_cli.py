"""``polyparallel plan --model`` and ``polyparallel bench-comm``: the command side of the advisor.

The advisors come from the ``polyparallel_register_advisors`` hook (one per runtime; the torch
plugin registers :class:`polyparallel_torch.advisor.TorchAdvisor`); the estimates from
:mod:`polyparallel._advisor`. Every input is checked before any process starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import click

from ._advisor import OPTIMIZER_STATES, Advisor, Candidate, ModelProfile, advise, load_links, save_links
from ._errors import PolyparallelError, exception_summary
from ._manager import PluginManager
from ._text import table
from ._topology import Topology

__all__ = ["plan_model", "bench_comm"]

MIB = 1024 * 1024


def advisors(pm: PluginManager) -> dict[str, Advisor]:
    """Runtime name -> advisor, for the runtimes installed here that registered one."""
    found: dict[str, Advisor] = {}
    pm.call("polyparallel_register_advisors", register=lambda runtime, advisor: found.__setitem__(runtime, advisor))
    runtimes = pm.runtimes()
    return {name: a for name, a in found.items() if name in runtimes and not runtimes[name].missing_imports()}


def _runtime_check(pm: PluginManager, runtime: str) -> Callable[[Topology, int], str | None]:
    capabilities = pm.runtimes()[runtime]

    def check(topology: Topology, stage: int) -> str | None:
        try:
            capabilities.check(topology, stage)
        except PolyparallelError as exc:
            return str(exc)
        return None
    return check


def plan_model(pm: PluginManager, model: str, world: int, batch: int | None, seq_len: int | None,
               stages: Sequence[int], fixed: Mapping[str, int], optimizer: str, measure: int, steps: int,
               timeout: float, as_json: bool, runtime: str | None = None) -> None:
    """Profile ``model``, estimate every topology of ``world`` ranks, print them ranked (and the
    refused ones with their reasons); with ``measure`` > 0 run the top ones for real.

    :param fixed: axis sizes the user pinned (``--tensor 2``).
    :param runtime: only this runtime's advisor (``--runtime``).
    """
    pinned = 1
    for size in fixed.values():
        pinned *= size
    if world % pinned:
        raise click.BadParameter(f"the pinned axes {dict(fixed)} need a multiple of {pinned} ranks; --world is "
                                 f"{world}. Change --world or the axis sizes.")
    if batch is None or batch < 1:
        raise click.BadParameter(f"--model needs the global batch size: --batch B (a positive int). Received: {batch}.",
                                 param_hint="'--batch'")
    if seq_len is not None and seq_len < 1:
        raise click.BadParameter(f"expected a positive int. Received: {seq_len}.", param_hint="'--seq-len'")
    if measure < 0 or steps < 1:
        raise click.BadParameter(f"--measure must be >= 0 and --steps >= 1. Received: {measure}, {steps}.")
    if measure:
        _check_timeout(timeout)
    found = advisors(pm)
    if not found:
        raise click.ClickException("no installed runtime registers a topology advisor; install one: "
                                   "pip install 'polyparallel[torch]'")
    if runtime is not None:
        if runtime not in found:
            raise click.BadParameter(f"{runtime!r} is not an installed runtime with a topology advisor; those "
                                     f"are: {', '.join(sorted(found))}.", param_hint="'--runtime'")
        found = {runtime: found[runtime]}
    profiles: list[tuple[ModelProfile, Advisor]] = []
    for _, advisor in sorted(found.items()):
        try:
            profile = advisor.profile(model, batch, seq_len)
        except (ValueError, TypeError, ImportError, AttributeError, RuntimeError, PolyparallelError) as exc:
            # a bad --model (or what its factory builds): a usage error, like every other bad option
            message = str(exc) if str(exc).startswith("--model") else f"--model {model}: {exception_summary(exc)}"
            raise click.UsageError(message) from None
        if profile is not None:
            profiles.append((profile, advisor))
    if not profiles:
        raise click.UsageError(f"--model {model}: no installed advisor ({', '.join(sorted(found))}) understands "
                               "the object its factory returns.")
    links = load_links(world)
    states = OPTIMIZER_STATES[optimizer]
    rows: list[Candidate] = []
    for profile, _ in profiles:
        rows += advise(profile, world, batch, stages, links, _runtime_check(pm, profile.runtime), fixed, states)
    accepted = sorted((c for c in rows if c.refused is None), key=lambda c: (c.step_s, c.memory["total"]))
    refused = [c for c in rows if c.refused is not None]
    measured: list[dict[str, Any]] = []
    if measure:
        for candidate in accepted[:measure]:
            advisor = dict((p.runtime, a) for p, a in profiles)[candidate.runtime]
            click.echo(f"measuring {candidate.label()} on {world} processes ...", err=True)
            try:
                (result,) = advisor.measure(model, batch, seq_len, [(candidate.topology, candidate.stage)], steps,
                                            optimizer, timeout)
            except Exception as exc:  # one failing run must not hide the others' figures
                result = {"error": exception_summary(exc)}
            measured.append({"candidate": candidate.to_dict(), **result})
    if as_json:
        click.echo(json.dumps({"model": [p.summary() for p, _ in profiles], "world": world, "batch": batch,
                               "seq_len": seq_len, "optimizer": optimizer, "optimizer_states": states,
                               "links": {**vars(links)}, "candidates": [c.to_dict() for c in accepted + refused],
                               "measured": measured}, indent=2))
    else:
        _print_plan(profiles, links, optimizer, states, world, batch, accepted, refused, measured)
    if not accepted:
        raise click.ClickException(f"no topology of {world} ranks is accepted for --model {model} (every candidate "
                                   "is refused, with its reason, above): change --world, the pinned axes or --zero.")


def _check_timeout(timeout: float) -> None:
    if not timeout > 0 or timeout == float("inf"):  # NaN fails the first test
        raise click.BadParameter(f"expected a positive, finite number of seconds. Received: {timeout!r}.",
                                 param_hint="'--timeout'")


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def _print_plan(profiles: list[tuple[ModelProfile, Advisor]], links: Any, optimizer: str, states: int, world: int,
                batch: int, accepted: list[Candidate], refused: list[Candidate], measured: list[dict[str, Any]]) -> None:

    for profile, _ in profiles:
        s = profile.summary()
        click.echo(f"model {s['model']} ({profile.runtime}): {s['layers']} layers, {_mib(s['parameters_bytes'])} MiB "
                   f"of parameters, {s['flops_per_sample'] / 1e6:.1f} MFLOP per sample (forward + backward)")
    click.echo(f"world {world}, global batch {batch}, optimizer {optimizer} ({states} state(s) per parameter)")
    click.echo(f"links: all-reduce {links.allreduce_busbw / 1e9:.2f} GB/s, all-gather {links.allgather_busbw / 1e9:.2f} "
               f"GB/s bus bandwidth, latency {links.latency * 1e6:.0f} us, {links.flops / 1e9:.1f} GFLOP/s per rank: "
               f"{links.source}\n")
    header = ["#", "runtime", "topology", "mb", "step ms", "compute", "data", "tensor", "pipe", "params", "grads",
              "optim", "acts", "buffers", "total MiB", "comm MiB d/t/p"]
    body = []
    for i, c in enumerate(accepted, 1):
        m, t, v = c.memory, c.time_s, c.comm_bytes
        body.append([str(i), c.runtime, c.label(), str(c.microbatches), f"{c.step_s * 1e3:.2f}",
                     *(f"{t[k] * 1e3:.2f}" for k in ("compute", "data", "tensor", "pipeline")),
                     *(_mib(m[k]) for k in ("parameters", "gradients", "optimizer", "activations", "buffers", "total")),
                     "/".join(_mib(v[k]) for k in ("data", "tensor", "pipeline"))])
    click.echo("estimated per rank (the rank holding the most), ranked by step time:")
    click.echo(table(header, body) if body else "  (none accepted)")
    if refused:
        click.echo("\nrefused:")
        for c in refused:
            click.echo(f"  {c.runtime} {c.label()}: {c.refused}")
    if measured:
        click.echo("\nmeasured vs estimated (parameters + gradients + optimizer state, the largest rank):")
        rows = []
        for entry in measured:
            cand = entry["candidate"]
            label = f"data={cand['data']} tensor={cand['tensor']} pipeline={cand['pipeline']} zero={cand['zero']}"
            est = sum(cand["memory_bytes"][k] for k in ("parameters", "gradients", "optimizer"))
            if "error" in entry:
                rows.append([label, f"{cand['time_s']['step'] * 1e3:.2f}", "-", _mib(est), "-", "-", entry["error"]])
                continue
            got = sum(entry["memory_max"].values())
            rows.append([label, f"{cand['time_s']['step'] * 1e3:.2f}", f"{entry['step_s'] * 1e3:.2f}", _mib(est),
                         _mib(got), f"{100 * (est - got) / got:+.1f}%" if got else "-", ""])
        click.echo(table(["topology", "est step ms", "measured step ms", "est MiB", "measured MiB", "memory error",
                           "error"], rows))


def bench_comm(pm: PluginManager, world: int, sizes: Sequence[int], iters: int, timeout: float, as_json: bool) -> None:
    """Measure on ``world`` processes of the automatically chosen runtime and cache the result."""
    from ._strategy import Strategy

    if world < 2 or iters < 1 or not sizes or any(s < 4 * world for s in sizes):
        raise click.BadParameter(f"expected --world >= 2, --iters >= 1 and sizes of at least 4 * world bytes. "
                                 f"Received: world={world}, iters={iters}, sizes={list(sizes)}.")
    _check_timeout(timeout)
    found = advisors(pm)
    try:
        runtime = pm.resolve_runtime(Strategy())
    except PolyparallelError as exc:
        raise click.ClickException(str(exc)) from None
    if runtime not in found:
        raise click.ClickException(f"the runtime {runtime or 'none'} registers no advisor to measure with; "
                                   "install one: pip install 'polyparallel[torch]'")
    click.echo(f"measuring {runtime} collectives on {world} processes ...", err=True)
    result = found[runtime].bench_comm(world, sizes, iters, timeout)
    path = save_links(world, result)
    if as_json:
        click.echo(json.dumps({**result, "cache": str(path)}, indent=2))
        return

    rows = [[op, str(size), f"{entry['time_s'] * 1e6:.0f}", f"{entry['busbw'] / 1e9:.3f}"]
            for op, per_size in result["table"].items() for size, entry in per_size.items()]
    click.echo(table(["operation", "bytes", "time us", "bus GB/s"], rows))
    click.echo(f"\ncompute: {result['flops'] / 1e9:.2f} GFLOP/s per rank (float32 matmul, every rank at once)")
    click.echo(f"saved to {path}")
