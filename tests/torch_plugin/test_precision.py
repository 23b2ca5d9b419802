"""``Strategy(precision=)`` on the torch runtime: bf16-mixed (autocast under DDP, FSDP2's
``MixedPrecisionPolicy`` at zero=2), fp16-mixed with a gradient scaler (``ShardedGradScaler``
under FSDP2), bf16-true, a bfloat16 gradient reduction (DDP's ``bf16_compress_hook``), the
memory per rank at bf16-true vs 32, and every refusal, before any process or collective.

Tolerance: bfloat16 keeps 8 significant bits (a relative rounding of 2**-9 per value). At data=2
each rank's gradient is rounded from half the batch and the halves averaged in float32, where
one process rounds the whole batch's once, so the runs differ by rounding alone: after the 8 steps
here the parameters agree within ``BF16_ATOL`` (2.5e-3, over 3x the largest difference seen,
7.3e-4 at bf16-mixed; values are O(0.3)), bf16-true (bfloat16 parameters, whose updates round
too) within ``BF16_TRUE_ATOL`` (1e-2; seen 2.9e-3), float16 (11 bits) within ``FP16_ATOL``
(5e-4; seen 1e-4), and the losses within 1% relative. Every run also differs from float32 by more than rounding noise of float32, which
shows the narrow dtype was really used.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polyparallel as pp

from .test_accumulation import BATCH, EPOCHS, dataset, net

BF16_ATOL, BF16_TRUE_ATOL, FP16_ATOL = 2.5e-3, 1e-2, 5e-4


def train(strategy: pp.Strategy, model: nn.Module, optimizer: str = "sgd") -> dict:
    """The plain loop with ``polyparallel_torch.steps`` (the scaler under fp16); the dtype the
    first layer computes in, the loss of every step, the final parameters."""
    import polyparallel_torch as pt

    params = model.parameters()
    if strategy.shard_policy.stage == 1:  # ZeroRedundancyOptimizer over the data group
        opt = pt.make_optimizer(strategy, model, torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        opt = (torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd"
               else torch.optim.Adam(params, lr=1e-3))
    scaler = pt.grad_scaler(model)
    if scaler is not None:
        # A scale neither run overflows at, so both take the same steps: at the default 2**16 the first
        # steps overflow and are skipped, and which ones depends on how the batch is split over ranks.
        scaler._init_scale = 2.0**8
    seen: list[torch.dtype] = []
    from polyparallel_torch.tensors import unwrap

    inner = unwrap(model)
    inner[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loader = strategy.shard_data(dataset())
    losses = []
    for _ in range(EPOCHS):
        for step in pt.steps(strategy, model, loader):
            total = pp.Mean(0.0, 0)
            for x, y in step:
                out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
                step.backward(loss)
                total += pp.Mean(loss.item() * len(y), len(y))
            step.optimize(opt)
            losses.append(strategy.reduce_metrics({"loss": total})["loss"])
    return {"params": {k: v.float() for k, v in pt.full_state(model).items()}, "losses": losses,
            "compute": str(seen[0]), "output": str(out.dtype), "param_dtype": str(next(model.parameters()).dtype),
            "memory": pt.state_bytes(model, opt), "scaler": type(scaler).__name__,
            "scale": None if scaler is None else scaler.get_scale()}


def reference(precision: str | pp.PrecisionPolicy | None) -> dict:
    strategy = pp.Strategy(data=1, batch_size=BATCH, precision=precision)
    return train(strategy, strategy.wrap_model(net()))


def _worker(strategy: pp.Strategy) -> dict:
    out = {}
    for label, s in (("bf16-mixed ddp", strategy.replace(precision="bf16-mixed")),
                     ("bf16-mixed fsdp", strategy.replace(precision="bf16-mixed", zero=2)),
                     ("fp16-mixed ddp", strategy.replace(precision="fp16-mixed")),
                     ("fp16-mixed fsdp", strategy.replace(precision="fp16-mixed", zero=2)),
                     ("bf16-true ddp", strategy.replace(precision="bf16-true")),
                     ("bf16 reduce ddp", strategy.replace(precision=pp.PrecisionPolicy(reduce_dtype="bfloat16")))):
        model = s.wrap_model(net())
        out[label] = train(s, model)
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        out[label]["comm hook"] = str(model._get_ddp_logging_data().get("comm_hook", "")) if ddp else ""
    # memory per rank of parameters + gradients + optimizer state (Adam), at zero=0 and zero=3
    big = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
    for label, s in (("32 zero=0", strategy.replace(precision="32")),
                     ("bf16-true zero=0", strategy.replace(precision="bf16-true")),
                     ("32 zero=3", strategy.replace(precision="32", zero=3)),
                     ("bf16-true zero=3", strategy.replace(precision="bf16-true", zero=3))):
        import copy

        import polyparallel_torch as pt

        model = s.wrap_model(copy.deepcopy(big))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(4, 64)).float().sum().backward()
        s.sync_grads(model)
        opt.step()
        out["memory " + label] = pt.state_bytes(model, opt)
    return out


def close(got: dict, want: dict, atol: float, label: str) -> float:
    worst = 0.0
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        worst = max(worst, diff)
        assert diff <= atol, f"{label}: {name} differs by {diff:.3g} (tolerance {atol})"
    return worst


@pytest.mark.timeout(300)
def test_precisions_at_data2_equal_one_process_within_tolerance_and_memory(run):
    strategy = pp.Strategy(data=2, batch_size=BATCH, timeout=60)
    results = run(_worker, strategy, 2, strategy, timeout=260)
    fp32 = reference("32")
    refs = {p: reference(p) for p in ("bf16-mixed", "fp16-mixed", "bf16-true")}
    refs["bf16 reduce"] = fp32
    tolerances = {"bf16-mixed": BF16_ATOL, "fp16-mixed": FP16_ATOL, "bf16-true": BF16_TRUE_ATOL, "bf16 reduce": BF16_ATOL}
    for rank, r in enumerate(results):
        for label, got in r.items():
            if label.startswith("memory"):
                continue
            name = label.rsplit(" ", 1)[0]
            want = refs[name]
            worst = close(got["params"], want["params"], tolerances[name], f"rank {rank}, {label}")
            print(f"{label}: max parameter difference to one process {worst:.2e}")
            for a, b in zip(got["losses"], want["losses"]):
                assert abs(a - b) <= 1e-2 * abs(b) + 1e-4, (label, got["losses"], want["losses"])
            # the narrow dtype was used: not float32's result
            assert max((got["params"][k] - fp32["params"][k]).abs().max().item() for k in fp32["params"]) > 1e-5
        assert r["bf16-mixed ddp"]["compute"] == "torch.bfloat16" and r["bf16-mixed ddp"]["output"] == "torch.float32"
        assert r["bf16-mixed fsdp"]["compute"] == "torch.bfloat16" and r["bf16-mixed fsdp"]["output"] == "torch.float32"
        assert r["bf16-mixed ddp"]["param_dtype"] == "torch.float32"
        assert r["fp16-mixed ddp"]["compute"] == "torch.float16" and r["fp16-mixed ddp"]["scaler"] == "GradScaler"
        assert r["fp16-mixed fsdp"]["scaler"] == "ShardedGradScaler"
        assert r["fp16-mixed ddp"]["scale"] == r["fp16-mixed fsdp"]["scale"] == refs["fp16-mixed"]["scale"] == 2.0**8
        assert r["bf16-true ddp"]["param_dtype"] == "torch.bfloat16" and r["bf16-true ddp"]["output"] == "torch.bfloat16"
        assert "bf16_compress_hook" in r["bf16 reduce ddp"]["comm hook"], r["bf16 reduce ddp"]["comm hook"]
        assert r["bf16-mixed ddp"]["comm hook"] == "" or "bf16" not in r["bf16-mixed ddp"]["comm hook"]
        # memory per rank: bf16-true halves parameters, gradients and Adam's moments; zero=3 halves again
        m = {k[len("memory "):]: v for k, v in r.items() if k.startswith("memory")}
        params = 64 * 256 + 256 + 256 + 1
        assert m["32 zero=0"] == {"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params}, m
        assert m["bf16-true zero=0"] == {k: v // 2 for k, v in m["32 zero=0"].items()}, m
        assert sum(m["bf16-true zero=3"].values()) * 2 == pytest.approx(sum(m["32 zero=3"].values()), rel=0.01), m
        assert sum(m["32 zero=3"].values()) < 0.55 * sum(m["32 zero=0"].values()), m
        if rank == 0:
            for label, v in m.items():
                print(f"memory per rank, {label}: params {v['params']:,} B, grads {v['grads']:,} B, "
                      f"optimizer {v['optimizer']:,} B, total {sum(v.values()):,} B")


def _worker_4(strategy: pp.Strategy) -> dict:
    out = {}
    for label, s in (("bf16-mixed data=2 x tensor=2", strategy.replace(data=2, tensor=2, precision="bf16-mixed")),
                     ("bf16-mixed data=4 zero=1", strategy.replace(data=4, tensor=1, zero=1, precision="bf16-mixed")),
                     ("bf16-true data=2 x tensor=2", strategy.replace(data=2, tensor=2, precision="bf16-true"))):
        model = s.wrap_model(net())
        out[label] = train(s, model)
    return out


@pytest.mark.timeout(300)
def test_bf16_with_tensor_parallel_and_zero1_equals_one_process_within_tolerance(run):
    # 4 gloo ranks: DTensor shards of the default tensor plan under autocast, and
    # ZeroRedundancyOptimizer (zero=1) stepping float32 partitions of a bf16-mixed model.
    strategy = pp.Strategy(data=2, tensor=2, batch_size=BATCH, timeout=60)
    results = run(_worker_4, strategy, 4, strategy, timeout=280)
    refs = {p: reference(p) for p in ("bf16-mixed", "bf16-true")}
    fp32 = reference("32")
    for rank, r in enumerate(results):
        for label, got in r.items():
            name = label.split(" ", 1)[0]
            tolerance = BF16_ATOL if name == "bf16-mixed" else BF16_TRUE_ATOL
            worst = close(got["params"], refs[name]["params"], tolerance, f"rank {rank}, {label}")
            print(f"{label}: max parameter difference to one process {worst:.2e}")
            for a, b in zip(got["losses"], refs[name]["losses"]):
                assert abs(a - b) <= 1e-2 * abs(b) + 1e-4, (label, got["losses"], refs[name]["losses"])
            assert max((got["params"][k] - fp32["params"][k]).abs().max().item() for k in fp32["params"]) > 1e-5
            assert got["compute"] == "torch.bfloat16", (label, got["compute"])
        assert r["bf16-mixed data=4 zero=1"]["param_dtype"] == "torch.float32"


# -- refusals: before any process starts (launch) or any collective (wrap_model) ---------------------------
REFUSED = [
    (pp.PrecisionPolicy(optimizer_dtype="bfloat16"), pp.Topology(data=2), 0, "optimizer_dtype to param_dtype"),
    (pp.PrecisionPolicy(param_dtype="float64", compute_dtype="float64", reduce_dtype="float64",
                        optimizer_dtype="float64"), pp.Topology(data=2), 0, "float64 runs only as precision=None"),
    (pp.PrecisionPolicy(param_dtype="bfloat16", compute_dtype="bfloat16", reduce_dtype="float32",
                        optimizer_dtype="bfloat16"), pp.Topology(data=2), 0, "in a wider one gains nothing"),
    (pp.PrecisionPolicy("bf16-mixed"), pp.Topology(pipeline=2), 0, "pipeline schedule calls"),
    (pp.PrecisionPolicy(reduce_dtype="bfloat16"), pp.Topology(data=2, tensor=2), 0, "bare module's gradients"),
]


@pytest.mark.parametrize("policy, topology, stage, reason", REFUSED)
def test_what_the_torch_runtime_cannot_map_is_refused_before_wrap_model_runs_a_collective(policy, topology, stage,
                                                                                           reason):
    from polyparallel_torch.model import validate

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(pp.UnsupportedTopologyError, match=rf"wrap_model\(\) cannot run precision .*{reason}"):
        validate(model, topology, {}, stage, precision=policy)


def _never_runs() -> None:
    raise AssertionError("a process started")


def test_a_refused_precision_is_refused_by_launch_before_any_process_starts():
    strategy = pp.Strategy(data=2, timeout=30, precision=pp.PrecisionPolicy(optimizer_dtype="bfloat16"))
    with pytest.raises(pp.UnsupportedTopologyError, match=r"launch\(\) cannot run precision .*torch's optimizers"):
        pp.launch(_never_runs, strategy, nprocs=2)


def test_fsdp_mp_policy_contradicting_the_precision_is_refused():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from polyparallel_torch.model import validate

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"may not set mp_policy under Strategy\(precision="):
        validate(model, pp.Topology(data=2), {"fsdp_kwargs": {"mp_policy": MixedPrecisionPolicy()}}, 2,
                 precision=pp.PrecisionPolicy("bf16-mixed"))


def test_fp16_gradients_of_an_unscaled_loss_are_refused_by_sync_grads():
    strategy = pp.Strategy(data=1, batch_size=BATCH, precision="fp16-mixed")
    model = strategy.wrap_model(net())
    x, y = dataset()[:4]
    nn.functional.mse_loss(model(x), y).backward()  # no scaler: float16 gradients may underflow
    with pytest.raises(pp.UnsupportedTopologyError, match=r"loss was never scaled"):
        strategy.sync_grads(model)


def test_precision_is_declared():
    from polyparallel_torch.capabilities import CAPABILITIES

    assert CAPABILITIES.precisions == {"32", "bf16-mixed", "bf16-true", "fp16-mixed", "custom"}
    assert CAPABILITIES.accumulation


def test_an_adapter_that_applies_the_precision_itself_passes_precision_none():
    # Lightning's precision plugin (or Ignite's autocast) does the casting: wrap_model(precision=None)
    # leaves the module's dtypes and forward alone, under a Strategy whose precision is bf16-true.
    strategy = pp.Strategy(data=1, precision="bf16-true")
    plain = strategy.wrap_model(net(), precision=None)
    x = dataset()[:4][0]
    assert next(plain.parameters()).dtype == torch.float32 and plain(x).dtype == torch.float32
    cast = strategy.wrap_model(net())
    assert next(cast.parameters()).dtype == torch.bfloat16 and cast(x).dtype == torch.bfloat16
    with pytest.raises(pp.PluginError, match=r"wrap_model\(precision=\) takes a PrecisionPolicy or None"):
        strategy.wrap_model(net(), precision="bf16-true")


def test_the_compute_dtype_travels_with_a_copy_and_autocast_ends_when_forward_raises():
    import copy

    strategy = pp.Strategy(data=1, precision="bf16-mixed")
    model = strategy.wrap_model(net())
    x = dataset()[:4][0]
    twin = copy.deepcopy(model)  # an EMA copy: its own weights, the same precision
    with torch.no_grad():
        twin[0].weight.zero_()
        twin[0].bias.zero_()
    assert not torch.equal(model(x), twin(x)) and twin(x).dtype == torch.float32
    seen = []
    twin[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    twin(x)
    assert seen == [torch.bfloat16]  # autocast inside the copy too
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5))  # wrong width: forward raises inside autocast
    assert not torch.is_autocast_enabled("cpu")  # and autocast did not stay on
