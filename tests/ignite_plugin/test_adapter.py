"""IgniteAdapter.auto_optim at the sharding stages: zero=1 rebuilds the optimizer as torch's
ZeroRedundancyOptimizer (its class, defaults and parameter groups kept) and trains as one process
does, and an optimizer that already holds state is refused; at zero=3 an optimizer given without
its model syncs nothing (the FSDP2 shards were reduce-scattered in backward). Each test is skipped
where the torch runtime does not run its stage (the adapter declares the runtime's stages)."""

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.capabilities import CAPABILITIES as TORCH_CAPABILITIES
from polyparallel_torch.testing import FEATURES, reference_model

pytestmark = [pytest.mark.multiprocess]

STEPS, ROWS = 4, 8  # rows per rank and step


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, 2 * ROWS, FEATURES, generator=g), torch.randint(0, 4, (STEPS, 2 * ROWS), generator=g)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Two groups with their own options: the first layer at another learning rate, no momentum.
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return torch.optim.SGD([{"params": first, "lr": 0.05, "momentum": 0.0}, {"params": rest}], lr=0.1, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, ranks: list[int]) -> dict[str, torch.Tensor]:
    """Each rank of ``ranks`` contributes its rows' loss (BatchNorm sees each rank's rows apart,
    as under DDP); the mean over them is what DDP's averaged gradients minimise."""
    xs, ys = _batches()
    model.train()
    for step in range(STEPS):
        opt.zero_grad()
        rows = [slice(r * ROWS, (r + 1) * ROWS) for r in ranks]
        loss = sum(nn.functional.cross_entropy(model(xs[step, s]), ys[step, s]) for s in rows) / len(rows)
        loss.backward()
        opt.step()
    inner = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def _zero1_worker(strategy: pp.Strategy) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ignite = strategy.adapt("ignite")
    coord = strategy.session().coords["data"]
    model = ignite.auto_model(reference_model(0))
    used = model.module if hasattr(model, "module") else model
    opt = ignite.auto_optim(_optimizer(used), model)
    out: dict = {"type": type(opt).__name__, "is_zero": isinstance(opt, ZeroRedundancyOptimizer),
                 "groups": [(g["lr"], g["momentum"], len(g["params"])) for g in opt.param_groups]}
    out["params"] = _train(model, opt, [coord])
    # This rank steps, and keeps the state of, its partition of the parameters only.
    out["local_state"] = len(opt.optim.state) if out["is_zero"] else len(opt.state)
    out["all_params"] = sum(1 for _ in used.parameters())
    stale = _optimizer(reference_model(0))
    stale.state[stale.param_groups[0]["params"][0]] = {"momentum_buffer": torch.zeros(1)}
    try:
        ignite.auto_optim(stale)
        out["stale"] = "accepted"
    except TypeError as exc:
        out["stale"] = str(exc)
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(1 not in TORCH_CAPABILITIES.stages, reason="the torch runtime here does not run zero=1")
def test_auto_optim_at_zero1_is_a_zero_redundancy_optimizer_matching_one_process(run):
    strategy = pp.Strategy(data=2, zero=1, timeout=60)
    results = run(_zero1_worker, strategy, 2, strategy, timeout=240)
    model = reference_model(0)
    want = _train(model, _optimizer(model), [0, 1])  # one process, the global batch
    for rank, r in enumerate(results):
        assert r["is_zero"], r["type"]
        assert [g[:2] for g in r["groups"]] == [(0.05, 0.0), (0.1, 0.9)], r["groups"]
        assert sum(g[2] for g in r["groups"]) == r["all_params"]
        assert 0 < r["local_state"] < r["all_params"], r  # sharded optimizer state
        for name, w in want.items():
            torch.testing.assert_close(r["params"][name], w, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
            assert torch.equal(r["params"][name], results[0]["params"][name]), f"replicas differ at {name}"
        assert "already holds state for 1 parameter(s)" in r["stale"], r["stale"]
        assert "before the first step" in r["stale"]


def _zero3_worker(strategy: pp.Strategy) -> dict:
    from polyparallel_torch.tensors import full_state

    ignite = strategy.adapt("ignite")
    model = ignite.auto_model(reference_model(0))
    opt = ignite.auto_optim(_optimizer(model))  # no model given: FSDP2 reduced in backward, nothing to sync
    _train(model, opt, [strategy.session().coords["data"]])
    return {n: t for n, t in full_state(model).items() if n in dict(model.named_parameters())}


@pytest.mark.timeout(300)
@pytest.mark.skipif(3 not in TORCH_CAPABILITIES.stages, reason="the torch runtime here does not run zero=3")
def test_auto_optim_at_zero3_without_the_model_leaves_the_sharded_gradients_alone(run):
    strategy = pp.Strategy(data=2, zero=3, timeout=60)
    results = run(_zero3_worker, strategy, 2, strategy, timeout=240)
    model = reference_model(0)
    want = _train(model, _optimizer(model), [0, 1])
    for rank, got in enumerate(results):
        assert set(got) == set(want)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
