"""A plain PyTorch loop on XLA devices through polyparallel's torch_xla runtime.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/xla_train.py   # 2 XLA CPU devices (threads)
    PJRT_DEVICE=TPU python examples/xla_train.py --nprocs 8           # every core of a TPU host

Each replica gets a disjoint shard of the data (an MpDeviceLoader), gradients are averaged over
the data axis with XLA all-reduces, and the reported loss is the count-weighted global value.
On CPU devices, where the replicas are threads of one process, ``pp.launch`` applies what upstream
torch_xla needs to run collectives from several threads (pytorch/xla issue 9089; polyparallel_xla.cpu).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def make_data(n: int = 1000) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :4].argmax(-1))


def train(state: dict[str, torch.Tensor], epochs: int) -> dict[str, float]:
    import torch_xla

    strategy = pp.Strategy(data=-1, runtime="xla", batch_size=64, timeout=60)
    loader = strategy.shard_data(make_data(), shuffle=True, remainder="drop")
    model = make_model()
    model.load_state_dict(state)  # weights built before launching: replica threads share the RNG
    model = strategy.wrap_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        total, count = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            strategy.sync_grads(model)
            opt.step()
            torch_xla.sync()
            total, count = total + float(loss.detach().cpu()) * len(y), count + len(y)
    return strategy.reduce_metrics({"loss": pp.Mean(total, count)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=int(os.environ.get("CPU_NUM_DEVICES", "2")))
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    strategy = pp.Strategy(data=-1, runtime="xla", batch_size=64, timeout=60)
    results = pp.launch(train, strategy, nprocs=args.nprocs, args=(make_model().state_dict(), args.epochs),
                       timeout=600)
    print(f"last-epoch loss over {args.nprocs} XLA devices: {results[0]['loss']:.4f}")


if __name__ == "__main__":
    main()
