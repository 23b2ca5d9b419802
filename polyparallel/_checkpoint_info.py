"""``polyparallel checkpoint inspect PATH``: what a checkpoint (or a folder of them) holds.

Framework-free: it reads the commit marker's JSON metadata (:mod:`polyparallel._checkpoints`)
and nothing else: the tensors are listed from the marker's ``arrays`` (every runtime records
them at save time since format version 2), and the files are verified against the sizes and
SHA-256 digests the marker recorded when they were written (``--no-verify``: sizes only).
A torch checkpoint of format version 1 lists no tensors (its marker did not record them).
"""

from __future__ import annotations

import os
from typing import Any

from . import _checkpoints
from ._checkpoint_files import problems
from ._errors import CheckpointError

__all__ = ["describe", "render"]


def _tensors(metadata: dict[str, Any]) -> list[dict[str, Any]] | str:
    if isinstance(metadata.get("arrays"), list):
        return [dict(a) for a in metadata["arrays"] if isinstance(a, dict)]
    return (f"not listed: its marker (format version {metadata.get('version')}) does not record them (format "
            "version 2 does); Strategy.load reads it all the same")


def _verification(metadata: dict[str, Any], verify: bool) -> str:
    if int(metadata.get("version", 1)) < 2:
        return "sizes only (format version 1 records no content hashes)"
    return "sizes and SHA-256 of every file" if verify else "sizes only (--no-verify)"


def describe(path: str | os.PathLike[str], tensors: bool = True, verify: bool = True) -> dict[str, Any]:
    """``{"path", "kind": "checkpoint"|"uncommitted"|"folder", ...}``: a committed checkpoint's
    metadata (plus ``tensors``, ``verified`` and a ``problem`` if its files do not match what was
    committed: missing, another size, another content), an uncommitted one (a staging directory,
    even one holding a marker, or a directory without a marker), or a folder's checkpoints
    (``checkpoints``: name, committed, step, saved_at; ``latest``).

    :param verify: recompute the SHA-256 of every file (reads the whole checkpoint once).
    :raises FileNotFoundError: ``path`` does not exist.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (no such directory).")
    own = set(os.listdir(path))
    if _checkpoints._STAGING in os.path.basename(path):
        held = f" (it holds a {_checkpoints.MARKER}, written before the rename that did not happen)" \
            if _checkpoints.MARKER in own else ""
        return {"path": path, "kind": "uncommitted",
                "problem": f"it is the staging directory of a save that was never published{held}: the save failed "
                           "or was killed before its final rename"}
    if _checkpoints.MARKER in own:
        try:
            metadata = _checkpoints.read_marker(path)
        except CheckpointError as exc:
            return {"path": path, "kind": "uncommitted", "problem": str(exc)}
        out: dict[str, Any] = {"path": path, "kind": "checkpoint", **metadata,
                               "verified": _verification(metadata, verify)}
        found = problems(path, metadata, None if verify else ())
        if found:
            out["problem"] = found[0] + (f" ({len(found) - 1} more file(s) at fault.)" if len(found) > 1 else "")
        if tensors:
            out["tensors"] = _tensors(metadata)
        return out
    if own & {".metadata", "ranks"}:
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
    lines.append(f"  files: {len(files)}, {_size(sum(files.values()))}; checked: {info.get('verified')}")
    if info.get("id"):
        lines.append(f"  save id: {info['id']} (format version {info.get('version')})")
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
