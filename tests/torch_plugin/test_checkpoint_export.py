"""``polyparallel checkpoint export`` of torch checkpoints (plugins/polyparallel_torch/checkpoint_export.py
and polyparallel/_checkpoint_export.py): one consolidated file, loaded back with plain
``torch.load(weights_only=True)`` and with the ``safetensors`` package's own reader. A checkpoint
written at data=2 x tensor=2 is exported in tests/torch_plugin/test_checkpoint.py's round trip."""

import os

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import polyparallel as pp
from polyparallel import cli as cli_module


def _export(*args: str):
    return CliRunner().invoke(cli_module.cli, ["checkpoint", "export", *args], prog_name="polyparallel")


def _saved(tmp_path):
    one = pp.Strategy(data=1, batch_size=4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).to(torch.bfloat16))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model[0](torch.randn(2, 8)).sum().backward()
    opt.step()
    return one.save(str(tmp_path / "step-1"), model=model, optimizer=opt, best=0.5), model, opt


def test_export_to_torch_loads_without_polyparallel(tmp_path):
    path, model, opt = _saved(tmp_path)
    result = _export(path, "--to", "torch")
    assert result.exit_code == 0, result.output
    exported = torch.load(path + ".pt", weights_only=True)
    assert sorted(exported["model"]) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(exported["model"][name], value, rtol=0, atol=0, msg=name)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).to(torch.bfloat16))
    fresh.load_state_dict(exported["model"])
    torch.testing.assert_close(exported["optimizer"]["state.0.weight.exp_avg"], opt.state[model[0].weight]["exp_avg"])
    assert exported["optimizer"]["param_groups.0.weight.lr"] == 0.01
    assert exported["extras"] == {"best": 0.5} and exported["polyparallel"]["topology"]["data"] == 1


def test_export_to_safetensors_reads_with_the_safetensors_package(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    path, model, _ = _saved(tmp_path)
    out = str(tmp_path / "weights.safetensors")
    result = _export(path, "--to", "safetensors", "-o", out)
    assert result.exit_code == 0, result.output
    loaded = safetensors.load_file(out)
    assert sorted(loaded) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        assert loaded[name].dtype == value.dtype
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    from safetensors import safe_open

    with safe_open(out, framework="pt") as f:
        assert '"framework": "torch"' in f.metadata()["polyparallel"]


def test_export_refuses_a_checkpoint_whose_files_do_not_verify(tmp_path):
    path, _, _ = _saved(tmp_path)
    shard = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, shard)) // 2)
        f.write(b"\x00\x01")
    result = _export(path, "--to", "torch")
    assert result.exit_code == 1 and f"{shard} is not the file this checkpoint wrote" in result.output
    assert not os.path.exists(path + ".pt")
