"""``polyparallel.CheckpointManager`` and ``_checkpoints.prune`` (framework-free): numbered
checkpoints in one folder, the newest ``keep`` kept, dead staging directories removed but never
one of a save in progress, the newest restored. A runtime-free plugin writes the checkpoints."""

from __future__ import annotations

import os
import time

import pytest

import polyparallel as pp
from polyparallel import _checkpoints

from .test_checkpoints import Saver


@pytest.fixture
def strategy(manager):
    manager.register(Saver(), name="saver")
    return pp.Strategy(data=1, plugin_manager=manager)


def test_the_manager_keeps_the_newest_and_restores_the_latest(strategy, tmp_path):
    manager = pp.CheckpointManager(strategy, tmp_path / "ckpts", keep=2)
    assert manager.restore() is None  # nothing yet: a fresh start
    for step in (10, 20, 30):
        assert manager.save(step, v=step) == str(tmp_path / "ckpts" / f"step-{step:08d}")
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step-00000020", "step-00000030"]
    assert manager.latest() == str(tmp_path / "ckpts" / "step-00000030")
    assert manager.restore()["v"] == 30
    assert manager.checkpoints() == [str(tmp_path / "ckpts" / "step-00000020"), manager.latest()]
    # A future of a synchronous runtime is a finished one: the asynchronous manager works alike.
    later = pp.CheckpointManager(strategy, tmp_path / "ckpts", keep=1, asynchronous=True)
    assert later.save(40, v=40).result() == str(tmp_path / "ckpts" / "step-00000040")
    assert later.wait() == str(tmp_path / "ckpts" / "step-00000040")
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step-00000040"]


def test_prune_removes_dead_staging_directories_but_never_a_save_in_progress(strategy, tmp_path):
    dead = tmp_path / "step-00000005.partial-dead"
    dead.mkdir()
    past = time.time() - 3600
    os.utime(dead, (past, past))  # a save killed an hour ago
    strategy.save(tmp_path / "step-00000010", v=1)
    in_progress = tmp_path / "step-00000020.partial-live"  # made after the newest commit
    in_progress.mkdir()
    removed = _checkpoints.prune(tmp_path, keep=1, pattern="step-*")
    assert removed == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000020.partial-live"]
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    assert _checkpoints.prune(tmp_path, keep=1, pattern="*") == []
    assert (tmp_path / "notes").is_dir()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keep": 0}, r"keep=\) takes an int >= 1 or None"),
    ({"name": "ckpt"}, r"must hold the field \{step\} once"),
    ({"name": "{epoch}-{step}"}, r"must hold the field \{step\} once"),
])
def test_bad_manager_options_are_refused(strategy, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pp.CheckpointManager(strategy, tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"step must be an int >= 0"):
        pp.CheckpointManager(strategy, tmp_path).save(-1)
