"""XLA on CPU, for information only (no ratio target): step times of the ``xla`` runtime on 2 XLA
CPU devices, a plain torch loop and a fastai ``Learner`` with ``strategy.adapt("fastai")``.

    bash tools/env-xla.sh   # once: .venv-xla (torch 2.9.0 + torch_xla 2.9.0 + fastai)
    OMP_NUM_THREADS=1 .venv-xla/bin/python benchmarks/bench_xla.py [--quick] [--json results.json]

The replicas are threads of one process (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=2``) and run with
the test support of :mod:`polyparallel_xla.testing` (ordered syncs, pytorch/xla issue 9089), so
each step's graphs run one replica at a time: these figures say what the XLA path costs on this
machine's CPUs, not what it does on a TPU. For context, the same fastai ``Learner`` in one eager
CPU process with the whole global batch. Step times are medians over the steps after the first
epoch (which compiles the graphs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "plugins")]

import polyparallel as pp  # noqa: E402

SAMPLES, FEATURES, HIDDEN, CLASSES, GLOBAL = 2048, 64, 256, 10, 64


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def _model(state: Any = None) -> Any:
    import torch
    from torch import nn

    if state is None:
        torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, CLASSES))
    if state is not None:
        model.load_state_dict(state)
    return model


def _fastai_step_times(learn: Any, epochs: int) -> list[float]:
    from fastai.callback.core import Callback

    times: list[float] = []

    class Timer(Callback):
        def before_batch(self) -> None:
            self.start = time.perf_counter()

        def after_batch(self) -> None:
            if self.training and self.epoch > 0:  # the first epoch compiles
                times.append(time.perf_counter() - self.start)

    learn.add_cb(Timer())
    learn.fit(epochs)
    return times


def _learner(model: Any, bs: int, cbs: list[Any]) -> Any:
    from polyparallel_fastai.testing import make_learner

    data = _data()
    return make_learner(data, data, model, bs, cbs=cbs)


def _replica(strategy: pp.Strategy, state: Any, epochs: int) -> dict[str, float]:
    import torch
    import torch_xla
    from torch import nn

    from polyparallel_xla.testing import install_ordered_sync

    install_ordered_sync()
    loader = strategy.shard_data(_data(), batch_size=GLOBAL, shuffle=True, remainder="drop")
    model = strategy.wrap_model(_model(state))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plain: list[float] = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            strategy.sync_grads(model)
            opt.step()
            torch_xla.sync()
            if epoch > 0:
                plain.append(time.perf_counter() - start)
    learn = _learner(_model(state), GLOBAL, [strategy.adapt("fastai")])
    fastai = _fastai_step_times(learn, epochs)
    return {"plain_torch_ms": 1e3 * statistics.median(plain), "fastai_ms": 1e3 * statistics.median(fastai)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs instead of 3")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    from polyparallel_xla.testing import cpu_env

    os.environ.update(cpu_env(2))
    epochs = 2 if args.quick else 3
    strategy = pp.Strategy(data=2, runtime="xla", batch_size=GLOBAL, timeout=60)
    per_rank = pp.launch(_replica, strategy, nprocs=2, args=(strategy, _model().state_dict(), epochs), timeout=900)
    eager = statistics.median(_fastai_step_times(_learner(_model(), GLOBAL, []), epochs))
    figures = {
        "xla_plain_torch_step_ms": max(r["plain_torch_ms"] for r in per_rank),
        "xla_fastai_step_ms": max(r["fastai_ms"] for r in per_rank),
        "eager_cpu_fastai_step_ms": 1e3 * eager,
    }
    print(f"XLA on CPU, 2 devices (threads), global batch {GLOBAL}, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}; "
          "median step time after the compiling epoch (information only):")
    print(f"  plain torch loop on the xla runtime   {figures['xla_plain_torch_step_ms']:8.2f} ms")
    print(f"  fastai Learner on the xla runtime     {figures['xla_fastai_step_ms']:8.2f} ms")
    print(f"  fastai Learner, one eager CPU process {figures['eager_cpu_fastai_step_ms']:8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
