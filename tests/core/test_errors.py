"""``polyparallel/_errors.py``: one hierarchy, standard bases, picklable across processes."""

from __future__ import annotations

import pickle

import pytest

import polyparallel as pp


@pytest.mark.parametrize(("error", "bases"), [
    (pp.TopologyError, (pp.PolyparallelError, ValueError)),
    (pp.UnsupportedTopologyError, (pp.TopologyError, ValueError)),
    (pp.NoPluginError, (pp.PolyparallelError, TypeError)),
    (pp.PluginError, (pp.PolyparallelError,)),
    (pp.CollectiveError, (pp.PolyparallelError, RuntimeError)),
    (pp.CollectiveTimeout, (pp.CollectiveError, TimeoutError)),
    (pp.LaunchError, (pp.PolyparallelError, RuntimeError)),
])
def test_hierarchy(error, bases):
    # Standard bases let callers catch what they already catch (ValueError for bad input, ...).
    for base in bases:
        assert issubclass(error, base)
    assert error.__doc__


def test_plugin_error_names_plugin_hook_and_cause():
    cause = KeyError("weight")
    err = pp.PluginError("lightning", "polyparallel_wrap_model", cause)
    assert (err.plugin, err.hook, err.error) == ("lightning", "polyparallel_wrap_model", cause)
    assert str(err) == "plugin 'lightning' failed in polyparallel_wrap_model: KeyError: 'weight'"


def test_collective_errors_carry_operation_axis_rank():
    err = pp.CollectiveTimeout("reduce_metrics over data timed out after 5s on rank 3",
                               operation="reduce_metrics", axis="data", rank=3)
    assert (err.operation, err.axis, err.rank) == ("reduce_metrics", "data", 3)
    assert "rank 3" in str(err)


def test_launch_error_carries_rank_and_traceback():
    err = pp.LaunchError("rank 1 failed", rank=1, traceback="Traceback ...\nZeroDivisionError")
    assert err.rank == 1 and err.traceback.endswith("ZeroDivisionError")
    assert pp.LaunchError("no rank").rank is None


@pytest.mark.parametrize("err", [
    pp.TopologyError("bad"),
    pp.UnsupportedTopologyError("unsupported"),
    pp.NoPluginError("nobody"),
    pp.PluginError("records", "polyparallel_shard_data", ValueError("boom")),
    pp.CollectiveError("failed", operation="sync_grads", axis="data", rank=1),
    pp.CollectiveTimeout("timed out", operation="reduce_metrics", axis="data", rank=2),
    pp.LaunchError("rank 0 failed", rank=0, traceback="Traceback ..."),
], ids=lambda e: type(e).__name__)
def test_errors_survive_pickling(err):
    # Errors are sent back from launched processes; keyword-only fields and notes (the core adds
    # "raised by plugin ..." notes) must survive the trip.
    err.add_note("raised by plugin 'records' in polyparallel_shard_data")
    clone = pickle.loads(pickle.dumps(err))
    assert clone.__notes__ == ["raised by plugin 'records' in polyparallel_shard_data"]
    assert type(clone) is type(err)
    assert str(clone) == str(err)
    assert vars(clone).keys() == vars(err).keys()
    for name, value in vars(err).items():
        if isinstance(value, BaseException):
            assert type(getattr(clone, name)) is type(value) and str(getattr(clone, name)) == str(value)
        else:
            assert getattr(clone, name) == value
