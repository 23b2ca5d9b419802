"""Ratio benchmark of the fastai adapter against a hand-written fastai + DDP callback.

    OMP_NUM_THREADS=1 python benchmarks/bench_fastai.py [--quick] [--rounds N] [--json results.json]

Three fastai ``Learner``s train the same MLP (256-512-512-10) on the same data, global batch 128,
SGD, in the same 2 gloo processes:

- native: a hand-written callback (what fastai users write without ``accelerate``): DDP over
  the world in ``before_fit``, each rank's loader reading the strided half of a shuffled order;
- control: a second, identical native Learner (same-vs-same: the noise floor of the ratio);
- polyparallel: ``strategy.adapt("fastai")``;
- native-local-loss: the native callback plus a hand-written smoothed loss that, like the
  adapter's, does not gather every batch's loss over the world (fastai's ``AvgSmoothLoss`` calls
  ``to_detach(..., gather=True)``: one ``all_gather`` per training step when ``WORLD_SIZE`` > 1).
  native-local-loss/polyparallel compares the same work; native/polyparallel shows what that
  per-step gather costs a fastai user.

Each round trains one epoch of each, in a rotating order (machine noise hits all alike); every
step starts after a barrier so both ranks are timed from the same point; the first round is
warm-up. Per round, each side's median step time; the figures are the medians over rounds of
native/polyparallel and native/control (> 1: the second side is faster) and their spread
(min-max over rounds). The target is a ratio within 3% of 1 when the control is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import polyparallel as pp


def _worker(strategy: pp.Strategy, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import AvgSmoothLoss, Learner
    from fastai.optimizer import SGD
    from torch import nn
    from torch.utils.data import TensorDataset

    rank, world = strategy.session().rank, strategy.session().world_size
    strategy.reduce_metrics({"start": 1.0})  # makes the runtime's process group before the native side uses it
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
    valid = TensorDataset(torch.randn(64, 256), torch.randint(0, 10, (64,)))

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    class NativeDDP(Callback):
        """The hand-written alternative: DDP in before_fit, unwrapped in after_fit."""

        order = 8

        def before_fit(self) -> None:
            self.learn.model = nn.parallel.DistributedDataParallel(self.learn.model)

        def after_fit(self) -> None:
            self.learn.model = self.learn.model.module

    class LocalSmooth(AvgSmoothLoss):
        """fastai's smoothed loss without the per-batch world-wide gather."""

        def accumulate(self, learn: Any) -> None:
            self.count += 1
            self.val = torch.lerp(learn.loss.mean().detach().cpu(), self.val, self.beta)

    class NativeDDPLocalLoss(NativeDDP):
        def before_fit(self) -> None:
            super().before_fit()
            recorder = self.learn.recorder
            self.saved = recorder.smooth_loss
            recorder.__dict__["smooth_loss"] = LocalSmooth(beta=self.saved.beta)

        def after_fit(self) -> None:
            super().after_fit()
            self.learn.recorder.__dict__["smooth_loss"] = self.saved

    def native_loader(ds: Any, bs: int, shuffle: bool) -> Any:
        gen = torch.Generator().manual_seed(0)

        def idxs() -> list[int]:  # the same order on every rank, each taking its strided part
            order = torch.randperm(len(ds), generator=gen).tolist() if shuffle else list(range(len(ds)))
            return order[rank::world]

        return DataLoader(ds, bs=bs, get_idxs=idxs, n=len(ds) // world, drop_last=shuffle)

    times: dict[str, list[float]] = {}

    class Timer(Callback):
        order = 100

        def __init__(self, name: str):
            super().__init__()
            self.side = name

        def before_batch(self) -> None:
            if self.training:
                dist.barrier()
                self.start = time.perf_counter()

        def after_batch(self) -> None:
            if self.training:
                times[self.side].append(time.perf_counter() - self.start)

    def learner(name: str) -> Any:
        if name == "polyparallel":
            dls = DataLoaders(DataLoader(train, bs=64, shuffle=True, drop_last=True), DataLoader(valid, bs=64), device="cpu")
            cbs = [strategy.adapt("fastai"), Timer(name)]
        else:
            dls = DataLoaders(native_loader(train, 128 // world, True), native_loader(valid, 64 // world, False), device="cpu")
            cbs = [NativeDDPLocalLoss() if name == "native-local-loss" else NativeDDP(), Timer(name)]
        learn = Learner(dls, model_(), loss_func=nn.functional.cross_entropy, opt_func=SGD, lr=0.01, cbs=cbs)
        learn.remove_cb(ProgressCallback)
        learn.logger = lambda *a, **k: None
        return learn

    sides = {name: learner(name) for name in ("native", "control", "polyparallel", "native-local-loss")}
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            times[name] = []
            sides[name].fit(1)
            if r:  # round 0 warms up
                per_round[name].append(statistics.median(times[name]))
    return {"per_round_ms": {k: [1000 * v for v in vs] for k, vs in per_round.items()},
            "steps_per_epoch": len(times["polyparallel"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of --rounds")
    parser.add_argument("--rounds", type=int, default=12, help="epochs per side after one warm-up epoch")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    strategy = pp.Strategy(data=2, timeout=120, batch_size=128)
    results = pp.launch(_worker, strategy, 2, args=(strategy, rounds), runtime="fastai", timeout=1200)
    # A step ends when the slowest rank ends it: per round, the slower rank's median on each side.
    rounds_ms = {side: [max(r["per_round_ms"][side][i] for r in results) for i in range(rounds)]
                 for side in ("native", "control", "polyparallel", "native-local-loss")}
    ratio = [n / p for n, p in zip(rounds_ms["native"], rounds_ms["polyparallel"])]
    same_work = [n / p for n, p in zip(rounds_ms["native-local-loss"], rounds_ms["polyparallel"])]
    control = [n / c for n, c in zip(rounds_ms["native"], rounds_ms["control"])]
    print(f"fastai training step, MLP 256-512-512-10, global batch 128, data=2 (gloo, 2 processes), {rounds} rounds "
          f"of {results[0]['steps_per_epoch']} steps per side, {time.perf_counter() - start:.0f} s")
    print(f"{'learner':40}  {'median step (ms)':>16}")
    print(f"{'-' * 40}  {'-' * 16}")
    for side, label in (("native", "fastai + hand-written DDP callback"), ("control", "the same again (control)"),
                        ("polyparallel", "fastai + polyparallel adapter"),
                        ("native-local-loss", "hand-written, loss not gathered per step")):
        print(f"{label:40}  {statistics.median(rounds_ms[side]):16.3f}")
    print(f"ratio native/polyparallel: median {statistics.median(ratio):.3f} (min {min(ratio):.3f}, max {max(ratio):.3f})")
    print(f"ratio native-local-loss/polyparallel (same work): median {statistics.median(same_work):.3f} "
          f"(min {min(same_work):.3f}, max {max(same_work):.3f})")
    print(f"ratio native/control:      median {statistics.median(control):.3f} (min {min(control):.3f}, max {max(control):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds_ms": rounds_ms, "ratio": ratio, "same_work_ratio": same_work, "control_ratio": control, "rounds": rounds,
                       "per_rank": results}, f, indent=2)


if __name__ == "__main__":
    main()
