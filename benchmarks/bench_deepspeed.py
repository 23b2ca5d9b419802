"""Ratio benchmark of the DeepSpeed adapter against a hand-written ``deepspeed.initialize``.

    OMP_NUM_THREADS=1 python benchmarks/bench_deepspeed.py [--quick] [--rounds N] [--zero S] [--launches L]
                                                           [--precision bf16-mixed] [--json results.json]

Three engines train the same MLP (256-512-512-10) on the same batches with SGD, a global batch of
128 and ZeRO stage ``--zero`` (2 by default), in the same 2 gloo processes:

- native A and native B: ``deepspeed.initialize`` with a hand-written config equivalent to the
  adapter's (``train_batch_size`` 128, micro-batch 64, ``zero_optimization.stage``,
  ``gradient_clipping`` 0, ``zero_allow_untested_optimizer``) and DeepSpeed's own groups. A vs B
  is the control: two identical engines, whose ratio shows the noise of the machine;
- polyparallel: ``strategy.adapt("deepspeed", ...)`` (the config built from the Strategy, the
  ``mpu`` on the Strategy's process groups).

With ``--precision bf16-mixed`` the Strategy has ``precision="bf16-mixed"`` and the hand-written
config adds what the adapter writes for it, ``bf16: {enabled: true}`` and
``communication_data_type: "fp32"``; the inputs are bfloat16 for all three engines.

Each round runs every engine for ``--steps`` steps, in a rotating order (machine noise hits all
alike); every step starts after a barrier so both ranks are timed from the same point. A round's
figure is each engine's median step (the slower rank's); the first round warms up and is dropped.
Reported: the median over rounds of the step time, and the paired ratios native/polyparallel and
native A/native B (the control) with their spread (min-max over rounds). > 1 means the second is
faster; the target for the adapter is a ratio within 3% of 1. With ``--launches L`` (L >= 2) the
whole measurement is repeated in L separate launches (fresh processes, fresh engines), and the
median and spread of the L per-launch figures are reported as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import polyparallel as pp

GLOBAL_BATCH = 128


def _worker(strategy: pp.Strategy, rounds: int, steps: int) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    stage = strategy.shard_policy.stage
    bf16 = strategy.precision is not None and strategy.precision.compute_dtype == "bfloat16"
    precision = {"bf16": {"enabled": True}, "communication_data_type": "fp32"} if bf16 else {}
    dtype = torch.bfloat16 if bf16 else torch.float32

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def native() -> Any:
        model = model_()
        config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
                  "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **precision}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                          config=config)
        return engine

    model = model_()
    engines = {"polyparallel": strategy.adapt("deepspeed", model=model, config={"steps_per_print": 10**9},
                                              optimizer=torch.optim.SGD(model.parameters(), lr=0.01)),
               "native A": native(), "native B": native()}
    torch.manual_seed(1 + strategy.session().rank)
    batches = [(torch.randn(GLOBAL_BATCH // 2, 256).to(dtype), torch.randint(0, 10, (GLOBAL_BATCH // 2,))) for _ in range(steps)]
    per_round: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds + 1):
        order = names[r % 3:] + names[:r % 3]  # rotate who goes first
        for name in order:
            engine, times = engines[name], []
            for x, y in batches:
                dist.barrier()
                start = time.perf_counter()
                loss = nn.functional.cross_entropy(engine(x).float(), y)
                engine.backward(loss)
                engine.step()
                times.append(time.perf_counter() - start)
            if r > 0:  # round 0 warms up
                per_round[name].append(statistics.median(times))
    keys = ("train_batch_size", "zero_optimization", "gradient_clipping", "bf16", "communication_data_type")
    return {"per_round_s": per_round, "config": {k: v for k, v in engines["polyparallel"].config.items() if k in keys},
            "bf16": {name: bool(e.bfloat16_enabled()) for name, e in engines.items()}}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of --rounds")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per engine (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=20, help="steps per engine per round")
    parser.add_argument("--zero", type=int, default=2, help="ZeRO stage (0-3)")
    parser.add_argument("--precision", choices=("32", "bf16-mixed"), default=None,
                        help="Strategy(precision=) and the matching hand-written bf16 config (default: none, fp32)")
    parser.add_argument("--launches", type=int, default=1, help="repeat the measurement in this many launches")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    strategy = pp.Strategy(data=2, zero=args.zero, timeout=120, batch_size=GLOBAL_BATCH, precision=args.precision)
    per_launch: list[tuple[float, float]] = []
    rounds_ms: dict[str, list[float]] = {}
    for _ in range(max(1, args.launches)):
        results = pp.launch(_worker, strategy, 2, args=(strategy, rounds, args.steps), timeout=1200, runtime="deepspeed")
        assert all(results[0]["bf16"].values()) == (args.precision == "bf16-mixed"), results[0]["bf16"]
        # A step ends when the slower rank ends it: per round, the slower rank's median.
        launch_ms = {name: [1000 * max(r["per_round_s"][name][i] for r in results) for i in range(rounds)]
                     for name in results[0]["per_round_s"]}
        for name, values in launch_ms.items():
            rounds_ms.setdefault(name, []).extend(values)
        per_launch.append((statistics.median(a / p for a, p in zip(launch_ms["native A"], launch_ms["polyparallel"])),
                           statistics.median(a / b for a, b in zip(launch_ms["native A"], launch_ms["native B"]))))
    adapter = [a / p for a, p in zip(rounds_ms["native A"], rounds_ms["polyparallel"])]
    control = [a / b for a, b in zip(rounds_ms["native A"], rounds_ms["native B"])]
    launches = len(per_launch)
    print(f"DeepSpeed training step, ZeRO {args.zero}, precision {args.precision or 'None (fp32)'}, MLP 256-512-512-10, "
          f"global batch {GLOBAL_BATCH}, data=2 (gloo, 2 processes), {launches} launch(es) x {rounds} rounds x "
          f"{args.steps} steps per engine, {time.perf_counter() - start:.0f} s")
    print(f"{'engine':44}  {'median step (ms) [min-max over rounds]':>40}")
    print(f"{'-' * 44}  {'-' * 40}")
    for name, label in (("native A", "deepspeed.initialize, hand-written config (A)"),
                        ("native B", "deepspeed.initialize, hand-written config (B)"),
                        ("polyparallel", "strategy.adapt('deepspeed')")):
        print(f"{label:44}  {_spread(rounds_ms[name]):>40}")
    print(f"paired ratio native A / polyparallel (median [min-max] over rounds): {_spread(adapter)}")
    print(f"control ratio native A / native B (same engine twice):               {_spread(control)}")
    if launches > 1:
        print(f"per launch ({launches}): native A / polyparallel {_spread([a for a, _ in per_launch])}, "
              f"control {_spread([c for _, c in per_launch])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds_ms": rounds_ms, "adapter_ratio": statistics.median(adapter),
                       "control_ratio": statistics.median(control), "config": results[0]["config"], "rounds": rounds,
                       "steps": args.steps, "zero": args.zero, "precision": args.precision,
                       "per_launch": per_launch}, f, indent=2)


if __name__ == "__main__":
    main()
