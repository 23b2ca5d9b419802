"""Ratio benchmark of zero=3 in the torch runtime against hand-written FSDP2 ``fully_shard``.

    OMP_NUM_THREADS=1 python benchmarks/bench_sharding.py [--quick] [--reps N] [--steps K] [--json out.json]

Three models of the same MLP (256-1024-1024-256, ~2.6M parameters) train with Adam on the same
batches (32 samples per rank), in the same 2 gloo processes, over the same process group:

- polyparallel: ``Strategy(data=2, zero=3).wrap_model(model)`` (its default units: each Linear,
  then the root) and ``strategy.sync_grads(model)`` each step (a no-op: FSDP2 reduced in
  backward; ``GradPolicy(check_backward=True)`` adds its identity check, one 16-byte all-reduce);
- native: ``fully_shard`` by hand on the same units (the last one not resharded after forward,
  as wrap_model does), then on the root, over the runtime's own ``data`` mesh
  (``get_runtime(session).submesh("data")``), so both sides run the same collectives on the same
  process group;
- control: a second, identical hand-written model: the same-vs-same ratio shows the noise floor.

The sides alternate step by step (cycling through every order of the three, a barrier before
each timed step), so a burst of load from other processes hits all of them alike. A repetition is K rounds of the three sides; its
ratio is the median over its rounds of the ratio within a round. Reported: the median step time
per side (and of the ``sync_grads`` call inside the polyparallel step), and the ratios native /
polyparallel, native / polyparallel without its ``sync_grads`` call (its time, measured inside
the step, subtracted: ``wrap_model`` alone) and native / control — each the median over
repetitions, with min and max. Ratio < 1 means the second side is slower.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import polyparallel as pp


def _worker(strategy: pp.Strategy, reps: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from polyparallel_torch import get_runtime

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))

    ours = strategy.wrap_model(model_())
    mesh = get_runtime(strategy.session()).submesh("data")  # the group wrap_model shards over

    def hand_written() -> nn.Module:
        model = model_()
        units = [m for m in model if any(True for _ in m.parameters())]
        for i, unit in enumerate(units):
            fully_shard(unit, mesh=mesh, reshard_after_forward=i < len(units) - 1)
        return fully_shard(model, mesh=mesh, reshard_after_forward=False)

    sides = {"polyparallel": ours, "native": hand_written(), "control": hand_written()}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in sides.items()}
    torch.manual_seed(strategy.session().rank)
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    sync_s = 0.0

    def step(name: str) -> None:
        nonlocal sync_s
        model, opt = sides[name], opts[name]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if name == "polyparallel":
            start = time.perf_counter()
            strategy.sync_grads(model)
            sync_s = time.perf_counter() - start
        opt.step()

    for name in sides:  # warm-up
        for _ in range(3):
            step(name)
    # Every order of the sides in turn (the same on every rank): each side runs in every position
    # and after every other side equally often (a side that always ran after the same one was
    # 10-15% faster here, same code or not).
    orders = list(itertools.permutations(sides))
    keys = [*sides, "sync_grads", *RATIOS]
    out: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(reps):
        per: dict[str, list[float]] = {k: [] for k in keys}
        for k in range(steps):
            took = {}
            for name in orders[(rep * steps + k) % len(orders)]:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                took[name] = time.perf_counter() - start
            took["sync_grads"] = sync_s
            took["polyparallel without sync_grads"] = took["polyparallel"] - sync_s
            for key in sides:
                per[key].append(took[key])
            per["sync_grads"].append(sync_s)
            for label, (a, b) in RATIOS.items():  # paired within the round
                per[label].append(took[a] / took[b])
        for key, values in per.items():
            out[key].append(statistics.median(values))
    return out


# Paired ratios (numerator side, denominator side) reported per repetition.
RATIOS = {"native / polyparallel": ("native", "polyparallel"),
          "native / polyparallel without sync_grads": ("native", "polyparallel without sync_grads"),
          "native / control (same vs same)": ("native", "control")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reps, steps = (10, 6) if args.quick else (args.reps, args.steps)
    strategy = pp.Strategy(data=2, zero=3, timeout=120)
    results = pp.launch(_worker, strategy, 2, args=(strategy, reps, steps), runtime="torch", timeout=1200)
    times = results[0]
    rows = {name: 1000 * statistics.median(times[name]) for name in ("polyparallel", "native", "control", "sync_grads")}
    figures = {label: (statistics.median(times[label]), min(times[label]), max(times[label])) for label in RATIOS}
    lines = [
        f"FSDP2 zero=3, data=2 (2 gloo processes, one process group), {reps} repetitions x {steps} "
        "alternated steps, median step time:",
        *(f"  {name:>12}: {ms:.3f} ms" for name, ms in rows.items()),
        *(f"  {label}: {m:.3f} (min {lo:.3f}, max {hi:.3f})" for label, (m, lo, hi) in figures.items()),
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_ms": rows, "ratios": figures, "reps": reps, "steps": steps}, f, indent=2)


if __name__ == "__main__":
    main()
