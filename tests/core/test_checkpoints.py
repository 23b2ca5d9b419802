"""The framework-free half of checkpoints (polyparallel/_checkpoints.py): what Strategy.save/load
accept, the commit marker and atomic publication, file checks, JSON values, exact-resumption
checks and latest_checkpoint. No runtime is needed: a recording plugin answers the hooks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import polyparallel as pp
from polyparallel import _checkpoints


class Saver:
    """A runtime-free plugin writing checkpoints the way every runtime must (staging, marker, publish)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, Any]] = []

    @pp.hookimpl
    def polyparallel_save_checkpoint(self, strategy, session, path, state):
        staging = _checkpoints.staging_path(path, "t0")
        os.makedirs(staging)
        Path(staging, "weights.bin").write_bytes(b"x" * 10)
        meta = _checkpoints.base_metadata(strategy, session, state.get("framework"))
        meta["extras"] = _checkpoints.split({k: v for k, v in state.items() if k != "framework"}, lambda v: False, "extras")[0]
        _checkpoints.write_marker(staging, meta)
        _checkpoints.publish(staging, path)
        return path

    @pp.hookimpl
    def polyparallel_load_checkpoint(self, strategy, session, path, state):
        meta = _checkpoints.read_marker(path)
        _checkpoints.verify_files(path, meta)
        self.loaded.append(state)
        return {"epoch": None, "step": None, "global_step": None, **_checkpoints.join(meta["extras"], {})}


@pytest.fixture
def strategy(manager):
    manager.register(Saver(), name="saver")
    return pp.Strategy(data=1, plugin_manager=manager)


def test_extras_round_trip_as_json_with_tuples(strategy, tmp_path):
    path = strategy.save(tmp_path / "step-1", lr=0.1, betas=(0.9, 0.99), names=["a", None], nested={"k": {"n": 1}},
                         flag=True, framework="mine")
    assert path == str(tmp_path / "step-1")
    meta = _checkpoints.read_marker(path)
    assert meta["framework"] == "mine" and meta["topology"] == {"pipeline": 1, "data": 1, "tensor": 1}
    assert meta["files"] == {"weights.bin": 10}
    assert strategy.load(path) == {"epoch": None, "step": None, "global_step": None, "lr": 0.1, "betas": (0.9, 0.99),
                                   "names": ["a", None], "nested": {"k": {"n": 1}}, "flag": True}


def test_a_save_replaces_an_earlier_checkpoint_and_clears_dead_staging_dirs(strategy, tmp_path):
    dead = tmp_path / "step-1.partial-dead"  # a save killed earlier
    dead.mkdir()
    strategy.save(tmp_path / "step-1", v=1)
    strategy.save(tmp_path / "step-1", v=2)
    assert strategy.load(tmp_path / "step-1")["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


@pytest.mark.parametrize(("state", "error", "message"), [
    ({"epoch": 1}, TypeError, "'epoch' is not a name an extra may take"),
    ({"cb": object()}, TypeError, "never arbitrary"),
    ({"deep": {"k": [1, {2}]}}, TypeError, r"the extra 'deep'\['k'\]\[1\] is a builtins.set"),
    ({"d": {1: 2}}, TypeError, "dict keys must be strings"),
    ({"framework": 3}, TypeError, "framework= names the framework"),
])
def test_save_refuses_what_a_checkpoint_cannot_hold(strategy, tmp_path, state, error, message):
    with pytest.raises(error, match=message):
        strategy.save(tmp_path / "c", **state)
    assert not os.path.exists(tmp_path / "c")


def test_save_never_replaces_something_that_is_not_a_checkpoint(strategy, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("keep")
    with pytest.raises(pp.CheckpointError, match="exists and is not a polyparallel checkpoint"):
        strategy.save(tmp_path / "c", v=1)
    assert (tmp_path / "c" / "mine.txt").read_text() == "keep"


def test_load_refuses_uncommitted_corrupt_truncated_and_other_runtimes(strategy, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        strategy.load(tmp_path / "none")
    (tmp_path / "half").mkdir()
    with pytest.raises(pp.CheckpointError, match="not a committed polyparallel checkpoint"):
        strategy.load(tmp_path / "half")
    with pytest.raises(TypeError, match="come back in the dict it returns"):
        strategy.load(tmp_path / "half", lr=0.1)
    path = strategy.save(tmp_path / "step-1", v=1)
    Path(path, "weights.bin").write_bytes(b"x" * 4)
    with pytest.raises(pp.CheckpointError, match="weights.bin has 4 bytes, 10 when it was committed"):
        strategy.load(path)
    os.remove(Path(path, "weights.bin"))
    with pytest.raises(pp.CheckpointError, match="weights.bin is missing"):
        strategy.load(path)
    Path(path, _checkpoints.MARKER).write_text("{not json")
    with pytest.raises(pp.CheckpointError, match="is corrupt"):
        strategy.load(path)
    path = strategy.save(tmp_path / "step-2", v=1)
    meta = json.loads(Path(path, _checkpoints.MARKER).read_text())
    Path(path, _checkpoints.MARKER).write_text(json.dumps({**meta, "runtime": "jax"}))
    with pytest.raises(pp.CheckpointError, match="written by the 'jax' runtime"):
        strategy.load(path)


def test_a_folder_of_checkpoints_points_to_latest_checkpoint(strategy, tmp_path):
    assert pp.latest_checkpoint(tmp_path / "nothing") is None
    strategy.save(tmp_path / "step-2", v=2)
    strategy.save(tmp_path / "step-10", v=10)
    (tmp_path / "step-12.partial-abc").mkdir()  # half-written: skipped
    (tmp_path / "step-11").mkdir()  # no marker: skipped
    assert pp.latest_checkpoint(tmp_path) == str(tmp_path / "step-10")  # newest committed, not by name
    listed = _checkpoints.list_checkpoints(tmp_path)
    assert [(c["name"], c["committed"]) for c in listed] == [
        ("step-11", False), ("step-12.partial-abc", False), ("step-2", True), ("step-10", True)]
    with pytest.raises(pp.CheckpointError, match="It holds checkpoints: load polyparallel.latest_checkpoint"):
        strategy.load(tmp_path)


def test_exact_resumption_names_both_global_batches():
    saved = {"global_batch": 8, "dataset_len": 48, "seed": 0, "shuffle": True, "remainder": "pad"}
    _checkpoints.check_loader_resume("p", saved, dict(saved))
    with pytest.raises(pp.CheckpointError, match="global batch size 8, this loader has 16"):
        _checkpoints.check_loader_resume("p", saved, {**saved, "global_batch": 16})
    with pytest.raises(pp.CheckpointError, match="Strategy seed 0, this loader has 1"):
        _checkpoints.check_loader_resume("p", saved, {**saved, "seed": 1})


def test_split_and_join_keep_tensors_out_of_the_json():
    class T:  # stands for a runtime's tensor
        pass

    t = T()
    value, tensors = _checkpoints.split({"a": [t, (1, t)], "b": 2.5}, lambda v: isinstance(v, T), "extras")
    assert tensors == {"extras.a.0": t, "extras.a.1.1": t}
    assert json.loads(_checkpoints.dumps(value)) == value
    assert _checkpoints.tensor_refs(value) == ["extras.a.0", "extras.a.1.1"]
    assert _checkpoints.join(value, tensors) == {"a": [t, (1, t)], "b": 2.5}


def test_a_save_killed_between_its_renames_leaves_the_old_checkpoint_loadable(strategy, tmp_path):
    path = strategy.save(tmp_path / "step-5", v=1)
    os.rename(path, path + ".old-abc")  # what publish leaves when killed after moving the old one aside
    assert pp.latest_checkpoint(tmp_path) == path + ".old-abc"
    assert [c["name"] for c in _checkpoints.list_checkpoints(tmp_path)] == ["step-5.old-abc"]
    assert strategy.load(path)["v"] == 1
    strategy.save(path, v=2)  # publishes at path and clears the aside
    assert sorted(os.listdir(tmp_path)) == ["step-5"] and strategy.load(path)["v"] == 2
    # An aside whose removal failed (here: one named like the session's staging token) never blocks a save.
    os.makedirs(os.path.join(path + ".old-t0", "left"))
    strategy.save(path, v=3)
    assert strategy.load(path)["v"] == 3 and pp.latest_checkpoint(tmp_path) == path
