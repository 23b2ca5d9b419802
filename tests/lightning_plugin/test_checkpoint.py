"""Lightning checkpoints are polyparallel checkpoints (plugins/polyparallel_lightning/checkpoint.py).

One launch of 4 gloo processes (data=2 x tensor=2, global batch 8, 40 samples: 5 steps an epoch):

- ``ModelCheckpoint(every_n_train_steps=7)`` in a run stopped at step 7 (step 2 of epoch 1, in the
  middle of it) writes one committed polyparallel directory; ``fit(ckpt_path=)`` from it ends
  with the parameters of an uninterrupted 2-epoch run (the loader resumes after the consumed
  batches, the momentum is restored);
- the same directory read at data=4 (``fit(ckpt_path=)`` in a data=4 Trainer) gives the saved
  parameters and optimizer state, resharded;
- a consolidated file (what earlier versions of the adapter and Lightning's own strategies write)
  still resumes.
"""

import os

import pytest

import polyparallel as pp
from polyparallel_torch.testing import momentum_buffers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(500)]

NS = "lightning.pytorch"
SAMPLES, GLOBAL_BATCH, STOP = 40, 8, 7


def _loader():
    from torch.utils.data import DataLoader

    from polyparallel_torch.testing import reference_dataset

    # batch_size is replaced by the strategy's global batch (per rank: 8 / data).
    return DataLoader(reference_dataset(SAMPLES), batch_size=1, shuffle=True)


def _worker(directory, legacy):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import flat_params

    hybrid = pp.Strategy(data=2, tensor=2, batch_size=GLOBAL_BATCH, seed=0, timeout=60)
    module_cls = reference_module_class(NS)
    quiet = dict(limit_val_batches=0)

    uninterrupted = module_cls(0, momentum=0.9)
    make_trainer(hybrid, NS, max_epochs=2, **quiet).fit(uninterrupted, _loader())

    stopped = module_cls(0, momentum=0.9)
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=STOP, save_top_k=-1)
    trainer = make_trainer(hybrid, NS, max_steps=STOP, enable_checkpointing=True, callbacks=[saver], **quiet)
    trainer.fit(stopped, _loader())
    path = os.path.join(directory, f"epoch=1-step={STOP}.ckpt")
    stopped_state = {"params": flat_params(stopped.net), "momentum": momentum_buffers(trainer.optimizers[0])}

    resumed = module_cls(0, momentum=0.9)
    trainer = make_trainer(hybrid, NS, max_epochs=2, **quiet)
    trainer.fit(resumed, _loader(), ckpt_path=path)
    resumed_steps = len(resumed.losses)

    # The older file's step 1 is max_steps: fit restores it (full tensors cut into shards) and stops.
    from_legacy = module_cls(0, momentum=0.9)
    trainer = make_trainer(hybrid, NS, max_steps=1, **quiet)
    trainer.fit(from_legacy, _loader(), ckpt_path=legacy)
    legacy_state = {"params": flat_params(from_legacy.net), "momentum": momentum_buffers(trainer.optimizers[0])}

    # Read at another topology: the data=4 Trainer's fit stops at once (max_steps reached) after
    # restoring the model and optimizer.
    data4 = pp.Strategy(data=4, batch_size=GLOBAL_BATCH, seed=0, timeout=60)
    resharded = module_cls(0, momentum=0.9)
    trainer = make_trainer(data4, NS, max_steps=STOP, **quiet)
    trainer.fit(resharded, _loader(), ckpt_path=path)
    return {"rank": hybrid.rank, "uninterrupted": flat_params(uninterrupted.net), "resumed": flat_params(resumed.net),
            "resumed_steps": resumed_steps, "stopped": stopped_state, "legacy": legacy_state,
            "resharded": {"params": flat_params(resharded.net), "momentum": momentum_buffers(trainer.optimizers[0])},
            "written": sorted(os.listdir(directory))}


def _legacy_file(path):
    """A consolidated checkpoint file, as the adapter wrote before (and Lightning's own DDP
    writes): one process, Lightning's own Trainer, one step."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from polyparallel_lightning.testing import reference_module_class
    from polyparallel_torch.testing import flat_params, reference_dataset

    module = reference_module_class(NS)(3, momentum=0.9)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(reference_dataset(16), batch_size=8))
    trainer.save_checkpoint(path)
    return {"params": flat_params(module.net), "momentum": momentum_buffers(trainer.optimizers[0])}


def _assert_state_equal(got, want, what):
    assert want["params"] and want["momentum"], what
    for name, values in want["params"].items():
        assert got["params"][name] == pytest.approx(values, abs=1e-6), f"{what}: {name}"
    assert got["momentum"].keys() == want["momentum"].keys(), what
    for key, values in want["momentum"].items():
        assert got["momentum"][key] == pytest.approx(values, abs=1e-6), f"{what}: momentum of parameter {key}"


def test_checkpoint_resumes_mid_epoch_exactly_reshards_and_reads_older_files(run, tmp_path):
    legacy = str(tmp_path / "old.ckpt")
    legacy_state = _legacy_file(legacy)
    hybrid = pp.Strategy(data=2, tensor=2, timeout=60)
    results = run(_worker, hybrid, 4, str(tmp_path / "ckpts"), legacy, timeout=460)
    written = results[0]["written"]
    assert written == [f"epoch=1-step={STOP}.ckpt"], written
    meta = pp.latest_checkpoint(str(tmp_path / "ckpts"), pattern="*.ckpt")
    assert meta is not None and os.path.basename(meta) == written[0], "a committed polyparallel checkpoint"
    for r in results:
        assert r["resumed_steps"] == 10 - STOP, "the resumed run trains only the remaining batches"
        for name, values in r["uninterrupted"].items():
            assert r["resumed"][name] == pytest.approx(values, abs=1e-5), f"{name} on rank {r['rank']}"
        # data=4 reads what data=2 x tensor=2 wrote: parameters and momentum, resharded.
        _assert_state_equal(r["resharded"], r["stopped"], f"data=4 on rank {r['rank']}")
        _assert_state_equal(r["legacy"], legacy_state, f"the consolidated file on rank {r['rank']}")


def test_refuses_checkpoints_without_lightning_state_and_several_optimizers(tmp_path):
    """One process: a plain loop's checkpoint holds no Lightning loop state (``ckpt_path=`` says
    how to use it), and a module with two optimizers cannot be saved as one checkpoint."""
    from polyparallel_lightning.testing import make_trainer, reference_module_class

    strategy = pp.Strategy(data=1, batch_size=GLOBAL_BATCH, seed=0)
    module_cls = reference_module_class(NS)
    plain = module_cls(0)
    strategy.save(tmp_path / "plain", model=plain, optimizer=plain.configure_optimizers())
    with pytest.raises(pp.CheckpointError, match=r"written outside Lightning .* fit without ckpt_path="):
        make_trainer(strategy, NS, max_steps=1, limit_val_batches=0).fit(module_cls(1), _loader(),
                                                                           ckpt_path=str(tmp_path / "plain"))

    class TwoOptimizers(module_cls):
        def configure_optimizers(self):
            return [super().configure_optimizers(), super().configure_optimizers()]

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
                optimizer.zero_grad()

    module = TwoOptimizers(0)
    module.automatic_optimization = False
    trainer = make_trainer(strategy, NS, max_steps=1, limit_val_batches=0)
    trainer.fit(module, _loader())
    collectives = []
    trainer.strategy.broadcast = lambda obj, src=0: collectives.append(obj) or obj  # records it, one process
    with pytest.raises(TypeError, match=r"holds one optimizer; configure_optimizers returned 2"):
        trainer.save_checkpoint(str(tmp_path / "two"))
    assert not (tmp_path / "two").exists()
    assert collectives == [], "refused before the path's broadcast (a collective every rank would enter)"


class _Planted:
    """A pickle that runs code when unpickled: it writes the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _planted_worker(directory, sentinel):
    from polyparallel_lightning.testing import make_trainer, reference_module_class

    strategy = pp.Strategy(data=2, zero=3, batch_size=GLOBAL_BATCH, seed=0, timeout=60)
    trainer = make_trainer(strategy, NS, max_steps=1, limit_val_batches=0)
    try:
        trainer.fit(reference_module_class(NS)(0), _loader(), ckpt_path=directory)
        outcome = ["loaded", ""]
    except Exception as exc:
        outcome = [type(exc).__name__, str(exc)]
    return {"rank": strategy.rank, "outcome": outcome, "ran": os.path.exists(sentinel)}


def test_a_crafted_lightning_directory_is_never_unpickled(run, tmp_path):
    # A directory holding meta.pt is read as Lightning's ModelParallelStrategy format (zero >= 1; at
    # zero=3 the parameters are DTensors, which that loader needs before it reads anything),
    # whose DCP reader would pickle.load its .metadata: a crafted directory would run code.
    import pickle

    import torch

    require = pytest.importorskip("polyparallel_torch.plugin")
    if 3 not in require.CAPABILITIES.stages:
        pytest.skip("the torch runtime does not declare zero=3")
    directory, sentinel = tmp_path / "crafted.ckpt", tmp_path / "ran.txt"
    directory.mkdir()
    torch.save({"epoch": 0, "global_step": 0}, directory / "meta.pt")
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(_Planted(str(sentinel)), f)
    results = run(_planted_worker, pp.Strategy(data=2, zero=3, timeout=60), 2, str(directory), str(sentinel),
                  timeout=300)
    assert not sentinel.exists(), "the crafted .metadata ran code"
    for r in results:
        assert r["outcome"][0] == "CheckpointError" and "refusing to load builtins.exec" in r["outcome"][1], r


def test_async_checkpoint_io_saves_through_async_save_and_commits_each(tmp_path, monkeypatch):
    """One process: Lightning's own switch for asynchronous saves, ``AsyncCheckpointIO``, makes every
    save an ``async_save``; ``ModelCheckpoint``'s removal of the older checkpoint waits for the new
    one's commit, and the teardown for the last."""
    import importlib

    from lightning.pytorch.callbacks import ModelCheckpoint

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch import checkpoint_async
    from polyparallel_torch.testing import flat_params

    started = []
    start = checkpoint_async.start
    monkeypatch.setattr(checkpoint_async, "start", lambda strategy, runtime, path, *args: started.append(
        os.path.basename(path)) or start(strategy, runtime, path, *args))
    async_io = importlib.import_module(f"{NS}.plugins.io").AsyncCheckpointIO
    strategy = pp.Strategy(data=1, batch_size=GLOBAL_BATCH, seed=0)
    module = reference_module_class(NS)(0, momentum=0.9)
    saver = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=1)
    trainer = make_trainer(strategy, NS, max_steps=4, enable_checkpointing=True, callbacks=[saver],
                           limit_val_batches=0, plugins=[async_io()])
    trainer.fit(module, _loader())
    assert started == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert trainer.strategy._pending_save is None, "the teardown finished the save in flight"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt"], "the older one removed after the newer's commit"
    fresh = reference_module_class(NS)(1)
    pp.Strategy(data=1).load(str(tmp_path / "epoch=0-step=4.ckpt"), model=fresh)
    assert flat_params(fresh.net) == flat_params(module.net)
