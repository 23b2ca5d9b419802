"""``Strategy(accumulate=N)`` on the torch runtime: micro-batches from ``shard_data``, one
reduction per optimizer step (``polyparallel_torch.steps``), the same training as one process
with the same global batch. 60 samples at a global batch of 16: each epoch ends with a partial
step (12 rows: micro-batches of 8 and 4 at data=2 x accumulate=2), whose shorter micro-batch
must weigh less."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp

SAMPLES, BATCH, EPOCHS = 60, 16, 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g))


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def train_steps(strategy: pp.Strategy, model: nn.Module) -> dict:
    """The plain loop with ``polyparallel_torch.steps``."""
    import polyparallel_torch as pt

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = strategy.shard_data(dataset())
    shapes = []
    for _ in range(EPOCHS):
        for step in pt.steps(strategy, model, loader):
            shapes.append([len(b[0]) for b in step.batches])
            for x, y in step:
                step.backward(nn.functional.mse_loss(model(x), y))
            step.optimize(opt)
    return {"params": pt.full_state(model), "micro": loader.batch_size, "shapes": shapes}


def reference() -> dict:
    """One process, batch 16, no accumulation: the plain loop as everybody writes it."""
    strategy = pp.Strategy(data=1, batch_size=BATCH)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = strategy.shard_data(dataset())
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(got: dict, want: dict, label: str, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys(), label
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= atol, f"{label}: {name} differs by {diff:.3g}"


def _counting_hook(counter: list[int]):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counter[0] += 1
        return allreduce_hook(state, bucket)

    return hook


def _ddp_fsdp_bare_worker(strategy: pp.Strategy) -> dict:
    out = {}
    # DDP (zero=0), its all-reduces counted by a comm hook (one bucket: a tiny model)
    model = strategy.wrap_model(net())
    counter = [0]
    model.register_comm_hook(None, _counting_hook(counter))
    out["ddp"] = train_steps(strategy, model)
    out["ddp"]["allreduces"] = counter[0]
    # FSDP2 (zero=2, zero=3): no reduce-scatter in the earlier micro-batches' backward
    fsdp = strategy.replace(zero=2)
    import torch.distributed as dist

    real, calls = dist.reduce_scatter_single, [0]

    def counting(*args, **kwargs):  # FSDP2's reduce-scatter (looked up on the module at each call), counted
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        model = fsdp.wrap_model(net())
        out["fsdp"] = train_steps(fsdp, model)
        per_step, calls[0] = calls[0], 0
        x, y = dataset()[:4]
        nn.functional.mse_loss(model(x), y).backward()  # one backward with the reduction on
        out["fsdp"]["reduce_scatters"] = (per_step, calls[0])
    finally:
        dist.reduce_scatter_single = real
    zero3 = strategy.replace(zero=3)  # parameters resharded after forward: gathered again in each backward
    out["zero3"] = train_steps(zero3, zero3.wrap_model(net()))
    # A bare module: gradients add up in .grad, sync_grads reduces once
    out["bare"] = train_steps(strategy, net())
    # The hand-written loop with no_sync around the earlier micro-batches.
    import polyparallel_torch as pt

    model = strategy.wrap_model(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = strategy.shard_data(dataset())
    for _ in range(EPOCHS):
        batches = list(loader)
        for i in range(0, len(batches), 2):
            group = batches[i:i + 2]
            rows = sum(len(y) for _, y in group)
            for k, (x, y) in enumerate(group):
                with pt.no_sync(model) if k < len(group) - 1 else torch.enable_grad():
                    (nn.functional.mse_loss(model(x), y) * len(y) / rows).backward()
            opt.step()
            opt.zero_grad()
    out["no_sync"] = {"params": pt.full_state(model)}
    return out


@pytest.mark.timeout(240)
def test_data2_accumulate2_equals_one_process_ddp_fsdp_bare_and_reduces_once(run):
    strategy = pp.Strategy(data=2, batch_size=BATCH, accumulate=2, timeout=60)
    results = run(_ddp_fsdp_bare_worker, strategy, 2, strategy, timeout=200)
    want = reference()
    for rank, r in enumerate(results):
        for label in ("ddp", "fsdp", "zero3", "bare", "no_sync"):
            assert_close(r[label]["params"], want, f"rank {rank}, {label}")
        assert r["ddp"]["micro"] == 4  # 16 / (2 x 2)
        # 30 samples a rank: three steps of two micro-batches of 4, then a step of 4 + 2 rows
        assert r["ddp"]["shapes"] == [[4, 4]] * 3 + [[4, 2]] + [[4, 4]] * 3 + [[4, 2]]
        # one all-reduce per optimizer step (8 steps), not one per micro-batch (16)
        assert r["ddp"]["allreduces"] == 2 * 4, r["ddp"]["allreduces"]
        # FSDP2: the reduce-scatters of one backward, once per step (8), not per micro-batch
        total, one_backward = r["fsdp"]["reduce_scatters"]
        assert one_backward >= 1 and total == 8 * one_backward, r["fsdp"]["reduce_scatters"]


def _data4_worker(strategy: pp.Strategy) -> dict:
    return train_steps(strategy, strategy.wrap_model(net()))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data4_without_accumulation_equals_one_process(run):
    strategy = pp.Strategy(data=4, batch_size=BATCH, timeout=60)
    results = run(_data4_worker, strategy, 4, strategy, timeout=260)
    want = reference()
    for rank, r in enumerate(results):
        assert_close(r["params"], want, f"data=4 rank {rank}")
        assert r["micro"] == 4 and r["shapes"] == ([[4]] * 3 + [[3]]) * 2, r["shapes"]


def test_one_process_accumulate4_equals_batch16():
    # 1 process x accumulate=4: micro-batches of 4, the partial step of 12 rows is three of them
    strategy = pp.Strategy(data=1, batch_size=BATCH, accumulate=4)
    r = train_steps(strategy, strategy.wrap_model(net()))
    assert r["micro"] == 4 and r["shapes"] == ([[4] * 4] * 3 + [[4] * 3]) * 2
    assert_close(r["params"], reference(), "data=1 x accumulate=4")


def test_micro_batches_from_a_loader_and_refusals():
    from torch.utils.data import DataLoader

    strategy = pp.Strategy(data=1, accumulate=2)
    loader = strategy.shard_data(DataLoader(dataset(), batch_size=8))  # per rank and optimizer step
    assert loader.batch_size == 4
    with pytest.raises(pp.TopologyError, match=r"batch_size 9 .* does not divide into accumulate=2"):
        strategy.shard_data(DataLoader(dataset(), batch_size=9))
    with pytest.raises(pp.TopologyError, match=r"accumulate=2 micro-batches"):
        strategy.shard_data(dataset(), batch_size=15)


def test_pipeline_with_accumulation_is_refused_before_any_collective():
    from polyparallel_torch.model import validate

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(pp.UnsupportedTopologyError, match=r"microbatches="):
        validate(model, pp.Topology(pipeline=2), {}, 0, accumulate=2)


def test_a_step_without_a_backward_per_micro_batch_is_refused():
    import polyparallel_torch as pt

    strategy = pp.Strategy(data=1, batch_size=BATCH, accumulate=2)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = next(iter(pt.steps(strategy, model, strategy.shard_data(dataset()))))
    for x, y in step:
        nn.functional.mse_loss(model(x), y).backward()  # not step.backward: no scaling
    with pytest.raises(RuntimeError, match=r"ran Step.backward 0 time\(s\) for 2"):
        step.optimize(opt)
    with pytest.raises(RuntimeError, match=r"inside `for batch in step:`"):
        step.backward(torch.tensor(1.0, requires_grad=True))
