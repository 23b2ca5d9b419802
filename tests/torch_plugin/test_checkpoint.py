"""One logical DCP checkpoint (checkpoint.py): written at zero=3 with data=2, loaded at data=4 and
into a plain single-process module with equal parameters; a pipeline x data model saved and loaded
back (and into one process); replicas written once; another model refused before any collective."""

import os

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch import load_checkpoint, make_optimizer, save_checkpoint
from polyparallel_torch.model import full_state


def _model(seed: int = 0, hidden: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _save_worker(path: str):
    strategy = pp.Strategy(data=2, zero=3, timeout=30)
    model = strategy.wrap_model(_model())
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=0.01)
    for step in range(2):
        torch.manual_seed(10 + step + strategy.session().rank)
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    save_checkpoint(strategy, path, model=model, optimizer=opt)
    return full_state(model)


def _load_worker(path: str, replicated_path: str):
    strategy = pp.Strategy(data=4, zero=3, timeout=30)
    model = strategy.wrap_model(_model(seed=1))  # other initial values: the load must replace them
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=0.01)
    load_checkpoint(strategy, path, model=model, optimizer=opt)
    steps = {float(s["step"]) for s in opt.state.values()}
    ddp = pp.Strategy(data=4, timeout=30)
    save_checkpoint(ddp, replicated_path, model=ddp.wrap_model(_model(hidden=2048)))  # 4 replicas of one model
    return {"params": full_state(model), "adam_steps": steps}


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoint_of_zero3_data2_loads_at_data4_and_in_one_process(run, tmp_path):
    path, replicated = str(tmp_path / "zero3"), str(tmp_path / "ddp")
    saved = run(_save_worker, pp.Strategy(data=2, timeout=30), 2, path, timeout=180)
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    loaded = run(_load_worker, pp.Strategy(data=4, timeout=30), 4, path, replicated, timeout=240)
    for r in loaded:
        assert r["adam_steps"] == {2.0}  # the optimizer state came back too
        for name, value in saved[0].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0)
    plain = _model(seed=2)
    load_checkpoint(pp.Strategy(data=1), path, model=plain)
    for name, value in saved[0].items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0)
    # Written once: the 4 DDP replicas' checkpoint holds one copy of the parameters (plus headers).
    one_copy = sum(t.numel() * t.element_size() for t in _model(hidden=2048).state_dict().values())
    assert one_copy <= _bytes(replicated) < 1.2 * one_copy


def _pipeline_worker(path: str):
    """pipeline=2 x data=2 (zero=0: stages replicated by FSDP2): save, then load into other values."""
    def deep(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    strategy = pp.Strategy(pipeline=2, data=2, timeout=30)
    model = strategy.wrap_model(deep(0), loss_fn=nn.functional.cross_entropy, microbatches=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(3)
    model.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    opt.step()
    save_checkpoint(strategy, path, model=model, optimizer=opt)
    other = strategy.wrap_model(deep(1), loss_fn=nn.functional.cross_entropy, microbatches=2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    other.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    other_opt.step()
    load_checkpoint(strategy, path, model=other, optimizer=other_opt)
    return {"saved": full_state(model.stage), "loaded": full_state(other.stage),
            "adam_steps": {float(s["step"]) for s in other_opt.state.values()}}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoint_of_a_pipeline_x_data_model_loads_back_and_in_one_process(run, tmp_path):
    path = str(tmp_path / "pipeline")
    results = run(_pipeline_worker, pp.Strategy(pipeline=2, data=2, timeout=30), 4, path, timeout=240)
    whole: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["adam_steps"] == {1.0}
        for name, value in r["saved"].items():
            torch.testing.assert_close(r["loaded"][name], value, rtol=0, atol=0)
        whole.update(r["saved"])
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    load_checkpoint(pp.Strategy(data=1), path, model=plain)  # every stage's entries, once
    assert set(plain.state_dict()) == set(whole)
    for name, value in whole.items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=0, atol=0)


def test_another_model_is_refused_before_any_collective(tmp_path, monkeypatch):
    path = str(tmp_path / "plain")
    save_checkpoint(pp.Strategy(data=1), path, model=_model())
    # Rank 0 of a 2-process world that was never started: a collective would fail or hang.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    strategy = pp.Strategy(data=2, timeout=5)
    with pytest.raises(ValueError, match=r"another model.*other shapes: 0.bias \[16\] in the checkpoint vs \[32\]"):
        load_checkpoint(strategy, path, model=_model(hidden=32))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['3.bias', '3.weight'\]"):
        load_checkpoint(strategy, path, model=nn.Sequential(nn.Linear(8, 16)).append(nn.ReLU()).append(
            nn.Linear(16, 4)).append(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="no optimizer state"):
        model = _model()
        load_checkpoint(strategy, path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        load_checkpoint(strategy, str(tmp_path / "nothing"), model=_model())
