"""``polyparallel checkpoint export`` of torch checkpoints: every shard gathered into one file in
this process, whatever topology wrote it (DCP reshards to whole tensors, as its own
``dcp_to_torch_save`` does, but through the allow-listed reader).

- ``--to torch``: ``{"model": state dict, "optimizer": flattened state (if saved), "extras": ...,
  "polyparallel": {"id", "framework", "topology", "progress", "loader"}}``; plain tensors and
  data only, so ``torch.load(file, weights_only=True)`` reads it and
  ``module.load_state_dict(d["model"])`` restores the weights. The optimizer's state is DCP's
  flattened form, keyed by parameter name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``):
  ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model, optimizer,
  d["optimizer"], options=StateDictOptions(flatten_optimizer_state_dict=True))`` restores it.
- ``--to safetensors``: the model's tensors under their state-dict names, the polyparallel
  metadata as JSON in ``__metadata__["polyparallel"]``: ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import polyparallel as pp
from polyparallel import _checkpoints
from polyparallel._checkpoint_export import write_safetensors

from .checkpoint_files import read_dcp_metadata, read_rank_files, safe_reader

__all__ = ["export", "full_state"]


def full_state(path: str, metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"model", "optim", "extras"}`` of the checkpoint ``path``: whole tensors (read in this
    process) and the JSON values of its rank files."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_dcp_metadata(path).state_dict_metadata
    tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in index.items()
               if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(tensors, storage_reader=safe_reader(path), no_dist=True)
    save_id = metadata.get("id") if int(metadata.get("version", 1)) >= 2 else None
    files = read_rank_files(path, save_id)
    out: dict[str, dict[str, Any]] = {}
    for section in ("model", "optim"):
        part = {k[len(section) + 1:]: v for k, v in tensors.items() if k.startswith(section + ".")}
        for payload in files.values():
            part.update(_checkpoints.join(payload["values"].get(section, {}), {}))
        out[section] = dict(sorted(part.items()))
    out["extras"] = _checkpoints.join(metadata.get("extras") or {}, tensors)
    return out


def export(path: str, metadata: dict[str, Any], to: str, output: str) -> str:
    """The torch runtime's ``polyparallel_export_checkpoint`` (module docstring)."""
    state = full_state(path, metadata)
    info = {k: metadata.get(k) for k in ("id", "framework", "topology", "progress", "loader", "polyparallel")}
    if to == "torch":
        payload: dict[str, Any] = {"model": state["model"], "extras": state["extras"], "polyparallel": info}
        if (metadata.get("contents") or {}).get("optimizer"):
            payload["optimizer"] = state["optim"]
        tmp = output + ".tmp"
        torch.save(payload, tmp)
        os.replace(tmp, output)
        return output
    others = sorted(k for k, v in state["model"].items() if not isinstance(v, torch.Tensor))
    if others:
        raise pp.CheckpointError(f"export --to safetensors: the model's state holds values that are not tensors "
                                 f"({others[:4]}), which safetensors cannot hold. Export --to torch instead.")
    tensors = ((name, str(t.dtype).replace("torch.", ""), list(t.shape), _raw(t)) for name, t in state["model"].items())
    return write_safetensors(output, tensors, {"polyparallel": json.dumps(info, sort_keys=True)})


def _raw(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes, contiguous (little-endian on the platforms torch runs on)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
