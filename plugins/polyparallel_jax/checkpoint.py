"""Checkpoints of the JAX runtime: orbax-checkpoint arrays under polyparallel's commit marker.

A checkpoint is a directory::

    path/
      state/                          orbax-checkpoint (PyTreeCheckpointHandler): one array per
                                      leaf, each process writing its own shards (tensorstore/OCDBT)
      polyparallel-checkpoint.json    the commit marker (:mod:`polyparallel._checkpoints`): format,
                                      runtime "jax", framework, topology written at, epoch/step,
                                      global batch, extras, the save id, and the size and SHA-256
                                      of every file

Leaves are named by their path (``module/params/l1/kernel``, ``optimizer/0/mu/l1/kernel``), so a
checkpoint written by one model is checked leaf by leaf (names, shapes) against the model it is
loaded into before anything is restored. Restoring reads each array straight into the sharding
the reading ``Mesh`` gives it (orbax reads only the slices each device needs), so a checkpoint
written at ``data=4 x tensor=2`` loads at ``data=8`` or on one device.

Atomic commit (the core's, shared with every runtime): everything is written into
``path.partial-<token>`` (orbax finalises its own ``state`` directory first), the marker is
written last, and the directory is renamed to ``path``. A directory without the marker is
refused; ``polyparallel.latest_checkpoint`` skips it. A failed save (a full disk) raises the same
:class:`polyparallel.CheckpointError` in every process, naming the path, the process and the
operating system's error, and process 0 removes the staging directory.

**What is hashed when.** orbax writes through tensorstore, whose streams cannot be wrapped, so the
SHA-256 of every file is not taken while writing (as the torch runtime does) but by process 0
reading each file once after orbax finalised the directory and before the marker is written
(:func:`polyparallel._checkpoints.write_marker` without records); a load recomputes them. The
save id is in the marker only (orbax's files carry none); the hashes bind the files to it.
Saves are synchronous (``Strategy.async_save`` returns a finished future) and loads whole (a
partial load, ``strict=False``/``keys=``, is refused).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

import polyparallel as pp
from polyparallel import _checkpoints as core

from .partition import path_name

__all__ = ["CheckpointError", "MARKER", "check_leaves", "committed", "flatten", "read_metadata", "restore",
           "restore_trees", "shapes", "stored_leaves", "tree_arrays", "write", "TIMEOUT"]

#: The commit marker (and metadata): a checkpoint directory is loadable only when it holds it.
MARKER = core.MARKER
STATE = "state"
CheckpointError = pp.CheckpointError
#: Seconds a process waits for the others at each agreement of a save (without a strategy's timeout).
TIMEOUT = 300.0


# -- names ---------------------------------------------------------------------------------------


def flatten(tree: Any, prefix: str) -> dict[str, Any]:
    """``prefix/<path>`` -> array leaf of ``tree`` (NNX ``Variable`` wrappers are not part of names)."""
    import jax

    leaves = jax.tree.flatten_with_path(tree)[0]
    named = {f"{prefix}/{path_name(path)}" if path else prefix: leaf for path, leaf in leaves}
    if len(named) != len(leaves):
        raise CheckpointError(f"Two leaves of {prefix!r} have the same path name; cannot name them in a checkpoint.")
    return named


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return nested


def _unnest(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_unnest(value, name))
        else:
            flat[name] = value
    return flat


# -- writing -------------------------------------------------------------------------------------


def write(path: str, arrays: Mapping[str, Any], metadata: Mapping[str, Any], timeout: float = TIMEOUT) -> str:
    """Write ``arrays`` (name -> ``jax.Array``) and ``metadata`` as a committed checkpoint at
    ``path`` (an earlier checkpoint there is replaced; any other existing path is refused).

    Every process calls it (each writes its own shards); process 0 writes the marker and
    publishes the directory; no process returns before it is published. Should a process fail to
    write or process 0 fail to commit, every process raises the same
    :class:`polyparallel.CheckpointError` (none waits for a commit that will not come) and the
    staging directory is removed. Returns the path. The agreements between processes (the staging
    name, the shards written, the commit's outcome) wait at most ``timeout`` seconds each and are
    recorded in the collective trace.
    """
    import jax
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path) and not committed(path):
        raise CheckpointError(f"Cannot save at {path!r}: it exists and is not a polyparallel checkpoint; a save "
                              "replaces only an earlier checkpoint. Choose another path, or remove it first.")
    staging = core.staging_path(path, _token(timeout))
    checkpointer = ocp.PyTreeCheckpointer()  # synchronous: the commit below comes after every write
    failure: str | None = None
    try:
        checkpointer.save(os.path.join(staging, STATE), args=ocp.args.PyTreeSave(_nest(arrays)))
    except Exception as exc:  # noqa: BLE001 - told to every process below
        failure = f"writing its arrays failed on process {jax.process_index()}: {_os_text(exc)}"
    finally:
        checkpointer.close()
    # Every process learns whether all wrote their shards (the barrier before the commit), then
    # process 0 commits and every process learns whether it did; the same steps whatever failed.
    failure = _everyone_knows(failure, timeout, "shards written")
    if failure is None:
        if jax.process_index() == 0:
            try:
                core.write_marker(staging, dict(metadata))
                core.publish(staging, path)
            except Exception as exc:  # noqa: BLE001 - told to every process below, which else waits
                failure = f"committing it failed on process 0: {_os_text(exc)}"
        failure = _everyone_knows(failure, timeout, "commit outcome")
    if failure is not None:
        if jax.process_index() == 0:
            _remove(staging)
        raise CheckpointError(
            f"Strategy.save: {path!r}: {failure}. Nothing was published: {path!r} is as it was before this save (an "
            "earlier checkpoint there, or in its folder, stays the latest), and the staging directory is removed. "
            "Fix the cause (free disk space, permissions) and save again.")
    return path


def _remove(staging: str) -> None:
    """Remove a failed save's staging directory. tensorstore's writer threads of the other arrays
    may still finish (and create files) after orbax raised the first error: retry for a few
    seconds until the directory stays gone."""
    import time

    for _ in range(50):
        core.remove_staging(staging)
        if not os.path.lexists(staging):
            time.sleep(0.1)  # a late writer would have recreated it by now
            if not os.path.lexists(staging):
                return
        time.sleep(0.1)


def _os_text(exc: BaseException) -> str:
    """The operating system's error in ``exc``'s chain (``OSError: [Errno 28] ...``), else ``exc``."""
    from polyparallel._checkpoint_files import os_error
    from polyparallel._errors import exception_summary

    return exception_summary(os_error(exc) or exc)


_MESSAGE = 2048  # bytes of a failure's text shared with every process


def _across(operation: str, fn: Any, timeout: float) -> Any:
    """A process-level collective of saving, bounded and recorded (:func:`polyparallel_jax.ops.bounded`)."""
    import jax

    from .ops import bounded

    return bounded(fn, timeout=timeout, operation=operation, axis="world", rank=jax.process_index())


def _everyone_knows(failure: str | None, timeout: float = TIMEOUT, step: str = "agreement") -> str | None:
    """The first failure of any process (``None`` when none failed), in every process: one
    all-gather of a fixed-size buffer, bounded by ``timeout`` and recorded as
    ``save_checkpoint (<step>)`` (the barrier after the shards, then after the commit)."""
    import jax

    if jax.process_count() == 1:
        return failure
    from jax.experimental import multihost_utils

    mine = np.zeros(_MESSAGE + 1, dtype=np.uint8)
    if failure is not None:
        text = failure.encode("utf-8")[:_MESSAGE]
        mine[0], mine[1:1 + len(text)] = 1, np.frombuffer(text, dtype=np.uint8)
    every = np.asarray(_across(f"save_checkpoint ({step})", lambda: multihost_utils.process_allgather(mine), timeout))
    for row in every.reshape(-1, _MESSAGE + 1):
        if row[0]:
            return bytes(row[1:]).rstrip(b"\0").decode("utf-8", "replace")
    return None


def _token(timeout: float = TIMEOUT) -> str:
    # The staging directory's name must be the same in every process: process 0's random token.
    import jax

    token = uuid.uuid4().int % (1 << 62)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = int(_across("save_checkpoint (staging name)",
                            lambda: multihost_utils.broadcast_one_to_all(np.int64(token)), timeout))
    return f"{token:016x}"


# -- reading -------------------------------------------------------------------------------------


def committed(path: str) -> bool:
    """Whether ``path`` is a committed checkpoint directory."""
    return os.path.isfile(os.path.join(path, MARKER))


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata of the committed JAX checkpoint at ``path``; refuses a partial, truncated or
    non-JAX one (``polyparallel.CheckpointError``, ``FileNotFoundError`` without a directory)."""
    path = os.fspath(path)
    metadata = core.read_marker(path)
    if metadata.get("runtime") != "jax":
        raise CheckpointError(f"{path!r} was written by the {metadata.get('runtime')!r} runtime, not by JAX; load it "
                              f"with Strategy(runtime={metadata.get('runtime')!r}).")
    core.verify_files(path, metadata)
    return metadata


def stored_leaves(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Leaf name -> (shape, dtype) of the arrays in the checkpoint, read from orbax's metadata
    (no array is read)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.metadata(os.path.join(path, STATE)).item_metadata.tree
    except Exception as exc:  # noqa: BLE001 - any orbax failure here means the directory is damaged
        raise CheckpointError(f"The checkpoint at {path!r} is damaged: orbax cannot read its metadata ({exc}).") from None
    finally:
        checkpointer.close()
    return {name: (tuple(leaf.shape), np.dtype(leaf.dtype)) for name, leaf in _unnest(tree).items()}


def check_leaves(path: str, stored: Mapping[str, tuple[tuple[int, ...], Any]],
                 expected: Mapping[str, tuple[tuple[int, ...], Any]], sections: tuple[str, ...]) -> None:
    """Refuse a checkpoint whose leaves under ``sections`` differ from ``expected`` (names, shapes)."""
    def within(names: Any) -> set[str]:
        return {n for n in names if n.split("/", 1)[0] in sections}

    have, want = within(stored), within(expected)
    problems = []
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing:
        problems.append(f"missing {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listing(unexpected)}")
    for name in sorted(have & want):
        if tuple(stored[name][0]) != tuple(expected[name][0]):
            problems.append(f"{name} has shape {tuple(stored[name][0])} in the checkpoint but "
                            f"{tuple(expected[name][0])} here")
    if problems:
        raise CheckpointError(f"The checkpoint at {path!r} was written by another model or optimizer: "
                              + "; ".join(problems) + ". Nothing was restored. Load it into the model (and optimizer) "
                              "that wrote it.")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def restore(path: str, targets: Mapping[str, Any]) -> dict[str, Any]:
    """Read the arrays named in ``targets``: a ``jax.ShapeDtypeStruct`` with a sharding is read
    straight into that sharding (resharding to the reading mesh); ``np.ndarray`` (the class) reads
    a host array. Only the named leaves are read."""
    import orbax.checkpoint as ocp

    item, args = {}, {}
    for name, target in targets.items():
        if target is np.ndarray:
            item[name], args[name] = np.zeros(()), ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            item[name] = target
            args[name] = ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape, dtype=target.dtype)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        restored = checkpointer.restore(os.path.join(path, STATE), args=ocp.args.PyTreeRestore(
            item=_nest(item), restore_args=_nest(args), partial_restore=True))
    finally:
        checkpointer.close()
    return _unnest(restored)


# -- pytrees (NNX states, optimizer states) <-> named arrays -----------------------------------------


def _is_key(leaf: Any) -> bool:
    import jax

    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def tree_arrays(tree: Any, prefix: str) -> dict[str, Any]:
    """The array leaves of ``tree`` by name; typed PRNG keys as their raw ``key_data`` (what
    orbax stores); leaves that are no arrays (a Python scalar in a user's Variable) are left out."""
    import jax

    return {name: jax.random.key_data(leaf) if _is_key(leaf) else leaf
            for name, leaf in flatten(tree, prefix).items() if _is_array(leaf)}


def shapes(arrays: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Name -> (shape, dtype) of named arrays (concrete or ``jax.ShapeDtypeStruct``)."""
    return {name: (tuple(a.shape), a.dtype) for name, a in arrays.items()}


def restore_trees(path: str, sections: Mapping[str, Any]) -> dict[str, Any]:
    """``prefix -> tree``: each tree rebuilt from the checkpoint's arrays, each leaf read straight
    into the sharding the tree's leaf has now (the reading mesh); keys wrapped back with their
    implementation. Check the names first with :func:`check_leaves`."""
    import jax

    targets: dict[str, Any] = {}
    for prefix, tree in sections.items():
        for name, leaf in flatten(tree, prefix).items():
            if _is_array(leaf):
                data = jax.random.key_data(leaf) if _is_key(leaf) else leaf
                targets[name] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
    restored = restore(path, targets)
    out = {}
    for prefix, tree in sections.items():
        named, treedef = flatten(tree, prefix), jax.tree.structure(tree)
        leaves = []
        for name, leaf in named.items():
            if not _is_array(leaf):
                leaves.append(leaf)
            elif _is_key(leaf):
                leaves.append(jax.random.wrap_key_data(restored[name], impl=jax.random.key_impl(leaf)))
            else:
                leaves.append(restored[name])
        out[prefix] = jax.tree.unflatten(treedef, leaves)
    return out
