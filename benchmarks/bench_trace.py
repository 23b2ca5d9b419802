"""What recording the collective trace costs (``polyparallel._trace``), side by side.

    python benchmarks/bench_trace.py [--quick] [--launches N] [--json results.json]

(a) a training step on 2 gloo ranks that issues recorded operations every step: a bare module
    (the non-DDP path: its ``sync_grads`` runs an identity check and the gradient buckets, one
    trace entry) and a ``reduce_metrics`` of the loss (another entry), with recording on against
    the same steps with recording off (the runtime's recorder removed, which is what
    ``POLYPARALLEL_TRACE=0`` does), interleaved, in ``--launches`` separate launches (median and
    spread of the ratio; goal: at most 1% slower, a ratio >= 0.99);
(b) the same with a DDP model (Lightning's and ``wrap_model``'s path): its ``sync_grads`` is
    DDP's reducer, not a runtime collective, so only ``reduce_metrics`` is recorded;
(c) the recording alone: one ``enter`` + ``finish`` (a frame walk, an entry, two clock reads),
    per entry, in this process.

Next to (a) and (b), a same-vs-same control (recording on against recording on, in the same
rotation) shows how far this machine's noise alone moves the ratio. The side channel's thread
runs in both sides (it is per process); ``POLYPARALLEL_TRACE=0`` also stops it.

Ratios > 1 mean recording on is faster (noise); the goal is >= 0.99.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import timeit
from typing import Any

import polyparallel as pp
from polyparallel import _trace


def _step_worker(quick: bool, ddp: bool) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn

    strategy = pp.Strategy(data=2, timeout=120)
    rt = __import__("polyparallel_torch.runtime", fromlist=["get_runtime"]).get_runtime(strategy.session())
    recorder = rt._rec
    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    if ddp:
        model = strategy.wrap_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        strategy.sync_grads(model)
        strategy.reduce_metrics({"loss": loss.detach()})
        opt.step()

    # "control" is recording on again: the same-vs-same ratio shows this machine's noise.
    times: dict[str, list[float]] = {"on": [], "off": [], "control": []}
    steps = 20 if quick else 80
    for i in range(steps):
        sides = [("on", recorder), ("off", None), ("control", recorder)]
        for name, rec in sides[i % 3:] + sides[:i % 3]:  # rotate who goes first
            rt._rec = rec  # the same on both ranks: they run the same collectives either way
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    rt._rec = recorder
    skip = 5
    return {k: statistics.median(v[skip:]) for k, v in times.items()}


def _record_alone(repeats: int) -> float:
    recorder = _trace.Recorder()

    def one() -> None:
        _trace.Recorder.finish(recorder.enter("reduce_metrics", "data", 1, "loss:mean[1]"))

    return min(timeit.repeat(one, number=2000, repeat=repeats)) / 2000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and launches (a smoke run)")
    parser.add_argument("--launches", type=int, default=None, help="launches per variant; default 6, 2 with --quick")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launches = args.launches or (2 if args.quick else 6)
    strategy = pp.Strategy(data=2, timeout=120)
    rows: list[tuple[str, str, str]] = []
    figures: dict[str, Any] = {}
    for name, ddp in (("bare module: sync_grads + reduce_metrics", False), ("DDP model: reduce_metrics", True)):
        per_launch = [pp.launch(_step_worker, strategy, 2, args=(args.quick, ddp), timeout=900)[0]
                      for _ in range(launches)]
        ratios = sorted(r["off"] / r["on"] for r in per_launch)
        control = sorted(r["control"] / r["on"] for r in per_launch)
        on = statistics.median(r["on"] for r in per_launch)
        off = statistics.median(r["off"] for r in per_launch)
        figures[name] = {"ratios": ratios, "control_ratios": control, "on_s": on, "off_s": off}
        rows.append((f"{name}, trace on/off ({launches} launches)", f"{on * 1e3:.3f} ms vs {off * 1e3:.3f} ms",
                     f"{statistics.median(ratios):.3f}x (min {ratios[0]:.3f}, max {ratios[-1]:.3f})"))
        rows.append((f"  control: trace on/on again ({launches} launches)", "same vs same",
                     f"{statistics.median(control):.3f}x (min {control[0]:.3f}, max {control[-1]:.3f})"))
    alone = _record_alone(3 if args.quick else 7)
    figures["record one entry"] = alone
    rows.append(("recording one entry (enter + finish)", f"{alone * 1e6:.2f} us", "-"))
    width = [max(len(r[i]) for r in rows + [("benchmark", "figure", "ratio")]) for i in range(3)]
    print(f"{'benchmark':<{width[0]}}  {'figure':<{width[1]}}  ratio (off/on time; goal >= 0.99)")
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
