"""``polyparallel checkpoint export PATH --to torch|safetensors [-o FILE]``: one consolidated file
that loads without polyparallel (as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
and DeepSpeed's ``zero_to_fp32`` write).

The core verifies the checkpoint (sizes and SHA-256 of every file) and asks the plugin of the
runtime that wrote it (``polyparallel_export_checkpoint``) to gather its shards in this one
process and write the file. The safetensors format is written here, framework-free
(:func:`write_safetensors`), from the raw bytes a plugin hands over: an 8-byte little-endian header
length, a JSON header (``dtype``, ``shape``, ``data_offsets`` per tensor, ``__metadata__``), then
the tensors' bytes, little-endian and contiguous — the format ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from typing import Any

from . import _checkpoints
from ._errors import CheckpointError

__all__ = ["FORMATS", "export", "write_safetensors"]

#: ``--to`` choices and the default suffix of the file.
FORMATS = {"torch": ".pt", "safetensors": ".safetensors"}
#: safetensors' dtype names (the torch dtype's name after ``torch.``).
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32",
                      "uint64": "U64"}


def default_output(path: str, to: str) -> str:
    """``<checkpoint directory><suffix>``, next to the directory."""
    return os.path.normpath(os.path.abspath(path)) + FORMATS[to]


def write_safetensors(output: str, tensors: Iterable[tuple[str, str, list[int], Any]],
                      metadata: dict[str, str] | None = None) -> str:
    """Write ``(name, dtype name, shape, raw little-endian bytes)`` as a safetensors file at
    ``output`` (written to a temporary name, then renamed: never half a file)."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name, dtype, shape, data in tensors:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise CheckpointError(f"export --to safetensors: {name} is {dtype}, which safetensors has no type for. "
                                  "Export --to torch instead.")
        view = memoryview(data).cast("B")
        header[name] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + len(view)]}
        blobs.append(view)
        offset += len(view)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = output + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return output


def export(path: str, to: str, output: str | None = None, plugin_manager: Any = None) -> str:
    """Write the committed checkpoint ``path`` as one file (``to``: ``torch`` or ``safetensors``)
    at ``output`` (default :func:`default_output`); returns its path.

    :raises CheckpointError: not committed, its files do not verify, or no installed plugin
        exports its runtime's checkpoints.
    """
    if to not in FORMATS:
        raise ValueError(f"export --to takes one of {sorted(FORMATS)}. Received: {to!r}.")
    path = os.path.abspath(os.fspath(path))
    metadata = _checkpoints.read_marker(path)
    _checkpoints.verify_files(path, metadata)
    output = os.path.abspath(output or default_output(path, to))
    if os.path.isdir(output):
        raise CheckpointError(f"export: {output!r} is a directory; -o names the file to write.")
    if plugin_manager is None:
        from ._manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    result = plugin_manager.call_for_runtime("polyparallel_export_checkpoint", metadata.get("runtime"), path=path,
                                             metadata=metadata, to=to, output=output)
    if result is None:
        raise CheckpointError(f"export: no installed plugin exports checkpoints of the {metadata.get('runtime')!r} "
                              f"runtime. Install its plugin (pip install 'polyparallel[{metadata.get('runtime')}]').")
    return str(result)
