"""build_config: the DeepSpeed config a Strategy implies (framework-free: no torch, no deepspeed)."""

import pytest

import polyparallel as pp
from polyparallel_deepspeed import PIPELINE_ZERO_REASON, build_config, check_strategy


def test_stage_and_batch_sizes_come_from_the_strategy():
    config = build_config(pp.Strategy(data=2, zero=3, batch_size=16))
    assert config["zero_optimization"] == {"stage": 3}
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) \
        == (16, 8, 1)


@pytest.mark.parametrize("given, expected", [
    ({"gradient_accumulation_steps": 2}, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 2}, (16, 2, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (16, 4, 2)),
    ({"train_batch_size": 16}, (16, 8, 1)),
])
def test_global_batch_is_micro_times_data_times_accumulation(given, expected):
    config = build_config(pp.Strategy(data=2, batch_size=16), given)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == expected


def test_without_a_strategy_batch_the_config_decides():
    config = build_config(pp.Strategy(data=4), {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})
    assert config["train_batch_size"] == 24
    assert build_config(pp.Strategy(data=4), micro_batch_size=3, accumulation=2)["train_batch_size"] == 24


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
     r"8 is not a multiple of train_micro_batch_size_per_gpu=3 x data=2"),
    (pp.Strategy(data=2, batch_size=8), {"gradient_accumulation_steps": 3}, {},
     r"8 does not divide into gradient_accumulation_steps=3 x data=2"),
    (pp.Strategy(data=2, batch_size=8), {"gradient_accumulation_steps": 2}, {"accumulation": 4},
     r"accumulation=4\) contradicts the config's gradient_accumulation_steps=2"),
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
