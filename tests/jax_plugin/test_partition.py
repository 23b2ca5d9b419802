"""polyparallel_jax.partition: partition rules, the Megatron MLP default, and their errors."""

from __future__ import annotations

import re

import jax
import pytest
from flax import nnx

import polyparallel as pp
from polyparallel_jax.conformance import small_mlp
from polyparallel_jax.partition import PlanError, megatron_mlp_plan, normalize_plan, param_specs, path_name

# The parameters of a three-layer MLP (12 -> 16 -> 16 -> 3).
MLP = {
    "l1/kernel": (12, 16), "l1/bias": (16,),
    "l2/kernel": (16, 16), "l2/bias": (16,),
    "l3/kernel": (16, 3), "l3/bias": (3,),
}


def test_default_plan_is_megatron_column_then_row_and_replicates_what_does_not_divide():
    specs = param_specs(MLP, None, {"data": 4, "tensor": 2})
    assert specs == {
        "l1/kernel": (None, "tensor"), "l1/bias": ("tensor",),  # column-parallel: output features
        "l2/kernel": ("tensor", None), "l2/bias": (),  # row-parallel: input features, bias replicated
        "l3/kernel": (), "l3/bias": (),  # 3 classes do not divide by 2: replicated
    }


def test_default_plan_alternates_in_natural_path_order():
    shapes = {f"layers/{i}/kernel": (8, 8) for i in (10, 2, 1, 3)}
    rules = dict(megatron_mlp_plan(shapes, 2))
    spec = {name: rules["^" + re.escape(name) + "$"] for name in shapes}
    assert spec == {"layers/1/kernel": (None, "tensor"), "layers/2/kernel": ("tensor", None),
                    "layers/3/kernel": (None, "tensor"), "layers/10/kernel": ("tensor", None)}


def test_default_plan_restarts_the_alternation_after_a_replicated_layer():
    shapes = {"a/kernel": (4, 3), "b/kernel": (3, 8), "c/kernel": (8, 8)}
    specs = param_specs(shapes, None, {"tensor": 2})
    # a: column split of 3 fails -> replicated; b starts a new column/row pair.
    assert specs == {"a/kernel": (), "b/kernel": (None, "tensor"), "c/kernel": ("tensor", None)}


def test_without_a_tensor_axis_everything_is_replicated():
    assert param_specs(MLP, None, {"data": 8, "tensor": 1}) == {name: () for name in MLP}


def test_user_rules_first_match_wins_and_unmatched_parameters_are_replicated():
    plan = [(r"kernel$", ("tensor", None)), (r"l1/kernel", (None, "tensor"))]
    specs = param_specs({"l1/kernel": (4, 8), "l1/bias": (8,)}, plan, {"tensor": 2})
    assert specs == {"l1/kernel": ("tensor", None), "l1/bias": ()}
    assert param_specs({"w": (4, 6)}, {"w": [None, "tensor"]}, {"tensor": 2}) == {"w": (None, "tensor")}


def test_rule_matching_no_parameter_names_the_rule_and_the_parameters():
    with pytest.raises(PlanError, match=r"\['decoder/kernel'\] match no parameter.*parameters are: l1/bias, l1/kernel, l2/bias"):
        param_specs(MLP, [("decoder/kernel", (None, "tensor"))], {"tensor": 2})
    assert issubclass(PlanError, ValueError) and issubclass(PlanError, pp.PolyparallelError)


def test_split_that_does_not_divide():
    with pytest.raises(PlanError, match=r"'l3/kernel' of shape \(16, 3\).*dimension 1: 3 is not a multiple of 2"):
        param_specs(MLP, [("l3/kernel", (None, "tensor"))], {"tensor": 2})


def test_spec_longer_than_the_parameter_rank():
    with pytest.raises(PlanError, match=r"'l1/bias' has 2 entries.*shape \(16,\) \(1 dimensions\)"):
        param_specs(MLP, [("l1/bias", (None, "tensor"))], {"tensor": 2})


@pytest.mark.parametrize("plan, message", [
    ([("l1", (None, "model"))], "unknown mesh axis 'model'"),
    ([("l1[", (None, "tensor"))], "not a valid regular expression"),
    ([("l1", (None, "tensor"), "extra")], r"\(pattern, spec\) pair"),
    ([(3, ("tensor",))], r"\(pattern, spec\) pair"),
])
def test_malformed_rules(plan, message):
    with pytest.raises(PlanError, match=message):
        normalize_plan(plan)


def test_normalize_plan_accepts_mappings_lists_and_single_names():
    rules = normalize_plan({"a": [None, "tensor"], "b": "tensor", "c": [("data", "tensor"), None]})
    assert rules == [("a", (None, "tensor")), ("b", ("tensor",)), ("c", (("data", "tensor"), None))]


def test_normalize_plan_accepts_a_partition_spec():
    from jax.sharding import PartitionSpec

    assert normalize_plan([("a", PartitionSpec(None, "tensor"))]) == [("a", (None, "tensor"))]


def test_path_name_of_tree_paths_and_nnx_state():
    tree = {"enc": [{"w": 1}], "t": (2,)}
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert names == ["enc/0/w", "t/0"]
    params = nnx.state(small_mlp(features=12, hidden=16, classes=3), nnx.Param)
    shapes = {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    # the NNX ".value" attribute is not part of the name
    assert shapes == {"bn/bias": (16,), "bn/scale": (16,), "l1/kernel": (12, 16), **{k: v for k, v in MLP.items() if k != "l1/bias"}}
