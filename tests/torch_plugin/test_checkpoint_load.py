"""Loading torch checkpoints (plugins/polyparallel_torch/checkpoint_load.py): the explicit partial
load of a model (fine-tuning a backbone into a model with a new head), and checkpoints of format
version 1 (sizes only, no save id, no tensor list), which still load and inspect."""

import json
import os

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import polyparallel as pp
from polyparallel import cli as cli_module


def _net(head: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, head))


def test_a_backbone_loads_into_a_model_with_a_new_head_only_when_asked(tmp_path):
    one = pp.Strategy(data=1)
    saved = _net()
    path = one.save(str(tmp_path / "backbone"), model=saved, optimizer=torch.optim.SGD(saved.parameters(), lr=0.1))
    fresh = _net(head=10, seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(pp.CheckpointError, match=r"another model.*other shapes: 2.bias \[4\] in the checkpoint vs \[10\]"):
        one.load(path, model=fresh)  # the default stays strict: no silent partial load
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "a refused load changed the model"

    result = one.load(path, model=fresh, strict=False)
    report = result["load_report"]
    assert report["loaded"] == ["0.bias", "0.weight"]
    assert report["mismatched"] == {"2.bias": {"checkpoint": [4], "model": [10]},
                                    "2.weight": {"checkpoint": [4, 16], "model": [10, 16]}}
    assert report["missing"] == [] and report["unexpected"] == [] and report["excluded"] == []
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(fresh.state_dict()[name], saved.state_dict()[name], rtol=0, atol=0)
    for name in ("2.weight", "2.bias"):
        torch.testing.assert_close(fresh.state_dict()[name], before[name], rtol=0, atol=0)

    other = _net(head=10, seed=2)
    report = one.load(path, model=other, keys=["0.*"])["load_report"]
    assert report["loaded"] == ["0.bias", "0.weight"] and report["excluded"] == ["2.bias", "2.weight"]
    torch.testing.assert_close(other[0].weight, saved[0].weight, rtol=0, atol=0)
    assert one.load(path, model=_net(head=10), keys=lambda name: name == "0.weight")["load_report"]["loaded"] == [
        "0.weight"]

    with pytest.raises(pp.CheckpointError, match=r"cannot give every selected key.*2.bias \[4\] in the checkpoint"):
        one.load(path, model=_net(head=10), keys=["2.*"])  # strict within the selection
    with pytest.raises(pp.CheckpointError, match=r"nothing of .* matches the selected keys"):
        one.load(path, model=_net(head=10), keys=["head.*"], strict=False)
    model = _net(head=10)
    with pytest.raises(pp.CheckpointError, match=r"restores model weights only"):
        one.load(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), strict=False)
    with pytest.raises(TypeError, match=r"pass model="):
        one.load(path, strict=False)
    with pytest.raises(TypeError, match=r"keys=\) takes glob patterns"):
        one.load(path, model=_net(head=10), keys=[3])
    with pytest.raises(TypeError, match="'load_report' is not a name an extra may take"):
        one.save(str(tmp_path / "x"), model=saved, load_report=1)


def _as_version_1(path: str) -> None:
    """What the previous format wrote: a marker with sizes only (no sha256, id or arrays) and rank
    files without a save id."""
    marker = os.path.join(path, "polyparallel-checkpoint.json")
    meta = json.load(open(marker))
    for key in ("sha256", "id", "arrays"):
        meta.pop(key)
    meta["version"] = 1
    ranks = os.path.join(path, "ranks")
    for name in os.listdir(ranks):
        payload = json.load(open(os.path.join(ranks, name)))
        payload.pop("save_id")
        with open(os.path.join(ranks, name), "w") as f:
            json.dump(payload, f)
        meta["files"][f"ranks/{name}"] = os.path.getsize(os.path.join(ranks, name))
    json.dump(meta, open(marker, "w"))


def test_a_checkpoint_of_format_version_1_loads_and_inspects(tmp_path):
    one = pp.Strategy(data=1)
    saved = _net()
    path = one.save(str(tmp_path / "old"), model=saved)
    _as_version_1(path)
    fresh = _net(seed=3)
    one.load(path, model=fresh)
    torch.testing.assert_close(fresh[2].weight, saved[2].weight, rtol=0, atol=0)
    result = CliRunner().invoke(cli_module.cli, ["checkpoint", "inspect", path], prog_name="polyparallel")
    assert result.exit_code == 0, result.output
    assert "checked: sizes only (format version 1 records no content hashes)" in result.output
    assert "tensors: not listed: its marker (format version 1) does not record them" in result.output
