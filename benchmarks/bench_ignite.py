"""Ratio benchmark of the Ignite adapter against a hand-written ignite + ``idist`` DDP trainer.

    OMP_NUM_THREADS=1 python benchmarks/bench_ignite.py [--quick] [--rounds N] [--json results.json]

Both sides train the same MLP (256-512-512-10) on the same data with ignite's
``create_supervised_trainer``, a global batch of 128 and SGD, in the same 2 gloo processes:

- native: ``idist.auto_model`` (DDP over the world), ``idist.auto_optim``,
  ``idist.auto_dataloader(batch_size=128)`` (ignite divides it by the world size);
- polyparallel: ``strategy.adapt("ignite")``: ``auto_model`` (DDP over the data group),
  ``auto_optim``, ``auto_dataloader`` (global batch 128), ``create_supervised_trainer`` attached.

Epochs alternate between the two sides, in alternating order (machine noise hits both alike); every iteration starts
after a barrier so both ranks are timed from the same point; the figure is the median step
time (first epoch of each side discarded as warm-up), and the paired ratio: the median over
epochs of the ratio of the two sides' epoch medians (robust to load drifting on a shared machine). Ratio = native / polyparallel: > 1 means
polyparallel is faster; the target is 0.97 or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import polyparallel as pp


def _worker(strategy: pp.Strategy, rounds: int) -> dict[str, Any]:
    import ignite.distributed as idist
    import torch
    import torch.distributed as dist
    from ignite.engine import Events, create_supervised_trainer
    from torch import nn
    from torch.utils.data import TensorDataset

    ignite = strategy.adapt("ignite")
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    loss_fn = nn.functional.cross_entropy
    # hand-written ignite + idist
    native_model = idist.auto_model(model_())
    native_opt = idist.auto_optim(torch.optim.SGD(native_model.parameters(), lr=0.01))
    native_loader = idist.auto_dataloader(dataset, batch_size=128, shuffle=True)
    native = create_supervised_trainer(native_model, native_opt, loss_fn, device=idist.device())
    # polyparallel
    ours_model = ignite.auto_model(model_())
    ours_opt = ignite.auto_optim(torch.optim.SGD(ours_model.parameters(), lr=0.01), ours_model)
    ours_loader = ignite.auto_dataloader(dataset)
    ours = ignite.create_supervised_trainer(ours_model, ours_opt, loss_fn, data=ours_loader)

    times: dict[str, list[float]] = {"native": [], "polyparallel": []}
    per_epoch: dict[str, dict[int, list[float]]] = {"native": {}, "polyparallel": {}}
    for name, engine in (("native", native), ("polyparallel", ours)):
        def start(e: Any) -> None:
            dist.barrier()
            e.state.step_start = time.perf_counter()

        def stop(e: Any, name: str = name) -> None:
            if e.state.epoch > 1:  # the first epoch of each side warms up
                times[name].append(time.perf_counter() - e.state.step_start)
                per_epoch[name].setdefault(e.state.epoch, []).append(times[name][-1])

        engine.add_event_handler(Events.ITERATION_STARTED, start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, stop)
    assert len(native_loader) == len(ours_loader), (len(native_loader), len(ours_loader))
    for epoch in range(1, rounds + 2):
        sides = [(native, native_loader), (ours, ours_loader)]
        for engine, loader in sides if epoch % 2 else sides[::-1]:  # alternate who goes first
            engine.run(loader, max_epochs=epoch)  # resumes: one more epoch each call
    return {name: {"median_ms": 1000 * statistics.median(v), "mean_ms": 1000 * statistics.fmean(v), "steps": len(v)}
            for name, v in times.items()} | {
        "batches_per_epoch": len(ours_loader),
        # paired by epoch (neighbours in time): robust to the machine's load drifting during the run
        "epoch_ratios": [statistics.median(per_epoch["native"][e]) / statistics.median(per_epoch["polyparallel"][e])
                         for e in sorted(per_epoch["native"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of --rounds")
    parser.add_argument("--rounds", type=int, default=12, help="epochs per side after one warm-up epoch")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    strategy = pp.Strategy(data=2, timeout=120, batch_size=128)
    results = pp.launch(_worker, strategy, 2, args=(strategy, rounds), timeout=900)
    # A step ends when the slowest rank ends it: take the slower rank's median on each side.
    native = max(r["native"]["median_ms"] for r in results)
    ours = max(r["polyparallel"]["median_ms"] for r in results)
    steps = results[0]["polyparallel"]["steps"]
    paired = statistics.median(statistics.median(r["epoch_ratios"]) for r in results)
    rows = [
        ("ignite + idist DDP (hand-written)", native, 1.0),
        ("ignite via polyparallel adapter", ours, native / ours),
    ]
    print(f"Ignite training step, MLP 256-512-512-10, global batch 128, data=2 (gloo, 2 processes), "
          f"{steps} timed steps per side, {time.perf_counter() - start:.0f} s")
    print(f"{'trainer':36}  {'median step (ms)':>16}  {'ratio native/ours':>17}")
    print(f"{'-' * 36}  {'-' * 16}  {'-' * 17}")
    for name, ms, ratio in rows:
        print(f"{name:36}  {ms:16.3f}  {ratio:17.3f}")
    print(f"paired ratio (median over epochs of native/ours epoch medians): {paired:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"native_ms": native, "polyparallel_ms": ours, "ratio": native / ours, "paired_ratio": paired, "per_rank": results,
                       "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
