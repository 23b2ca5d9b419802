"""A tiny Ignite job for the SLURM lane: the same under sbatch + srun and polyparallel launch."""
import json
import os
import sys

import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp

strategy = pp.Strategy(data=-1, batch_size=16, timeout=60)
ignite = strategy.adapt("ignite")
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
torch.manual_seed(0)
model = ignite.auto_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1), model)
loader = ignite.auto_dataloader(data, shuffle=False)
trainer = ignite.create_supervised_trainer(model, optimizer, nn.functional.cross_entropy, data=loader)
losses = []
trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: losses.append(float(engine.state.output)))
trainer.run(loader, max_epochs=1)
row = {"rank": strategy.rank, "world": strategy.world_size, "slurm": os.environ.get("SLURM_PROCID"),
       "losses": losses, "params": sum(float(p.detach().sum()) for p in model.parameters())}
sys.stdout.write("RESULT " + json.dumps(row) + "\n")
sys.stdout.flush()
