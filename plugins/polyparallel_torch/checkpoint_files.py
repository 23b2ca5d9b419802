"""What a torch checkpoint holds besides DCP's tensors, and reading DCP's index without pickle.

- ``ranks/rank-<r>.json``: each rank's RNG states (Python's ``random``, torch's CPU and CUDA
  generators, NumPy's global one when NumPy is imported) and the non-tensor values of its state
  dicts (an optimizer's per-parameter hyperparameters, keyed by parameter name, so that every
  topology finds its own: a pipeline stage writes its stage's). JSON: loading unpickles nothing.
- DCP's ``.metadata`` is a pickle; :func:`read_dcp_metadata` reads it with an unpickler that
  admits only DCP's metadata classes, torch dtypes/sizes and paths, and refuses anything else.
  Checkpoints written here never hold DCP "bytes" entries (those DCP would ``torch.load`` with
  ``weights_only=False``), and a checkpoint that has some is refused.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import random
import sys
from typing import Any

import torch

import polyparallel as pp
from polyparallel import _checkpoints

__all__ = ["read_dcp_metadata", "read_rank_files", "restore_rng", "rng_states", "write_rank_file"]

RANKS = "ranks"

# The globals a DCP .metadata pickle refers to (torch 2.4-2.13): its dataclasses, torch sizes,
# dtypes and layouts, and the path class of the writer's platform.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
      ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_dcp_metadata(path: str) -> Any:
    """DCP's ``Metadata`` of the checkpoint ``path``, unpickled with an allow-list.

    :raises polyparallel.CheckpointError: it is missing, corrupt, refers to other classes, or
        holds non-tensor ("bytes") entries.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise pp.CheckpointError(f"{path!r} holds no DCP .metadata file; it is not a torch checkpoint of "
                                 "polyparallel (or it is incomplete).") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise pp.CheckpointError(f"{file!r} is corrupt or not DCP metadata ({exc}); refused without loading "
                                 "it further.") from None
    if not isinstance(metadata, Metadata):
        raise pp.CheckpointError(f"{file!r} is not DCP metadata (it holds a {type(metadata).__name__}).")
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    if pickled:
        raise pp.CheckpointError(f"{path!r} holds pickled objects ({pickled[:4]}...), which DCP would unpickle "
                                 "without restriction; polyparallel never writes them and refuses to load them.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _safe_reader(path: str) -> Any:
    """A DCP ``FileSystemReader`` whose metadata goes through :func:`read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(path)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


# -- RNG states ------------------------------------------------------------------------------------------
def rng_states() -> dict[str, Any]:
    """This process's RNG states as JSON-able values."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Put back what :func:`rng_states` returned (NumPy's only where NumPy is imported; CUDA's
    only where CUDA is initialised with as many devices)."""
    random.setstate(states["python"])
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
    cuda = states.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in cuda])
    numpy = sys.modules.get("numpy")
    if numpy is not None and states.get("numpy") is not None:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))


# -- per-rank files ------------------------------------------------------------------------------------------
def write_rank_file(directory: str, rank: int, values: dict[str, Any]) -> None:
    """This rank's RNG states and non-tensor ``values`` (already JSON-able, from ``_checkpoints.split``)."""
    os.makedirs(os.path.join(directory, RANKS), exist_ok=True)
    payload = {"rank": rank, "rng": _checkpoints.split(rng_states(), lambda _: False, "rng")[0], "values": values}
    with open(os.path.join(directory, RANKS, f"rank-{rank:05d}.json"), "w", encoding="utf-8") as f:
        f.write(_checkpoints.dumps(payload))
        f.flush()
        os.fsync(f.fileno())  # durable before the marker commits the checkpoint (as DCP syncs its files)


def read_rank_files(path: str) -> dict[int, dict[str, Any]]:
    """Every rank's file of the checkpoint ``path``: rank -> ``{"rng", "values"}``."""
    files: dict[int, dict[str, Any]] = {}
    for file in sorted(glob.glob(os.path.join(glob.escape(path), RANKS, "rank-*.json"))):
        try:
            with open(file, encoding="utf-8") as f:
                payload = json.load(f)
            files[int(payload["rank"])] = {"rng": _checkpoints.join(payload["rng"], {}), "values": payload["values"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise pp.CheckpointError(f"{file!r} is corrupt ({exc}); load an earlier checkpoint.") from None
    return files
