"""``polyparallel trace DIR``: the collective traces written by ``--trace-dir`` as timelines."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from . import _trace_report
from ._text import table

__all__ = ["trace"]


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--rank", "ranks", type=int, multiple=True,
              help="show this rank's own timeline in full: every entry, with full paths and shapes (repeatable)")
@click.option("--last", type=int, default=40, show_default=True, help="rows of the aligned table (0: all)")
@click.option("--json", "as_json", is_flag=True, help="print the traces as JSON")
def trace(directory: str, ranks: tuple[int, ...], last: int, as_json: bool) -> None:
    """Show the collective traces in DIRECTORY (written by `polyparallel launch --trace-dir`,
    polyparallel.launch(trace_dir=) or POLYPARALLEL_TRACE_DIR): one line per rank (why its trace was
    written), then a table aligning the ranks' collectives by axis and sequence number, one column
    per rank (`!` marks a row where the ranks differ or one is missing: the desync or the hang; `u`
    after the number: a collective that is not identity-checked, paired by its order on the axis).
    The table fits in 100 columns: long operation names are cut (`...[n]`) and listed in full below
    it, and ranks that do not fit are shown in several tables."""

    try:
        traces = _trace_report.read_dir(directory)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if last < 0:
        raise click.BadParameter(f"expected 0 (all) or more rows. Received: {last}.", param_hint="'--last'")
    missing = sorted(set(ranks) - set(traces))
    if missing:
        raise click.BadParameter(f"no trace of rank(s) {missing} in {directory}; it holds ranks {sorted(traces)}.",
                                 param_hint="'--rank'")
    if as_json:
        click.echo(json.dumps({str(r): t for r, t in sorted(traces.items())}, indent=2))
        return
    world = max((t["header"].get("world_size") or 0 for t in traces.values()), default=0)
    absent = sorted(set(range(world)) - set(traces))
    for rank, t in sorted(traces.items()):
        h = t["header"]
        why = h.get("reason", "?") if h.get("reason") != "exit" or not h.get("failure") else \
            f"exit after: {h['failure']}"
        why = why if len(why) <= 160 else why[:157] + "..."
        dropped = f", {h['dropped']} older dropped" if h.get("dropped") else ""
        click.echo(f"rank {rank} (host {h.get('host', '?')}, pid {h.get('pid', '?')}): {len(t['entries'])} "
                   f"collectives{dropped}; written at {why}")
    if absent:
        click.echo(f"no trace from rank(s) {absent} of {world}: killed before writing, or another directory")
    click.echo("")
    click.echo("\n".join(_trace_report.timeline_text(traces, last or None)))
    for rank in ranks:
        click.echo(f"\nrank {rank}:")
        entries = traces[rank]["entries"]
        t0 = min((e["t0"] for t in traces.values() for e in t["entries"]), default=0.0)
        click.echo(table(["t (s)", "ms", "axis", "#", "operation", "state", "caller", "detail"], [
            [f"{e['t0'] - t0:.3f}", _ms(e), e["axis"], "" if e.get("seq") is None else str(e["seq"]), e["operation"],
             e["state"] + (f": {e['error']}" if e.get("error") else ""), _full(e), (e.get("detail") or "")[:80]]
            for e in entries]))


def _ms(entry: dict[str, Any]) -> str:
    return f"{1e3 * (entry['t1'] - entry['t0']):.1f}" if entry.get("t1") else "-"


def _full(entry: dict[str, Any]) -> str:
    user, site = entry.get("user"), entry.get("site")
    if not user:
        return "?"
    rel = lambda p: os.path.relpath(p) if not p.startswith("<") else p  # noqa: E731
    return rel(user) + (f" via {rel(site)}" if site and site != user else "")
