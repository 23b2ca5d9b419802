"""``polyparallel checkpoint inspect`` (polyparallel/_checkpoint_info.py), framework-free: a
checkpoint's metadata, a folder of checkpoints, a half-written one (exit code 1). The tensor
listing of a torch checkpoint is tested in tests/torch_plugin/test_checkpoint.py."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel import cli as cli_module


def _write(path: str, **fields) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "weights.bin"), "wb") as f:
        f.write(b"x" * 2048)
    strategy = pp.Strategy(data=1, plugin_manager=pp.PluginManager(autoload=False))
    meta = {**_checkpoints.base_metadata(strategy, strategy.session(), "lightning"), **fields}
    _checkpoints.write_marker(path, meta)


def _inspect(*args: str):
    return CliRunner().invoke(cli_module.cli, ["checkpoint", "inspect", *args], prog_name="polyparallel")


def test_inspect_prints_topology_progress_and_files(tmp_path):
    path = str(tmp_path / "step-8")
    _write(path, topology={"pipeline": 1, "data": 2, "tensor": 2}, world_size=4,
           contents={"model": True, "optimizer": True, "loader": True, "extras": ["best"]},
           progress={"epoch": 1, "step": 2, "global_step": 8},
           loader={"global_batch": 8, "dataset_len": 48, "seed": 0, "shuffle": True})
    result = _inspect(path)
    assert result.exit_code == 0, result.output
    assert "written at data=2 x tensor=2 (world size 4, zero=0)" in result.output
    assert "framework lightning" in result.output
    assert "holds: model, optimizer, loader; extras: best" in result.output
    assert "progress: epoch 1, 2 batch(es) of it consumed, global step 8; global batch 8, 48 samples" in result.output
    assert "files: 1, 2.0 KiB" in result.output
    as_json = json.loads(_inspect(path, "--json").output)
    assert as_json["kind"] == "checkpoint" and as_json["progress"]["global_step"] == 8


def test_inspect_a_folder_and_a_half_written_checkpoint(tmp_path):
    _write(str(tmp_path / "step-4"), progress={"epoch": 0, "step": 4, "global_step": 4})
    (tmp_path / "step-8.partial-1f").mkdir()
    result = _inspect(str(tmp_path))
    assert result.exit_code == 0, result.output
    assert f"latest committed: {tmp_path / 'step-4'}" in result.output
    lines = result.output.splitlines()
    assert any("step-4" in line and "committed" in line and "epoch 0 step 4" in line for line in lines)
    assert any("step-8.partial-1f" in line and "NOT COMMITTED" in line for line in lines)
    result = _inspect(str(tmp_path / "step-8.partial-1f"))
    assert result.exit_code == 1 and "NOT COMMITTED" in result.output


def test_inspect_reports_a_truncated_file(tmp_path):
    path = str(tmp_path / "c")
    _write(path)
    with open(os.path.join(path, "weights.bin"), "wb") as f:
        f.write(b"x")
    result = _inspect(path)
    assert result.exit_code == 1 and "PROBLEM" in result.output and "weights.bin has 1 bytes" in result.output


def test_inspect_lists_the_arrays_a_runtime_recorded_in_its_marker(tmp_path):
    # The JAX runtime writes name/shape/dtype of every array into the marker (orbax's own index
    # needs JAX to read): inspect lists them without importing any framework.
    path = str(tmp_path / "jax-ckpt")
    _write(path, runtime="jax", tensors="orbax-checkpoint",
           arrays=[{"name": "params.dense.kernel", "shape": [4, 8], "dtype": "float32"}])
    as_json = json.loads(_inspect(path, "--json").output)
    assert as_json["tensors"] == [{"name": "params.dense.kernel", "shape": [4, 8], "dtype": "float32"}]
    assert "params.dense.kernel" in _inspect(path).output


def test_a_staging_directory_is_never_called_committed_even_with_a_marker(tmp_path):
    # A save that died after its marker was written but before the rename leaves a staging
    # directory holding the marker: it was never published, so it is not a checkpoint.
    path = str(tmp_path / "step-8.partial-1f")
    _write(path)
    result = _inspect(path)
    assert result.exit_code == 1, result.output
    assert "NOT COMMITTED" in result.output and "committed 20" not in result.output
    assert "never published" in result.output


def test_inspect_refuses_flipped_bytes_and_a_file_of_another_checkpoint(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    _write(first)
    _write(second)
    with open(os.path.join(second, "weights.bin"), "r+b") as f:  # same size, other content
        f.write(b"y")
    with open(os.path.join(second, "weights.bin"), "rb") as f:
        other = f.read()
    with open(os.path.join(first, "weights.bin"), "wb") as f:  # a shard of another checkpoint copied over
        f.write(other)
    result = _inspect(first)
    assert result.exit_code == 1, result.output
    assert "PROBLEM" in result.output and "weights.bin" in result.output and "SHA-256" in result.output
    assert _inspect(first, "--no-verify").exit_code == 0  # sizes only, as asked
