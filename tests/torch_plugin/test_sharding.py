"""Sharding stages in the torch runtime (sharding.py): zero=1 (ZeroRedundancyOptimizer), zero=2/3
(FSDP2 over the data axis, after DTensor TP) against a single-process run with the same global
batch; per-rank memory at stage 0 vs 3; bad input refused before any collective.

Scenarios share launches: one 2-process launch (data=2: stages 1, 2, 3 and the memory of 0 vs 3),
one 4-process launch (data=2 x tensor=2: stages 2 and 3; data=4: the memory of 0 vs 3; and
pipeline=2 x data=2 at stage 3)."""

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch import make_optimizer
from polyparallel_torch.tensors import full_state, unwrap

STEPS, GLOBAL_BATCH, LR = 3, 8, 0.01


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (STEPS * GLOBAL_BATCH,), generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model, (x_all, y_all) = _model(), _data()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_all[batch]), y_all[batch]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(strategy: pp.Strategy) -> dict:
    """Adam on this replica's slice of each global batch; the full parameters afterwards."""
    from polyparallel_torch.pipeline import PipelineModel

    session = strategy.session()
    data, d = session.topology.size("data"), session.coords["data"]
    pipelined = session.topology.size("pipeline") > 1
    options = {"loss_fn": nn.functional.cross_entropy, "microbatches": 2} if pipelined else {}
    model = strategy.wrap_model(_model(), **options)
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=LR)
    x_all, y_all = _data()
    untouched = True
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        x, y = x_all[batch][d::data], y_all[batch][d::data]  # what shard_data hands this replica
        opt.zero_grad()
        if isinstance(model, PipelineModel):
            model.train_step(x, y)
        else:
            nn.functional.cross_entropy(model(x), y).backward()
        before = [_local(p.grad).clone() for p in model.parameters() if p.grad is not None]
        strategy.sync_grads(model)  # FSDP2: reduced in backward, a no-op here
        after = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        untouched &= all(torch.equal(a, b) for a, b in zip(before, after))
        opt.step()
    inner = model.stage if isinstance(model, PipelineModel) else model
    names = {n for n, _ in unwrap(inner).named_parameters()}
    params = {k: v for k, v in full_state(inner).items() if k in names}
    return {"type": type(model).__name__, "stage_type": type(inner).__name__, "optimizer": type(opt).__name__,
            "params": params,
            "sync_grads_untouched": untouched}


def _memory(strategy: pp.Strategy) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and Adam state after one step of a 1M-parameter MLP."""
    torch.manual_seed(0)
    model = strategy.wrap_model(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                                              nn.Linear(512, 256)))
    opt = make_optimizer(strategy, model, torch.optim.Adam, lr=LR)
    model(torch.randn(4, 256)).sum().backward()
    strategy.sync_grads(model)
    opt.step()

    def nbytes(ts) -> int:
        return sum(_local(t).numel() * _local(t).element_size() for t in ts if isinstance(t, torch.Tensor))

    params = list(model.parameters())
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
            "optimizer": nbytes(v for s in opt.state.values() for v in s.values())}


def _two_process_worker():
    base = pp.Strategy(data=2, timeout=30)
    out = {stage: _train(base.replace(zero=stage)) for stage in (1, 2, 3)}
    out["memory"] = {stage: _memory(base.replace(zero=stage)) for stage in (0, 3)}
    return out


def _four_process_worker():
    out = {}
    tensor = pp.Strategy(data=2, tensor=2, timeout=30)
    out["tensor"] = {stage: _train(tensor.replace(zero=stage)) for stage in (2, 3)}
    data4 = pp.Strategy(data=4, timeout=30)
    out["memory"] = {stage: _memory(data4.replace(zero=stage)) for stage in (0, 3)}
    out["pipeline"] = _train(pp.Strategy(pipeline=2, data=2, zero=3, timeout=30))
    # zero=0: each stage replicated over data by FSDP2 (HSDP on the (data, tensor=1) mesh slice), not sync_grads.
    groups = len(torch.distributed.distributed_c10d._world.pg_map)
    out["pipeline0"] = _train(pp.Strategy(pipeline=2, data=2, timeout=30))
    out["pipeline0"]["new_groups"] = len(torch.distributed.distributed_c10d._world.pg_map) - groups
    return out


def _assert_equal(params: dict, ref: dict, what: str) -> None:
    assert set(params) == set(ref), what
    for name, value in params.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{what}, {name}: {m}")


def _report_memory(memory: dict, data: int) -> None:
    total = {stage: sum(m.values()) for stage, m in memory.items()}
    print(f"\nmemory per rank, data={data}: " + "; ".join(
        f"zero={s}: params {m['params']:,} B, grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, total "
        f"{total[s]:,} B" for s, m in memory.items()) + f"; zero=3 / zero=0 = {total[3] / total[0]:.4f}")
    assert total[3] == pytest.approx(total[0] / data, rel=0.02)
    for part in ("params", "grads", "optimizer"):
        assert memory[3][part] == pytest.approx(memory[0][part] / data, rel=0.02), part


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_stages_on_data2_match_one_process_and_shard_memory(run):
    results = run(_two_process_worker, pp.Strategy(data=2, timeout=30), 2, timeout=240)
    ref = _reference()
    for r in results:
        assert r[1]["optimizer"] == "ZeroRedundancyOptimizer" and r[1]["type"] == "DistributedDataParallel"
        assert r[2]["type"] == r[3]["type"] == "FSDPSequential" and r[3]["optimizer"] == "Adam"
        for stage in (1, 2, 3):
            _assert_equal(r[stage]["params"], ref, f"zero={stage}, data=2")
            assert r[stage]["sync_grads_untouched"]
    _report_memory(results[0]["memory"], 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_data2_tensor2_pipeline_and_data4(run):
    results = run(_four_process_worker, pp.Strategy(data=4, timeout=30), 4, timeout=360)
    ref = _reference()
    for r in results:
        for stage in (2, 3):
            assert r["tensor"][stage]["type"] == "FSDPSequential"
            _assert_equal(r["tensor"][stage]["params"], ref, f"zero={stage}, data=2 x tensor=2")
        stage_ref = {k: v for k, v in ref.items() if k in r["pipeline"]["params"]}
        assert stage_ref, "a pipeline stage holds parameters"
        _assert_equal(r["pipeline"]["params"], stage_ref, "zero=3, pipeline=2 x data=2")
        zero0 = r["pipeline0"]
        assert zero0["stage_type"] == "FSDPSequential" and zero0["new_groups"] == 0
        assert zero0["sync_grads_untouched"]  # reduced in backward: sync_grads is a no-op
        _assert_equal(zero0["params"], stage_ref, "zero=0, pipeline=2 x data=2")
    covered = {k for r in results for k in r["pipeline"]["params"]}
    assert covered == set(ref)
    _report_memory(results[0]["memory"], 4)


# -- bad input, refused before any collective -------------------------------------------------------
def _unstarted(monkeypatch, **sizes):
    # Rank 0 of a 2-process world that was never started: any collective would hang (and making
    # the process group would fail for want of MASTER_ADDR), so an error here came before one.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(pp.Topology(**sizes).world_size if -1 not in sizes.values() else 2))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return pp.Strategy(**sizes, timeout=5)


def test_zero1_with_tensor_or_pipeline_x_data_refused_before_launch():
    strategy = pp.Strategy(data=2, tensor=2, zero=1)
    with pytest.raises(pp.UnsupportedTopologyError, match="zero=1 with tensor=2.*ZeroRedundancyOptimizer.*zero=2"):
        strategy.check("torch")
    with pytest.raises(pp.UnsupportedTopologyError, match="zero=1 with tensor=2"):
        pp.launch(print, strategy, 4, runtime="torch", timeout=10)
    with pytest.raises(pp.UnsupportedTopologyError,
                       match="zero=1 with pipeline=2: each pipeline stage .*ZeroRedundancyOptimizer.*DTensors.*zero=2"):
        pp.launch(print, pp.Strategy(pipeline=2, data=2, zero=1), 4, runtime="torch", timeout=10)
    with pytest.raises(pp.UnsupportedTopologyError, match="zero=1 with pipeline=2"):  # one rule for every data size
        pp.Strategy(pipeline=2, data=1, zero=1).check("torch")
    # A script under torchrun: the session checks the axes only (an adapter such as DeepSpeed may
    # shard by itself on these groups), so wrap_model refuses the stage, before any collective.
    from polyparallel_torch.model import validate

    with pytest.raises(pp.UnsupportedTopologyError, match="zero=1 with pipeline=2"):
        validate(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), pp.Topology(pipeline=2, data=2), {}, stage=1)
    for stage in (0, 2, 3):
        pp.Strategy(pipeline=2, data=2, zero=stage).check("torch", world_size=4)
    for stage in (0, 1, 2, 3):  # every stage is declared
        pp.Strategy(data=2, zero=stage).check("torch")
    pp.Strategy(data=2, tensor=2, zero=3).check("torch")


def test_fsdp_options_refused_before_any_collective(monkeypatch):
    s = _unstarted(monkeypatch, data=2)
    with pytest.raises(pp.PluginError, match="fsdp_kwargs= at sharding stage zero=0"):
        s.wrap_model(_model(), fsdp_kwargs={})
    s3 = s.replace(zero=3)
    with pytest.raises(pp.PluginError, match=r"may not set \['mesh', 'reshard_after_forward'\]"):
        s3.wrap_model(_model(), fsdp_kwargs={"mesh": None, "reshard_after_forward": True})
    with pytest.raises(pp.TopologyError, match=r"shard_modules= names \['encoder'\].*Submodules: 0, 1, 2, 3, 4"):
        s3.wrap_model(_model(), shard_modules=["encoder"])


def test_make_optimizer_refuses_an_instance_and_builds_plain_optimizers_without_data():
    model = _model()
    strategy = pp.Strategy(data=1, zero=1)
    with pytest.raises(TypeError, match="needs an optimizer class.*Received: SGD"):
        make_optimizer(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = make_optimizer(strategy, model, torch.optim.SGD, lr=0.1)
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.1
