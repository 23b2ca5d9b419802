"""``polyparallel checkpoint export``'s framework-free half (polyparallel/_checkpoint_export.py):
the safetensors layout, the refusals. The torch plugin's export (and a read with the safetensors
package itself) is tested in tests/torch_plugin/test_checkpoint_export.py."""

from __future__ import annotations

import json
import struct

import pytest
from click.testing import CliRunner

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel import cli as cli_module
from polyparallel._checkpoint_export import export, write_safetensors

from .test_checkpoint_info import _write


def test_write_safetensors_lays_out_header_and_data(tmp_path):
    out = write_safetensors(str(tmp_path / "w.safetensors"),
                            [("a", "float32", [2], struct.pack("<2f", 1.0, 2.0)), ("b", "uint8", [3], b"\x01\x02\x03")],
                            {"k": "v"})
    blob = open(out, "rb").read()
    (size,) = struct.unpack("<Q", blob[:8])
    assert size % 8 == 0
    header = json.loads(blob[8:8 + size])
    assert header["a"] == {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    assert header["b"] == {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}
    assert header["__metadata__"] == {"k": "v"}
    assert blob[8 + size:] == struct.pack("<2f", 1.0, 2.0) + b"\x01\x02\x03"
    with pytest.raises(pp.CheckpointError, match="complex64, which safetensors has no type for"):
        write_safetensors(str(tmp_path / "x"), [("c", "complex64", [1], b"\x00" * 8)])


def test_export_without_a_plugin_for_the_runtime_names_it(tmp_path):
    path = str(tmp_path / "c")
    _write(path, runtime="mine")
    with pytest.raises(pp.CheckpointError, match=r"no installed plugin exports checkpoints of the 'mine' runtime"):
        export(path, "torch", plugin_manager=pp.PluginManager(autoload=False))
    result = CliRunner().invoke(cli_module.cli, ["checkpoint", "export", str(tmp_path / "c.partial-1"), "--to", "torch"])
    assert result.exit_code == 2  # no such directory
    (tmp_path / "c.partial-1").mkdir()
    _checkpoints.write_marker(str(tmp_path / "c.partial-1"), _checkpoints.read_marker(path))
    result = CliRunner().invoke(cli_module.cli, ["checkpoint", "export", str(tmp_path / "c.partial-1"), "--to", "torch"])
    assert result.exit_code == 1 and "never published" in result.output
