"""A tiny Lightning job for the SLURM lane: the same under sbatch + srun and polyparallel launch."""
import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import polyparallel as pp


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


strategy = pp.Strategy(data=-1, timeout=60)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
trainer = L.Trainer(strategy=strategy.adapt("lightning"), accelerator="cpu",
                    devices=int(os.environ.get("LOCAL_WORLD_SIZE", strategy.world_size)), max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Module()
trainer.fit(model, DataLoader(data, batch_size=8))
row = {"rank": strategy.rank, "world": strategy.world_size, "slurm": os.environ.get("SLURM_PROCID"),
       "environment": type(trainer.strategy.cluster_environment).__name__, "losses": model.losses,
       "params": sum(float(p.detach().sum()) for p in model.parameters())}
sys.stdout.write("RESULT " + json.dumps(row) + "\n")
sys.stdout.flush()
