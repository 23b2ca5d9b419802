"""Strategy(precision=) and Strategy(accumulate=) in the Ignite adapter's supervised step.

- bf16-mixed at data=2 (gloo processes) equals ignite in one process (its own
  ``supervised_training_step`` with the forward and loss under CPU bfloat16 autocast) on the same
  global batches, within the bf16 tolerance below, and differs from float32 by more than that;
- data=2 x accumulate=2 equals ignite in one process with the same global batch (1e-5), with one
  gradient all-reduce per optimizer step;
- ignite options that contradict the Strategy (amp_mode=, scaler=, gradient_accumulation_steps=)
  are refused when the trainer is built, naming both.
"""

import pytest
import torch
from torch import nn

import polyparallel as pp

N, GLOBAL, EPOCHS = 40, 8, 2  # 5 global batches of 8 per epoch
#: Measured: 1e-4-scale between one process and data=2 in bf16, ~1e-3 between bf16 and float32.
BF16_ATOL = 5e-4


def _model():
    from polyparallel_torch.testing import reference_model

    model = reference_model(0)
    model[3] = nn.Identity()  # no BatchNorm (its statistics are per rank): the same function at data=1 and 2
    return model


def _worker(strategy):
    from polyparallel_torch.testing import LR, flat_params, reference_dataset

    ignite = strategy.adapt("ignite")
    model = ignite.auto_model(_model())
    opt = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=LR), model)
    loader = ignite.auto_dataloader(reference_dataset(N), batch_size=GLOBAL, shuffle=True)
    dtypes = set()

    def model_fn(m, x):
        out = m(x)
        dtypes.add(str(out.dtype))
        return out

    trainer = ignite.create_supervised_trainer(model, opt, nn.functional.cross_entropy, data=loader,
                                               model_fn=model_fn)
    trainer.run(loader, max_epochs=EPOCHS)
    scaler = getattr(trainer.state, "scaler", None)
    return {"params": flat_params(model), "dtypes": sorted(dtypes), "iterations": trainer.state.iteration,
            "scale": float(scaler.get_scale()) if scaler is not None else None}


def _one_process(precision):
    """Ignite alone, one process: its own step, the global batches of shard_data's order."""
    from ignite.engine import Engine, Events, supervised_training_step
    from torch.utils.data import DataLoader

    from polyparallel_torch import TopologySampler
    from polyparallel_torch.testing import LR, flat_params, reference_dataset

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = TopologySampler(N, 0, 1, seed=0, shuffle=True)
    loader = DataLoader(reference_dataset(N), batch_size=GLOBAL, sampler=sampler)
    enabled = precision == "bf16"

    def model_fn(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            return m(x)

    def loss_fn(y_pred, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            return nn.functional.cross_entropy(y_pred, y)

    engine = Engine(supervised_training_step(model, opt, loss_fn, model_fn=model_fn))
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: sampler.set_epoch(e.state.epoch - 1))
    engine.run(loader, max_epochs=EPOCHS)
    return flat_params(model)


def _max_diff(a, b):
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))


def _both(strategy):
    """Both scenarios in one launch (process start-up is most of a test's time here)."""
    return {"bf16": _worker(strategy.replace(precision="bf16-mixed")),
            "fp16": _worker(strategy.replace(precision="fp16-mixed")),
            "accumulation": _accumulation_worker(strategy.replace(accumulate=2))}


@pytest.fixture(scope="module")
def launched():
    strategy = pp.Strategy(data=2, timeout=60, seed=0)
    return pp.launch(_both, strategy, 2, args=(strategy,), runtime="ignite", timeout=200)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bf16_mixed_at_data_2_equals_ignite_in_one_process(launched):
    results = [r["bf16"] for r in launched]
    reference, fp32 = _one_process("bf16"), _one_process("fp32")
    for r in results:
        assert r["dtypes"] == ["torch.bfloat16"]
        assert r["iterations"] == 5 * EPOCHS
        assert _max_diff(r["params"], reference) < BF16_ATOL
    assert _max_diff(reference, fp32) > 2 * BF16_ATOL, "bfloat16 was computed"


@pytest.mark.parametrize(("strategy", "options", "message"), [
    (pp.Strategy(precision="bf16-mixed"), {"amp_mode": "amp"},
     r"amp_mode='amp'\) contradicts Strategy\(precision='bf16-mixed'\)"),
    (pp.Strategy(precision="bf16-mixed"), {"scaler": True},
     r"scaler=True\) contradicts Strategy\(precision='bf16-mixed'\), whose loss scaling is False"),
    (pp.Strategy(precision="32"), {"gradient_accumulation_steps": 2},
     r"gradient_accumulation_steps=2\) contradicts Strategy\(accumulate=1\)"),
])
def test_contradicting_ignite_options_are_refused_naming_both(strategy, options, message):
    from polyparallel_ignite.precision import check_kwargs

    with pytest.raises(pp.TopologyError, match=message):
        check_kwargs(strategy, options)


def test_dtype_combinations_without_a_preset_are_refused_before_launch():
    custom = pp.PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16")
    with pytest.raises(pp.UnsupportedTopologyError, match="'ignite'.*cannot run precision"):
        pp.Strategy(data=2, precision=custom).check("ignite", world_size=2)
    pp.Strategy(data=2, precision="fp16-mixed").check("ignite", world_size=2)


def _accumulation_worker(strategy):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from polyparallel_torch.testing import LR, flat_params, reference_dataset

    ignite = strategy.adapt("ignite")
    model = ignite.auto_model(_model())
    reductions = []

    def counting_hook(state, bucket):
        reductions.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    opt = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=LR), model)
    loader = ignite.auto_dataloader(reference_dataset(N), batch_size=GLOBAL, shuffle=True)  # micro-batches of 2
    steps = []
    opt.register_step_post_hook(lambda *args: steps.append(1))
    trainer = ignite.create_supervised_trainer(model, opt, nn.functional.cross_entropy, data=loader)
    trainer.run(loader, max_epochs=EPOCHS)
    return {"params": flat_params(model), "iterations": trainer.state.iteration, "steps": len(steps),
            "reductions": len(reductions), "micro": loader.batch_size}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_data_2_accumulate_2_equals_one_process_with_the_global_batch(launched):
    results = [r["accumulation"] for r in launched]
    reference = _one_process("fp32")
    for r in results:
        assert r["micro"] == 2, "global 8 = 2 (micro) x 2 (accumulate) x 2 (data)"
        assert (r["iterations"], r["steps"]) == (10 * EPOCHS, 5 * EPOCHS)
        assert r["reductions"] == r["steps"], "one gradient all-reduce per optimizer step (no_sync between)"
        assert _max_diff(r["params"], reference) < 1e-5


#: fp16 keeps 11 bits of mantissa: fp16-mixed at data=2 stays within this of float32 in one process.
FP16_ATOL = 2e-4


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fp16_mixed_at_data_2_scales_the_loss_and_trains_as_float32_within_fp16_tolerance(launched):
    fp32 = _one_process("fp32")
    for r in (r["fp16"] for r in launched):
        assert r["dtypes"] == ["torch.float16"]
        assert r["scale"] is not None and r["scale"] > 1, "dynamic loss scaling (GradScaler) on the CPU"
        assert _max_diff(r["params"], fp32) < FP16_ATOL


def test_bf16_true_keeps_the_parameters_in_bfloat16_through_the_step():
    from ignite.engine import Engine
    from torch.utils.data import DataLoader

    from polyparallel_ignite.precision import cast_params, training_step
    from polyparallel_torch.testing import LR, reference_dataset

    strategy = pp.Strategy(precision="bf16-true")
    model = cast_params(_model(), strategy.precision)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]

    # float32 inputs: the step casts them to the parameters' bfloat16
    engine = Engine(training_step(model, opt, nn.functional.cross_entropy, strategy, torch.device("cpu")))
    engine.run(DataLoader(reference_dataset(N), batch_size=GLOBAL), max_epochs=1)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {s["momentum_buffer"].dtype for s in opt.state.values()} == {torch.bfloat16}, "optimizer state bf16"
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "it trained"
    assert engine.state.output == engine.state.output  # a finite loss (not NaN)
