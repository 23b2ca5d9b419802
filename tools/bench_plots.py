"""The figures of the documentation's Benchmarks page, from what ``bash benchmarks/run.sh`` wrote.

    python tools/bench_plots.py                      # benchmarks/results/*.json -> docs/assets/benchmarks/
    python tools/bench_plots.py --results DIR --out DIR

For every framework benchmark found (each writes its own JSON with ``--json``), one figure: the
ratio of the hand-written native code's step time to polyparallel's (> 1: polyparallel faster),
the median with its spread over rounds (min to max), next to the same-vs-same control ratio where
the benchmark measures one (the machine's noise). ``results.md`` beside the figures is the table
the page includes; it says which benchmarks had no results. Nothing is measured here: run the
benchmarks first, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Ratio:
    """One framework's headline: native / polyparallel, with its spread and control."""

    name: str
    what: str
    median: float
    low: float
    high: float
    control: tuple[float, float, float] | None = None  # median, low, high of same vs same


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _lightning(d: dict[str, Any]) -> Ratio:
    return Ratio("lightning", "Lightning adapter vs Lightning's own ddp", d["ratio_ddp_over_adapter"],
                 d["ratio_per_round_min"], d["ratio_per_round_max"])


def _ignite(d: dict[str, Any]) -> Ratio:
    epochs = [x for rank in d["per_rank"] for x in rank["epoch_ratios"]]
    return Ratio("ignite", "Ignite adapter vs a hand-written idist trainer", d["paired_ratio"], min(epochs), max(epochs))


def _fastai(d: dict[str, Any]) -> Ratio:
    # Against the hand-written callback doing the same work: the benchmark's other hand-written
    # side also gathers the loss every step, which the adapter does not (its "ratio").
    return Ratio("fastai", "fastai callback vs a hand-written DDP callback (same work)", *_spread(d["same_work_ratio"]),
                 control=_spread(d["control_ratio"]))


def _deepspeed(d: dict[str, Any]) -> Ratio:
    ms = d["rounds_ms"]
    ratios = [a / p for a, p in zip(ms["native A"], ms["polyparallel"])]
    control = [a / b for a, b in zip(ms["native A"], ms["native B"])]
    return Ratio("deepspeed", f"adapt('deepspeed') vs hand-written deepspeed.initialize (ZeRO {d['zero']})",
                 *_spread(ratios), control=_spread(control))


def _jax(d: dict[str, Any]) -> Ratio:
    # fp32, against the program fit runs written by hand (a shard_map step with the same
    # reductions); bench_jax's ratios are hand / fit per launch, its control the hand side twice.
    fp32 = d["32"]
    return Ratio("jax", "Model.fit vs the same program by hand (shard_map), fp32", *_spread(fp32["ratios"]["shard_map"]),
                 control=_spread(fp32["control"]))


def _sharding(d: dict[str, Any]) -> Ratio:
    ratios = d["ratios"]
    return Ratio("pytorch-zero3", "wrap_model at zero=3 vs hand-written fully_shard",
                 *ratios["native / polyparallel"], control=tuple(ratios["native / control (same vs same)"]))  # type: ignore[arg-type]


EXTRACTORS: dict[str, Callable[[dict[str, Any]], Ratio]] = {
    "lightning.json": _lightning, "ignite.json": _ignite, "fastai.json": _fastai, "deepspeed.json": _deepspeed,
    "jax.json": _jax, "sharding.json": _sharding,
}


def read(results: Path) -> tuple[list[Ratio], list[str]]:
    """The ratios found in ``results`` and the benchmark files that are missing."""
    found, missing = [], []
    for name, extract in EXTRACTORS.items():
        path = results / name
        if path.exists():
            found.append(extract(json.loads(path.read_text())))
        else:
            missing.append(name)
    return found, missing


def draw(ratio: Ratio, path: Path) -> None:
    """One framework's figure: the ratio's median and spread, and the control's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 2.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = [("polyparallel", (ratio.median, ratio.low, ratio.high))]
    if ratio.control:
        rows.append(("control (same vs same)", ratio.control))
    for y, (label, (mid, low, high)) in enumerate(rows):
        ax.errorbar([mid], [y], xerr=[[mid - low], [high - mid]], fmt="o", capsize=4, label=label)
        ax.annotate(f"{mid:.2f} ({low:.2f}-{high:.2f})", (mid, y), textcoords="offset points", xytext=(0, 8), ha="center",
                    fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("native step time / polyparallel step time (> 1: polyparallel faster)")
    ax.set_title(ratio.what, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # the axis label is wider than the axes


def table(found: list[Ratio], missing: list[str]) -> str:
    """The Markdown the Benchmarks page includes."""
    lines = ["| framework | compared with | ratio (median) | spread (min-max) | control |", "|---|---|---|---|---|"]
    for r in found:
        control = f"{r.control[0]:.2f} ({r.control[1]:.2f}-{r.control[2]:.2f})" if r.control else "-"
        lines.append(f"| {r.name} | {r.what} | {r.median:.2f} | {r.low:.2f}-{r.high:.2f} | {control} |")
    out = "\n".join(lines) + "\n\n" if found else ""
    out += "".join(f"![{r.name}: {r.what}](assets/benchmarks/{r.name}.png)\n\n" for r in found)  # from docs/benchmarks.md
    if missing:
        out += ("!!! note \"Not measured yet\"\n    No results for " + ", ".join(f"`{m}`" for m in missing)
                + " in `benchmarks/results/`: run `bash benchmarks/run.sh` on a quiet machine, then"
                " `python tools/bench_plots.py`.\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "benchmarks")
    args = parser.parse_args(argv)
    found, missing = read(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    for ratio in found:
        draw(ratio, args.out / f"{ratio.name}.png")
    (args.out / "results.md").write_text(table(found, missing))
    print(f"{len(found)} figure(s) in {args.out}; no results for: {', '.join(missing) or 'none'}")


if __name__ == "__main__":
    main()
