"""Ignite checkpoints are polyparallel checkpoints (plugins/polyparallel_ignite/checkpoint.py).

- Exact resumption (data=2 x tensor=2, global batch 8, 40 samples: 5 steps an epoch): a run
  whose ``adapter.checkpoint(..., every=7)`` saved at step 7 (step 2 of epoch 1) and that was
  then terminated, resumed by ``adapter.load_checkpoint`` and ``trainer.run``, ends with the
  parameters of an uninterrupted 2-epoch run.
- Round trip across frameworks on the same model: Lightning at data=2 x tensor=2 saves, Ignite
  at data=4 loads (parameters and momentum equal) and saves, a plain single process loads that
  with ``strategy.load``: parameters and optimizer state equal Lightning's.
- A score computed per rank saves on every rank alike (rank 0's score decides), without a hang.
"""

import os

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.testing import momentum_buffers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

SAMPLES, GLOBAL_BATCH, STOP, MOMENTUM = 40, 8, 7, 0.9


def _job(ignite):
    """A fresh model, optimizer, loader and supervised trainer (the reference problem)."""
    from polyparallel_torch.testing import LR, reference_dataset, reference_model, reference_plan

    plan = {"plan": reference_plan()} if ignite.session.topology.size("tensor") > 1 else {}
    model = ignite.auto_model(reference_model(0), **plan)
    optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model)
    loader = ignite.auto_dataloader(reference_dataset(SAMPLES), batch_size=GLOBAL_BATCH)
    trainer = ignite.create_supervised_trainer(model, optimizer, nn.functional.cross_entropy, data=loader)
    return model, optimizer, loader, trainer


def _resume_worker(strategy, directory):
    from ignite.engine import Events

    from polyparallel_torch.testing import flat_params

    ignite = strategy.adapt("ignite")
    model, _, loader, trainer = _job(ignite)
    trainer.run(loader, max_epochs=2)
    uninterrupted = flat_params(model)

    model, optimizer, loader, trainer = _job(ignite)
    ignite.checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, directory, every=STOP)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=STOP), lambda engine: engine.terminate())
    trainer.run(loader, max_epochs=2)

    model, optimizer, loader, trainer = _job(ignite)
    steps = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: steps.append(engine.state.iteration))
    restored = ignite.load_checkpoint(os.path.join(directory, f"checkpoint_{STOP}"),
                                      {"model": model, "optimizer": optimizer, "trainer": trainer}, loader=loader)
    trainer.run(loader, max_epochs=2)
    written, resumed = sorted(os.listdir(directory)), flat_params(model)

    # A score computed per rank (rising on rank 0, falling elsewhere) would make only rank 0 save
    # from the second step on, and its collective save wait for peers that never come: every rank
    # decides from rank 0's score instead.
    model, optimizer, loader, trainer = _job(ignite)
    rank = strategy.rank
    scored = ignite.checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer},
                               os.path.join(directory, "scored"), n_saved=1, score_name="s",
                               score_function=lambda engine: engine.state.iteration * (1 if rank == 0 else -1))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, scored)
    trainer.run(loader, max_epochs=1)
    return {"rank": strategy.rank, "uninterrupted": uninterrupted, "resumed": resumed, "steps": steps,
            "progress": [restored["epoch"], restored["step"]], "written": written,
            "scored": sorted(os.listdir(os.path.join(directory, "scored"))), "last": str(scored.last_checkpoint)}


def test_ignite_resumes_mid_epoch_exactly(run, tmp_path):
    strategy = pp.Strategy(data=2, tensor=2, batch_size=GLOBAL_BATCH, seed=0, timeout=60)
    results = run(_resume_worker, strategy, 4, strategy, str(tmp_path), timeout=360)
    assert results[0]["written"] == [f"checkpoint_{STOP}"]
    assert results[0]["scored"] == ["checkpoint_s=5"], "rank 0's best score (the last of 5 steps), kept alone"
    assert {r["last"] for r in results} == {os.path.join(str(tmp_path), "scored", "checkpoint_s=5")}
    for r in results:
        assert r["progress"] == [1, 2], "saved after step 2 of epoch 1 (0-based)"
        assert r["steps"] == list(range(STOP + 1, 11)), "the resumed run trains only the remaining steps"
        for name, values in r["uninterrupted"].items():
            assert r["resumed"][name] == pytest.approx(values, abs=1e-5), f"{name} on rank {r['rank']}"


# -- Lightning -> Ignite -> plain loop ------------------------------------------------------------------
def _round_trip_worker(directory):
    from torch.utils.data import DataLoader

    from polyparallel_lightning.testing import make_trainer, reference_module_class
    from polyparallel_torch.testing import LR, flat_params, reference_dataset

    module_cls = reference_module_class("lightning.pytorch")
    hybrid = pp.Strategy(data=2, tensor=2, batch_size=GLOBAL_BATCH, seed=0, timeout=60)
    lightning_module = module_cls(0, momentum=MOMENTUM)
    trainer = make_trainer(hybrid, max_steps=3, limit_val_batches=0)
    trainer.fit(lightning_module, DataLoader(reference_dataset(SAMPLES), batch_size=1, shuffle=True))
    trainer.save_checkpoint(os.path.join(directory, "lightning"))
    saved = {"params": flat_params(lightning_module), "momentum": momentum_buffers(trainer.optimizers[0])}

    # Ignite at data=4 on the same model: the LightningModule is an nn.Module (forward = its net).
    ignite = pp.Strategy(data=4, seed=0, timeout=60).adapt("ignite")
    model = ignite.auto_model(module_cls(1))
    optimizer = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model)
    restored = ignite.load_checkpoint(os.path.join(directory, "lightning"), {"model": model, "optimizer": optimizer})
    in_ignite = {"params": flat_params(model), "momentum": momentum_buffers(optimizer)}
    handler = ignite.checkpoint({"model": model, "optimizer": optimizer}, os.path.join(directory, "ignite"))
    handler.save_handler(None, "from-lightning")  # what Checkpoint calls (every rank)
    return {"rank": hybrid.rank, "saved": saved, "ignite": in_ignite, "progress": [restored["epoch"], restored["step"]]}


def _assert_state_equal(got, want, what):
    assert want["params"] and want["momentum"], what
    assert got["params"].keys() == want["params"].keys(), what
    for name, values in want["params"].items():
        assert got["params"][name] == pytest.approx(values, abs=1e-6), f"{what}: {name}"
    assert got["momentum"].keys() == want["momentum"].keys(), what
    for key, values in want["momentum"].items():
        assert got["momentum"][key] == pytest.approx(values, abs=1e-6), f"{what}: momentum of parameter {key}"


def test_lightning_to_ignite_to_plain_loop_round_trip(run, tmp_path):
    pytest.importorskip("lightning.pytorch")
    from polyparallel_lightning.testing import reference_module_class
    from polyparallel_torch.testing import LR, flat_params

    results = run(_round_trip_worker, pp.Strategy(data=4, timeout=60), 4, str(tmp_path), timeout=360)
    for r in results:
        _assert_state_equal(r["ignite"], r["saved"], f"Ignite at data=4, rank {r['rank']}")
        assert r["progress"] == [0, 3], "Lightning saved its loader's position: 3 steps of epoch 0"
    # A plain single-process loop on the same model reads what Ignite wrote.
    model = reference_module_class("lightning.pytorch")(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pp.Strategy(data=1).load(str(tmp_path / "ignite" / "from-lightning"), model=model, optimizer=optimizer)
    _assert_state_equal({"params": flat_params(model), "momentum": momentum_buffers(optimizer)}, results[0]["saved"],
                        "a plain loop")


# -- one process: the handler's files and refusals ------------------------------------------------------
def _plain_job(strategy):
    from ignite.engine import create_supervised_trainer

    from polyparallel_torch.testing import LR, reference_dataset, reference_model

    model = reference_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = strategy.shard_data(reference_dataset(SAMPLES), batch_size=GLOBAL_BATCH)
    trainer = create_supervised_trainer(model, optimizer, nn.functional.cross_entropy)
    return model, optimizer, loader, trainer


def test_handler_writes_directories_keeps_n_saved_and_restores_extras(tmp_path):
    strategy = pp.Strategy(data=1, seed=0)
    ignite = strategy.adapt("ignite")
    model, optimizer, loader, trainer = _plain_job(strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    from ignite.engine import Events

    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: scheduler.step())
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "scheduler": scheduler}
    handler = ignite.checkpoint(to_save, tmp_path, every=3, n_saved=2)
    trainer.run(loader, max_epochs=2)  # 10 steps: saves at 3, 6, 9; keeps the last two
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_6", "checkpoint_9"]
    assert handler.last_checkpoint == tmp_path / "checkpoint_9"
    assert pp.latest_checkpoint(str(tmp_path), pattern="checkpoint_*") == str(tmp_path / "checkpoint_9")

    model2, optimizer2, loader2, trainer2 = _plain_job(strategy)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    restored = ignite.load_checkpoint(tmp_path / "checkpoint_9", {"model": model2, "optimizer": optimizer2,
                                                                "trainer": trainer2, "scheduler": scheduler2},
                                      loader=loader2)
    assert (restored["epoch"], restored["step"]) == (1, 4)
    assert trainer2.state.iteration == 9 and trainer2.state.epoch == 1
    from polyparallel_torch.testing import LR

    assert scheduler2.state_dict()["last_epoch"] == 9
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** (9 // 2)), "the learning rate at step 9"


def test_handler_refusals_name_the_problem(tmp_path):
    strategy = pp.Strategy(data=1, seed=0)
    ignite = strategy.adapt("ignite")
    model, optimizer, loader, trainer = _plain_job(strategy)
    with pytest.raises(TypeError, match=r"holds one model; received \['a', 'b'\]"):
        ignite.checkpoint({"a": model, "b": nn.Linear(2, 2)}, tmp_path)
    with pytest.raises(TypeError, match=r"no nn.Module among \['optimizer'\]"):
        ignite.checkpoint({"optimizer": optimizer}, tmp_path)
    with pytest.raises(TypeError, match=r"'epoch' cannot name a StepLR"):
        ignite.checkpoint({"model": model, "epoch": torch.optim.lr_scheduler.StepLR(optimizer, 1)}, tmp_path)
    with pytest.raises(ValueError, match=r"every=\) takes an int >= 1. Received: 0"):
        ignite.checkpoint({"model": model, "trainer": trainer}, tmp_path, every=0)
    with pytest.raises(TypeError, match=r"there is none"):
        ignite.checkpoint({"model": model}, tmp_path, every=2)
    # A checkpoint without engine state (a plain loop's) cannot restore an engine.
    strategy.save(tmp_path / "plain", model=model, optimizer=optimizer)
    with pytest.raises(pp.CheckpointError, match=r"holds no Ignite engine state"):
        ignite.load_checkpoint(tmp_path / "plain", {"model": model, "trainer": trainer})


def test_a_checkpoint_saved_again_under_its_name_survives_a_failed_save(tmp_path):
    # Ignite calls remove(name) before it saves `name` again; the committed checkpoint must stay
    # until its successor is committed, so a save that fails leaves the previous one loadable.
    strategy = pp.Strategy(data=1, seed=0)
    ignite = strategy.adapt("ignite")
    model, optimizer, loader, trainer = _plain_job(strategy)

    class Counter:
        """An extra whose state stops being plain data once broken (the save is then refused)."""

        def __init__(self):
            self.broken, self.n = False, 0

        def state_dict(self):
            return {"n": object() if self.broken else self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    from ignite.engine import Events

    counter = Counter()
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: setattr(counter, "n", engine.state.iteration))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda engine: setattr(counter, "broken", True))
    ignite.checkpoint({"model": model, "trainer": trainer, "counter": counter}, tmp_path, every=2, n_saved=1,
                      filename_pattern="latest")
    with pytest.raises(TypeError, match=r"counter"):
        trainer.run(loader, max_epochs=1)  # saves at step 2; the save at step 4 is refused
    assert sorted(os.listdir(tmp_path)) == ["latest"]
    restored = Counter()
    ignite.load_checkpoint(tmp_path / "latest", {"model": _plain_job(strategy)[0], "counter": restored})
    assert restored.n == 2


def test_a_loader_restored_from_an_ignite_checkpoint_moves_on_in_a_plain_loop(tmp_path):
    # Ignite pins the sampler's epoch (set_epoch at every EPOCH_STARTED); a plain loop resumed
    # from its checkpoint must see the rest of the saved epoch, then the next epochs' orders,
    # not the saved epoch's order again and again.
    from ignite.engine import Events

    from polyparallel_torch.testing import reference_dataset

    strategy = pp.Strategy(data=1, batch_size=GLOBAL_BATCH, seed=0)
    ignite = strategy.adapt("ignite")
    model, optimizer, loader, trainer = _job(ignite)
    ignite.checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, tmp_path, every=STOP)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=STOP), lambda engine: engine.terminate())
    trainer.run(loader, max_epochs=3)

    model, optimizer, loader, _ = _job(ignite)  # a plain loop from here on
    progress = strategy.load(tmp_path / f"checkpoint_{STOP}", model=model, optimizer=optimizer, loader=loader)
    assert (progress["epoch"], progress["step"]) == (1, 2)
    xs = reference_dataset(SAMPLES).tensors[0]

    def order(epoch):
        return xs[pp.shard_indices(SAMPLES, 0, 1, seed=0, epoch=epoch)]

    passes = [torch.cat([x for x, _ in loader]) for _ in range(2)]
    torch.testing.assert_close(passes[0], order(1)[2 * GLOBAL_BATCH:], msg="the rest of the saved epoch")
    torch.testing.assert_close(passes[1], order(2), msg="the next epoch's order")
