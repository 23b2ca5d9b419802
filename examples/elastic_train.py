"""Fault-tolerant training in a plain torch loop: a checkpoint every K steps, and workers that
resume from the newest complete one when torchrun's elastic agent restarts them.

    # 4 processes; if a rank dies, the agent restarts every worker (at most twice)
    polyparallel launch --nproc-per-node 4 --max-restarts 2 examples/elastic_train.py --ckpt-dir ckpts --every 4
    # the same, with rank 2 killed (SIGKILL) right before the checkpoint of step 8, first attempt only
    polyparallel launch --nproc-per-node 4 --max-restarts 2 examples/elastic_train.py --ckpt-dir ckpts \\
        --every 4 --kill-rank 2 --kill-step 8

Resuming takes no code beyond ``polyparallel.latest_checkpoint`` and ``strategy.load``: the
checkpoint holds the model, the optimizer, the loader's position (epoch and batches consumed)
and the RNG states, so the resumed run continues the same sample order and ends with the
parameters of an uninterrupted run. A checkpoint whose save was cut short (here: rank 2 dies,
its peers are left inside ``strategy.save``) stays a ``step-N.partial-*`` directory without a
commit marker, which ``latest_checkpoint`` skips; the restarted job resumes from the one before.

Rank 0 prints ``RESUME {...}`` at the start of each attempt (the checkpoint it resumes from and
what the folder held) and ``RESULT {...}`` at the end (the final parameters), for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
from torch import nn

import polyparallel as pp


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def dataset(n: int = 96) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4)


def train(strategy: pp.Strategy, epochs: int, ckpt_dir: str | None = None, every: int = 4,
          kill_rank: int | None = None, kill_step: int | None = None) -> dict[str, Any]:
    """Train (resuming from ``ckpt_dir``'s newest committed checkpoint, if any); the final parameters."""
    model = strategy.wrap_model(build())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = strategy.shard_data(dataset())
    progress = {"epoch": 0}
    found = pp.latest_checkpoint(ckpt_dir) if ckpt_dir else None
    if found is not None:
        progress = strategy.load(found, model=model, optimizer=opt, loader=loader)
    if ckpt_dir and strategy.rank == 0:
        held = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        print("RESUME " + json.dumps({"attempt": attempt, "from": found, "held": held}), flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for _ in range(progress["epoch"], epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            strategy.sync_grads(model)  # a no-op under DDP
            opt.step()
            step = loader.global_step
            if ckpt_dir and step % every == 0:
                if first_attempt and strategy.rank == kill_rank and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # the simulated failure
                strategy.save(os.path.join(ckpt_dir, f"step-{step:06d}"), model=model, optimizer=opt, loader=loader)
    from polyparallel_torch import full_state

    return {k: v.tolist() for k, v in full_state(model).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True, help="folder of step-N checkpoints (made if missing)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size")
    parser.add_argument("--kill-rank", type=int, default=None, help="simulate a failure of this rank ...")
    parser.add_argument("--kill-step", type=int, default=None, help="... right before the checkpoint of this step")
    args = parser.parse_args()
    strategy = pp.Strategy(data=-1, batch_size=args.batch_size, timeout=60)
    params = train(strategy, args.epochs, args.ckpt_dir, args.every, args.kill_rank, args.kill_step)
    if strategy.rank == 0:
        print("RESULT " + json.dumps(params), flush=True)


if __name__ == "__main__":
    main()
