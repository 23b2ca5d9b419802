"""What a torch checkpoint holds besides DCP's tensors, hashing DCP's files while they are
written, and reading DCP's index without pickle.

- ``ranks/rank-<r>.json``: each rank's RNG states (Python's ``random``, torch's CPU and CUDA
  generators, NumPy's global one when NumPy is imported), the non-tensor values of its state
  dicts (an optimizer's per-parameter hyperparameters, keyed by parameter name, so that every
  topology finds its own: a pipeline stage writes its stage's) and the save id. JSON: loading
  unpickles nothing.
- :func:`hashing_writer`: DCP's ``FileSystemWriter`` whose file streams hash every byte as DCP
  writes it (:class:`polyparallel._checkpoint_files.HashingStream`), and which writes the save id
  into DCP's own ``.metadata`` (``storage_meta.save_id``); each rank keeps the size and SHA-256 of
  the files it wrote, for the commit marker.
- DCP's ``.metadata`` is a pickle; :func:`read_dcp_metadata` reads it with an unpickler that
  admits only DCP's metadata classes, torch dtypes/sizes and paths, and refuses anything else.
  Checkpoints written here never hold DCP "bytes" entries (those DCP would ``torch.load`` with
  ``weights_only=False``), and a checkpoint that has some is refused — except in a directory of
  Lightning's own format (``allow_bytes``), whose entries are then read with
  ``torch.load(weights_only=True)`` first (:func:`safe_load_planner`).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import pickle
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

import polyparallel as pp
from polyparallel import _checkpoint_files, _checkpoints

__all__ = ["hashing_writer", "read_dcp_metadata", "read_rank_files", "restore_rng", "rng_states",
           "safe_load_planner", "safe_reader", "write_rank_file"]

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


def read_dcp_metadata(path: str, allow_bytes: bool = False) -> Any:
    """DCP's ``Metadata`` of the checkpoint ``path``, unpickled with an allow-list.

    :param allow_bytes: admit non-tensor ("bytes") entries (a directory of Lightning's own
        format); read them only through :func:`safe_load_planner`.
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
    if pickled and not allow_bytes:
        raise pp.CheckpointError(f"{path!r} holds pickled objects ({pickled[:4]}...), which DCP would unpickle "
                                 "without restriction; polyparallel never writes them and refuses to load them.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def safe_reader(path: str, allow_bytes: bool = False) -> Any:
    """A DCP ``FileSystemReader`` whose metadata goes through :func:`read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(path, allow_bytes)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


_safe_reader = safe_reader  # the name of earlier releases


def safe_load_planner() -> Any:
    """DCP's ``DefaultLoadPlanner``, except that a "bytes" entry is first read with
    ``torch.load(weights_only=True)`` (plain data and tensors only; anything else is refused)
    before DCP's own ``torch.load`` of it, which unpickles without restriction."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise pp.CheckpointError(f"the entry {read_item.dest_index.fqn!r} holds objects other than plain "
                                         f"data and tensors; refused without loading it ({str(exc).splitlines()[0]})"
                                         ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return Planner()


# -- hashing DCP's files as they are written --------------------------------------------------------------
class _HashingFileSystem:
    """DCP's ``FileSystem`` of a writer, its write streams wrapped to hash what DCP writes."""

    def __init__(self, fs: Any, root: str, records: _checkpoint_files.Records):
        self._fs, self._root, self._records = fs, root, records

    def _rel(self, path: Any) -> str:
        return os.path.relpath(os.fspath(path), self._root).replace(os.sep, "/")

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode and "a" not in mode:
            with self._fs.create_stream(path, mode) as raw:
                yield raw
            return
        try:
            with self._fs.create_stream(path, mode) as raw:
                stream = _checkpoint_files.HashingStream(raw)
                yield stream
        except Exception as exc:  # a write's error names no file (torch.save wraps it): name it
            cause = _checkpoint_files.os_error(exc)
            if cause is None:
                raise
            raise _checkpoint_files.naming(cause, path) from exc
        # Only a stream written to its end is recorded (a failed write raised through the yield).
        self._records.add(self._rel(path), stream.size, stream.digest if "w" in mode else None)

    def rename(self, path: Any, new_path: Any) -> None:
        self._fs.rename(path, new_path)
        self._records.rename(self._rel(path), self._rel(new_path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def hashing_writer(staging: str, save_id: str) -> Any:
    """A DCP ``FileSystemWriter`` into ``staging`` (files synced, as DCP's default) that records
    the size and SHA-256 of every file it writes (``writer.records``, a
    :class:`polyparallel._checkpoint_files.Records`) and writes ``save_id`` as DCP's own
    ``storage_meta.save_id`` in ``.metadata``. Works for ``dcp.save`` and ``dcp.async_save``
    (whose staging copies the tensors first)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        records: _checkpoint_files.Records

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            self.save_id = save_id

    writer = Writer(staging)
    writer.save_id = save_id
    writer.records = _checkpoint_files.Records()
    writer.fs = _HashingFileSystem(writer.fs, staging, writer.records)  # type: ignore[assignment]
    return writer


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
def rank_file(rank: int) -> str:
    """The relative path of rank ``rank``'s file."""
    return f"{RANKS}/rank-{rank:05d}.json"


def write_rank_file(directory: str, rank: int, values: dict[str, Any], save_id: str | None = None
                    ) -> tuple[str, int, str]:
    """This rank's RNG states, non-tensor ``values`` (already JSON-able, from
    ``_checkpoints.split``) and the save id; durable (fsynced) before it returns, as DCP syncs
    its files before the marker commits them. Returns ``(relative path, size, sha256)``."""
    os.makedirs(os.path.join(directory, RANKS), exist_ok=True)
    payload = {"rank": rank, "rng": _checkpoints.split(rng_states(), lambda _: False, "rng")[0], "values": values,
               "save_id": save_id}
    rel = rank_file(rank)
    size, digest = _checkpoint_files.write_bytes(os.path.join(directory, rel),
                                                 _checkpoints.dumps(payload).encode("utf-8"))
    return rel, size, digest


def read_rank_files(path: str, save_id: str | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's file of the checkpoint ``path``: rank -> ``{"rng", "values"}``.

    :param save_id: the checkpoint's save id (format version 2): a file of another save is refused.
    """
    files: dict[int, dict[str, Any]] = {}
    for file in sorted(glob.glob(os.path.join(glob.escape(path), RANKS, "rank-*.json"))):
        try:
            with open(file, encoding="utf-8") as f:
                payload = json.load(f)
            rank = int(payload["rank"])
            files[rank] = {"rng": _checkpoints.join(payload["rng"], {}), "values": payload["values"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise pp.CheckpointError(f"{file!r} is corrupt ({exc}); load an earlier checkpoint.") from None
        if save_id is not None and payload.get("save_id") != save_id:
            raise pp.CheckpointError(_checkpoint_files.foreign(path, rank_file(rank), payload.get("save_id"), save_id))
    return files
