"""Saving and loading what the JAX plugin owns: a :class:`~polyparallel_jax.Model` (module,
optimizer state, progress of ``fit``), or a plain ``flax.nnx.Module`` with an ``nnx.Optimizer``
and a :class:`~polyparallel_jax.ShardedArrays` loader (the ``polyparallel_save_checkpoint`` /
``polyparallel_load_checkpoint`` hooks behind ``Strategy.save``/``Strategy.load``).

The format is :mod:`polyparallel_jax.checkpoint` (orbax-checkpoint under the core's commit
marker). Leaves are named ``module/params/...``, ``module/batch_stats/...``, ``module/other/...``
(RNG counters and keys, other variables), ``optimizer/...`` and ``extras/...`` (array extras).
Loading checks every name and shape against the objects it loads into before anything is
restored, then reads each array into the sharding the object has on the reading mesh. Flax
msgpack files written by earlier versions of ``Model.save`` (a file, not a directory) are still
read by ``Model.load``.

A ``Model`` is saved and loaded through its public methods (:class:`SavedModel`): this module
does not import :mod:`polyparallel_jax.model` (which imports it), and the Model's state changes
only by its own methods (``place``, ``restore_state``, with its one reset).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

import polyparallel as pp
from polyparallel import _checkpoints as core
from polyparallel._errors import exception_summary

from . import checkpoint as ck
from .steps import split_state

__all__ = ["MODULE_SECTIONS", "SavedModel", "checkpoint_every", "fit_checkpoint", "load_model", "load_module",
           "module_sections", "save_model", "save_module", "start_position"]

MODULE_SECTIONS = ("module/params", "module/batch_stats", "module/other")
#: What fit(checkpoint=DIR) names its checkpoints in DIR (found again by polyparallel.latest_checkpoint).
FIT_PATTERN = "step-*"
#: fit(checkpoint=DIR) keeps this many committed checkpoints in DIR, removing older ones.
FIT_KEEP = 2


class SavedModel(Protocol):
    """What saving uses of a :class:`polyparallel_jax.Model`: its public attributes and methods."""

    module: Any
    optimizer: Any
    history: dict[str, list[float]]

    @property
    def placed_strategy(self) -> pp.Strategy | None: ...

    @property
    def fit_progress(self) -> dict[str, Any] | None: ...

    def place(self, strategy: pp.Strategy | None = None) -> pp.Strategy | None: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore_state(self, read: Callable[[dict[str, Any]], Mapping[str, Any]], *, optimizer: bool,
                      progress: Mapping[str, Any] | None = None) -> None: ...

    def save(self, path: str, **extras: Any) -> str: ...

    def load(self, path: str, strategy: pp.Strategy | None = None, loader: Any = None) -> dict[str, Any]: ...


def module_sections(module: Any) -> dict[str, Any]:
    """An NNX module's state by checkpoint section (:data:`MODULE_SECTIONS`), as placed now."""
    _, params, stats, rest = split_state(module)
    return dict(zip(MODULE_SECTIONS, (params, stats, rest)))


def _arrays(sections: Mapping[str, Any]) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    for prefix, tree in sections.items():
        arrays.update(ck.tree_arrays(tree, prefix))
    return arrays


def _abstract(tree: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    # Leaves of a jax.eval_shape result (ShapeDtypeStruct) by name.
    return {name: (tuple(leaf.shape), leaf.dtype) for name, leaf in ck.flatten(tree, prefix).items()
            if hasattr(leaf, "shape")}


# -- metadata and extras -------------------------------------------------------------------------


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (bool, int, float))


def _extra_name(key: str) -> str:
    # core.split names tensors "extras.<key>.<index>"; orbax joins nested keys with "." itself.
    return key.replace(".", "/")


def _metadata(strategy: pp.Strategy | None, framework: str, loader: Mapping[str, Any] | None,
              extras: Mapping[str, Any], **more: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The marker's metadata (the core's fields, the loader's progress, the extras as JSON) and
    the extras' arrays by checkpoint name."""
    if strategy is not None:
        metadata = core.base_metadata(strategy, strategy.session(), framework)
    else:  # Model.fit on one device, without a strategy
        now = time.time_ns()
        metadata = {"format": core.FORMAT, "version": core.VERSION, "polyparallel": pp.__version__, "runtime": "jax",
                    "framework": framework, "topology": {"pipeline": 1, "data": 1, "tensor": 1}, "world_size": 1,
                    "zero": 0, "saved_at_ns": now, "saved_at": datetime.datetime.fromtimestamp(
                        now / 1e9, datetime.timezone.utc).isoformat(timespec="seconds")}
    for name, value in extras.items():
        core.check_value(value, f"the extra {name!r}")
    value, tensors = core.split(dict(extras), _is_array, "extras")
    loader = dict(loader) if loader is not None else None
    progress = None if loader is None else {"epoch": loader["epoch"], "step": loader["batches"],
                                            "global_step": loader["global_step"]}
    # The torch runtime's fields (progress, contents, tensors) so that `polyparallel checkpoint
    # inspect` reads both alike; epoch/step/global_batch also at the top level, as the issue asked.
    metadata.update(loader=loader, extras=value, progress=progress, tensors="orbax-checkpoint", **more,
                    epoch=loader["epoch"] if loader else None, step=loader["batches"] if loader else None,
                    global_step=loader["global_step"] if loader else None,
                    global_batch=loader["global_batch"] if loader else None)
    return metadata, {_extra_name(k): v for k, v in tensors.items()}


def _describe(metadata: dict[str, Any], arrays: Mapping[str, Any], loader: bool) -> dict[str, Any]:
    """Add what the checkpoint holds: ``contents`` (as the torch runtime writes it) and
    ``arrays`` (every leaf's name, shape and dtype, listed without reading orbax)."""
    sections = {name.split("/", 1)[0] for name in arrays}
    metadata["contents"] = {"model": "module" in sections, "optimizer": "optimizer" in sections, "loader": loader,
                            "extras": sorted(metadata.get("extras") or {})}
    metadata["arrays"] = [{"name": name, "shape": list(a.shape), "dtype": str(a.dtype)} for name, a in sorted(arrays.items())]
    return metadata


def _result(path: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What a load returns: ``{"epoch", "step", "global_step", **extras}`` (array extras as
    ``jax.Array``)."""
    import jax.numpy as jnp

    value = metadata.get("extras") or {}
    refs = core.tensor_refs(value)
    arrays = ck.restore(path, {_extra_name(k): np.ndarray for k in refs}) if refs else {}
    extras = core.join(value, {k: jnp.asarray(arrays[_extra_name(k)]) for k in refs})
    return {"epoch": metadata.get("epoch"), "step": metadata.get("step"), "global_step": metadata.get("global_step"),
            **extras}


def _check_loader(path: str, metadata: Mapping[str, Any], loader: Any) -> None:
    if loader is None:
        return
    saved = metadata.get("loader")
    if not saved:
        raise pp.CheckpointError(f"{path!r} was saved without a loader, so it cannot resume one exactly. Load it "
                                 "without loader= (weights only), or save with loader=.")
    core.check_loader_resume(path, saved, loader.state_dict())


# -- Model ----------------------------------------------------------------------------------------


def save_model(model: SavedModel, path: str, extras: Mapping[str, Any], framework: str = "flax",
               loader: Any = None) -> str:
    """``Model.save``: module state, optimizer state, ``fit`` progress (or ``loader``'s) and ``extras``."""
    sections = model.checkpoint_state()
    info = model.fit_progress or {}
    progress = loader.state_dict() if loader is not None else info.get("loader")
    metadata, extra_arrays = _metadata(model.placed_strategy, framework, progress, extras,
                                       fit={"history": info.get("history", {}), "partial": info.get("partial", [])})
    arrays = {**_arrays(sections), **extra_arrays}
    strategy = model.placed_strategy
    return ck.write(path, arrays, _describe(metadata, arrays, progress is not None),
                    strategy.timeout if strategy is not None else ck.TIMEOUT)


def load_model(model: SavedModel, path: str, strategy: pp.Strategy | None, loader: Any = None) -> dict[str, Any]:
    """``Model.load``: check, place on the reading strategy's mesh, restore into that placement."""
    import jax

    if os.path.isfile(path):
        return load_msgpack(model, path, strategy)
    metadata = ck.read_metadata(path)
    _check_loader(path, metadata, loader)
    stored = ck.stored_leaves(path)
    expected: dict[str, Any] = {}
    for prefix, tree in module_sections(model.module).items():
        expected.update(ck.shapes(ck.tree_arrays(tree, prefix)))
    with_optimizer = any(name.startswith("optimizer/") for name in stored)
    if with_optimizer:  # the optimizer's structure, without computing anything
        params = module_sections(model.module)["module/params"]
        expected.update(_abstract(jax.eval_shape(model.optimizer.init, params), "optimizer"))
    ck.check_leaves(path, stored, expected, ("module", "optimizer"))
    # The reading placement first: every array is then read straight into its sharding there.
    model.place(strategy)
    model.restore_state(lambda targets: ck.restore_trees(path, targets), optimizer=with_optimizer,
                        progress={"loader": metadata.get("loader"), **(metadata.get("fit") or {})})
    if loader is not None:
        loader.load_state_dict(metadata["loader"])
    return _result(path, metadata)


def load_msgpack(model: SavedModel, path: str, strategy: pp.Strategy | None = None) -> dict[str, Any]:
    """A flax msgpack file written by ``Model.save`` before the orbax format: parameters and
    BatchNorm statistics (checked by name and shape), optimizer leaves in order (no names, so only
    their count is checked); restored into the reading placement like a checkpoint directory."""
    import jax
    from flax import nnx, serialization
    from msgpack.exceptions import UnpackException

    expected_format = ("Model.load() reads a checkpoint directory written by Model.save(), or a flax msgpack file "
                       "written by an earlier Model.save()")
    with open(path, "rb") as f:
        content = f.read()
    try:
        blob = serialization.msgpack_restore(content)
    except (ValueError, UnpackException) as exc:  # msgpack's ExtraData, FormatError, OutOfData, ...
        raise pp.CheckpointError(f"{path!r} is a file that is not msgpack ({exception_summary(exc)}); "
                                 f"{expected_format}. Pass the checkpoint's directory.") from None
    if not isinstance(blob, dict) or "module" not in blob:
        raise pp.CheckpointError(f"{path!r} is msgpack but holds no 'module' state; {expected_format}.")
    values = ck.tree_arrays(blob["module"], "module")  # parameters and statistics together, by path
    here = ck.tree_arrays(nnx.state(model.module, (nnx.Param, nnx.BatchStat)), "module")
    ck.check_leaves(path, ck.shapes(values), ck.shapes(here), ("module",))
    saved = blob.get("opt_state") or {}
    if saved:
        params = nnx.state(model.module, nnx.Param)
        count = len(jax.tree.leaves(jax.eval_shape(model.optimizer.init, params)))
        if count != len(saved):
            raise pp.CheckpointError(f"The checkpoint's optimizer state has {len(saved)} arrays; this optimizer has "
                                     f"{count}. Load it into a Model with the same optimizer.")
    optimizer = [saved[str(i)] for i in range(len(saved))]

    def read(targets: dict[str, Any]) -> dict[str, Any]:  # the file names module leaves "module/<path>"
        out = {name: _placed_like(targets[name], [values[k] for k in ck.flatten(targets[name], "module")])
               for name in ("module/params", "module/batch_stats")}
        if "optimizer" in targets:
            out["optimizer"] = _placed_like(targets["optimizer"], optimizer)
        return out

    model.place(strategy)
    model.restore_state(read, optimizer=bool(saved), progress=None)
    return {"epoch": None, "step": None, "global_step": None}


def _placed_like(tree: Any, values: list[Any]) -> Any:
    """``tree`` with its array leaves replaced, in order, by ``values`` (host arrays) placed in
    their shardings and dtypes."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.device_put(np.asarray(value, leaf.dtype), leaf.sharding)
                                        for value, leaf in zip(values, leaves, strict=True)])


# -- a plain NNX module (and nnx.Optimizer) through the hooks ---------------------------------------


def save_module(strategy: pp.Strategy, path: str, module: Any, optimizer: Any, loader: Any, framework: str,
                extras: Mapping[str, Any]) -> str:
    """A ``flax.nnx.Module`` (and an ``nnx.Optimizer``) as they are placed now."""
    from flax import nnx

    sections = module_sections(module)
    if optimizer is not None:
        sections["optimizer"] = nnx.state(optimizer)
    metadata, extra_arrays = _metadata(strategy, framework, loader.state_dict() if loader is not None else None, extras)
    arrays = {**_arrays(sections), **extra_arrays}
    return ck.write(path, arrays, _describe(metadata, arrays, loader is not None), strategy.timeout)


def load_module(path: str, module: Any, optimizer: Any, loader: Any) -> dict[str, Any]:
    """Restore into ``module`` (and ``optimizer``, ``loader``) in place, each array in the sharding
    its current value has (place the module on the reading mesh first: ``strategy.wrap_model``)."""
    from flax import nnx

    metadata = ck.read_metadata(path)
    _check_loader(path, metadata, loader)
    sections = module_sections(module)
    checked: tuple[str, ...] = ("module",)
    if optimizer is not None:
        sections["optimizer"] = nnx.state(optimizer)
        checked = ("module", "optimizer")
    ck.check_leaves(path, ck.stored_leaves(path), ck.shapes(_arrays(sections)), checked)
    restored = ck.restore_trees(path, sections)
    nnx.update(module, *(restored[name] for name in MODULE_SECTIONS))
    if optimizer is not None:
        nnx.update(optimizer, restored["optimizer"])
    if loader is not None:
        loader.load_state_dict(metadata["loader"])
    return _result(path, metadata)


# -- fit(checkpoint=, resume=) ---------------------------------------------------------------------


def checkpoint_every(checkpoint: str | None, every: int | None) -> int | None:
    """``fit(checkpoint_every=)`` checked (a positive int, with ``checkpoint=``)."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint_every must be a positive int (steps). Received: {every!r}.")
    if checkpoint is None:
        raise ValueError("checkpoint_every= saves into checkpoint=DIR; pass checkpoint= as well.")
    return every


def fit_checkpoint(model: SavedModel, directory: str, global_step: int) -> None:
    """``fit(checkpoint=DIR)``: save ``DIR/step-<global step>``, then keep the newest
    :data:`FIT_KEEP` committed ones (half-written ones of killed jobs go too)."""
    import shutil

    import jax

    model.save(os.path.join(directory, f"step-{global_step:08d}"))
    if jax.process_index() == 0:
        found = core.list_checkpoints(directory, FIT_PATTERN)
        keep = {c["path"] for c in [c for c in found if c["committed"]][-FIT_KEEP:]}
        for entry in found:
            if entry["path"] not in keep:
                shutil.rmtree(entry["path"], ignore_errors=True)


def start_position(model: SavedModel, checkpoint: str | None, resume: bool | str, data: Any) -> tuple[int, int, list[Any]]:
    """Where ``fit`` starts: ``(0, 0, [])``, or after loading the checkpoint ``resume`` names
    (``True``: the newest committed one in ``checkpoint``, none yet: from scratch) the saved
    epoch, step and partial epoch's metric sums, with the saved history put back. A fit whose
    data settings differ from the saved ones is refused before anything is restored."""
    if resume is False:
        return 0, 0, []
    if resume is True:
        if checkpoint is None:
            raise ValueError("fit(resume=True) resumes from the newest checkpoint in checkpoint=DIR; pass checkpoint= "
                             "(or resume=PATH).")
        source = pp.latest_checkpoint(checkpoint, FIT_PATTERN)
        if source is None:
            return 0, 0, []  # nothing committed yet: the first attempt of an elastic job
    elif isinstance(resume, (str, os.PathLike)):
        source = os.fspath(resume)
    else:
        raise TypeError(f"resume must be True, False or a checkpoint path. Received: {type(resume).__name__}.")
    metadata = ck.read_metadata(source)
    if not metadata.get("fit") or not metadata.get("loader"):
        raise pp.CheckpointError(f"Cannot resume fit from {source!r}: it holds no fit progress (saved outside fit). "
                                 "Load it with Model.load(path) and call fit without resume=.")
    model.load(source, loader=data)  # into the current placement; checks the loader first
    model.history = {k: list(v) for k, v in (metadata["fit"].get("history") or {}).items()}
    epoch, step = int(metadata["loader"]["epoch"]), int(metadata["loader"]["batches"])
    return epoch, step, [(m, c) for m, c in metadata["fit"].get("partial", [])]
