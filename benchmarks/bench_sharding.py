"""Ratio benchmark of zero=3 in the torch runtime against hand-written FSDP2 ``fully_shard``.

    OMP_NUM_THREADS=1 python benchmarks/bench_sharding.py [--quick] [--reps N] [--steps K] [--json out.json]

Three models of the same MLP (256-1024-1024-256, ~2.6M parameters) train with Adam on the same
batches (32 samples per rank), in the same 2 gloo processes:

- polyparallel: ``Strategy(data=2, zero=3).wrap_model(model)`` (its default units: each Linear,
  then the root) and ``strategy.sync_grads(model)`` each step (a no-op but its identity check);
- native: ``fully_shard`` by hand on the same units (the last one not resharded after forward,
  as wrap_model does), then on the root, over a 1-D data mesh;
- native again (a second, identical hand-written model): the control, a same-vs-same ratio that
  shows the noise floor of this machine.

Each repetition times K steps of every side, in rotating order, after a barrier; a step ends with
the optimizer step. Figures: the median step time per side, and the paired ratios native /
polyparallel and native / control (median over repetitions of the per-repetition ratio, with min
and max). Ratio > 1 means the second side is slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import polyparallel as pp


def _worker(strategy: pp.Strategy, reps: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))

    ours = strategy.wrap_model(model_())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data",))

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

    def step(name: str) -> None:
        model, opt = sides[name], opts[name]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if name == "polyparallel":
            strategy.sync_grads(model)
        opt.step()

    for name in sides:  # warm-up
        for _ in range(2):
            step(name)
    times: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for rep in range(reps):
        for name in order[rep % 3:] + order[:rep % 3]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reps, steps = (10, 5) if args.quick else (args.reps, args.steps)
    strategy = pp.Strategy(data=2, zero=3, timeout=120)
    results = pp.launch(_worker, strategy, 2, args=(strategy, reps, steps), runtime="torch", timeout=1200)
    times = results[0]

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        r = [x / y for x, y in zip(times[a], times[b])]
        return statistics.median(r), min(r), max(r)

    rows = {name: 1000 * statistics.median(t) for name, t in times.items()}
    native, control = ratio("native", "polyparallel"), ratio("native", "control")
    lines = [
        f"FSDP2 zero=3, data=2 (2 gloo processes), {reps} repetitions x {steps} steps, median step time:",
        *(f"  {name:>12}: {ms:.2f} ms" for name, ms in rows.items()),
        f"  native / polyparallel: {native[0]:.3f} (min {native[1]:.3f}, max {native[2]:.3f})",
        f"  native / control (same vs same): {control[0]:.3f} (min {control[1]:.3f}, max {control[2]:.3f})",
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_ms": rows, "native_over_polyparallel": native, "native_over_control": control,
                       "reps": reps, "steps": steps}, f, indent=2)


if __name__ == "__main__":
    main()
