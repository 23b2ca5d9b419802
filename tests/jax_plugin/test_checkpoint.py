"""polyparallel_jax.checkpoint and .saving: orbax checkpoints resharded to the reading mesh, the
atomic commit, refusals before anything is restored, exact mid-epoch resumption of Model.fit."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import polyparallel as pp
from polyparallel import _checkpoints as core
from polyparallel_jax import Model, saving
from polyparallel_jax.conformance import dataset, small_mlp

BATCHES = 7  # 200 samples, global batch 32: 7 batches an epoch


def _model(seed: int = 0, **kwargs) -> Model:
    return Model(small_mlp(seed=seed, **kwargs), optimizer=optax.adam(1e-2), metrics=["accuracy"])


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def _assert_close(a, b, atol: float) -> None:
    left, right = _host(a), _host(b)
    assert len(left) == len(right) and left
    for x, y in zip(left, right):
        np.testing.assert_allclose(x, y, atol=atol)


def _everything(model: Model):
    return nnx.state(model.module), model._opt_state


def test_written_at_data4_tensor2_loads_at_data8_and_on_one_device(jax_strategy, tmp_path):
    x, y = dataset(200)
    written = _model()
    written.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=4, tensor=2), verbose=0)
    kernel = nnx.state(written.module, nnx.Param)["l1"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")  # really split when written
    path = written.save(str(tmp_path / "ckpt"), note="first")

    meta = core.read_marker(path)
    assert (meta["runtime"], meta["framework"], meta["topology"]) == ("jax", "flax", {"pipeline": 1, "data": 4, "tensor": 2})
    assert (meta["epoch"], meta["step"], meta["global_step"], meta["global_batch"]) == (1, 0, BATCHES, 32)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the staging directory was renamed

    read = _model(seed=5)  # other initial values: everything must come from the checkpoint
    assert read.load(path, strategy=jax_strategy(data=8)) == {"epoch": 1, "step": 0, "global_step": BATCHES, "note": "first"}
    _assert_close(_everything(read), _everything(written), atol=1e-6)  # params, BatchNorm stats, RNG, Adam moments
    for leaf in jax.tree.leaves(_everything(read)):
        assert dict(leaf.sharding.mesh.shape) == {"pipeline": 1, "data": 8, "tensor": 1}  # read into the data=8 mesh

    single = _model(seed=6)
    single.load(path)  # no strategy: one device
    _assert_close(_everything(single), _everything(written), atol=1e-6)
    assert {d for leaf in jax.tree.leaves(_everything(single)) for d in leaf.devices()} == {jax.devices()[0]}

    # Training continues from the restored Adam state identically at both topologies.
    written.fit(x, y, epochs=1, batch_size=32, verbose=0)
    read.fit(x, y, epochs=1, batch_size=32, verbose=0)
    _assert_close(nnx.state(read.module, nnx.Param), nnx.state(written.module, nnx.Param), atol=1e-5)


def test_local_batch_stats_loaded_under_another_strategy_start_like_a_refit(jax_strategy, tmp_path):
    # A checkpoint holds the average of the per-device statistics; loaded under data=4 x tensor=2,
    # every device starts from it, exactly as the Model that wrote it does when it is refitted there.
    x, y = dataset(200)
    local = {"batch_stats*": "local"}
    written = _model()
    written.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=8, state_policy=local), verbose=0)
    path = written.save(str(tmp_path / "ckpt"))
    read = _model(seed=5)
    read.load(path, strategy=jax_strategy(data=4, tensor=2, state_policy=local))
    assert read.batch_stats_per_device is None  # per-device copies start at the next fit
    for model in (written, read):
        model.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=4, tensor=2, state_policy=local), verbose=0)
    assert np.asarray(read.batch_stats_per_device["bn"]["mean"][...]).shape[0] == 4
    _assert_close(read.batch_stats_per_device, written.batch_stats_per_device, atol=1e-6)
    _assert_close(_everything(read), _everything(written), atol=1e-6)


class _Killed(Exception):
    """Stands for the job dying right after a checkpoint was committed."""


class _Died(BaseException):
    """Stands for the job being killed in the middle of a save (no error handling runs)."""


@pytest.mark.parametrize(("first", "resumed_at"), [
    (dict(data=4, tensor=2), dict(data=4, tensor=2)), (dict(data=4, tensor=2), dict(data=8)),
    (dict(data=2, tensor=4, accumulate=2), dict(data=8)), (dict(data=8), dict(data=4, tensor=2, accumulate=4)),
], ids=["same", "data=8", "accumulate=2-then-data=8", "data=8-then-accumulate=4"])
def test_fit_resumed_mid_epoch_ends_with_the_uninterrupted_parameters(jax_strategy, tmp_path, monkeypatch, first,
                                                                      resumed_at):
    # A step is a global batch whatever the accumulation, so a run resumes under another one;
    # without BatchNorm there (its statistics are per micro-batch), exactly.
    options = {"batch_norm": False} if "accumulate" in first or "accumulate" in resumed_at else {}
    x, y = dataset(200)
    reference = _model(**options)
    reference.fit(x, y, epochs=2, batch_size=32, strategy=jax_strategy(**first), verbose=0)

    save = saving.fit_checkpoint

    def dies_at_step_10(model, directory, global_step):
        save(model, directory, global_step)
        if global_step == 10:  # epoch 1, after its 3rd batch
            raise _Killed

    monkeypatch.setattr(saving, "fit_checkpoint", dies_at_step_10)
    with pytest.raises(_Killed):
        _model(**options).fit(x, y, epochs=2, batch_size=32, strategy=jax_strategy(**first), verbose=0,
                              checkpoint=str(tmp_path), checkpoint_every=5)
    monkeypatch.undo()
    newest = pp.latest_checkpoint(str(tmp_path))
    assert os.path.basename(newest) == "step-00000010"
    assert (core.read_marker(newest)["epoch"], core.read_marker(newest)["step"]) == (1, 3)

    resumed = _model(seed=9, **options)
    history = resumed.fit(x, y, epochs=2, batch_size=32, strategy=jax_strategy(**resumed_at), verbose=0,
                          checkpoint=str(tmp_path), checkpoint_every=5, resume=True)
    _assert_close(nnx.state(resumed.module), nnx.state(reference.module), atol=1e-5)
    _assert_close(resumed._opt_state, reference._opt_state, atol=1e-5)
    for name, values in reference.history.items():  # the interrupted epoch's metrics include its first batches
        np.testing.assert_allclose(history[name], values, atol=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000014"]  # the two newest kept


def test_resume_true_without_a_checkpoint_starts_from_scratch(jax_strategy, tmp_path):
    x, y = dataset(64)
    fresh, resumed = _model(), _model()
    fresh.fit(x, y, epochs=1, batch_size=16, strategy=jax_strategy(data=8), verbose=0)
    resumed.fit(x, y, epochs=1, batch_size=16, strategy=jax_strategy(data=8), verbose=0,
                checkpoint=str(tmp_path / "ckpts"), resume=True)
    _assert_close(nnx.state(resumed.module, nnx.Param), nnx.state(fresh.module, nnx.Param), atol=0)
    assert pp.latest_checkpoint(str(tmp_path / "ckpts")).endswith("step-00000004")


# -- refusals --------------------------------------------------------------------------------------


@pytest.fixture
def saved(jax_strategy, tmp_path):
    """A checkpoint of a small_mlp trained one epoch with Adam at data=8, written by fit."""
    x, y = dataset(200)
    _model().fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=8), verbose=0, checkpoint=str(tmp_path))
    return pp.latest_checkpoint(str(tmp_path))


@pytest.mark.parametrize("other, message", [
    (lambda: _model(hidden=8), r"module/params/l1/kernel has shape \(12, 16\) in the checkpoint but \(12, 8\) here"),
    (lambda: _model(batch_norm=False), r"unexpected module/batch_stats/bn/mean, module/batch_stats/bn/var, "
                                       r"module/params/bn/bias"),
    (lambda: Model(small_mlp(), optimizer=optax.sgd(0.1, momentum=0.9)), r"missing optimizer/0/trace/bn/bias.*"
                                                                          r"unexpected optimizer/0/count"),
], ids=["shape", "unexpected", "optimizer"])
def test_another_model_is_refused_naming_the_leaf_before_anything_is_restored(saved, jax_strategy, other, message):
    model = other()
    before = _host(nnx.state(model.module))
    with pytest.raises(pp.CheckpointError, match=message):
        model.load(saved, strategy=jax_strategy(data=8))
    for a, b in zip(_host(nnx.state(model.module)), before):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_killed_before_its_commit_is_never_loaded(saved, jax_strategy, tmp_path, monkeypatch):
    model = _model()
    model.load(saved)

    def killed(directory, metadata):  # the job dies after the arrays, before the marker
        raise _Died  # not an error the save handles: nothing is cleaned up, as when killed

    monkeypatch.setattr(core, "write_marker", killed)
    with pytest.raises(_Died):
        model.save(str(tmp_path / "step-00000099"))
    monkeypatch.undo()
    staging = [n for n in os.listdir(tmp_path) if n.startswith("step-00000099.partial-")]
    assert len(staging) == 1 and os.path.isdir(tmp_path / staging[0] / "state")  # orbax had written its arrays
    assert pp.latest_checkpoint(str(tmp_path)) == saved  # skipped by the resume path
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        model.load(str(tmp_path / "step-00000099"))
    os.rename(tmp_path / staging[0], tmp_path / "copied")  # e.g. copied by hand without a marker
    with pytest.raises(pp.CheckpointError, match="not a committed polyparallel checkpoint: it has no "
                                                 "polyparallel-checkpoint.json"):
        model.load(str(tmp_path / "copied"))


def test_truncated_file_and_other_runtime_are_refused(saved, tmp_path):
    meta = core.read_marker(saved)
    name = max(meta["files"], key=meta["files"].get)  # the largest array file
    with open(os.path.join(saved, name), "r+b") as f:
        f.truncate(meta["files"][name] // 2)
    with pytest.raises(pp.CheckpointError, match=rf"is corrupt: {name} has .* bytes"):
        _model().load(saved)
    torch_like = tmp_path / "torch"
    torch_like.mkdir()
    core.write_marker(str(torch_like), {**meta, "runtime": "torch"})
    with pytest.raises(pp.CheckpointError, match=r"written by the 'torch' runtime, not by JAX"):
        _model().load(str(torch_like))


def test_resuming_with_another_global_batch_is_refused_before_restoring(saved, jax_strategy):
    x, y = dataset(200)
    model = _model(seed=3)
    before = _host(nnx.state(model.module, nnx.Param))
    with pytest.raises(pp.CheckpointError, match=r"global batch size 32, this loader has 64"):
        model.fit(x, y, epochs=2, batch_size=64, strategy=jax_strategy(data=8), verbose=0, resume=saved)
    for a, b in zip(_host(nnx.state(model.module, nnx.Param)), before):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"resume=True\) resumes from the newest checkpoint in checkpoint=DIR"):
        model.fit(x, y, batch_size=32, resume=True)
    with pytest.raises(ValueError, match="checkpoint_every= saves into checkpoint=DIR"):
        model.fit(x, y, batch_size=32, checkpoint_every=3)


def test_extras_must_be_json_or_arrays(saved):
    model = _model()
    model.load(saved)
    with pytest.raises(TypeError, match=r"the extra 'bad' is a builtins.object.*never arbitrary \(pickled\) objects"):
        model.save(saved, bad=object())
    assert core.read_marker(saved)["extras"] == {}  # the refused save left the checkpoint as it was


def test_old_msgpack_files_still_load(jax_strategy, tmp_path):
    # A file exactly as the msgpack Model.save wrote it (module pure dict, optimizer leaves in order).
    x, y = dataset(200)
    written = _model()
    written.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=8), verbose=0)
    state = nnx.to_pure_dict(nnx.state(written.module, (nnx.Param, nnx.BatchStat)))
    blob = {"module": state, "opt_state": {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(written._opt_state))}}
    path = tmp_path / "model.msgpack"
    path.write_bytes(serialization.msgpack_serialize(jax.tree.map(np.asarray, blob)))
    read = _model(seed=4)
    assert read.load(str(path)) == {"epoch": None, "step": None, "global_step": None}
    read.fit(x, y, epochs=1, batch_size=32, strategy=jax_strategy(data=8), verbose=0)  # Adam state placed on first fit
    written.fit(x, y, epochs=1, batch_size=32, verbose=0)
    _assert_close(nnx.state(read.module, nnx.Param), nnx.state(written.module, nnx.Param), atol=1e-5)


@pytest.mark.parametrize("content, message", [
    (b"not a checkpoint\n", r"is a file that is not msgpack \(ExtraData: .*\); Model.load\(\) reads a checkpoint "
                             r"directory written by Model.save\(\), or a flax msgpack file"),
    (b"", r"is a file that is not msgpack \(ValueError: .*\); Model.load\(\) reads a checkpoint directory"),
    (serialization.msgpack_serialize([1, 2, 3]), r"is msgpack but holds no 'module' state; Model.load\(\) reads"),
], ids=["text", "empty", "msgpack-list"])
def test_a_file_that_is_no_model_msgpack_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "model.ckpt"
    path.write_bytes(content)
    model = _model()
    before = _host(nnx.state(model.module))
    with pytest.raises(pp.CheckpointError, match=re.escape(repr(str(path))) + " " + message):
        model.load(str(path))
    _assert_close(nnx.state(model.module), before, atol=0)


def test_another_models_msgpack_file_is_refused_naming_the_leaf(tmp_path):
    other = _model(hidden=8)
    blob = {"module": nnx.to_pure_dict(nnx.state(other.module, (nnx.Param, nnx.BatchStat)))}
    path = tmp_path / "model.msgpack"
    path.write_bytes(serialization.msgpack_serialize(jax.tree.map(np.asarray, blob)))
    model = _model()
    before = _host(nnx.state(model.module))
    with pytest.raises(pp.CheckpointError, match=r"module/l1/kernel has shape \(12, 8\) in the checkpoint but "
                                                 r"\(12, 16\) here.*Nothing was restored"):
        model.load(str(path))
    _assert_close(nnx.state(model.module), before, atol=0)


def test_metadata_is_json_the_cli_can_show(saved):
    with open(os.path.join(saved, core.MARKER)) as f:
        meta = json.load(f)
    assert meta["format"] == "polyparallel-checkpoint" and meta["loader"]["dataset_len"] == 200
    assert meta["fit"]["history"]["loss"] and meta["files"]
    assert meta["progress"] == {"epoch": 1, "step": 0, "global_step": BATCHES}
    assert meta["contents"] == {"model": True, "optimizer": True, "loader": True, "extras": []}
    arrays = {a["name"]: (a["shape"], a["dtype"]) for a in meta["arrays"]}
    assert arrays["module/params/l1/kernel"] == ([12, 16], "float32")
    assert arrays["optimizer/0/mu/l1/kernel"] == ([12, 16], "float32")
    assert arrays["module/batch_stats/bn/mean"] == ([16], "float32")


def _commit_fails_on_process_0(directory: str) -> str:
    """Both processes save one replicated array; process 0's marker write fails (a full disk)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from polyparallel_jax import checkpoint

    if jax.process_index() == 0:
        def full(staging, metadata):
            raise OSError(28, "No space left on device")

        core.write_marker = full  # this process only: the commit of process 0 fails
    mesh = Mesh(np.array(jax.devices()), ("data",))
    array = jax.device_put(np.arange(4.0), NamedSharding(mesh, PartitionSpec()))
    try:
        checkpoint.write(os.path.join(directory, "step-1"), {"w": array}, {"epoch": 0})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_commit_failing_on_process_0_fails_every_process_without_waiting(tmp_path, monkeypatch):
    from pathlib import Path

    from polyparallel_jax.launch import launch_processes

    tests = str(Path(__file__).parents[1])  # the processes import this module as jax_plugin.test_checkpoint
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
    trace = tmp_path.parent / f"{tmp_path.name}-trace"
    first, second = launch_processes(_commit_fails_on_process_0, 2, args=(str(tmp_path),), timeout=120,
                                     trace_dir=str(trace))
    # The same error in both processes, naming the path, the process and the operating system's error.
    assert first == second, (first, second)
    assert first.startswith("CheckpointError") and "committing it failed on process 0" in first, first
    assert "[Errno 28] No space left on device" in first and str(tmp_path / "step-1") in first, first
    assert os.listdir(tmp_path) == [], "neither the checkpoint nor its staging directory is left"
    # The save's agreements between processes are bounded and recorded in each process's trace.
    from polyparallel import _trace_report

    for recorded in _trace_report.read_dir(str(trace)).values():
        assert [(e["operation"], e["axis"], e["state"]) for e in recorded["entries"]] == [
            ("save_checkpoint (staging name)", "world", "done"), ("save_checkpoint (shards written)", "world", "done"),
            ("save_checkpoint (commit outcome)", "world", "done")]


def test_a_full_disk_fails_the_save_alike_and_keeps_the_previous_checkpoint(saved, tmp_path):
    # In a subprocess: a file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG, as
    # a full disk fails them with ENOSPC) must not hit the test runner's own files.
    import subprocess
    import sys
    import textwrap

    target = str(tmp_path / "step-00000099")
    script = textwrap.dedent(f"""
        import resource, signal
        import optax
        from polyparallel_jax import Model
        from polyparallel_jax.conformance import small_mlp
        model = Model(small_mlp(seed=0), optimizer=optax.adam(1e-2), metrics=["accuracy"])
        model.load({saved!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            model.save({target!r})
            print("OUTCOME saved")
        except Exception as exc:
            print("OUTCOME", type(exc).__name__, exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    outcome = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME")]
    assert outcome and outcome[0].startswith("OUTCOME CheckpointError"), done.stdout[-2000:] + done.stderr[-3000:]
    assert f"'{target}': writing its arrays failed on process 0" in outcome[0], outcome[0]
    assert "Nothing was published" in outcome[0] and "File too large" in outcome[0], outcome[0]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("step-00000099")], os.listdir(tmp_path)
    assert pp.latest_checkpoint(str(tmp_path)) == saved


def test_a_manager_keeps_the_newest_jax_checkpoints_and_partial_loads_are_refused(saved, jax_strategy, tmp_path):
    strategy = jax_strategy(data=8)
    model = _model()
    model.load(saved, strategy=strategy)
    manager = pp.CheckpointManager(strategy, tmp_path / "managed", keep=2)
    for step in (1, 2, 3):
        manager.save(step, model=model, note=step)
    assert sorted(os.listdir(tmp_path / "managed")) == ["step-00000002", "step-00000003"]
    meta = core.read_marker(manager.latest())
    assert meta["version"] == core.VERSION and meta["id"] and set(meta["sha256"]) == set(meta["files"])
    fresh = _model(seed=2)
    assert manager.restore(model=fresh)["note"] == 3
    _assert_close(nnx.state(fresh.module, nnx.Param), nnx.state(model.module, nnx.Param), atol=0)
    # A flipped byte in an array file is refused, naming it.
    name = max(meta["files"], key=meta["files"].get)
    with open(os.path.join(manager.latest(), name), "r+b") as f:
        f.seek(meta["files"][name] // 2)
        byte = f.read(1)
        f.seek(meta["files"][name] // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(pp.CheckpointError, match=rf"{name} is not the file this checkpoint wrote"):
        _model().load(manager.latest(), strategy=strategy)
    with pytest.raises(pp.CheckpointError, match=r"the JAX runtime loads whole models only"):
        strategy.load(str(tmp_path / "managed" / "step-00000002"), model=_model(), strict=False)
