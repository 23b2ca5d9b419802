"""Checkpoints of the torch runtime (checkpoint.py, checkpoint_files.py) through ``Strategy.save`` /
``Strategy.load``, with real gloo processes.

- Round trips, parameters and optimizer state equal (1e-6): data=2 x tensor=2 -> data=4 -> one
  process; pipeline=2 x data=2 -> data=2; zero=3 at data=2 -> data=4 -> one process.
- Exact resumption in a plain loop: stopped at step 2 of epoch 1, resumed at the same topology and
  at data=4 from data=2 (same global batch): the final parameters equal the uninterrupted run's
  and a single-process reference (1e-5).
- Refusals before any collective: another model, a missing commit marker, a truncated file, a
  changed global batch, a pickle in DCP's index, objects as extras.
"""

import json
import os
import pickle

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch import load_checkpoint, make_optimizer, save_checkpoint
from polyparallel_torch.tensors import full_state

N, BATCH, EPOCHS = 48, 8, 2  # 6 steps an epoch


def _mlp(seed: int = 0, hidden: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _deep(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 4, (N,), generator=g))


def _step(strategy, model, opt, batch) -> None:
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    strategy.sync_grads(model)  # a no-op under DDP; reduces the tensor-parallel shards over data
    opt.step()


def _full_optim(model, opt) -> dict:
    """The optimizer state with every DTensor gathered, per parameter name (flattened)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    module = model.stage if hasattr(model, "stage") else model
    _, state = get_state_dict(module, (opt,), options=StateDictOptions(full_state_dict=True,
                                                                        flatten_optimizer_state_dict=True))
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _assert_same(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(got[k], v, rtol=tol, atol=tol, msg=k)
        else:
            assert got[k] == v, k


# -- launch 1: 4 processes write a data=2 x tensor=2 and a pipeline=2 x data=2 checkpoint ----------------------
def _write_worker(tmp: str):
    strategy = pp.Strategy(data=2, tensor=2, batch_size=BATCH, timeout=60)
    model = strategy.wrap_model(_mlp(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = strategy.shard_data(_dataset())
    for step, batch in enumerate(loader):
        _step(strategy, model, opt, batch)
        if step == 2:
            break
    strategy.save(f"{tmp}/tp", model=model, optimizer=opt, loader=loader, note="tp", scale=torch.tensor([2.0, 3.0]))
    tp = {"params": full_state(model), "optim": _full_optim(model, opt)}

    pipe = pp.Strategy(pipeline=2, data=2, timeout=60)
    staged = pipe.wrap_model(_deep(0), loss_fn=nn.functional.cross_entropy, microbatches=2)
    pipe_opt = torch.optim.Adam(staged.parameters(), lr=0.01)
    torch.manual_seed(3)
    staged.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    pipe_opt.step()
    pipe.save(f"{tmp}/pipeline", model=staged, optimizer=pipe_opt)
    return {"tp": tp, "stage": {"params": full_state(staged.stage), "optim": _full_optim(staged, pipe_opt)}}


# -- launch 2: 2 processes (data=2) load the pipeline checkpoint; train, stop mid-epoch, resume ------------------
def _train(strategy, model, opt, loader, first_epoch: int, stop=None) -> None:
    for epoch in range(first_epoch, EPOCHS):
        for batch in loader:
            _step(strategy, model, opt, batch)
            if stop is not None and stop(epoch, loader.state_dict()["batches"]):
                return


def _resume_worker(tmp: str):
    strategy = pp.Strategy(data=2, batch_size=BATCH, timeout=60)
    plain = strategy.wrap_model(_deep(5))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.5)
    strategy.load(f"{tmp}/pipeline", model=plain, optimizer=plain_opt)
    from_pipeline = {"params": full_state(plain), "optim": _full_optim(plain, plain_opt)}

    # The uninterrupted run, which also writes the checkpoint a stopped run would have written.
    model = strategy.wrap_model(_mlp(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = strategy.shard_data(_dataset())
    saved = {}

    def save_at_epoch1_step2(epoch: int, batches: int) -> bool:
        if (epoch, batches) == (1, 2):
            strategy.save(f"{tmp}/mid", model=model, optimizer=opt, loader=loader, loss_scale=1.5)
            saved["rand"] = torch.rand(3)  # the RNG right after the save
        return False

    _train(strategy, model, opt, loader, 0, save_at_epoch1_step2)
    uninterrupted = full_state(model)
    # A fresh process state: other weights, a fresh optimizer and loader, then load.
    model = strategy.wrap_model(_mlp(7))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = strategy.shard_data(_dataset())
    torch.manual_seed(999)
    progress = strategy.load(f"{tmp}/mid", model=model, optimizer=opt, loader=loader)
    rand_after_load = torch.rand(3)
    _train(strategy, model, opt, loader, progress["epoch"])
    return {"from_pipeline": from_pipeline, "uninterrupted": uninterrupted, "resumed": full_state(model),
            "progress": progress, "rng": (saved["rand"], rand_after_load)}


# -- launch 3: 4 processes (data=4) load the tensor-parallel checkpoint and resume the data=2 run ------------------
def _data4_worker(tmp: str):
    strategy = pp.Strategy(data=4, batch_size=BATCH, timeout=60)
    model = strategy.wrap_model(_mlp(9))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    loader = strategy.shard_data(_dataset())
    progress = strategy.load(f"{tmp}/tp", model=model, optimizer=opt, loader=loader)
    from_tp = {"params": full_state(model), "optim": _full_optim(model, opt), "progress": progress,
               "loader": loader.state_dict()}
    model = strategy.wrap_model(_mlp(7))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = strategy.shard_data(_dataset())
    progress = strategy.load(f"{tmp}/mid", model=model, optimizer=opt, loader=loader)
    _train(strategy, model, opt, loader, progress["epoch"])
    return {"from_tp": from_tp, "resumed": full_state(model)}


def _reference() -> dict:
    """One process, the same global batches: the uninterrupted run."""
    strategy = pp.Strategy(data=1, batch_size=BATCH)
    model = _mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(strategy, model, opt, strategy.shard_data(_dataset()), 0)
    return model.state_dict()


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_round_trips_across_topologies_and_exact_resumption(run, tmp_path):
    tmp = str(tmp_path)
    written = run(_write_worker, pp.Strategy(data=2, tensor=2, timeout=60), 4, tmp, timeout=240)
    tp = written[0]["tp"]
    for r in written:
        _assert_same(r["tp"]["params"], tp["params"], 0)
    meta = json.load(open(f"{tmp}/tp/polyparallel-checkpoint.json"))
    assert meta["topology"] == {"pipeline": 1, "data": 2, "tensor": 2} and meta["progress"] == {
        "epoch": 0, "step": 3, "global_step": 3}
    assert not [n for n in os.listdir(tmp) if ".partial-" in n]  # published, nothing left behind

    resumed = run(_resume_worker, pp.Strategy(data=2, timeout=60), 2, tmp, timeout=240)
    data4 = run(_data4_worker, pp.Strategy(data=4, timeout=60), 4, tmp, timeout=240)

    # data=2 x tensor=2 -> data=4 -> one process: parameters and optimizer state.
    for r in data4:
        _assert_same(r["from_tp"]["params"], tp["params"], 1e-6)
        _assert_same(r["from_tp"]["optim"], tp["optim"], 1e-6)
        assert r["from_tp"]["progress"] == {"epoch": 0, "step": 3, "global_step": 3, "note": "tp",
                                            "scale": pytest.approx(torch.tensor([2.0, 3.0]))}
        assert r["from_tp"]["loader"]["batches"] == 3 and r["from_tp"]["loader"]["epoch"] == 0
    plain, strategy = _mlp(11), pp.Strategy(data=1)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.5)
    strategy.load(f"{tmp}/tp", model=plain, optimizer=plain_opt)  # the documented one-liner
    _assert_same(plain.state_dict(), tp["params"], 1e-6)
    _assert_same(_full_optim(plain, plain_opt), tp["optim"], 1e-6)
    # ... and as one consolidated file that plain torch.load reads (checkpoint export).
    from click.testing import CliRunner

    from polyparallel import cli as cli_module

    exported = CliRunner().invoke(cli_module.cli, ["checkpoint", "export", f"{tmp}/tp", "--to", "torch"])
    assert exported.exit_code == 0, exported.output
    consolidated = torch.load(f"{tmp}/tp.pt", weights_only=True)
    _assert_same(consolidated["model"], tp["params"], 0)
    _assert_same(consolidated["optimizer"], tp["optim"], 0)
    assert consolidated["extras"]["note"] == "tp"

    # pipeline=2 x data=2 -> data=2: every stage's parameters and optimizer state, once.
    whole = {k: v for r in written for k, v in r["stage"]["params"].items()}
    whole_optim = {k: v for r in written for k, v in r["stage"]["optim"].items()}
    for r in resumed:
        _assert_same(r["from_pipeline"]["params"], whole, 1e-6)
        _assert_same(r["from_pipeline"]["optim"], whole_optim, 1e-6)

    # Exact resumption: same topology, and data=4 from data=2, equal the uninterrupted run.
    reference = _reference()
    for r in resumed:
        assert {k: r["progress"][k] for k in ("epoch", "step", "global_step")} == {"epoch": 1, "step": 2,
                                                                                   "global_step": 8}
        assert r["progress"]["loss_scale"] == 1.5
        torch.testing.assert_close(r["rng"][1], r["rng"][0], rtol=0, atol=0)  # this rank's RNG came back
        _assert_same(r["uninterrupted"], reference, 1e-5)
        _assert_same(r["resumed"], r["uninterrupted"], 1e-5)
    for r in data4:
        _assert_same(r["resumed"], reference, 1e-5)


def _zero3_worker(tmp: str):
    strategy = pp.Strategy(data=2, zero=3, timeout=60)
    model = strategy.wrap_model(_mlp())
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=0.01)
    for step in range(2):
        torch.manual_seed(10 + step + strategy.session().rank)
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    save_checkpoint(strategy, f"{tmp}/zero3", model=model, optimizer=opt)
    return full_state(model)


def _zero3_load_worker(tmp: str):
    strategy = pp.Strategy(data=4, zero=3, timeout=60)
    model = strategy.wrap_model(_mlp(seed=1))  # other initial values: the load must replace them
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=0.01)
    load_checkpoint(strategy, f"{tmp}/zero3", model=model, optimizer=opt)
    steps = {float(s["step"]) for s in opt.state.values()}
    ddp = pp.Strategy(data=4, timeout=60)
    ddp.save(f"{tmp}/ddp", model=ddp.wrap_model(_mlp(hidden=2048)))  # 4 replicas of one model
    return {"params": full_state(model), "adam_steps": steps}


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoint_of_zero3_data2_loads_at_data4_and_in_one_process(run, tmp_path):
    tmp = str(tmp_path)
    saved = run(_zero3_worker, pp.Strategy(data=2, timeout=60), 2, tmp, timeout=180)
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    loaded = run(_zero3_load_worker, pp.Strategy(data=4, timeout=60), 4, tmp, timeout=240)
    for r in loaded:
        assert r["adam_steps"] == {2.0}  # the optimizer state came back too
        _assert_same(r["params"], saved[0], 0)
    plain = _mlp(seed=2)
    load_checkpoint(pp.Strategy(data=1), f"{tmp}/zero3", model=plain)
    _assert_same(plain.state_dict(), saved[0], 0)
    # Written once: the 4 DDP replicas' checkpoint holds one copy of the parameters (plus headers).
    one_copy = sum(t.numel() * t.element_size() for t in _mlp(hidden=2048).state_dict().values())
    assert one_copy <= _bytes(f"{tmp}/ddp") < 1.2 * one_copy


# -- refusals, on rank 0 of a 2-process world that was never started: a collective would fail or hang ------------
@pytest.fixture
def unstarted_world(monkeypatch):
    """Call it (after saving in one process) for rank 0's strategy of that world."""
    def enter() -> pp.Strategy:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        return pp.Strategy(data=2, batch_size=BATCH, timeout=5)
    return enter


def _saved(tmp_path, name: str = "plain") -> str:
    one = pp.Strategy(data=1, batch_size=BATCH)
    model = _mlp()
    loader = one.shard_data(_dataset())
    next(iter(loader))
    return one.save(str(tmp_path / name), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    loader=loader)


def test_another_model_is_refused_before_any_collective(tmp_path, unstarted_world):
    path = str(tmp_path / "plain")
    pp.Strategy(data=1).save(path, model=_mlp())
    unstarted_world = unstarted_world()
    with pytest.raises(pp.CheckpointError, match=r"another model.*other shapes: 0.bias \[16\] in the checkpoint vs \[32\]"):
        unstarted_world.load(path, model=_mlp(hidden=32))
    with pytest.raises(pp.CheckpointError, match=r"missing from the checkpoint: \['3.bias', '3.weight'\]"):
        unstarted_world.load(path, model=_mlp().append(nn.Linear(4, 4)))
    with pytest.raises(pp.CheckpointError, match="no optimizer state"):
        model = _mlp()
        unstarted_world.load(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        unstarted_world.load(str(tmp_path / "nothing"), model=_mlp())


def test_a_changed_global_batch_is_refused_naming_both(tmp_path, unstarted_world):
    path = _saved(tmp_path)
    unstarted_world = unstarted_world()
    model = _mlp()
    loader = unstarted_world.shard_data(_dataset(), batch_size=12)
    with pytest.raises(pp.CheckpointError, match=r"global batch size 8, this loader has 12"):
        unstarted_world.load(path, model=model, loader=loader)


def test_half_written_truncated_and_pickled_checkpoints_are_refused(tmp_path, unstarted_world):
    paths = [_saved(tmp_path, name) for name in ("plain", "unmarked", "pickled")]
    unstarted_world = unstarted_world()
    path = paths[0]
    distcp = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, distcp), "r+b") as f:
        f.truncate(100)
    with pytest.raises(pp.CheckpointError, match=rf"corrupt: {distcp} has 100 bytes"):
        unstarted_world.load(path, model=_mlp())

    path = paths[1]
    os.remove(os.path.join(path, "polyparallel-checkpoint.json"))  # what a save killed before its commit leaves
    with pytest.raises(pp.CheckpointError, match="not a committed polyparallel checkpoint"):
        unstarted_world.load(path, model=_mlp())
    assert pp.latest_checkpoint(tmp_path, pattern="*") == paths[2]  # the newest committed one

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = paths[2]
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Boom(), f)
    meta_file = os.path.join(path, "polyparallel-checkpoint.json")
    meta = json.load(open(meta_file))
    meta["files"][".metadata"] = os.path.getsize(os.path.join(path, ".metadata"))
    json.dump(meta, open(meta_file, "w"))
    with pytest.raises(pp.CheckpointError, match="refusing to load posix.system"):
        unstarted_world.load(path, model=_mlp())


def test_objects_are_refused_as_extras_and_names_are_checked(tmp_path, unstarted_world):
    unstarted_world = unstarted_world()
    with pytest.raises(TypeError, match="never arbitrary"):
        unstarted_world.save(str(tmp_path / "x"), model=_mlp(), callback=lambda: None)
    with pytest.raises(TypeError, match="'step' is not a name an extra may take"):
        unstarted_world.save(str(tmp_path / "x"), step=3)
    with pytest.raises(TypeError, match="come back in the dict"):
        unstarted_world.load(str(tmp_path / "x"), best=1.0)
    (tmp_path / "data").mkdir()
    with pytest.raises(pp.CheckpointError, match="exists and is not a polyparallel checkpoint"):
        unstarted_world.save(str(tmp_path / "data"), model=_mlp())
    assert not os.path.exists(tmp_path / "x")


def test_inspect_lists_the_tensors_and_shapes_of_a_torch_checkpoint(tmp_path):
    from click.testing import CliRunner

    from polyparallel import cli as cli_module

    path = _saved(tmp_path)
    result = CliRunner().invoke(cli_module.cli, ["checkpoint", "inspect", path], prog_name="polyparallel")
    assert result.exit_code == 0, result.output
    assert "progress: epoch 0, 1 batch(es) of it consumed, global step 1; global batch 8" in result.output
    assert "model.0.weight  [16, 8]  float32" in result.output
    assert "tensors (4):" in result.output  # the model's four (SGD without momentum keeps no state)


# -- elastic restarts: examples/elastic_train.py under `polyparallel launch --max-restarts 2` ------------------------
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_train.py")


# In the default suite (about 20 s on a quiet machine): the fault-tolerance claim is checked by CI.
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_killed_rank_restarts_from_the_last_committed_checkpoint(tmp_path):
    import importlib.util
    import subprocess
    import sys

    ckpts = str(tmp_path / "ckpts")
    command = [sys.executable, "-m", "polyparallel.cli", "launch", "--nproc-per-node", "4", "--max-restarts", "2",
               EXAMPLE, "--ckpt-dir", ckpts, "--every", "4", "--kill-rank", "2", "--kill-step", "8"]
    done = subprocess.run(["timeout", "-k", "10", "360", *command], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    resumes = [json.loads(line[len("RESUME "):]) for line in done.stdout.splitlines() if line.startswith("RESUME ")]
    (result,) = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    # Attempt 0 started from nothing; rank 2 died before the checkpoint of step 8, leaving its peers
    # inside that save: attempt 1 found step 8 half-written (a staging directory, no marker) and
    # resumed from step 4.
    assert [r["attempt"] for r in resumes] == [0, 1] and resumes[0]["from"] is None
    assert resumes[1]["from"] == os.path.join(ckpts, "step-000004")
    assert any(name.startswith("step-000008.partial-") for name in resumes[1]["held"]), resumes[1]["held"]
    assert "step-000008" not in resumes[1]["held"]
    assert sorted(os.listdir(ckpts)) == ["step-000004", "step-000008", "step-000012"]  # the stale one removed
    # Equal to an uninterrupted single-process run with the same global batch.
    spec = importlib.util.spec_from_file_location("elastic_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    reference = example.train(pp.Strategy(data=1, batch_size=16), epochs=2)
    for name, value in reference.items():
        torch.testing.assert_close(torch.tensor(result[name]), torch.tensor(value), rtol=1e-5, atol=1e-5)


def test_restarts_get_a_fresh_rendezvous_store_only_while_torchrun_runs(monkeypatch, tmp_path):
    # The elastic test above fails without it (restarted workers read the old attempt's gloo
    # addresses); this checks that the setting does not outlive `polyparallel launch`.
    from torch.distributed import run as torchrun

    from polyparallel_torch.launchers.torchrun import launch_script

    (tmp_path / "train.py").write_text("pass\n")  # a script that exists: a missing one is refused first
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")))
    assert launch_script(["train.py"], {"nproc_per_node": 1, "max_restarts": 2}) == 0
    assert launch_script(["train.py"], {"nproc_per_node": 1, "max_restarts": 0}) == 0
    assert seen == ["1", None] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # the user's choice is kept
    launch_script(["train.py"], {"nproc_per_node": 1, "max_restarts": 2})
    assert seen[-1] == "0" and os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_a_loader_without_position_is_refused_before_anything_is_written(tmp_path, unstarted_world):
    # Its state was read on rank 0 only, after the tensors were written: the other ranks then
    # waited for rank 0's outcome until the timeout. Every rank now refuses it before any collective.
    from polyparallel_torch.data import ShardedLoader, TopologySampler

    unstarted_world = unstarted_world()
    loader = ShardedLoader(_dataset(), batch_size=None, sampler=TopologySampler(N, 0, 2))
    with pytest.raises(pp.CheckpointError, match=r"save\(loader=\): this loader has no position"):
        unstarted_world.save(str(tmp_path / "x"), model=_mlp(), loader=loader)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("with_grads", [False, True])
def test_adam_moments_load_into_a_fresh_optimizer_with_or_without_gradients(tmp_path, with_grads):
    one = pp.Strategy(data=1, batch_size=BATCH)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = next(iter(one.shard_data(_dataset())))
    for _ in range(2):
        _step(one, model, opt, batch)
    one.save(str(tmp_path / "adam"), model=model, optimizer=opt)
    fresh = _mlp(seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    if with_grads:  # a backward ran before the load: DCP then does not create the optimizer's state
        nn.functional.cross_entropy(fresh(batch[0]), batch[1]).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in fresh.parameters()]
    one.load(str(tmp_path / "adam"), model=fresh, optimizer=fresh_opt)
    _assert_same(_full_optim(fresh, fresh_opt), _full_optim(model, opt), 0)
    for p, g in zip(fresh.parameters(), grads):  # the gradients are left as they were
        assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
    # A checkpoint holding state this optimizer has none of (momentum) is refused, not dropped.
    sgd_model = _mlp()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    _step(one, sgd_model, sgd, batch)
    one.save(str(tmp_path / "sgd"), model=sgd_model, optimizer=sgd)
    plain = _mlp()
    with pytest.raises(pp.CheckpointError, match=r"another optimizer's state: its \['optim.state.*would not be loaded"):
        one.load(str(tmp_path / "sgd"), model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))


# -- issue 20: content hashes, per-save identity, named mismatches ------------------------------------------------
def _trained(seed: int):
    one = pp.Strategy(data=1, batch_size=BATCH)
    model = _mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = next(iter(one.shard_data(_dataset())))
    for _ in range(2):
        _step(one, model, opt, batch)
    return one, model, opt


def test_a_shard_of_another_checkpoint_or_flipped_bytes_is_refused_naming_the_file(tmp_path):
    one, model, opt = _trained(0)
    first = one.save(str(tmp_path / "a"), model=model, optimizer=opt)
    _, other, other_opt = _trained(1)
    second = one.save(str(tmp_path / "b"), model=other, optimizer=other_opt)
    (shard,) = [f for f in os.listdir(first) if f.endswith(".distcp")]
    assert os.path.getsize(os.path.join(first, shard)) == os.path.getsize(os.path.join(second, shard))
    with open(os.path.join(second, shard), "rb") as f:
        foreign = f.read()
    with open(os.path.join(first, shard), "wb") as f:  # same size: only the sizes were checked
        f.write(foreign)
    fresh = _mlp(5)
    with pytest.raises(pp.CheckpointError, match=rf"{shard} is not the file this checkpoint wrote"):
        one.load(first, model=fresh, optimizer=torch.optim.Adam(fresh.parameters(), lr=0.01))
    # Flipped bytes in the middle of a tensor's data (not in torch's own headers).
    third = one.save(str(tmp_path / "c"), model=model, optimizer=opt)
    size = os.path.getsize(os.path.join(third, shard))
    with open(os.path.join(third, shard), "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(pp.CheckpointError, match=rf"{shard} is not the file this checkpoint wrote"):
        one.load(third, model=_mlp(5))


def test_an_optimizer_of_another_model_is_named(tmp_path):
    one, model, opt = _trained(0)
    stranger = _mlp(1)
    with pytest.raises(pp.CheckpointError, match=r"optimizer=\): .*not parameters of model="):
        one.save(str(tmp_path / "x"), model=model, optimizer=torch.optim.Adam(stranger.parameters(), lr=0.01))
    assert not os.listdir(tmp_path)
    path = one.save(str(tmp_path / "ok"), model=model, optimizer=opt)
    with pytest.raises(pp.CheckpointError, match=r"optimizer=\): .*not parameters of model="):
        one.load(path, model=_mlp(2), optimizer=torch.optim.Adam(stranger.parameters(), lr=0.01))


# -- one launch of 2 processes: a full disk on one rank, and a shard of another checkpoint ------------------------
def _disk_worker(tmp: str):
    import resource
    import signal

    strategy = pp.Strategy(data=2, timeout=30)
    torch.manual_seed(0)
    model = strategy.wrap_model(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    strategy.save(f"{tmp}/step-1", model=model, optimizer=opt)
    saved = full_state(model)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    outcomes, listings = {}, {}
    # 64 KiB: rank 1's JSON file fits, its DCP shard does not; 1 KiB: not even its JSON file.
    for case, limit in (("shards", 64 * 1024), ("rank file", 1024)):
        if strategy.rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            strategy.save(f"{tmp}/step-2", model=model, optimizer=opt)
            outcomes[case] = ["saved", ""]
        except Exception as exc:  # what users' code and frameworks' handlers catch
            outcomes[case] = [type(exc).__name__, str(exc)]
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is one
            outcomes[case] = [f"BaseException {type(exc).__name__}", str(exc)]
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        torch.distributed.barrier()  # every rank is past this case (the next one makes its staging directory)
        listings[case] = [sorted(os.listdir(tmp)), pp.latest_checkpoint(tmp)]
        torch.distributed.barrier()
    # The job goes on: the next save works, and the previous checkpoint is intact.
    strategy.save(f"{tmp}/step-3", model=model, optimizer=opt)
    fresh = strategy.wrap_model(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    strategy.load(f"{tmp}/step-1", model=fresh)
    reloaded = full_state(fresh)

    # A shard of another checkpoint (same shapes, so the same size) copied over rank 1's.
    torch.manual_seed(1)
    other = strategy.wrap_model(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    strategy.save(f"{tmp}/other", model=other)
    strategy.save(f"{tmp}/mine", model=model)
    if strategy.rank == 0:
        import shutil

        shutil.copyfile(f"{tmp}/other/__1_0.distcp", f"{tmp}/mine/__1_0.distcp")
    torch.distributed.barrier()  # the swap is done before any rank loads
    try:
        strategy.load(f"{tmp}/mine", model=fresh)
        swapped = ["loaded", ""]
    except Exception as exc:
        swapped = [type(exc).__name__, str(exc)]
    return {"rank": strategy.rank, "outcomes": outcomes, "listings": listings, "saved": saved,
            "reloaded": reloaded, "swapped": swapped}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_full_disk_on_one_rank_fails_alike_everywhere_and_keeps_the_previous_checkpoint(run, tmp_path):
    results = run(_disk_worker, pp.Strategy(data=2, timeout=30), 2, str(tmp_path), timeout=300)
    for case in ("shards", "rank file"):
        kinds = {r["outcomes"][case][0] for r in results}
        messages = {r["outcomes"][case][1] for r in results}
        assert kinds == {"CheckpointError"}, (case, [r["outcomes"][case] for r in results])
        assert len(messages) == 1, (case, messages)  # the same error on every rank
        (message,) = messages
        assert str(tmp_path / "step-2") in message and "rank 1" in message, message
        assert "Errno 27" in message and "File too large" in message, message
        assert {"shards": "/__1_0.distcp", "rank file": "/ranks/rank-00001.json"}[case] in message, message
        listing, latest = results[0]["listings"][case]
        assert listing == ["step-1"], f"{case}: the staging directory stays behind: {listing}"
        assert latest == str(tmp_path / "step-1")
    for r in results:
        for name, value in r["saved"].items():
            torch.testing.assert_close(r["reloaded"][name], value, rtol=0, atol=0, msg=name)
        assert r["swapped"][0] == "CheckpointError", r["swapped"]
        assert "__1_0.distcp is not the file this checkpoint wrote" in r["swapped"][1], r["swapped"]
    assert results[0]["swapped"] == results[1]["swapped"]


def test_state_dicts_take_the_whole_torch_path(tmp_path):
    """StateDicts (an engine's state already converted, as the DeepSpeed plugin gives it) is saved
    and loaded by the torch runtime's own code: the marker lists its tensors and hashes its files,
    a plain module loads it, it is filled in place on a load (a partial one too, saying which keys),
    and async saves work; the refusals are the torch path's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from polyparallel import _checkpoints
    from polyparallel_torch import checkpoint as torch_checkpoint
    from polyparallel_torch.checkpoint import StateDicts

    one = pp.Strategy(data=1)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    model_state, optim_state = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    model_state = {k: v.detach().clone() for k, v in model_state.items()}
    path = torch_checkpoint.save(one, str(tmp_path / "sd"), {"model": StateDicts(model_state, optim_state)}, {})
    meta = _checkpoints.read_marker(path)
    assert set(meta["sha256"]) == set(meta["files"]) and meta["contents"]["optimizer"] is True
    assert {a["name"] for a in meta["arrays"]} == {f"model.{k}" for k in model_state} | {
        f"optim.{k}" for k, v in optim_state.items() if isinstance(v, torch.Tensor)}
    # A plain module and optimizer load it as the checkpoint of a torch model.
    fresh = _mlp(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    one.load(path, model=fresh, optimizer=fresh_opt)
    _assert_same(_full_optim(fresh, fresh_opt), _full_optim(model, opt), 0)
    # Into a StateDicts: its dicts filled in place, every key said loaded.
    target = StateDicts({k: torch.empty_like(v) for k, v in model_state.items()},
                        {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in optim_state.items()})
    torch_checkpoint.load(one, path, {"model": target}, {})
    assert target.loaded == sorted(model_state)
    for k, v in {**model_state, **optim_state}.items():
        got = target.model[k] if k in model_state else target.optim[k]
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k
    # A partial load fills the selected keys only and says which.
    part = StateDicts({k: torch.zeros_like(v) for k, v in model_state.items()})
    result = torch_checkpoint.load(one, path, {"model": part}, {"strict": True, "keys": ["0.*"]})
    assert part.loaded == ["0.bias", "0.weight"] == result["load_report"]["loaded"]
    assert torch.equal(part.model["0.weight"], model_state["0.weight"]) and not part.model["2.weight"].any()
    with pytest.raises(pp.CheckpointError, match="restores model weights only"):  # with its optimizer's state
        torch_checkpoint.load(one, path, {"model": target}, {"strict": False})
    with pytest.raises(pp.CheckpointError, match="carries its optimizer's state itself"):
        torch_checkpoint.save(one, str(tmp_path / "x"), {"model": target, "optimizer": fresh_opt}, {})
    assert not os.path.exists(tmp_path / "x")
    future = torch_checkpoint.save(one, str(tmp_path / "sd-async"), {"model": StateDicts(model_state)},
                                   {"asynchronous": True})
    assert future.result() == str(tmp_path / "sd-async")
    again = _mlp(2)
    one.load(future.result(), model=again)
    _assert_same(dict(again.state_dict()), model_state, 0)
