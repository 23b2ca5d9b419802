"""build_config: the DeepSpeed config a Strategy implies (framework-free: no torch, no deepspeed)."""

import pytest

import polyparallel as pp
from polyparallel_deepspeed import PIPELINE_ZERO_REASON, build_config, check_strategy


def test_stage_and_batch_sizes_come_from_the_strategy():
    config = build_config(pp.Strategy(data=2, zero=3, batch_size=16))
    assert config["zero_optimization"] == {"stage": 3}
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) \
        == (16, 8, 1)


@pytest.mark.parametrize("accumulate, given, expected", [
    (2, {}, (16, 4, 2)),
    (2, {"gradient_accumulation_steps": 2}, (16, 4, 2)),
    (4, {"train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
    (2, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (16, 4, 2)),
    (1, {"train_batch_size": 16}, (16, 8, 1)),
])
def test_global_batch_is_micro_times_data_times_accumulation(accumulate, given, expected):
    config = build_config(pp.Strategy(data=2, batch_size=16, accumulate=accumulate), given)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == expected


def test_without_a_strategy_batch_the_config_decides():
    config = build_config(pp.Strategy(data=4, accumulate=2), {"train_micro_batch_size_per_gpu": 3})
    assert config["train_batch_size"] == 24
    assert build_config(pp.Strategy(data=4, accumulate=2), micro_batch_size=3)["train_batch_size"] == 24


def test_pytorch_like_defaults_and_user_options_win():
    strategy = pp.Strategy(data=2, zero=1, batch_size=8)
    config = build_config(strategy, torch_optimizer=True)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default is 1.0
    assert config["zero_allow_untested_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in build_config(strategy.replace(zero=0), torch_optimizer=True)
    mine = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}, "steps_per_print": 7,
            "zero_allow_untested_optimizer": False}
    config = build_config(strategy, mine, torch_optimizer=True)
    assert config["gradient_clipping"] == 1.0 and config["steps_per_print"] == 7
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert config["zero_allow_untested_optimizer"] is False
    assert mine["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}  # the user's dict is not changed


def test_adam_means_adam_unless_asked():
    strategy = pp.Strategy(data=2, batch_size=8)
    adam = build_config(strategy, {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}})
    assert adam["optimizer"]["params"] == {"lr": 0.1, "torch_adam": True, "adam_w_mode": False}
    asked = build_config(strategy, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": True}}})
    assert asked["optimizer"]["params"]["adam_w_mode"] is True
    assert "adam_w_mode" not in build_config(strategy, {"optimizer": {"type": "AdamW"}})["optimizer"].get("params", {})


@pytest.mark.parametrize("strategy, config, kwargs, message", [
    (pp.Strategy(data=2, zero=2, batch_size=8), {"zero_optimization": {"stage": 3}}, {},
     r"zero_optimization.stage=3 contradicts the Strategy's sharding stage zero=2"),
    (pp.Strategy(data=2, batch_size=8), {"zero_optimization": {"stage": 1}}, {},
     r"zero_optimization.stage=1 contradicts the Strategy's sharding stage zero=0"),
    (pp.Strategy(data=2, batch_size=8), {"train_batch_size": 16}, {},
     r"train_batch_size=16 contradicts the Strategy's global batch size 8"),
    (pp.Strategy(data=2, batch_size=8), {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, {},
     r"train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x data=2 = 4, but the global batch size is 8"),
    (pp.Strategy(data=2), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3}, {},
     r"train_micro_batch_size_per_gpu=3 x gradient_accumulation_steps=1 x data=2 = 6, but the global batch size is 8"),
    (pp.Strategy(data=2, accumulate=2), {"train_batch_size": 10}, {},
     r"the global batch size 10 does not divide over data=2 ranks x accumulate=2 micro-batches; use a multiple of 4"),
    (pp.Strategy(data=2, batch_size=8), {"gradient_accumulation_steps": 2}, {},
     r"gradient_accumulation_steps=2 contradicts the Strategy's accumulate=1 .*\(Strategy\(accumulate=N\)\)"),
    (pp.Strategy(data=2, batch_size=8, accumulate=2), {"gradient_accumulation_steps": 4}, {},
     r"gradient_accumulation_steps=4 contradicts the Strategy's accumulate=2"),
    (pp.Strategy(data=2, batch_size=8), {"train_micro_batch_size_per_gpu": 2}, {"micro_batch_size": 4},
     r"micro_batch_size=4\) contradicts the config's train_micro_batch_size_per_gpu=2"),
    (pp.Strategy(data=2), {}, {}, r"needs a batch size: set the global one on the Strategy"),
    (pp.Strategy(data=2, batch_size=8), {"train_micro_batch_size_per_gpu": 0}, {}, r"must be a positive int. Received: 0"),
])
def test_contradictions_name_both_sides(strategy, config, kwargs, message):
    with pytest.raises(pp.TopologyError, match=message):
        build_config(strategy, config, **kwargs)


def _never_called() -> None:
    raise AssertionError("launch started a process")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_3_with_a_pipeline_is_refused_with_deepspeeds_reason(stage):
    strategy = pp.Strategy(data=2, pipeline=2, zero=stage, batch_size=8)
    with pytest.raises(pp.UnsupportedTopologyError, match=f"zero={stage} with pipeline=2: DeepSpeed says.*{PIPELINE_ZERO_REASON}"):
        check_strategy(strategy)
    with pytest.raises(pp.UnsupportedTopologyError, match=PIPELINE_ZERO_REASON):
        build_config(strategy)
    check_strategy(strategy.replace(zero=1))  # ZeRO 0/1 run with a pipeline
    # The adapter's capabilities say so too, so the core refuses it before any process starts.
    with pytest.raises(pp.UnsupportedTopologyError, match=f"zero={stage} with pipeline=2: DeepSpeed says.*{PIPELINE_ZERO_REASON}"):
        strategy.check("deepspeed", world_size=4)
    with pytest.raises(pp.UnsupportedTopologyError, match=PIPELINE_ZERO_REASON):
        pp.launch(_never_called, strategy, nprocs=4, runtime="deepspeed")


def test_config_must_be_a_mapping():
    with pytest.raises(TypeError, match=r"config=\) must be a dict of DeepSpeed options .* Received: str"):
        build_config(pp.Strategy(data=2, batch_size=8), "ds_config.json")  # type: ignore[arg-type]


# -- precision: the bf16/fp16 sections written from Strategy(precision=) ----------------------------------
def test_precision_writes_deepspeeds_sections():
    assert "bf16" not in build_config(pp.Strategy(data=2, batch_size=8, precision="32"))
    assert "communication_data_type" not in build_config(pp.Strategy(data=2, batch_size=8))
    config = build_config(pp.Strategy(data=2, zero=2, batch_size=8, precision="bf16-mixed"))
    assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "fp32"
    assert "fp16" not in config
    # A consistent user section is accepted, and an off one is off.
    assert build_config(pp.Strategy(data=2, batch_size=8, precision="bf16-mixed"),
                        {"bf16": {"enabled": True}, "communication_data_type": "fp32"})["bf16"] == {"enabled": True}
    assert build_config(pp.Strategy(data=2, batch_size=8, precision="32"), {"bf16": {"enabled": False}})["bf16"] == \
        {"enabled": False}


def test_fp16_maps_to_the_dynamic_loss_scaler():
    from polyparallel_deepspeed.precision import sections

    assert sections(pp.PrecisionPolicy("fp16-mixed")) == {"fp16": {"enabled": True, "loss_scale": 0},
                                                           "communication_data_type": "fp32"}
    assert sections(pp.PrecisionPolicy(compute_dtype="float16", loss_scaling=False))["fp16"]["loss_scale"] == 1.0
    assert sections(pp.PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16"))["communication_data_type"] \
        == "bf16"
    assert sections(None) == {} and sections(pp.PrecisionPolicy("32")) == {}


@pytest.mark.parametrize("strategy, config, message", [
    (pp.Strategy(data=2, batch_size=8, precision="32"), {"bf16": {"enabled": True}},
     r"bf16.enabled=True contradicts the Strategy's precision PrecisionPolicy\('32'\).*Strategy\(precision='bf16-mixed'\)"),
    (pp.Strategy(data=2, batch_size=8), {"bf16": {"enabled": True}},
     r"bf16.enabled=True contradicts the Strategy's no precision \(Strategy\(precision=None\): fp32\)"),
    (pp.Strategy(data=2, batch_size=8, precision="bf16-mixed"), {"bf16": {"enabled": False}},
     r"bf16.enabled=False contradicts the Strategy's precision PrecisionPolicy\('bf16-mixed'\).*Drop bf16"),
    (pp.Strategy(data=2, batch_size=8, precision="bf16-mixed"), {"communication_data_type": "bf16"},
     r"communication_data_type='bf16' contradicts the Strategy's precision PrecisionPolicy\('bf16-mixed'\) .*, whose "
     r"reduce_dtype='float32' is 'fp32'"),
    (pp.Strategy(data=2, batch_size=8), {"communication_data_type": "bf16"},
     r"communication_data_type='bf16' contradicts the Strategy's no precision"),
    (pp.Strategy(data=2, batch_size=8, precision="bf16-mixed"), {"bf16": {"enabled": True, "immediate_grad_update": True}},
     r"bf16.immediate_grad_update is not tested by polyparallel"),
])
def test_precision_contradictions_name_both_sides(strategy, config, message):
    with pytest.raises(pp.TopologyError, match=message):
        build_config(strategy, config)


@pytest.mark.parametrize("precision, reason", [
    ("fp16-mixed", r"DeepSpeed's CPU accelerator runs float16 only where oneDNN has float16 kernels"),
    ("bf16-true", r"keeps a float32 master copy of the parameters"),
    (pp.PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16"), r"other combinations of dtypes"),
])
def test_precisions_not_run_are_refused_before_launch_with_the_reason(precision, reason):
    strategy = pp.Strategy(data=2, batch_size=8, precision=precision)
    with pytest.raises(pp.UnsupportedTopologyError, match=reason):
        build_config(strategy)
    with pytest.raises(pp.UnsupportedTopologyError, match=reason):
        pp.launch(_never_called, strategy, nprocs=2, runtime="deepspeed")


def test_bf16_with_a_pipeline_is_refused():
    with pytest.raises(pp.UnsupportedTopologyError, match=r"with data parallelism only: DeepSpeed's pipeline engine"):
        build_config(pp.Strategy(data=2, pipeline=2, batch_size=8, precision="bf16-mixed"))


def test_the_adapter_declares_precision_and_accumulation():
    caps = pp.Strategy().plugin_manager.adapters()["deepspeed"].capabilities
    assert caps.precisions == {"32", "bf16-mixed"} and caps.accumulation is True
    assert {"bf16-true", "fp16-mixed", "custom"} == set(dict(caps.precision_reasons))
