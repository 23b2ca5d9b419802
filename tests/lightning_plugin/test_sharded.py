"""Stages 1-3 through Lightning (``sharded.py``, over Lightning's ``ModelParallelStrategy``) in real
runs (gloo on CPU, processes from polyparallel.launch): at ``Strategy(data=2, zero=3)`` the
parameters equal a single-process run, and ``trainer.save_checkpoint`` writes one polyparallel
checkpoint (``torch.distributed.checkpoint``) that loads into a plain single-process module and
resumes at data=4.

Each test is skipped, naming the reason, while the torch runtime does not declare the stage in
its capabilities (the sharding is the runtime's ``wrap_model``; the adapter runs what it runs).
"""

import os

import pytest

import polyparallel as pp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

NS = "lightning.pytorch"


def require_stage(stage):
    """Skip unless the torch runtime declares ``stage`` (``polyparallel_torch.capabilities.CAPABILITIES``)."""
    from polyparallel_torch.capabilities import CAPABILITIES

    if stage not in CAPABILITIES.stages:
        pytest.skip(f"the torch runtime declares sharding stages {sorted(CAPABILITIES.stages)}, not {stage}: "
                    "the adapter's sharded path needs the runtime's FSDP2 wrap_model")


def _loader(per_rank):
    from torch.utils.data import DataLoader

    from polyparallel_torch.testing import reference_dataset

    return DataLoader(reference_dataset(37), batch_size=per_rank, shuffle=True)


def _save_worker(strategy, directory):
    from polyparallel_lightning.testing import LightningDriver, make_trainer, reference_module_class
    from polyparallel_torch.testing import flat_params

    driver = LightningDriver(NS)
    trained = driver.train(strategy)  # the conformance kit's training, through Lightning
    module = reference_module_class(NS)(0, momentum=0.9)
    trainer = make_trainer(strategy, NS, max_steps=2, limit_val_batches=0)
    trainer.fit(module, _loader(4))
    trainer.save_checkpoint(os.path.join(directory, "sharded.ckpt"))
    # What earlier versions of the adapter wrote at stages 1-3: Lightning's own ModelParallelStrategy
    # folder (DCP shards + meta.pt), written here by that base class's save_checkpoint.
    from polyparallel_lightning.checkpoint import CheckpointMixin

    lightning_own = super(CheckpointMixin, trainer.strategy)  # ModelParallelStrategy's methods
    dumped = trainer._checkpoint_connector.dump_checkpoint()  # what trainer.save_checkpoint passes on
    dumped["state_dict"] = lightning_own.lightning_module_state_dict()
    dumped["optimizer_states"] = [lightning_own.optimizer_state(o) for o in trainer.strategy.optimizers]
    lightning_own.save_checkpoint(dumped, os.path.join(directory, "lightning-format.ckpt"))
    trainer.strategy.barrier()
    return {"rank": strategy.rank, "trained": trained, "saved": flat_params(module.net),
            "lightning_base": [c.__name__ for c in type(trainer.strategy).__mro__],
            "model": [type(trainer.strategy.model).__name__, type(trainer.strategy.model).__mro__[1].__name__]}


def _resume_worker(strategy, directory):
    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import flat_params

    module = reference_module_class(NS)(1, momentum=0.9)  # another initialisation: the load must replace it
    trainer = make_trainer(strategy, NS, max_steps=2, limit_val_batches=0)
    # Saved after step 2: restoring at max_steps=2 loads and trains no further.
    trainer.fit(module, _loader(2), ckpt_path=os.path.join(directory, "sharded.ckpt"))
    older = reference_module_class(NS)(2, momentum=0.9)
    make_trainer(strategy, NS, max_steps=2, limit_val_batches=0).fit(
        older, _loader(2), ckpt_path=os.path.join(directory, "lightning-format.ckpt"))
    return {"rank": strategy.rank, "step": trainer.global_step, "loaded": flat_params(module.net),
            "older": flat_params(older.net)}


def test_stage3_matches_single_process_and_its_checkpoint_loads_at_another_data_size(run, tmp_path):
    require_stage(3)
    from polyparallel_lightning.testing import LightningDriver, reference_module_class

    strategy = pp.Strategy(data=2, zero=3, timeout=60, seed=0)
    saved = run(_save_worker, strategy, 2, strategy, str(tmp_path))
    reference = LightningDriver(NS).train_reference(2)
    for r in saved:
        assert "ModelParallelStrategy" in r["lightning_base"] and "DDPStrategy" not in r["lightning_base"]
        assert r["model"][0].startswith("FSDP"), f"rank {r['rank']}: wrap_model did not apply fully_shard"
        for name, values in r["trained"].items():
            assert values == pytest.approx(reference[name], abs=1e-5), f"{name} on rank {r['rank']}"
    assert saved[0]["saved"] == saved[1]["saved"]
    # One logical checkpoint: a committed polyparallel directory (torch.distributed.checkpoint
    # shards), which loads into the plain module in this single process (the documented one-liner).
    folder = tmp_path / "sharded.ckpt"
    assert pp.latest_checkpoint(str(tmp_path), pattern="*.ckpt") == str(folder)
    module = reference_module_class(NS)(5)
    pp.Strategy(data=1).load(str(folder), model=module)
    for name, param in module.net.named_parameters():
        assert param.reshape(-1).double().tolist() == pytest.approx(saved[0]["saved"][name], abs=1e-7), name
    # ... and at another data size, resharded on load.
    wider = pp.Strategy(data=4, zero=3, timeout=60, seed=0)
    resumed = run(_resume_worker, wider, 4, wider, str(tmp_path))
    for r in resumed:
        assert r["step"] == 2
        for name, values in r["loaded"].items():
            assert values == pytest.approx(saved[0]["saved"][name], abs=1e-7), f"{name} on rank {r['rank']}"
            assert r["older"][name] == pytest.approx(saved[0]["saved"][name], abs=1e-7), f"{name}: meta.pt folder"
