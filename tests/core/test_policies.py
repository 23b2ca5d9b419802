"""``polyparallel/_policies.py``: validated, immutable, picklable policy values and ``Mean``."""

from __future__ import annotations

import dataclasses
import doctest
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyparallel as pp
from polyparallel import _policies
from polyparallel._policies import (
    DEFAULT_STATE_RULES,
    DataPolicy,
    GradPolicy,
    Mean,
    MetricPolicy,
    PrecisionPolicy,
    StatePolicy,
)

# -- DataPolicy ---------------------------------------------------------------------------------------


def test_data_policy_defaults():
    p = DataPolicy()
    # shuffle=None inherits: a loader keeps its own choice, data without a loader is shuffled
    assert (p.batch_size, p.shuffle, p.remainder) == (None, None, "pad")


@pytest.mark.parametrize(("shuffle", "inherited", "expected"), [
    (None, None, True), (None, True, True), (None, False, False),
    (True, None, True), (True, False, True), (False, None, False), (False, True, False),
])
def test_data_policy_shuffles_inherits_unless_set(shuffle, inherited, expected):
    assert DataPolicy(shuffle=shuffle).shuffles(inherited) is expected


@pytest.mark.parametrize("remainder", ["pad", "drop", "uneven"])
def test_data_policy_remainders(remainder):
    assert DataPolicy(remainder=remainder).remainder == remainder


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"remainder": "wrap"}, r"DataPolicy\.remainder must be one of 'pad', 'drop', 'uneven'\. Received: 'wrap'\."),
    ({"remainder": None}, r"DataPolicy\.remainder must be one of .* Received: None\."),
    ({"batch_size": 0}, r"DataPolicy\.batch_size must be a positive int or None\. Received: 0\."),
    ({"batch_size": -8}, r"DataPolicy\.batch_size must be a positive int or None\. Received: -8\."),
    ({"batch_size": 8.0}, r"DataPolicy\.batch_size must be a positive int or None\. Received: 8\.0\."),
    ({"batch_size": True}, r"DataPolicy\.batch_size must be a positive int or None\. Received: True\."),
    ({"batch_size": "8"}, r"DataPolicy\.batch_size must be a positive int or None\. Received: '8'\."),
    ({"shuffle": "no"}, r"DataPolicy\.shuffle must be True, False or None \(inherit the loader's choice\)\. Received: 'no'\."),
    ({"shuffle": 0}, r"DataPolicy\.shuffle must be True, False or None .* Received: 0\."),
])
def test_data_policy_invalid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataPolicy(**kwargs)


def test_data_policy_replace_validates():
    with pytest.raises(ValueError, match="batch_size"):
        dataclasses.replace(DataPolicy(batch_size=8), batch_size=0)
    assert dataclasses.replace(DataPolicy(batch_size=8), remainder="drop") == DataPolicy(8, None, "drop")


# -- GradPolicy ---------------------------------------------------------------------------------------


def test_grad_policy():
    assert GradPolicy() == GradPolicy(op="mean", bucket_mb=None)
    assert GradPolicy().bucket_bytes() == 25 * 2**20 and GradPolicy(bucket_mb=0.5).bucket_bytes() == 2**19
    assert GradPolicy(op="sum").op == "sum"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"op": "max"}, r"GradPolicy\.op must be one of 'mean', 'sum'\. Received: 'max'\."),
    ({"op": "avg"}, r"GradPolicy\.op must be one of 'mean', 'sum'\. Received: 'avg'\."),
    ({"bucket_mb": 0}, r"GradPolicy\.bucket_mb must be > 0\. Received: 0\."),
    ({"bucket_mb": -1.5}, r"GradPolicy\.bucket_mb must be > 0\. Received: -1\.5\."),
    ({"bucket_mb": math.nan}, r"GradPolicy\.bucket_mb must be > 0\. Received: nan\."),
    ({"check": 1}, r"GradPolicy\.check must be True or False\. Received: 1\."),
    ({"check_backward": "yes"}, r"GradPolicy\.check_backward must be True or False\. Received: 'yes'\."),
])
def test_grad_policy_invalid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradPolicy(**kwargs)


# -- MetricPolicy --------------------------------------------------------------------------------------


def test_metric_policy_ops_per_name():
    p = MetricPolicy("max", {"samples": "sum", "loss": "mean"})
    assert p.op_for("samples") == "sum" and p.op_for("loss") == "mean" and p.op_for("acc") == "max"
    # A mapping and pairs in any order are the same policy (normalised, sorted).
    assert p == MetricPolicy("max", [("loss", "mean"), ("samples", "sum")])
    assert p.ops == (("loss", "mean"), ("samples", "sum"))


@pytest.mark.parametrize(("args", "message"), [
    (("median",), r"MetricPolicy\.op must be one of 'mean', 'sum', 'max', 'min'\. Received: 'median'\."),
    (("mean", {"acc": "avg"}), r"MetricPolicy\.ops\['acc'\] must be one of 'mean', 'sum', 'max', 'min'\. Received: 'avg'\."),
])
def test_metric_policy_invalid(args, message):
    with pytest.raises(ValueError, match=message):
        MetricPolicy(*args)


# -- StatePolicy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "action"), [
    ("bn.running_mean", "mean"), ("layer1.0.bn1.running_var", "mean"), ("batch_stats", "mean"),
    ("bn.num_batches_tracked", "local"), ("rng", "local"), ("dropout_key", "local"), ("step_count", "local"),
    ("fc.weight", "broadcast"), ("params", "broadcast"),
])
def test_state_policy_defaults(name, action):
    assert StatePolicy().action_for(name) == action


def test_state_policy_user_rules_first_in_order():
    p = StatePolicy([("encoder.*", "local"), ("*", "mean")])
    assert p.action_for("encoder.bn.running_mean") == "local"  # user rule beats the default rule
    assert p.action_for("decoder.weight") == "mean"
    assert StatePolicy({"*.weight": "local"}, default="mean").action_for("fc.bias") == "mean"


def test_state_policy_without_default_rules():
    p = StatePolicy(default="local", use_defaults=False)
    assert p.action_for("bn.running_mean") == "local"
    assert p.use_defaults is False


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rules": {"bn.*": "average"}},
     r"StatePolicy action for 'bn\.\*' must be one of 'mean', 'broadcast', 'local'\. Received: 'average'\."),
    ({"rules": [("*", "sync")]}, r"StatePolicy action for '\*' must be one of .* Received: 'sync'\."),
    ({"rules": {3: "mean"}}, r"StatePolicy\(rules=\) must be a mapping of name pattern \(str\) -> action, e\.g\. "
                             r"\{'encoder\.\*': 'local'\}, or a list of such pairs\. Received: \{3: 'mean'\}\."),
    ({"default": "sum"}, r"StatePolicy\.default must be one of 'mean', 'broadcast', 'local'\. Received: 'sum'\."),
])
def test_state_policy_invalid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StatePolicy(**kwargs)


def test_default_state_rules_use_known_actions():
    assert {action for _, action in DEFAULT_STATE_RULES} <= set(_policies.STATE_ACTIONS)


# -- Mean ----------------------------------------------------------------------------------------------


def test_mean_is_count_weighted():
    # A mean of 3 samples and a mean of 5 is not the mean of the two means.
    combined = Mean.of(2.0, 3) + Mean.of(10.0, 5)
    assert combined == Mean(56.0, 8)
    assert combined.value == pytest.approx(56 / 8)
    assert combined.value != (2.0 + 10.0) / 2
    assert float(combined) == combined.value


def test_mean_of_nothing_is_nan():
    assert math.isnan(Mean(0.0, 0).value)


def test_mean_adds_only_means():
    with pytest.raises(TypeError):
        Mean(1.0, 1) + 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.integers(1, 1000)), min_size=1, max_size=8))
def test_mean_equals_the_single_process_mean(shards):
    # Each shard holds (per-sample mean, sample count); the combination equals the mean over all samples.
    total = Mean(0.0, 0)
    for value, count in shards:
        total = total + Mean.of(value, count)
    expected = sum(v * c for v, c in shards) / sum(c for _, c in shards)
    assert total.value == pytest.approx(expected, rel=1e-9, abs=1e-6)


# -- value semantics for all policies ------------------------------------------------------------------

POLICIES = [
    DataPolicy(batch_size=64, shuffle=False, remainder="uneven"),
    GradPolicy(op="sum", bucket_mb=4.0),
    MetricPolicy("sum", {"acc": "mean"}),
    StatePolicy({"encoder.*": "local"}, default="mean"),
    Mean(6.0, 3),
    PrecisionPolicy("bf16-mixed"),
    PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16"),
    GradPolicy(accumulate=4),
    GradPolicy(check_backward=True),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_pickle_round_trip_and_hash(policy):
    clone = pickle.loads(pickle.dumps(policy))
    assert clone == policy and hash(clone) == hash(policy) and type(clone) is type(policy)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_immutable(policy):
    field = dataclasses.fields(policy)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(policy, field)


def test_policies_are_exported():
    assert (pp.DataPolicy, pp.GradPolicy, pp.MetricPolicy, pp.StatePolicy, pp.Mean, pp.PrecisionPolicy) == (
        DataPolicy, GradPolicy, MetricPolicy, StatePolicy, Mean, PrecisionPolicy)


def test_doctests():
    result = doctest.testmod(_policies, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# -- precision -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtypes, scaling", [
    ("32", ("float32", "float32", "float32", "float32"), False),
    ("bf16-mixed", ("float32", "bfloat16", "float32", "float32"), False),
    ("bf16-true", ("bfloat16", "bfloat16", "bfloat16", "bfloat16"), False),
    ("fp16-mixed", ("float32", "float16", "float32", "float32"), True),
])
def test_precision_presets(name, dtypes, scaling):
    policy = PrecisionPolicy(name)
    assert tuple(policy.dtypes().values()) == dtypes and policy.loss_scaling is scaling
    assert policy.name == name and repr(policy) == f"PrecisionPolicy({name!r})"
    assert policy.mixed is (dtypes[0] != dtypes[1])


def test_precision_aliases_and_fields_name_the_same_preset():
    assert PrecisionPolicy("bf16") == PrecisionPolicy("bf16-mixed") == PrecisionPolicy(compute_dtype="bfloat16")
    assert PrecisionPolicy("16-mixed") == PrecisionPolicy(compute_dtype="float16")  # scaling on by default for fp16
    assert PrecisionPolicy("32-true") == PrecisionPolicy("fp32") == PrecisionPolicy() == PrecisionPolicy("32")
    custom = PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16")  # bf16 gradient all-reduce
    assert custom.name is None and "reduce_dtype='bfloat16'" in repr(custom)
    assert PrecisionPolicy(compute_dtype="float16", loss_scaling=False).name is None


@pytest.mark.parametrize("kwargs, message", [
    ({"preset": "bf17"}, r"unknown preset 'bf17'; the presets are '32', 'bf16-mixed', 'bf16-true', 'fp16-mixed'"),
    ({"preset": "bf16-mixed", "reduce_dtype": "bfloat16"}, r"a preset name or explicit fields, not both"),
    ({"compute_dtype": "int8"}, r"compute_dtype must be one of 'float64', 'float32', 'bfloat16', 'float16'\. Received: 'int8'"),
    ({"param_dtype": "bfloat16", "compute_dtype": "float32"}, r"compute is wider than the parameters"),
    ({"param_dtype": "bfloat16", "compute_dtype": "float16"}, r"two 16-bit dtypes"),
    ({"compute_dtype": "bfloat16", "loss_scaling": True}, r"loss_scaling=True\) is for float16 compute"),
    ({"loss_scaling": "yes"}, r"loss_scaling must be True or False"),
])
def test_precision_refusals_say_what_to_do(kwargs, message):
    preset = kwargs.pop("preset", None)
    with pytest.raises(ValueError, match=message):
        PrecisionPolicy(preset, **kwargs)


def test_the_ddp_backward_check_is_opt_in():
    # Recorded always, identity-checked only when asked (one more all-reduce a step).
    assert GradPolicy().check_backward is False and GradPolicy().check is True
    assert GradPolicy(check_backward=True) != GradPolicy()


def test_accumulate_is_a_positive_count():
    assert GradPolicy().accumulate == 1 and GradPolicy(accumulate=8).accumulate == 8
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"GradPolicy\.accumulate must be a positive int"):
            GradPolicy(accumulate=bad)
