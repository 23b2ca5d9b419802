"""``polyparallel/_topology.py``: named axes, rank <-> coordinates, groups per axis, roles."""

from __future__ import annotations

import copy
import doctest
import itertools
import json
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyparallel as pp
from polyparallel import _topology
from polyparallel._topology import AXES, Topology

FAST = settings(max_examples=60, deadline=None)

#: Random axis sizes, world sizes up to 5 * 5 * 5.
axis_sizes = st.fixed_dictionaries({axis: st.integers(1, 5) for axis in AXES})
axes = st.sampled_from(AXES)


def numpy_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """The groups DeviceMesh builds for mesh dim ``axis`` of ``arange(world).reshape(*sizes)``:
    move that dim last and read off its 1-D slices."""
    mesh = np.arange(math.prod(sizes.values())).reshape([sizes[a] for a in AXES])
    return np.moveaxis(mesh, AXES.index(axis), -1).reshape(-1, sizes[axis]).tolist()


# -- properties over random shapes ------------------------------------------------------------------


@FAST
@given(axis_sizes)
def test_coords_and_rank_of_are_inverse(sizes):
    t = Topology(**sizes)
    assert t.world_size == math.prod(sizes.values())
    for rank in range(t.world_size):
        coords = t.coords(rank)
        assert list(coords) == list(AXES)  # outermost first
        assert t.rank_of(**coords) == rank
    for point in itertools.product(*(range(sizes[a]) for a in AXES)):
        coords = dict(zip(AXES, point))
        assert t.coords(t.rank_of(**coords)) == coords


@FAST
@given(axis_sizes, axes)
def test_groups_partition_the_ranks(sizes, axis):
    t = Topology(**sizes)
    groups = t.groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(t.world_size))
    assert len(groups) == t.world_size // sizes[axis]
    for group in groups:
        assert len(group) == sizes[axis]
        coords = [t.coords(r) for r in group]
        # Members differ only along `axis`, and are ordered by their coordinate on it.
        assert [c[axis] for c in coords] == list(range(sizes[axis]))
        for other in AXES:
            if other != axis:
                assert len({c[other] for c in coords}) == 1
        for rank in group:
            assert t.group_of(rank, axis) == group


@FAST
@given(axis_sizes, axes)
def test_groups_match_the_device_mesh_layout(sizes, axis):
    assert Topology(**sizes).groups(axis) == numpy_groups(sizes, axis)


@FAST
@given(axis_sizes)
def test_roles(sizes):
    t = Topology(**sizes)
    last_stage = sizes["pipeline"] - 1
    loggers = t.ranks_with_role("logger")
    assert loggers == [t.rank_of(pipeline=last_stage)]  # exactly one, and it holds the loss
    assert t.ranks_with_role("loss") == t.ranks_with_role("metrics") == [
        r for r in range(t.world_size) if t.coords(r)["pipeline"] == last_stage]
    writers = t.ranks_with_role("checkpoint")
    assert writers == [r for r in range(t.world_size) if t.coords(r)["data"] == 0]
    # One complete copy of the model: one rank per (pipeline stage, tensor shard).
    assert len(writers) == sizes["pipeline"] * sizes["tensor"]
    assert {(t.coords(r)["pipeline"], t.coords(r)["tensor"]) for r in writers} == set(
        itertools.product(range(sizes["pipeline"]), range(sizes["tensor"])))
    for rank in range(t.world_size):
        assert t.roles(rank) <= set(_topology.ROLES)
        assert ("loss" in t.roles(rank)) == ("metrics" in t.roles(rank))


@FAST
@given(axis_sizes, axes, st.integers(1, 6))
def test_resolve_infers_the_minus_one_axis(sizes, inferred, factor):
    fixed = {a: s for a, s in sizes.items() if a != inferred}
    world = math.prod(fixed.values()) * factor
    t = Topology(**fixed, **{inferred: -1})
    assert not t.is_resolved
    resolved = t.resolve(world)
    assert resolved.is_resolved
    assert resolved.size(inferred) == factor
    assert resolved == Topology(**fixed, **{inferred: factor})
    assert resolved.world_size == world
    assert resolved.resolve(world) == resolved
    assert t.sizes[inferred] == -1  # the original is unchanged


@FAST
@given(axis_sizes, axes, st.integers(1, 6), st.data())
def test_resolve_refuses_a_world_the_fixed_axes_do_not_divide(sizes, inferred, factor, data):
    fixed = {a: s for a, s in sizes.items() if a != inferred}
    product = math.prod(fixed.values())
    if product == 1:
        return  # every world size is a multiple of 1
    world = product * factor + data.draw(st.integers(1, product - 1))
    with pytest.raises(pp.TopologyError, match=f"does not divide world size {world}"):
        Topology(**fixed, **{inferred: -1}).resolve(world)


@FAST
@given(axis_sizes, st.integers(1, 200))
def test_resolve_of_a_fixed_topology_checks_the_world_size(sizes, world):
    t = Topology(**sizes)
    if world == t.world_size:
        assert t.resolve(world) is t
    else:
        with pytest.raises(pp.TopologyError, match=f"needs {t.world_size} ranks but the world size is {world}"):
            t.resolve(world)


# -- the documented layout ---------------------------------------------------------------------------


def test_megatron_layout_tensor_ranks_are_adjacent():
    t = Topology(data=2, tensor=2, pipeline=2)
    assert t.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.coords(5) == {"pipeline": 1, "data": 0, "tensor": 1}
    assert t.shape == (2, 2, 2)
    # The logger holds the loss: first rank of the last stage, not global rank 0.
    assert t.roles(4) == {"logger", "loss", "metrics", "checkpoint"}
    assert t.roles(0) == {"checkpoint"}
    assert t.roles(7) == {"loss", "metrics"}


def test_defaults_are_one_process():
    t = Topology()
    assert t.sizes == {"pipeline": 1, "data": 1, "tensor": 1}
    assert t.world_size == 1 and t.parallel_axes() == ()
    assert t.roles(0) == set(_topology.ROLES)
    assert t.groups("data") == [[0]]


def test_shape_helpers():
    t = Topology(data=-1, tensor=2)
    assert t.axis_names == AXES
    assert t.sizes == {"pipeline": 1, "data": -1, "tensor": 2}
    assert t.size("tensor") == 2 and t.size("data") == -1
    assert t.parallel_axes() == ("data", "tensor")  # an inferred axis may be > 1
    assert t.resolve(2).parallel_axes() == ("tensor",)


def test_to_dict_is_json_ready_and_complete():
    t = Topology(data=2, tensor=2)
    d = t.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["axes"] == t.sizes and d["world_size"] == 4
    assert d["groups"] == {a: t.groups(a) for a in AXES}
    assert d["ranks"][3] == {"rank": 3, "coords": {"pipeline": 0, "data": 1, "tensor": 1},
                             "roles": ["loss", "metrics"]}


# -- invalid input: every error says what was received ----------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data": 0}, r"axis 'data' must be a positive size or -1 .*Received: data=0\."),
    ({"tensor": -2}, r"axis 'tensor' must be a positive size or -1 .*Received: tensor=-2\."),
    ({"data": -1, "pipeline": -1}, r"At most one topology axis may be -1 .*received 2: pipeline=-1, data=-1"),
    ({"data": 2.0}, r"axis 'data' must be an int .*Received: data=2\.0 of type float\."),
    ({"tensor": "2"}, r"axis 'tensor' must be an int .*Received: tensor='2' of type str\."),
    ({"data": True}, r"axis 'data' must be an int .*Received: data=True of type bool\."),
    ({"pipeline": None}, r"axis 'pipeline' must be an int .*of type NoneType\."),
    ({"context": 2}, r"Unknown topology axis context\. Expected axes: pipeline, data, tensor\."),
    ({"expert": 2, "context": 2}, r"Unknown topology axis context, expert\."),
])
def test_invalid_topology(kwargs, message):
    with pytest.raises(pp.TopologyError, match=message):
        Topology(**kwargs)


def test_topology_error_is_a_value_error():
    with pytest.raises(ValueError):
        Topology(data=0)


def test_resolve_errors_name_the_sizes_and_the_world():
    with pytest.raises(pp.TopologyError, match=r"Topology\(pipeline=1, tensor=3\) does not divide world size 8: "
                                               r"the fixed axes take 3 ranks"):
        Topology(data=-1, tensor=3).resolve(8)
    with pytest.raises(pp.TopologyError, match=r"Topology\(pipeline=1, data=2, tensor=2\) needs 4 ranks but the "
                                               r"world size is 8\. Launch 4 processes, or set one axis to -1"):
        Topology(data=2, tensor=2).resolve(8)


@pytest.mark.parametrize("world", [0, -1, 2.0, True, "8", None])
def test_resolve_rejects_a_bad_world_size(world):
    with pytest.raises(pp.TopologyError, match=f"world size must be a positive int. Received: {world!r}"):
        Topology(data=-1).resolve(world)


@pytest.mark.parametrize("rank", [8, 100, -1, 1.0, True, "0", None])
def test_rank_out_of_range(rank):
    t = Topology(data=2, tensor=2, pipeline=2)
    expected = rf"rank {rank!r} is out of range for Topology\(pipeline=2, data=2, tensor=2\); expected an int in \[0, 8\)"
    for call in (t.coords, t.roles, lambda r: t.group_of(r, "data")):
        with pytest.raises(pp.TopologyError, match=expected):
            call(rank)


@pytest.mark.parametrize(("coords", "message"), [
    ({"tensor": 2}, r"coordinate tensor=2 is out of range for Topology\(.*\); expected an int in \[0, 2\)"),
    ({"data": -1}, r"coordinate data=-1 is out of range .*\[0, 2\)"),
    ({"pipeline": 3}, r"coordinate pipeline=3 is out of range .*\[0, 1\)"),
    ({"data": 1.0}, r"coordinate data=1\.0 is out of range"),
    ({"data": True}, r"coordinate data=True is out of range"),
    ({"expert": 0}, r"rank_of\(\) got unknown axis expert\. Expected axes: pipeline, data, tensor\."),
])
def test_rank_of_invalid_coordinates(coords, message):
    with pytest.raises(pp.TopologyError, match=message):
        Topology(data=2, tensor=2).rank_of(**coords)


def test_rank_of_defaults_missing_axes_to_zero():
    assert Topology(data=2, tensor=2).rank_of(data=1) == 2
    assert Topology(data=2, tensor=2).rank_of() == 0


@pytest.mark.parametrize("call", [
    lambda t: t.groups("model"), lambda t: t.size("model"), lambda t: t.group_of(0, "model"),
])
def test_unknown_axis_name(call):
    with pytest.raises(pp.TopologyError, match=r"Unknown topology axis 'model'\. Expected one of: pipeline, data, tensor\."):
        call(Topology(data=2))


@pytest.mark.parametrize("use", [
    lambda t: t.world_size, lambda t: t.shape, lambda t: t.coords(0), lambda t: t.rank_of(data=0),
    lambda t: t.groups("data"), lambda t: t.roles(0), lambda t: t.to_dict(),
])
def test_an_unresolved_topology_must_be_resolved_first(use):
    with pytest.raises(pp.TopologyError, match=r"Topology\(pipeline=1, data=-1, tensor=2\) has an axis of size -1; "
                                               r"call \.resolve\(world_size\) before"):
        use(Topology(data=-1, tensor=2))


def test_unknown_role():
    with pytest.raises(pp.TopologyError, match=r"Unknown role 'writer'\. Expected one of: logger, loss, metrics, checkpoint\."):
        Topology().ranks_with_role("writer")


# -- value semantics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [Topology(), Topology(data=2, tensor=2, pipeline=2), Topology(data=-1, tensor=4)])
def test_pickle_and_copy_round_trip(t):
    for clone in (pickle.loads(pickle.dumps(t)), copy.copy(t), copy.deepcopy(t)):
        assert clone == t and hash(clone) == hash(t) and repr(clone) == repr(t)
        assert type(clone) is Topology


def test_immutable():
    t = Topology(data=2)
    with pytest.raises(AttributeError, match="immutable"):
        t._sizes = (1, 1, 1)
    with pytest.raises(AttributeError, match="immutable"):
        t.data = 4
    with pytest.raises(AttributeError, match="immutable"):
        del t._sizes
    t.sizes["data"] = 8  # a copy: changing it changes nothing
    assert t.size("data") == 2 and t == Topology(data=2)


def test_equality_and_hash():
    assert Topology(data=2, tensor=1) == Topology(data=2)
    assert Topology(data=2) != Topology(tensor=2)
    assert Topology(data=2) != {"data": 2}
    assert len({Topology(data=2), Topology(data=2), Topology(data=-1)}) == 2


def test_repr_round_trips():
    t = Topology(data=-1, tensor=2, pipeline=3)
    assert repr(t) == "Topology(pipeline=3, data=-1, tensor=2)"
    assert eval(repr(t), {"Topology": Topology}) == t


def test_doctests():
    result = doctest.testmod(_topology, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
