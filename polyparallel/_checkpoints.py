"""The framework-free half of polyparallel checkpoints (``Strategy.save`` / ``Strategy.load``).

A checkpoint is a directory. A runtime plugin writes its tensors there in its own format (torch:
``torch.distributed.checkpoint``), but every runtime shares what is defined here, so the core,
the CLI and :func:`latest_checkpoint` can read any checkpoint without importing a framework:

- **Atomic commit.** Everything is written into a staging directory ``<path>.partial-<save id>``
  (:func:`staging_path`); once every rank finished, one rank writes the commit marker
  :data:`MARKER` (JSON metadata, :func:`write_marker`) into it and renames it to ``<path>``
  (:func:`publish`). A directory without the marker, or still under its staging name, is a
  half-written checkpoint: never loaded. A failed save removes its staging directory
  (:func:`remove_staging`); :func:`prune` keeps the newest committed checkpoints of a folder.
- **Metadata** (the marker's JSON, format version :data:`VERSION`): the topology and runtime it
  was written at, the framework, the loader's progress and position, the extras that are not
  tensors, the name/shape/dtype of every tensor (``arrays``), a per-save identity (``id``, also in
  the runtime's own files), and the size and SHA-256 of every file, hashed while it was written
  (:mod:`polyparallel._checkpoint_files`): a flipped byte or a file of another checkpoint is
  refused naming the file (:func:`verify_files`). Version 1 (sizes only, no ``id``/``arrays``)
  still loads, its files checked by size.
- **Values.** Extras and other non-tensor values are JSON (:func:`split` / :func:`join`); loading
  never unpickles anything.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import _checkpoint_files as files_
from ._errors import CheckpointError

if TYPE_CHECKING:
    from ._session import Session
    from ._strategy import Strategy

__all__ = ["MARKER", "latest_checkpoint", "list_checkpoints", "prune", "read_marker"]

#: The commit marker: present (and valid JSON) exactly when the checkpoint is complete.
MARKER = "polyparallel-checkpoint.json"
FORMAT = "polyparallel-checkpoint"
#: The format version written; every earlier one is read (1: sizes only, no save id, no tensor list).
VERSION = 2
#: The objects Strategy.save/load take by these names; everything else given to save is an extra.
OBJECTS = ("model", "optimizer", "loader")
#: Keys Strategy.load returns next to the extras (so no extra may use them).
PROGRESS = ("epoch", "step", "global_step")
#: What Strategy.load returns for a partial load (strict=False or keys=): loaded/missing/... keys.
LOAD_REPORT = "load_report"
RESERVED = (*OBJECTS, "framework", *PROGRESS, LOAD_REPORT)
#: What must agree between the saved loader and the loader resumed into (exact resumption).
LOADER_MUST_MATCH = ("global_batch", "dataset_len", "seed", "shuffle", "remainder")
_TUPLE, _TENSOR = "__tuple__", "__tensor__"
_STAGING, _ASIDE = ".partial-", ".old-"


# -- what Strategy.save/load accept ---------------------------------------------------------------
def _path(path: Any, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{where}: path must be a directory path (str or os.PathLike). Received: {path!r}.")
    return os.path.abspath(os.fspath(path))


def _looks_like_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def check_value(value: Any, where: str) -> None:
    """Refuse what a checkpoint cannot hold without pickling: anything but numbers, strings,
    booleans, ``None``, lists/tuples/dicts (string keys) of them, and tensors/arrays (which the
    runtime checks further)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or key in (_TUPLE, _TENSOR):
                raise TypeError(f"{where}: dict keys must be strings other than {_TUPLE!r}/{_TENSOR!r}. "
                                f"Received the key {key!r}.")
            check_value(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_value(item, f"{where}[{i}]")
        return
    if _looks_like_array(value):
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds numbers, strings, "
        "booleans, None, lists/tuples/dicts of them and tensors, never arbitrary (pickled) objects. Save what "
        "restores it instead (its state_dict(), if that is made of these), or the values it needs.")


def check_save(path: Any, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``Strategy.save``'s checks, on every rank before any collective: the path, the keywords
    and the extras' types. Returns the absolute path and the state (``None`` objects dropped)."""
    path = _path(path, "Strategy.save")
    for name in PROGRESS:
        if name in state:
            raise TypeError(f"Strategy.save: {name!r} is not a name an extra may take: Strategy.load returns the "
                            f"loader's progress under {', '.join(map(repr, PROGRESS))}. Pass loader= (its epoch and "
                            f"position are saved), or name your value otherwise (e.g. my_{name}=).")
    if LOAD_REPORT in state:
        raise TypeError(f"Strategy.save: {LOAD_REPORT!r} is not a name an extra may take: Strategy.load returns the "
                        "report of a partial load under it. Name your value otherwise.")
    framework = state.get("framework")
    if framework is not None and not isinstance(framework, str):
        raise TypeError(f"Strategy.save: framework= names the framework for the metadata (a str). Received: {framework!r}.")
    for name, value in state.items():
        if name not in OBJECTS and name != "framework":
            check_value(value, f"Strategy.save: the extra {name!r}")
    if os.path.lexists(path) and not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(f"Strategy.save: {path!r} exists and is not a polyparallel checkpoint; a save replaces "
                              "only an earlier checkpoint. Choose another path, or remove it first.")
    return path, {k: v for k, v in state.items() if v is not None}


def check_load(path: Any, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``Strategy.load``'s checks of its arguments (before reading anything)."""
    path = recovered(_path(path, "Strategy.load"))
    unknown = sorted(set(state) - set(OBJECTS))
    if unknown:
        raise TypeError(f"Strategy.load restores {', '.join(f'{o}=' for o in OBJECTS)} in place; it got {unknown}. "
                        "Extras need no keyword: they come back in the dict it returns.")
    return path, {k: v for k, v in state.items() if v is not None}


def recovered(path: str) -> str:
    """``path``, or — when it is missing because a save of it died between :func:`publish`'s two
    renames — the committed checkpoint it had been, still under ``<path>.old-<token>`` (the newest
    such, by commit time). Read-only: the next save of ``path`` publishes there and removes it."""
    if os.path.lexists(path):
        return path
    parent, base = os.path.split(path)
    if not base or not os.path.isdir(parent or "."):
        return path
    best: tuple[int, str] | None = None
    for name in os.listdir(parent or "."):
        if name.startswith(base + _ASIDE):
            meta = _marker_or_none(os.path.join(parent, name))
            if meta is not None and (best is None or meta.get("saved_at_ns", -1) > best[0]):
                best = (meta.get("saved_at_ns", -1), os.path.join(parent, name))
    return path if best is None else best[1]


def _marker_or_none(path: str) -> dict[str, Any] | None:
    try:
        return read_marker(path)
    except (CheckpointError, FileNotFoundError):
        return None


# -- the marker ----------------------------------------------------------------------------------------
def read_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of the committed checkpoint ``path``.

    :raises FileNotFoundError: ``path`` does not exist.
    :raises CheckpointError: ``path`` has no commit marker (a half-written checkpoint, or not a
        checkpoint), or its marker is not polyparallel's metadata.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (no such directory).")
    if _STAGING in os.path.basename(os.path.normpath(path)):
        raise CheckpointError(f"{path!r} is the staging directory of a save that was never published (it failed or "
                              "was killed before its final rename), not a committed checkpoint; it is never loaded. "
                              "Load the checkpoint it was for, or polyparallel.latest_checkpoint(<its folder>).")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        hint = ""
        if latest_checkpoint(path) is not None:
            hint = f" It holds checkpoints: load polyparallel.latest_checkpoint({path!r})."
        raise CheckpointError(f"{path!r} is not a committed polyparallel checkpoint: it has no {MARKER} (a checkpoint "
                              f"whose save did not finish on every rank, or another directory).{hint}")
    try:
        with open(marker, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{marker!r} is corrupt ({exc}); the checkpoint cannot be trusted.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{marker!r} is not polyparallel checkpoint metadata.")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(f"{path!r} was written in checkpoint format version {meta.get('version')!r}; this "
                              f"polyparallel reads versions up to {VERSION}. Upgrade polyparallel.")
    return meta


def base_metadata(strategy: Strategy, session: Session, framework: str | None,
                  save_id: str | None = None) -> dict[str, Any]:
    """The fields every runtime writes into the marker (the runtime adds its own): ``save_id`` is
    this save's identity (the same on every rank; default a fresh one), which the runtime also
    writes into its own files, so that a file of another save is recognised."""
    from . import __version__

    now = time.time_ns()
    return {
        "format": FORMAT, "version": VERSION, "id": save_id or new_save_id(), "polyparallel": __version__,
        "runtime": session.runtime,
        "framework": framework or session.runtime, "topology": dict(session.topology.sizes),
        "world_size": session.world_size, "zero": strategy.shard_policy.stage, "saved_at_ns": now,
        "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def new_save_id() -> str:
    """A fresh per-save identity (random; a runtime makes it once and shares it with every rank)."""
    return secrets.token_hex(8)


def staging_path(path: str, token: str) -> str:
    """Where a save of ``path`` writes before it is published (``token``: the same on every rank,
    e.g. the save id)."""
    return f"{path}{_STAGING}{token}"


def file_sizes(directory: str) -> dict[str, int]:
    """Relative path -> size of every file under ``directory`` except the marker."""
    return files_.on_disk(directory)


def write_marker(directory: str, metadata: dict[str, Any],
                 files: Mapping[str, tuple[int, str]] | None = None) -> None:
    """Write the marker into ``directory`` in one step (a temporary file renamed over it), with
    the size and SHA-256 of every file already there.

    :param files: relative path -> ``(size, sha256 hex digest)`` of every file of the checkpoint,
        as recorded while each rank wrote them (:class:`polyparallel._checkpoint_files.HashingStream`,
        :func:`~polyparallel._checkpoint_files.write_bytes`); the directory must hold exactly
        these files with these sizes. ``None``: every file there is hashed now, by reading it
        (for a writer that cannot be wrapped).
    :raises CheckpointError: the directory's files are not the recorded ones.
    """
    if files is None:
        files = {rel: (size, files_.hash_file(os.path.join(directory, rel)))
                 for rel, size in files_.on_disk(directory).items()}
    else:
        files_.check_records(directory, files)
    metadata = {**metadata, "version": VERSION, "files": {rel: int(size) for rel, (size, _) in sorted(files.items())},
                files_.HASH: {rel: digest for rel, (_, digest) in sorted(files.items())}}
    metadata.setdefault("id", new_save_id())
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MARKER))


def publish(staging: str, path: str) -> None:
    """Make the complete ``staging`` directory the checkpoint ``path`` (one rename); an earlier
    checkpoint at ``path`` is replaced, and stale staging directories of ``path`` (saves that
    died) are removed."""
    parent, base = os.path.split(path)
    if os.path.lexists(path):
        # A fresh name for each save: an earlier aside whose removal failed never blocks this one.
        # Killed between the renames, the old checkpoint stays loadable there (recovered()).
        aside = path + _ASIDE + secrets.token_hex(6)
        os.rename(path, aside)
        try:
            os.rename(staging, path)
        except BaseException:
            os.rename(aside, path)  # the previous checkpoint stays the one at path
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, path)
    _sync_directory(parent)  # the renames are durable before the save returns
    for name in os.listdir(parent):
        if name.startswith(base + _STAGING) or name.startswith(base + _ASIDE):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _sync_directory(directory: str) -> None:
    """fsync a directory (its entries: a rename in it); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the data files are synced already
    finally:
        os.close(fd)


def verify_files(path: str, metadata: dict[str, Any], hashed: Any = None) -> None:
    """Refuse a checkpoint whose files are missing, have other sizes than when it was committed
    (truncated, partly copied), or — format version 2 — other contents (the SHA-256 of each file
    in ``hashed``, default every file, recomputed: flipped bytes, a file of another checkpoint).

    :raises CheckpointError: naming the first file at fault.
    """
    found = files_.problems(path, metadata, hashed)
    if found:
        raise CheckpointError(found[0] + (f" ({len(found) - 1} more file(s) at fault.)" if len(found) > 1 else ""))


def remove_staging(staging: str) -> None:
    """Remove the staging directory of a save that failed (no checkpoint was published from it)."""
    if _STAGING in os.path.basename(staging):
        shutil.rmtree(staging, ignore_errors=True)


# -- values as JSON ------------------------------------------------------------------------------------
def split(value: Any, is_tensor: Callable[[Any], bool], prefix: str) -> tuple[Any, dict[str, Any]]:
    """``value`` as JSON, with every tensor replaced by a reference, and the tensors by key
    (``prefix`` + its path). Tuples stay tuples through :func:`join`."""
    tensors: dict[str, Any] = {}

    def walk(item: Any, key: str) -> Any:
        if is_tensor(item):
            tensors[key] = item
            return {_TENSOR: key}
        if isinstance(item, Mapping):
            return {str(k): walk(v, f"{key}.{k}") for k, v in item.items()}
        if isinstance(item, tuple):
            return {_TUPLE: [walk(v, f"{key}.{i}") for i, v in enumerate(item)]}
        if isinstance(item, list):
            return [walk(v, f"{key}.{i}") for i, v in enumerate(item)]
        if item is None or isinstance(item, (bool, int, str)) or (isinstance(item, float)):
            return item
        raise TypeError(f"{key} is a {type(item).__module__}.{type(item).__qualname__}, which a checkpoint cannot "
                        "hold without pickling (numbers, strings, booleans, None, lists/dicts of them and tensors only).")

    return walk(value, prefix), tensors


def join(value: Any, tensors: Mapping[str, Any]) -> Any:
    """Undo :func:`split`: references replaced by ``tensors[key]``."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(join(v, tensors) for v in value[_TUPLE])
        return {k: join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [join(v, tensors) for v in value]
    return value


def tensor_refs(value: Any) -> list[str]:
    """The tensor keys a :func:`split` value refers to."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return [value[_TENSOR]]
        return [k for v in value.values() for k in tensor_refs(v)]
    if isinstance(value, list):
        return [k for v in value for k in tensor_refs(v)]
    return []


def dumps(value: Any) -> str:
    """JSON text of a :func:`split` value (``NaN``/``Infinity`` kept, as Python's json reads them)."""
    return json.dumps(value, sort_keys=True, allow_nan=True)


# -- exact resumption ----------------------------------------------------------------------------------
def check_loader_resume(path: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse to resume a loader whose samples would differ from the saved run's (exact resumption
    needs the same global batch, data set, seed and shuffling; the data size may differ).

    A global batch that differs because ``Strategy(accumulate=)`` changed (the loader's batches
    are micro-batches of ``batch_size / accumulate``) is refused naming accumulate, old and new;
    another accumulate with the same micro-batch resumes (the same samples are consumed)."""
    old, new = saved.get("accumulate"), current.get("accumulate")
    if saved.get("global_batch") != current.get("global_batch") and old is not None and new is not None and old != new:
        raise CheckpointError(
            f"Strategy.load: {path!r} was saved with Strategy(accumulate={old}) (global micro-batch "
            f"{saved.get('global_batch')}), this run has accumulate={new} (global micro-batch "
            f"{current.get('global_batch')}): the loader's position counts micro-batches of batch_size / accumulate, "
            f"so exact resumption would consume other samples than the saved run. Resume with "
            f"Strategy(accumulate={old}), or keep the micro-batch (batch_size x {new}/{old}), or load without loader= "
            "to keep only the weights and the epoch.")
    for key in LOADER_MUST_MATCH:
        if saved.get(key) != current.get(key):
            what = {"global_batch": "global batch size", "dataset_len": "data set length", "seed": "Strategy seed",
                    "shuffle": "shuffling", "remainder": "remainder policy"}[key]
            fix = {"global_batch": "Resume with the same global batch (Strategy(batch_size=) or the loader's batch "
                                   "size x data), or load without loader= to keep only the weights and the epoch",
                   "seed": "Use Strategy(seed=) of the saved run"}.get(key, "Shard the same data the same way")
            raise CheckpointError(
                f"Strategy.load: {path!r} was saved with {what} {saved.get(key)!r}, this loader has "
                f"{current.get(key)!r}; exact resumption would consume other samples than the saved run. {fix}.")


# -- finding checkpoints -------------------------------------------------------------------------------
def list_checkpoints(directory: str | os.PathLike[str], pattern: str = "step-*") -> list[dict[str, Any]]:
    """The checkpoints in ``directory`` whose names match ``pattern``, committed or not, oldest
    first: ``{"name", "path", "committed", "metadata"}`` (``metadata`` ``None`` when not committed)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found: list[dict[str, Any]] = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if _ASIDE in name:
            # The committed checkpoint a save moved aside and died before replacing (recovered()).
            base = name.split(_ASIDE, 1)[0]
            if not fnmatch.fnmatch(base, pattern) or recovered(os.path.join(directory, base)) != full:
                continue
        elif not fnmatch.fnmatch(name, pattern) or not os.path.isdir(full):
            continue
        meta = None
        if _STAGING not in name:
            try:
                meta = read_marker(full)
            except (CheckpointError, FileNotFoundError):
                meta = None
        found.append({"name": name, "path": full, "committed": meta is not None, "metadata": meta})
    found.sort(key=lambda c: (c["metadata"] or {}).get("saved_at_ns", -math.inf))
    return found


def latest_checkpoint(directory: str | os.PathLike[str], pattern: str = "step-*") -> str | None:
    """The newest *committed* checkpoint among ``directory``'s subdirectories named ``pattern``
    (newest by commit time), or ``None`` when there is none (or no ``directory``). Half-written
    ones (a job killed while saving) are skipped. The default ``pattern`` matches ``step-*``
    names only: pass ``pattern="*.ckpt"`` for Lightning's, ``"checkpoint_*"`` for Ignite's.

    >>> ckpt = polyparallel.latest_checkpoint("ckpts")              # doctest: +SKIP
    >>> progress = strategy.load(ckpt, model=model, optimizer=opt, loader=loader) if ckpt else None  # doctest: +SKIP
    """
    committed = [c for c in list_checkpoints(directory, pattern) if c["committed"]]
    return committed[-1]["path"] if committed else None


def prune(directory: str | os.PathLike[str], keep: int, pattern: str = "step-*") -> list[str]:
    """Keep the ``keep`` newest committed checkpoints of ``directory`` named ``pattern`` (newest by
    commit time); remove the older committed ones and the staging directories (``.partial-``) of
    saves that failed or were killed: those last modified before the newest commit, so that a save
    in progress (of this job or a peer rank) is never touched. The newest committed checkpoint is
    never removed, nor anything that is not a checkpoint. Call it on one rank
    (:class:`polyparallel.CheckpointManager` does). Returns the removed paths.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune(keep=) takes an int >= 1 (the newest committed checkpoint always stays). "
                         f"Received: {keep!r}.")
    found = list_checkpoints(directory, pattern)
    committed = [c for c in found if c["committed"]]
    if not committed:
        return []
    newest = committed[-1]["metadata"].get("saved_at_ns", 0)
    doomed = [c["path"] for c in committed[:-keep]]
    for c in found:
        if _STAGING in c["name"]:
            try:
                if os.stat(c["path"]).st_mtime_ns < newest:
                    doomed.append(c["path"])
            except OSError:
                pass
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
