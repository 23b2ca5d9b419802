"""adapt("deepspeed"): refusals before any collective (one process), and on real gloo processes
(one launch per world size, several engines each): the config the engine runs, the mpu on the
Strategy's groups, the hooks on an engine, and per-rank memory at ZeRO 0-3."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from torch import nn  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel_deepspeed import UnsupportedConfigError  # noqa: E402
from polyparallel_deepspeed.adapter import DeepSpeedSetupError  # noqa: E402

ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}

# Buckets of a few KB: DeepSpeed's defaults (5e8 elements) would add fixed buffers to the state
# the memory test compares; parameters are all partitioned at ZeRO-3 (no persistence threshold).
SMALL_BUCKETS = {"reduce_bucket_size": 4096, "allgather_bucket_size": 4096, "stage3_prefetch_bucket_size": 4096,
                 "stage3_param_persistence_threshold": 0}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _adapt(strategy, **kwargs):
    model = _model()
    return strategy.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


# -- refused before any process group or collective --------------------------------------------------------
@pytest.mark.parametrize("strategy, kwargs, error, message", [
    (pp.Strategy(data=2, zero=2, batch_size=8), {"config": {"zero_optimization": {"stage": 3}}}, pp.TopologyError,
     r"zero_optimization.stage=3 contradicts the Strategy's sharding stage zero=2"),
    (pp.Strategy(data=2, batch_size=8), {"config": {"train_batch_size": 32}}, pp.TopologyError,
     r"train_batch_size=32 contradicts the Strategy's global batch size 8"),
    (pp.Strategy(data=2, batch_size=8), {"micro_batch_size": 2}, pp.TopologyError,
     r"train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x data=2 = 4, but the global batch size is 8"),
    (pp.Strategy(data=2, batch_size=8), {"accumulation": 2}, TypeError,
     r"accumulation=2\) is not taken: gradient accumulation belongs to the Strategy.*Strategy\(accumulate=N\)"),
    (pp.Strategy(data=2, batch_size=8, precision="32"), {"config": {"bf16": {"enabled": True}}}, pp.TopologyError,
     r"bf16.enabled=True contradicts the Strategy's precision PrecisionPolicy\('32'\)"),
    (pp.Strategy(data=2, pipeline=2, zero=2, batch_size=8), {}, pp.UnsupportedTopologyError,
     r"cannot run sharding stage zero=2 with pipeline=2: DeepSpeed says 'ZeRO-2 and ZeRO-3 are incompatible"),
    (pp.Strategy(data=2, pipeline=2, zero=3, batch_size=8), {}, pp.UnsupportedTopologyError,
     r"incompatible with pipeline parallelism"),
    (pp.Strategy(data=2, tensor=2, batch_size=8), {}, pp.UnsupportedTopologyError,
     r"'deepspeed' \(plugin 'deepspeed'\) cannot run tensor=2: it supports parallelism along data, pipeline only"),
    (pp.Strategy(data=2, pipeline=2, batch_size=8), {"loss_fn": nn.functional.cross_entropy, "model": nn.Linear(2, 2)},
     TypeError, r"With pipeline=2, adapt\('deepspeed', model=\) must be an nn.Sequential or a list of layers"),
    (pp.Strategy(data=2, pipeline=2, batch_size=8), {}, TypeError, r"With pipeline=2, adapt\('deepspeed'\) needs loss_fn="),
    (pp.Strategy(data=2, batch_size=8), {"mpu": object()}, TypeError, r"sets deepspeed.initialize's mpu= from the Strategy"),
    # An optimizer (or scheduler) in the config and as an argument: DeepSpeed would silently take the argument.
    (pp.Strategy(data=2, batch_size=8), {"config": {"optimizer": ADAM}}, TypeError,
     r"got an optimizer twice: optimizer=SGD and the config's 'optimizer' entry \{'type': 'Adam'"),
    (pp.Strategy(data=2, batch_size=8), {"lr_scheduler": object(), "config": {"scheduler": {"type": "WarmupLR"}}},
     TypeError, r"got an lr_scheduler twice: lr_scheduler=object and the config's 'scheduler' entry"),
    (pp.Strategy(data=2, batch_size=8), {"config": {"fp16": {"enabled": True}}}, UnsupportedConfigError,
     r"config key 'fp16' is refused: the precision is set on the Strategy"),
    (pp.Strategy(data=2, batch_size=8, precision="fp16-mixed"), {}, pp.UnsupportedTopologyError,
     r"cannot run precision PrecisionPolicy\('fp16-mixed'\): DeepSpeed's CPU accelerator runs float16 only"),
    (pp.Strategy(data=2, zero=3, batch_size=8), {"config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
     UnsupportedConfigError, r"zero_optimization.offload_param is refused: ZeRO-Offload is not tested here"),
    (pp.Strategy(data=2, batch_size=8), {"config": {"gradient_cliping": 1.0}}, UnsupportedConfigError,
     r"'gradient_cliping' is not one DeepSpeed reads \(it would be ignored silently\)"),
    # PipelineModule's own arguments pass through pipeline_options=, except those the adapter sets.
    (pp.Strategy(data=2, pipeline=2, batch_size=8),
     {"loss_fn": nn.functional.cross_entropy, "pipeline_options": {"loss_fn": nn.functional.mse_loss}}, TypeError,
     r"PipelineModule's 'loss_fn' is refused: the adapter builds it from the Strategy"),
    (pp.Strategy(data=2, pipeline=2, batch_size=8),
     {"loss_fn": nn.functional.cross_entropy, "pipeline_options": {"activation_interval": 1}}, TypeError,
     r"PipelineModule takes no argument 'activation_interval'"),
    (pp.Strategy(data=2, batch_size=8), {"pipeline_options": {"activation_checkpoint_interval": 1}}, TypeError,
     r"builds a PipelineModule, which needs pipeline > 1; the Strategy has pipeline=1"),
])
def test_bad_input_is_refused_before_any_collective(strategy, kwargs, error, message, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = kwargs.pop("model", None) or _model()
    with pytest.raises(error, match=message):
        strategy.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("fp16_supported", [True, False])
def test_a_zero3_dtype_is_refused_alike_whatever_the_cpu_says_of_fp16(fp16_supported, monkeypatch):
    """DeepSpeed's zero.Init infers float16 where the accelerator reports fp16 support (a CPU with
    AVX512-FP16/AMX), so a float64 model failed inside deepspeed.initialize on such a machine and
    ran elsewhere: refused on both, before any collective, naming the dtype."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: fp16_supported)
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = _model().double()
    with pytest.raises(TypeError, match=r"ZeRO-3 holds parameters of dtype torch.float32, torch.float16, torch.bfloat16 "
                                        r".*the model's '0.weight' is torch.float64. Convert the model"):
        pp.Strategy(data=2, zero=3, batch_size=8).adapt("deepspeed", model=model,
                                                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not torch.distributed.is_initialized()


def test_no_compiler_is_refused_before_any_collective(monkeypatch):
    """The decision for a machine without a C++ compiler: refused up front, naming both fixes
    (a compiler, or DeepSpeed installed with the op prebuilt)."""
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        pytest.skip("DeepSpeed's communication backend is already up in this process (its op is loaded)")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(DeepSpeedSetupError, match=r"no C\+\+ compiler was found .*'/nonexistent/c\+\+'.*"
                                                   r"apt-get install g\+\+.*DS_BUILD_SHM_COMM=1 pip install deepspeed"):
        _adapt(pp.Strategy(data=2, batch_size=8))
    assert not torch.distributed.is_initialized()


def test_a_launcher_without_local_rank_is_refused(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(DeepSpeedSetupError, match=r"reads LOCAL_RANK .* start it with polyparallel.launch"):
        _adapt(pp.Strategy(data=2, batch_size=8))
    assert not torch.distributed.is_initialized()


# -- on real processes ----------------------------------------------------------------------------------
def _engines(strategy):
    """In each process: what the engines DeepSpeed built from the Strategy run, and their memory."""
    from deepspeed.utils import groups

    from polyparallel_deepspeed.mpu import TopologyMpu
    from polyparallel_deepspeed.testing import state_bytes

    out = {"memory": {}}
    for stage in (0, 1, 2, 3):
        model = _model()
        engine = strategy.replace(zero=stage).adapt(
            "deepspeed", model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
            config={"zero_optimization": SMALL_BUCKETS, "steps_per_print": 1000})
        x = torch.randn(4, 256) + strategy.session().rank
        for _ in range(2):  # optimizer state exists after a step; gradients after the last backward
            engine.backward(engine(x).square().mean())
            engine.step()
        engine.backward(engine(x).square().mean())
        out["memory"][stage] = state_bytes(engine)
        if stage == 3:
            out["stage3"] = {"zero": engine.zero_optimization_stage(), "clip": engine.gradient_clipping(),
                             "steps_per_print": engine.steps_per_print(), "batch": engine.train_batch_size(),
                             "micro": engine.train_micro_batch_size_per_gpu(), "mpu": isinstance(engine.mpu, TopologyMpu),
                             "dp_ranks": torch.distributed.get_process_group_ranks(groups._get_data_parallel_group()),
                             "sync_grads_is_noop": strategy.sync_grads(engine) is engine}
    # ZeRO-3 runs a float32 model whatever the accelerator says of fp16 (issue 19: on a CPU reporting
    # fp16 support, DeepSpeed's zero.Init inferred float16 and asserted on a float64 model).
    from deepspeed.accelerator import get_accelerator

    accelerator, out["fp16"] = get_accelerator(), {}
    for supported in (True, False):
        accelerator.is_fp16_supported = lambda supported=supported: supported
        try:
            model = _model()
            engine = strategy.replace(zero=3).adapt("deepspeed", model=model,
                                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            engine.backward(engine(torch.ones(4, 256)).square().mean())
            engine.step()
            out["fp16"][supported] = str(next(engine.module.parameters()).dtype)
        finally:
            del accelerator.is_fp16_supported  # the class's method again
    # Adam from the config means torch's Adam (not AdamW); the default clip is 0.
    model = _model()
    engine = strategy.adapt("deepspeed", model=model,
                            config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
    out["adam"] = type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer).__name__
    return out


def _check_memory(results, data):
    memory = results[0]["memory"]
    for stage in (1, 2, 3):  # every rank holds the same share
        assert all(r["memory"][stage]["total"] == memory[stage]["total"] for r in results)
    zero, three = memory[0]["total"], memory[3]["total"]
    # Stage 3 holds about 1/data of stage 0 (params + grads + Adam's two moments = 4 copies): 5 copies
    # over data ranks, DeepSpeed keeping an fp32 master partition beside the partitioned parameters.
    assert zero / data <= three <= 1.3 * zero / data, (memory, data)
    assert memory[3]["params"] * data == memory[0]["params"]
    assert memory[1]["total"] < zero and memory[3]["total"] < memory[1]["total"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_engines_follow_the_strategy_data2(run):
    strategy = pp.Strategy(data=2, batch_size=8, timeout=60)
    results = run(_engines, strategy, 2, strategy, timeout=280)
    info = results[0]["stage3"]
    assert info == {"zero": 3, "clip": 0.0, "steps_per_print": 1000, "batch": 8, "micro": 4, "mpu": True,
                    "dp_ranks": [0, 1], "sync_grads_is_noop": True}
    assert results[0]["adam"] == "Adam"
    assert results[0]["fp16"] == {True: "torch.float32", False: "torch.float32"}
    _check_memory(results, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_memory_data4(run):
    strategy = pp.Strategy(data=4, batch_size=16, timeout=90)
    results = run(_engines, strategy, 4, strategy, timeout=400)
    assert results[0]["stage3"]["dp_ranks"] == [0, 1, 2, 3]
    _check_memory(results, 4)
