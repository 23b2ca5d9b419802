"""A tiny training job for the SLURM lane: the same under srun, sbatch and polyparallel launch."""
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp

tensor = int(sys.argv[1]) if len(sys.argv) > 1 else 1
strategy = pp.Strategy(data=-1, tensor=tensor, batch_size=16, timeout=60)
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
loader = strategy.shard_data(data)
model = strategy.wrap_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    strategy.sync_grads(model)
    opt.step()
    losses.append(strategy.reduce_metrics({"loss": pp.Mean(loss.item() * len(y), len(y))})["loss"])
total = sum(float(p.detach().to_local().sum() if hasattr(p, "to_local") else p.detach().sum())
            for p in model.parameters())
row = {"rank": strategy.rank, "world": strategy.world_size, "slurm": os.environ.get("SLURM_PROCID"),
       "losses": losses, "params": total}
sys.stdout.write("RESULT " + json.dumps(row) + "\n")
sys.stdout.flush()
