"""``polyparallel checkpoint inspect PATH``: what a checkpoint (or a folder of them) holds.

Framework-free: it reads the commit marker's JSON metadata (:mod:`polyparallel._checkpoints`).
The tensors of a torch checkpoint are listed from DCP's index only when the torch plugin imports
(its reader admits DCP's own classes only); otherwise the listing says how to get them.
"""

from __future__ import annotations

import os
from typing import Any

from . import _checkpoints
from ._errors import CheckpointError

__all__ = ["describe", "render"]


def _tensors(path: str, metadata: dict[str, Any]) -> list[dict[str, Any]] | str:
    if isinstance(metadata.get("arrays"), list):
        # A runtime that lists its arrays in the marker (JAX/orbax): no framework needed to read it.
        return [dict(a) for a in metadata["arrays"] if isinstance(a, dict)]
    if metadata.get("tensors") != "torch.distributed.checkpoint":
        return f"tensors are stored by the {metadata.get('runtime')!r} runtime; not listed here"
    try:
        from polyparallel_torch.checkpoint_files import read_dcp_metadata
    except ImportError:
        return "install polyparallel[torch] to list the tensors"
    try:
        index = read_dcp_metadata(path).state_dict_metadata
    except CheckpointError as exc:
        return f"unreadable: {exc}"
    return [{"name": k, "shape": list(v.size), "dtype": str(v.properties.dtype).replace("torch.", "")}
            for k, v in sorted(index.items())]


def describe(path: str | os.PathLike[str], tensors: bool = True) -> dict[str, Any]:
    """``{"path", "kind": "checkpoint"|"uncommitted"|"folder", ...}``: a committed checkpoint's
    metadata (plus ``tensors`` and a ``problem`` if its files do not match), an uncommitted one,
    or a folder's checkpoints (``checkpoints``: name, committed, step, saved_at; ``latest``).

    :raises FileNotFoundError: ``path`` does not exist.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (no such directory).")
    own = set(os.listdir(path))
    if _checkpoints.MARKER in own:
        try:
            metadata = _checkpoints.read_marker(path)
        except CheckpointError as exc:
            return {"path": path, "kind": "uncommitted", "problem": str(exc)}
        out: dict[str, Any] = {"path": path, "kind": "checkpoint", **metadata}
        try:
            _checkpoints.verify_files(path, metadata)
        except CheckpointError as exc:
            out["problem"] = str(exc)
        if tensors:
            out["tensors"] = _tensors(path, metadata)
        return out
    if ".partial-" in os.path.basename(path) or own & {".metadata", "ranks"}:
        return {"path": path, "kind": "uncommitted",
                "problem": f"it has no {_checkpoints.MARKER}: its save did not finish on every rank"}
    rows = []
    for c in _checkpoints.list_checkpoints(path, "*"):
        meta = c["metadata"] or {}
        rows.append({"name": c["name"], "committed": c["committed"], "saved_at": meta.get("saved_at"),
                     "progress": meta.get("progress"), "topology": meta.get("topology")})
    return {"path": path, "kind": "folder", "checkpoints": rows, "latest": _checkpoints.latest_checkpoint(path, "*")}


def _topology(sizes: dict[str, int] | None) -> str:
    if not sizes:
        return "-"
    shown = [f"{a}={s}" for a, s in sizes.items() if s > 1] or ["data=1"]
    return " x ".join(shown)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(info: dict[str, Any]) -> str:
    """The text ``polyparallel checkpoint inspect`` prints for :func:`describe`'s result."""
    if info["kind"] == "uncommitted":
        return (f"{info['path']}\n  NOT COMMITTED: never loaded by Strategy.load or polyparallel.latest_checkpoint.\n"
                f"  {info['problem']}")
    if info["kind"] == "folder":
        lines = [f"{info['path']}: {len(info['checkpoints'])} checkpoint(s); latest committed: {info['latest'] or 'none'}"]
        for row in info["checkpoints"]:
            progress = row["progress"] or {}
            state = "committed" if row["committed"] else "NOT COMMITTED"
            step = f"epoch {progress.get('epoch')} step {progress.get('step')}" if progress else ""
            lines.append(f"  {row['name']:<28} {state:<14} {_topology(row['topology']):<22} {step}  {row['saved_at'] or ''}")
        return "\n".join(line.rstrip() for line in lines)
    loader = info.get("loader") or {}
    progress = info.get("progress")
    contents = info.get("contents") or {}
    held = [k for k in ("model", "optimizer", "loader") if contents.get(k)]
    files = info.get("files") or {}
    lines = [
        f"{info['path']}  committed {info.get('saved_at')}",
        f"  written at {_topology(info.get('topology'))} (world size {info.get('world_size')}, zero={info.get('zero')}) "
        f"by runtime {info.get('runtime')}, framework {info.get('framework')}, polyparallel {info.get('polyparallel')}",
        f"  holds: {', '.join(held) or 'nothing but extras'}; extras: {', '.join(contents.get('extras') or []) or 'none'}",
    ]
    if progress:
        lines.append(f"  progress: epoch {progress['epoch']}, {progress['step']} batch(es) of it consumed, global step "
                     f"{progress['global_step']}; global batch {loader.get('global_batch')}, {loader.get('dataset_len')} "
                     f"samples, seed {loader.get('seed')}, shuffle {loader.get('shuffle')}")
    lines.append(f"  files: {len(files)}, {_size(sum(files.values()))}")
    if "problem" in info:
        lines.append(f"  PROBLEM: {info['problem']}")
    tensors = info.get("tensors")
    if isinstance(tensors, str):
        lines.append(f"  tensors: {tensors}")
    elif tensors is not None:
        lines.append(f"  tensors ({len(tensors)}):")
        width = max((len(t["name"]) for t in tensors), default=0)
        lines += [f"    {t['name']:<{width}}  {t['shape']}  {t['dtype']}" for t in tensors]
    return "\n".join(lines)
