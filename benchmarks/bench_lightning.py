"""Step time of a Lightning ``Trainer`` through the polyparallel adapter against Lightning's own
``strategy="ddp"``, on the same LightningModule, data, seed and processes.

    python benchmarks/bench_lightning.py [--quick] [--rounds N] [--json results.json]
    python benchmarks/bench_lightning.py --precision bf16-mixed [--quick] [--launches N] [--json results.json]

With ``--precision P`` both sides train at that precision, each the way its own users set it: the
adapter side through ``Strategy(data=2, precision=P)`` (the Trainer gets no ``precision=``, the
adapter installs Lightning's precision plugin), the Lightning side as ``Trainer(strategy="ddp",
precision=P)``; a third side, a second ``Trainer(strategy="ddp", precision=P)``, is the
same-vs-same control. Each of ``--launches`` launches (10 with ``--quick``) gives one ratio (its
pooled step medians); the figures are the median over launches with min and max.

Two gloo processes (``polyparallel.launch``; Lightning's DDP detects the launcher and joins the
same process group). Each round fits one epoch with each strategy, alternating which goes first
so machine noise hits both alike. A step is timed from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward, gradient reduction, optimizer step, and a per-step
``self.log(..., sync_dist=True)``); the headline is the median of all of rank 0's steps after a
warm-up, pooled over rounds (per-round ratios are shown too: on a shared machine they scatter). Ratio = ddp / adapter: > 1 means the
adapter is faster, 0.97 means 3 % slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import polyparallel as pp

WARMUP = 5


def _module_class() -> type:
    import lightning.pytorch as L
    import torch
    from torch import nn

    class BenchModule(L.LightningModule):
        def __init__(self, width: int):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                     nn.Linear(width, 10))
            self.step_times: list[float] = []
            self._start = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss, sync_dist=True, batch_size=len(y))
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_times.append(time.perf_counter() - self._start)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return BenchModule


def _worker(strategy: pp.Strategy, rounds: int, samples: int, width: int,
            precision: str | None = None) -> dict[str, Any]:
    import logging
    import warnings

    import lightning.pytorch as L

    # Keep the table readable: Lightning's per-Trainer banners and tips say nothing measured here.
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    module_cls = _module_class()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 256, generator=g), torch.randint(0, 10, (samples,), generator=g))
    sides = ["adapter", "ddp"] + (["control"] if precision is not None else [])
    per_side: dict[str, list[float]] = {side: [] for side in sides}
    pooled: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(rounds):
        order = sides[i % len(sides):] + sides[:i % len(sides)] if i % 2 == 0 else list(reversed(sides))
        for side in order:
            module = module_cls(width)
            # The adapter's precision comes from the Strategy; Lightning's own ddp takes it as Trainer(precision=).
            own = {} if side == "adapter" or precision is None else {"precision": precision}
            trainer = L.Trainer(
                strategy=strategy.adapt("lightning", namespace="lightning.pytorch") if side == "adapter" else "ddp",
                accelerator="cpu", devices=strategy.world_size, max_epochs=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **own,
            )
            trainer.fit(module, DataLoader(data, batch_size=32, shuffle=True))
            per_side[side].append(statistics.median(module.step_times[WARMUP:]))
            pooled[side] += module.step_times[WARMUP:]
    return {"rank": strategy.rank, **per_side, "pooled": pooled}


def main() -> None:
    parser = argparse.ArgumentParser(description="adapter vs Lightning ddp step time")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and samples")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed: both sides at it, with a control")
    parser.add_argument("--launches", type=int, default=None, help="with --precision: launches (10; --quick 10)")
    args = parser.parse_args()
    if args.precision is not None:
        return _precision_main(args)
    rounds = args.rounds or (4 if args.quick else 10)
    samples = 2048 if args.quick else 4096
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    strategy = pp.Strategy(data=2, timeout=120)
    results = pp.launch(_worker, strategy, 2, args=(strategy, rounds, samples, args.width), timeout=1800)
    rank0 = results[0]
    # Headline: the median over every timed step of every round (robust to a noisy round).
    adapter_ms = 1000 * statistics.median(rank0["pooled"]["adapter"])
    ddp_ms = 1000 * statistics.median(rank0["pooled"]["ddp"])
    per_round = [d / a for a, d in zip(rank0["adapter"], rank0["ddp"])]
    row = {"benchmark": "Lightning step, data=2, gloo, 2 processes",
           "model": f"MLP 256-{args.width}-{args.width}-10, batch 32 per rank",
           "rounds": rounds, "adapter_ms": adapter_ms, "lightning_ddp_ms": ddp_ms, "ratio_ddp_over_adapter": ddp_ms / adapter_ms,
           "ratio_per_round_median": statistics.median(per_round), "ratio_per_round_min": min(per_round),
           "ratio_per_round_max": max(per_round)}
    header = ["benchmark", "adapter (ms)", "lightning ddp (ms)", "ratio ddp/adapter", "per-round ratios (min..max)"]
    cells = [row["benchmark"], f"{adapter_ms:.3f}", f"{ddp_ms:.3f}", f"{row['ratio_ddp_over_adapter']:.3f}",
             f"{row['ratio_per_round_min']:.3f}..{row['ratio_per_round_max']:.3f}"]
    widths = [max(len(h), len(c)) for h, c in zip(header, cells)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
    print(f"({row['model']}; median of rank 0's steps over {rounds} alternating rounds, per-round ratio median "
          f"{row['ratio_per_round_median']:.3f}; ratio > 1: adapter faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


def _precision_main(args: argparse.Namespace) -> None:
    launches = args.launches or 10
    rounds = args.rounds or (3 if args.quick else 6)
    samples = 1024 if args.quick else 4096
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    strategy = pp.Strategy(data=2, timeout=120, precision=args.precision)
    ratios, controls, times = [], [], {"adapter": [], "ddp": [], "control": []}
    for _ in range(launches):
        rank0 = pp.launch(_worker, strategy, 2, args=(strategy, rounds, samples, args.width, args.precision),
                          timeout=1800)[0]
        med = {side: 1000 * statistics.median(rank0["pooled"][side]) for side in times}
        for side in times:
            times[side].append(med[side])
        ratios.append(med["ddp"] / med["adapter"])
        controls.append(med["ddp"] / med["control"])
    row = {"benchmark": f"Lightning step at {args.precision}, data=2, gloo, 2 processes",
           "model": f"MLP 256-{args.width}-{args.width}-10, batch 32 per rank", "launches": launches,
           "rounds_per_launch": rounds, "adapter_ms": statistics.median(times["adapter"]),
           "lightning_ddp_ms": statistics.median(times["ddp"]),
           "ratio_ddp_over_adapter": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "control_ratio": statistics.median(controls), "control_min": min(controls),
           "control_max": max(controls)}
    print(f"{row['benchmark']} ({row['model']}), {launches} launches x {rounds} alternating rounds of 3 fits:")
    print(f"  adapter (Strategy(precision={args.precision!r})) {row['adapter_ms']:.3f} ms, Lightning "
          f"Trainer(strategy='ddp', precision={args.precision!r}) {row['lightning_ddp_ms']:.3f} ms")
    print(f"  ratio ddp/adapter {row['ratio_ddp_over_adapter']:.3f} ({row['ratio_min']:.3f}..{row['ratio_max']:.3f}); "
          f"control ddp/ddp {row['control_ratio']:.3f} ({row['control_min']:.3f}..{row['control_max']:.3f}) "
          "(ratio > 1: adapter faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
