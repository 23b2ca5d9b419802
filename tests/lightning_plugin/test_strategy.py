"""The adapter in real Lightning runs (gloo on CPU, processes from polyparallel.launch).

- data=2: the loss curve equals Lightning's own ``strategy="ddp"`` on the same module and seed,
  and the epoch mean of ``self.log(sync_dist=True)`` is the count-weighted mean over all samples;
- data=2 x tensor=2: ``ModelCheckpoint`` and ``trainer.save_checkpoint`` write polyparallel
  checkpoints (one DCP directory each); resuming from one gives the parameters of an
  uninterrupted run (momentum included), and it loads into a plain single-process module;
  torchmetrics reduce over the data group, not the world.
"""

import pytest

import polyparallel as pp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

NS = "lightning.pytorch"


def _loader(per_rank):
    from torch.utils.data import DataLoader

    from polyparallel_torch.testing import reference_dataset

    return DataLoader(reference_dataset(37), batch_size=per_rank, shuffle=True)


def _parity_worker(strategy):
    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import flat_params

    module_cls = reference_module_class(NS)
    ours = module_cls(0)
    trainer = make_trainer(strategy, NS, max_epochs=2, limit_val_batches=0)
    trainer.fit(ours, _loader(4))
    ours_epoch_loss = float(trainer.callback_metrics["train_loss"])
    ours_sampler = type(trainer.train_dataloader.sampler).__name__
    lightning_ddp = module_cls(0)
    # Lightning's own DDP, fed the shards of polyparallel's order (pp.shard_indices, not torch's randperm)
    from torch.utils.data import DataLoader

    from polyparallel_torch import TopologySampler
    from polyparallel_torch.testing import reference_dataset

    same_batches = DataLoader(reference_dataset(37), batch_size=4,
                              sampler=TopologySampler(37, strategy.rank, 2, seed=strategy.seed, shuffle=True))
    trainer = make_trainer(strategy, NS, adapter="ddp", max_epochs=2, limit_val_batches=0,
                           use_distributed_sampler=False)
    trainer.fit(lightning_ddp, same_batches)
    return {"rank": strategy.rank, "ours": ours.losses, "ddp": lightning_ddp.losses,
            "ours_epoch_loss": ours_epoch_loss, "ddp_epoch_loss": float(trainer.callback_metrics["train_loss"]),
            "ours_params": flat_params(ours.net), "ddp_params": flat_params(lightning_ddp.net),
            "ddp_class": type(trainer.strategy).__name__, "ours_sampler": ours_sampler}


def test_loss_curve_equals_lightning_ddp_and_epoch_mean_is_count_weighted(run):
    strategy = pp.Strategy(data=2, timeout=60, seed=0)
    results = run(_parity_worker, strategy, 2, strategy)
    steps_per_epoch = 5  # 37 samples padded to 38, 19 per rank, batches of 4: 4, 4, 4, 4, 3
    for r in results:
        assert r["ddp_class"] == "DDPStrategy"
        assert r["ours_sampler"] == "TopologySampler", "the adapter shards through strategy.shard_data"
        assert len(r["ours"]) == len(r["ddp"]) == 2 * steps_per_epoch
        assert r["ours"] == pytest.approx(r["ddp"], abs=1e-5, rel=1e-5), f"rank {r['rank']}"
        for name, values in r["ours_params"].items():
            assert values == pytest.approx(r["ddp_params"][name], abs=1e-5), name
    assert results[0]["ours"] != results[1]["ours"], "both ranks saw the same batches"
    # The epoch value of self.log(on_epoch=True, sync_dist=True): every sample of the last epoch
    # weighted once, over both data ranks (a mean of per-rank means would weigh the batch of 3 like the 4s).
    sizes = [4, 4, 4, 4, 3]
    total = sum(loss * n for r in results for loss, n in zip(r["ours"][-steps_per_epoch:], sizes))
    expected = total / (2 * sum(sizes))
    for r in results:
        assert r["ours_epoch_loss"] == pytest.approx(expected, rel=1e-6)
        assert r["ours_epoch_loss"] == pytest.approx(r["ddp_epoch_loss"], rel=1e-6)


def _checkpoint_worker(strategy, directory):
    import os

    import torchmetrics
    from lightning.pytorch.callbacks import ModelCheckpoint

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import flat_params

    module_cls = reference_module_class(NS)
    short = dict(limit_train_batches=2, limit_val_batches=0)
    uninterrupted = module_cls(0, momentum=0.9)
    make_trainer(strategy, NS, max_epochs=2, **short).fit(uninterrupted, _loader(4))

    first = module_cls(0, momentum=0.9)
    trainer = make_trainer(strategy, NS, max_epochs=1, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)], **short)
    trainer.fit(first, _loader(4))
    trainer.save_checkpoint(os.path.join(directory, "manual.ckpt"))
    resumed = module_cls(0, momentum=0.9)
    make_trainer(strategy, NS, max_epochs=2, **short).fit(resumed, _loader(4),
                                                            ckpt_path=os.path.join(directory, "last.ckpt"))

    class CountingModule(module_cls):
        def __init__(self):
            super().__init__(0)
            self.counted = torchmetrics.SumMetric()

        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            self.counted.update(float(len(batch[1])))
            self.log("torchmetrics_samples", self.counted)

    counting = CountingModule()
    trainer = make_trainer(strategy, NS)
    trainer.validate(counting, _loader(4), verbose=False)
    return {"rank": strategy.rank, "written": sorted(os.listdir(directory)), "after_first": flat_params(first.net),
            "uninterrupted": flat_params(uninterrupted.net), "resumed": flat_params(resumed.net),
            "samples": float(trainer.callback_metrics["samples"]),
            "torchmetrics_samples": float(trainer.callback_metrics["torchmetrics_samples"])}


def test_hybrid_checkpoints_are_polyparallel_checkpoints_and_resume_exactly(run, tmp_path):
    from polyparallel_lightning.testing import reference_module_class

    strategy = pp.Strategy(data=2, tensor=2, timeout=60)
    results = run(_checkpoint_worker, strategy, 4, strategy, str(tmp_path))
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["written"] == ["epoch=0-step=2.ckpt", "last.ckpt", "manual.ckpt"]
    for r in results:
        for name, values in r["resumed"].items():
            assert values == pytest.approx(r["uninterrupted"][name], abs=1e-6), f"{name} on rank {r['rank']}"
        assert r["samples"] == 37.0, "self.log(reduce_fx='sum', sync_dist=True) counted tensor replicas"
        assert r["torchmetrics_samples"] == 37.0, "a torchmetrics metric was reduced over the world"
    # Each is one committed polyparallel directory (each shard written once), which loads into the
    # plain, single-process model, momentum included.
    for name in by_rank[0]["written"]:
        assert (tmp_path / name / "polyparallel-checkpoint.json").is_file(), name
    module = reference_module_class(NS)(1, momentum=0.9)
    optimizer = module.configure_optimizers()
    pp.Strategy(data=1).load(str(tmp_path / "manual.ckpt"), model=module, optimizer=optimizer)
    after_first = by_rank[0]["after_first"]
    for name, param in module.net.named_parameters():
        assert param.reshape(-1).double().tolist() == pytest.approx(after_first[name], abs=1e-7), name
    momentum = optimizer.state[module.net[0].weight]["momentum_buffer"]
    assert momentum.shape == (16, 8), "optimizer state of a sharded parameter, whole"


# -- nothing outlives the Trainer ------------------------------------------------------------------------
#: Lightning launches the processes (Trainer(devices=2), its subprocess launcher): rank 0 is this
#: script, rank 1 a copy Lightning starts. Lightning's own DDP first, then the adapter, then
#: Lightning's own DDP again; each rank prints what it saw.
LIGHTNING_LAUNCHED = '''
import json, os, sys, warnings

import lightning.pytorch as L
from torch.utils.data import DataLoader

import polyparallel as pp
from polyparallel_lightning.environment import launched_externally
from polyparallel_lightning.testing import reference_module_class
from polyparallel_torch.testing import reference_dataset

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
module_cls = reference_module_class("lightning.pytorch")
loader = DataLoader(reference_dataset(16), batch_size=4)
seen = {}


def use(name, strategy):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        max_epochs=1, limit_train_batches=2)
    trainer.fit(module_cls(0), loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module_cls(0), loader, verbose=False)
    seen[name] = {"env": {k: os.environ.get(k) for k in KEYS}, "filters": [repr(f) for f in warnings.filters],
                  "launched_externally": launched_externally(), "rank": trainer.global_rank,
                  "sampler_warnings": sum("DistributedSampler" in str(w.message) for w in caught)}


use("plain", "ddp")
use("adapter", pp.Strategy(data=2, timeout=60).adapt("lightning", namespace="lightning.pytorch"))
use("plain_after", "ddp")
sys.stdout.write("RESULT " + json.dumps(seen) + "\\n")
sys.stdout.flush()
'''


def test_a_plain_trainer_after_the_adapter_sees_what_it_would_without_polyparallel(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "lightning_launched.py"
    script.write_text(LIGHTNING_LAUNCHED)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                        "MASTER_PORT")}
    proc = subprocess.run(["timeout", "-k", "10", "300", sys.executable, str(script)], cwd=tmp_path, check=False,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert sorted(r["plain"]["rank"] for r in results) == [0, 1], "Lightning must start exactly one more process"
    for seen in results:
        plain, adapter, after = seen["plain"], seen["adapter"], seen["plain_after"]
        rank = plain["rank"]
        # The environment and warning filters after the adapter's run are those after Lightning's own.
        assert adapter["env"] == plain["env"], f"rank {rank}"
        assert adapter["filters"] == plain["filters"] == after["filters"], f"rank {rank}"
        assert after["env"] == plain["env"] and not adapter["launched_externally"] and not after["launched_externally"]
        assert adapter["env"]["RANK"] is None, "RANK is never Lightning's: polyparallel's left behind"
        # The adapter silences Lightning's DistributedSampler warning for its own Trainer only.
        assert adapter["sampler_warnings"] == 0
        assert plain["sampler_warnings"] == after["sampler_warnings"] == (1 if rank == 0 else 0), f"rank {rank}"


def test_warning_filters_are_left_as_they_were():
    import warnings

    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import reference_dataset

    before = list(warnings.filters)
    strategy = pp.Strategy(data=1, timeout=30)
    trainer = make_trainer(strategy, NS, max_epochs=1, limit_train_batches=2)
    trainer.fit(reference_module_class(NS)(0), DataLoader(reference_dataset(8), batch_size=4))
    trainer.validate(reference_module_class(NS)(0), DataLoader(reference_dataset(8), batch_size=4), verbose=False)
    assert warnings.filters == before
    assert "_resolve_sampler" not in vars(trainer._data_connector), "the Trainer got its data connector back"
    assert isinstance(trainer, L.Trainer)
