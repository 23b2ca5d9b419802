"""Ratio benchmark of ``Strategy(precision="bf16-mixed")`` in the torch runtime against the
bf16 a user writes by hand, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_precision.py [--quick] [--launches N] [--steps K] [--json out.json]

The same MLP (256-1024-1024-256, ~2.4M parameters) trains with Adam on the same batches (32
samples per rank), in the same 2 gloo processes, over the same process group:

- **DDP** (zero=0): polyparallel's ``Strategy(data=2, precision="bf16-mixed").wrap_model(model)``
  (DDP, autocast in forward hooks, outputs back in float32) and the plain loop's
  ``strategy.sync_grads(model)``, against a hand-written ``DistributedDataParallel`` over the
  runtime's data group with ``torch.autocast("cpu", torch.bfloat16)`` around the forward;
- **FSDP2** (zero=2): ``Strategy(..., zero=2)``'s ``wrap_model`` (``MixedPrecisionPolicy`` on
  every unit) against ``fully_shard`` by hand on the same units with a hand-made
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (``output_dtype=float32``
  on the root), over the runtime's own ``data`` mesh;
- a **control** per scenario: a second, identical hand-written model (the same-vs-same ratio
  shows the noise floor).

The polyparallel step includes the plain loop's ``strategy.sync_grads(model)`` (a no-op under DDP
and FSDP2: they reduced in backward; with ``GradPolicy(check_backward=True)`` FSDP2's runs its
identity check, one 16-byte all-reduce), timed inside the step: the ratio
without it is ``wrap_model``'s precision mapping alone.

Within a launch the sides alternate step by step through every order of the three (a barrier
before each timed step); a launch's ratio is the median over its rounds of the ratio within a
round. Each figure is the median over ``--launches`` separate launches, with min and max.
Ratio native / polyparallel < 1 means polyparallel is slower.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import polyparallel as pp

RATIOS = {"native / polyparallel": ("native", "polyparallel"),
          "native / polyparallel without sync_grads": ("native", "polyparallel without sync_grads"),
          "native / control (same vs same)": ("native", "control")}


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))


def _sides(strategy: pp.Strategy, scenario: str) -> dict[str, Any]:
    """name -> (model, forward): each side's model and how its step calls it."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from polyparallel_torch import get_runtime

    rt = get_runtime(strategy.session())

    def autocast_forward(model: nn.Module) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            return out.float()
        return forward

    def hand_ddp() -> Any:
        model = nn.parallel.DistributedDataParallel(_model(), process_group=rt.group("data"))
        return model, autocast_forward(model)

    def hand_fsdp() -> Any:
        model = _model()
        mesh = rt.submesh("data")
        unit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
        for m in model:
            if any(True for _ in m.parameters()):
                fully_shard(m, mesh=mesh, reshard_after_forward=False, mp_policy=unit)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=root)
        return model, model

    ours = strategy.wrap_model(_model())
    hand = hand_ddp if scenario == "ddp" else hand_fsdp
    return {"polyparallel": (ours, ours), "native": hand(), "control": hand()}


def _worker(strategy: pp.Strategy, steps: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    out = {}
    for scenario, s in (("ddp", strategy), ("fsdp2 zero=2", strategy.replace(zero=2))):
        sides = _sides(s, "ddp" if scenario == "ddp" else "fsdp")
        opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, (m, _) in sides.items()}
        torch.manual_seed(s.session().rank)
        x, y = torch.randn(32, 256), torch.randn(32, 256)

        sync_s = 0.0

        def step(name: str) -> None:
            nonlocal sync_s
            model, forward = sides[name]
            opt = opts[name]
            opt.zero_grad()
            nn.functional.mse_loss(forward(x), y).backward()
            if name == "polyparallel":
                start = time.perf_counter()
                s.sync_grads(model)  # the plain loop's call (a no-op under DDP and FSDP2)
                sync_s = time.perf_counter() - start
            opt.step()

        for name in sides:  # warm-up
            for _ in range(3):
                step(name)
        orders = list(itertools.permutations(sides))
        times: dict[str, list[float]] = {k: [] for k in [*sides, "sync_grads", *RATIOS]}
        for k in range(steps):
            took = {}
            for name in orders[k % len(orders)]:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                took[name] = time.perf_counter() - start
            took["sync_grads"] = sync_s
            took["polyparallel without sync_grads"] = took["polyparallel"] - sync_s
            for name in [*sides, "sync_grads"]:
                times[name].append(took[name])
            for label, (a, b) in RATIOS.items():
                times[label].append(took[a] / took[b])
        out[scenario] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 launches of 12 steps")
    parser.add_argument("--launches", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    launches, steps = (10, 12) if args.quick else (args.launches, args.steps)
    strategy = pp.Strategy(data=2, precision="bf16-mixed", timeout=120)
    runs = [pp.launch(_worker, strategy, 2, args=(strategy, steps), runtime="torch", timeout=600)[0]
            for _ in range(launches)]
    report: dict[str, Any] = {"launches": launches, "steps": steps}
    lines = [f"bf16-mixed, data=2 (2 gloo processes, one process group), {launches} launches x {steps} alternated "
             "steps; per launch the median, then the median over launches (min, max):"]
    for scenario in runs[0]:
        figures = {}
        for key in runs[0][scenario]:
            values = [r[scenario][key] for r in runs]
            figures[key] = (statistics.median(values), min(values), max(values))
        report[scenario] = figures
        lines.append(f"  {scenario}:")
        for name in ("polyparallel", "native", "control", "sync_grads"):
            m, lo, hi = figures[name]
            lines.append(f"    {name:>12}: {1000 * m:.2f} ms (min {1000 * lo:.2f}, max {1000 * hi:.2f})")
        for label in RATIOS:
            m, lo, hi = figures[label]
            lines.append(f"    {label}: {m:.3f} (min {lo:.3f}, max {hi:.3f})")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
