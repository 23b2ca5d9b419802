"""Lightning checkpoints as polyparallel checkpoints: one DCP directory, resharded on load.

``ModelCheckpoint``, ``trainer.save_checkpoint(path)`` and ``trainer.fit(ckpt_path=path)`` go
through :class:`CheckpointMixin` (shared by both stages' strategies), which Lightning calls through
its public ``Strategy`` extension points, as its own ``ModelParallelStrategy`` does for
distributed checkpoints:

- ``save_checkpoint(checkpoint, path)``: the model and optimizer are written by
  ``strategy.save(path, model=, optimizer=, framework="lightning", lightning=...)`` — the torch
  runtime's ``torch.distributed.checkpoint`` directory, each shard written once, committed
  atomically — and the rest of Lightning's checkpoint dictionary (epoch, global step, loop
  progress with the training loader's position, callback states, LR schedulers, hyperparameters)
  rides along as the ``lightning`` extra (plain data and tensors only: nothing is unpickled on load).
- ``load_checkpoint(path)``: ``strategy.load(path, model=, optimizer=)`` restores the model and
  optimizer in place at *this* topology (written at data=2 x tensor=2, read at data=4, or in a
  plain loop / Ignite / a single process), then hands Lightning its dictionary back to restore
  loops, callbacks and schedulers. ``restore_checkpoint_after_setup`` is true, so the model is
  wrapped (DDP, DTensor shards, FSDP2) and its optimizers exist when the checkpoint is read.

The training loader's position (epoch, batches consumed) reaches Lightning's fit loop through
the ``ResumableLoader`` (:func:`resumable_loader_class`: the ``ShardedLoader`` that
``strategy.shard_data`` made, whose ``state_dict`` / ``load_state_dict`` Lightning 2.4-2.6 saves in
``loops`` and restores before the first batch, Lightning's "stateful dataloader" protocol), so a
run stopped in the middle of an epoch continues with the remaining batches of that epoch, in the
order of an uninterrupted run, without Lightning's warning about a loader that is not resumable.
It is also saved as ``loader=``, so Ignite or a plain loop resumes from the same position.

Older checkpoints still load: a *file* (the consolidated checkpoint earlier versions of the
adapter wrote at stage 0, full tensors) goes through Lightning's ``CheckpointIO`` and is cut into
this rank's shards (:func:`localize_state`, :func:`localize_optimizer`; local slicing, no
communication); a directory written by Lightning's ``ModelParallelStrategy`` (earlier versions
of the adapter at stages 1-3: it holds ``meta.pt``) is read as that strategy reads it, except
that nothing is unpickled (:func:`load_lightning_directory`: DCP's index through the allow-listed
reader, its other entries and ``meta.pt`` with ``torch.load(weights_only=True)``), so a crafted
directory cannot run code. A failed save raises ``polyparallel.CheckpointError`` on every rank
(Lightning's ``ModelCheckpoint`` sees an ordinary exception; nothing is published).

Asynchronous saves: with Lightning's own switch, ``Trainer(plugins=[AsyncCheckpointIO()])``, each
save goes through ``strategy.async_save`` (training continues while the files are written; the
commit stays atomic). The save in flight is finished (its error raised, on every rank) before
the next save, before ``ModelCheckpoint`` removes an older checkpoint (the new one is committed
first), before a load, and at the strategy's teardown.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import polyparallel as pp

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["CheckpointMixin", "is_tensor_parallel", "load_lightning_directory", "localize_state", "localize_optimizer"]

#: What Lightning's checkpoint dictionary holds that the polyparallel checkpoint stores itself.
_TENSOR_STATE = ("state_dict", "optimizer_states")
#: The file a directory written by Lightning's ModelParallelStrategy holds (its own format).
_LIGHTNING_METADATA = "meta.pt"


def _dtensor_type() -> type[DTensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (the plan was applied already)."""
    dtensor = _dtensor_type()
    return any(isinstance(p, dtensor) for p in module.parameters())


def _shard_like(full: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    # src_data_rank=None: every rank holds the full tensor already; slice locally, no collective.
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def localize_state(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """A copy of ``state`` (a full state dict) whose entries are cut into the shards of the
    DTensor entries of ``module``'s own state dict."""
    dtensor = _dtensor_type()
    out = dict(state)
    for name, current in module.state_dict().items():
        value = out.get(name)
        if isinstance(current, dtensor) and isinstance(value, torch.Tensor) and not isinstance(value, dtensor):
            out[name] = _shard_like(value, current)
    return out


def localize_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """In place: optimizer state of DTensor parameters (momentum, Adam moments) loaded as full
    tensors is cut into the parameter's shards."""
    dtensor = _dtensor_type()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, dtensor) or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == param.shape:
                    state[key] = _shard_like(value, param)


def epoch_length_loader(loader: Any) -> Any:
    """``loader`` (a ``ShardedLoader`` from ``strategy.shard_data``) as a :class:`ResumableLoader`:
    the same dataset, sampler and options; anything else is returned as it is."""
    from polyparallel_torch.data import ShardedLoader, _loader_options

    if type(loader) is not ShardedLoader:
        return loader
    return resumable_loader_class()(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                                    **_loader_options(loader))


@functools.cache
def resumable_loader_class() -> type:
    """:class:`ResumableLoader`, built on first use (``ShardedLoader`` imports torch)."""
    from polyparallel_torch.data import ShardedLoader

    class ResumableLoader(ShardedLoader):
        """The training loader Lightning runs: a ``ShardedLoader`` (``state_dict`` /
        ``load_state_dict``, which Lightning's fit loop saves in ``loops`` and restores before the
        first batch of a resumed run) whose ``len()`` is always the whole epoch's.

        Lightning counts a resumed epoch from its own progress (batches already done, restored
        from the checkpoint) up to ``len(loader)``, as for torchdata's ``StatefulDataLoader``: a
        length shortened by the consumed batches would end the resumed epoch early."""

        def __len__(self) -> int:
            sampler = self.sampler
            batches, rest = divmod(sampler._len, self.batch_size)  # type: ignore[attr-defined]
            return batches + int(bool(rest) and not self.drop_last)

    ResumableLoader.__module__ = __name__
    return ResumableLoader


def load_lightning_directory(strategy: Any, path: str, weights_only: bool | None) -> dict[str, Any]:
    """A directory in Lightning's own ``ModelParallelStrategy`` format (DCP shards + ``meta.pt``:
    what earlier versions of the adapter wrote at stages 1-3), restored into ``strategy.model``
    and its optimizers as Lightning's own loader does, but without unpickling anything: DCP's
    ``.metadata`` is read with the allow-listed reader (a crafted index is refused before
    anything is read), its non-tensor entries with ``torch.load(weights_only=True)`` first, and
    ``meta.pt`` with ``weights_only=True`` unless the caller passed ``weights_only=False``.
    Returns the rest of Lightning's checkpoint dictionary (``meta.pt``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from polyparallel_torch.checkpoint_files import read_dcp_metadata, safe_load_planner, safe_reader

    read_dcp_metadata(path, allow_bytes=True)  # every rank refuses a crafted index alike, before any collective
    module = strategy.model
    module_state = {"state_dict": get_model_state_dict(module)}
    dcp.load(module_state, storage_reader=safe_reader(path, allow_bytes=True), planner=safe_load_planner())
    module.load_state_dict(module_state["state_dict"], strict=strategy.lightning_module.strict_loading)
    for idx, optimizer in enumerate(_plain(o) for o in strategy.optimizers):
        key = f"optimizer_{idx}"
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optim_state, storage_reader=safe_reader(path, allow_bytes=True), planner=safe_load_planner())
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return torch.load(os.path.join(path, _LIGHTNING_METADATA), weights_only=weights_only is not False)


def _plain(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (``_optimizer``, public as ``optimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


class CheckpointMixin:
    """Lightning's checkpoint hooks over ``strategy.save`` / ``strategy.load`` (module docstring).

    Mixed into both stages' strategies; a stage supplies :meth:`_load_legacy_directory` for the
    directories its earlier versions wrote.
    """

    _pp: Any
    #: How the checkpoint being restored was read: "polyparallel", "file" (consolidated) or "lightning".
    _restored_from: str | None = None
    #: The future of the asynchronous save in flight (``AsyncCheckpointIO``), if any.
    _pending_save: Any = None

    def _asynchronous(self) -> bool:
        """Whether the Trainer asked for asynchronous saves (Lightning's ``AsyncCheckpointIO`` plugin)."""
        io = getattr(self, "_checkpoint_io", None)
        return any(c.__name__ == "AsyncCheckpointIO" for c in type(io).__mro__) if io is not None else False

    def _finish_pending_save(self) -> None:
        """Finish the asynchronous save in flight, raising its error (the same on every rank)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        """The save in flight is finished first, then Lightning's teardown."""
        try:
            self._finish_pending_save()
        finally:
            super().teardown()  # type: ignore[misc]

    # -- saving ---------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """States synchronised (the StatePolicy; every rank runs it, as Lightning dumps a checkpoint
        on every rank), then the module's own (sharded) state dict — no gathering: the
        checkpoint writes each shard where it lives."""
        self.sync_states()  # type: ignore[attr-defined]
        return self.lightning_module.state_dict()  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's own (sharded) state dict; the checkpoint reads the live optimizer."""
        return _plain(optimizer).state_dict()

    def _checkpoint_optimizer(self, checkpoint: Mapping[str, Any]) -> Any:
        """The one optimizer to save with the model, or ``None`` for a weights-only checkpoint."""
        if "optimizer_states" not in checkpoint:
            return None
        optimizers = [_plain(o) for o in self.optimizers]  # type: ignore[attr-defined]
        if len(optimizers) > 1:
            raise TypeError(f"The polyparallel Lightning checkpoint holds one optimizer; configure_optimizers "
                            f"returned {len(optimizers)}. Use one optimizer (parameter groups for different "
                            "settings), or save_weights_only=True.")
        return optimizers[0] if optimizers else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` as one polyparallel checkpoint directory at ``filepath`` (every rank
        calls it; rank 0's path is used). ``storage_options`` is refused: the runtime writes the
        directory, not Lightning's ``CheckpointIO``."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: the "
                            "checkpoint is written by torch.distributed.checkpoint, not a CheckpointIO.")
        optimizer = self._checkpoint_optimizer(checkpoint)  # refused before the broadcast (a collective)
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # type: ignore[attr-defined]
        lightning = {k: v for k, v in checkpoint.items() if k not in _TENSOR_STATE}
        state: dict[str, Any] = {"model": self.lightning_module, "framework": "lightning",  # type: ignore[attr-defined]
                                 "lightning": lightning}
        if optimizer is not None:
            state["optimizer"] = optimizer
        loader = self._train_loader()
        if loader is not None:
            state["loader"] = loader  # its position, for a resume outside Lightning (Ignite, a plain loop)
        self._finish_pending_save()
        if self._asynchronous():
            self._pending_save = self._pp.async_save(path, **state)
        else:
            self._pp.save(path, **state)

    def _train_loader(self) -> Any:
        """The training loader ``strategy.shard_data`` made for the (last) fit, if any."""
        from polyparallel_torch.data import ShardedLoader

        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if trainer is None:
            return None
        loader = trainer.train_dataloader
        return loader if isinstance(loader, ShardedLoader) else None

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint (a directory, or an older file) once, after every rank is past it
        (and after the save in flight, which replaces it, is committed)."""
        self._finish_pending_save()
        self.barrier("remove_checkpoint")  # type: ignore[attr-defined]
        if self.global_rank == 0:  # type: ignore[attr-defined]
            self.checkpoint_io.remove_checkpoint(filepath)  # type: ignore[attr-defined]

    # -- loading ---------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: the checkpoint is read into the wrapped model and its optimizers (shards exist)."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """Whether Lightning loads the optimizer state itself: only from an older consolidated file
        (a polyparallel checkpoint restored it already in :meth:`load_checkpoint`)."""
        return self._restored_from == "file"

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model (and optimizer, when fitting) from ``checkpoint_path`` at this topology;
        return Lightning's dictionary (loops, callbacks, schedulers) for it to restore the rest.

        :param weights_only: Lightning's (2.6) option for ``torch.load``; used for older files
            only (a polyparallel checkpoint never unpickles objects).
        """
        self._finish_pending_save()
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))  # type: ignore[attr-defined]
        if os.path.isfile(path):
            self._restored_from = "file"
            options = {} if weights_only is None else {"weights_only": weights_only}
            return self.checkpoint_io.load_checkpoint(path, **options)  # type: ignore[attr-defined]
        if os.path.isfile(os.path.join(path, _LIGHTNING_METADATA)):
            self._restored_from = "lightning"
            return self._load_legacy_directory(path, weights_only)
        self._restored_from = "polyparallel"
        state: dict[str, Any] = {"model": self.lightning_module}  # type: ignore[attr-defined]
        optimizers = [_plain(o) for o in self.optimizers]  # type: ignore[attr-defined]
        if len(optimizers) == 1:
            state["optimizer"] = optimizers[0]
        elif len(optimizers) > 1:
            # After the path's broadcast: which kind of checkpoint it is (an older single file
            # with several optimizers loads) is known only from rank 0's path. Every rank runs
            # that broadcast and has the same optimizers, so every rank raises here alike.
            raise TypeError(f"The polyparallel Lightning checkpoint holds one optimizer; this module has "
                            f"{len(optimizers)}.")
        restored = self._pp.load(path, **state)
        lightning = restored.get("lightning")
        if not isinstance(lightning, dict):
            raise pp.CheckpointError(
                f"{path!r} is a polyparallel checkpoint written outside Lightning (Ignite, a plain loop): it holds "
                "no Lightning loop state. Its model and optimizer were loaded; to train on from them, call "
                "strategy.load(path, model=module, optimizer=optimizer) yourself and fit without ckpt_path=.")
        return dict(lightning)

    def _load_legacy_directory(self, path: str, weights_only: bool | None) -> dict[str, Any]:
        """A checkpoint directory in Lightning's own ``ModelParallelStrategy`` format."""
        raise ValueError(f"{path!r} is a checkpoint directory written by Lightning's ModelParallelStrategy "
                         "(it holds meta.pt); load it with Strategy(zero=1|2|3), whose Lightning strategy reads it.")

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Only for an older consolidated file: its full tensors, cut into this rank's shards
        (a polyparallel checkpoint was restored in :meth:`load_checkpoint`)."""
        if self._restored_from != "file":
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        state = checkpoint["state_dict"]
        if is_tensor_parallel(module):
            state = localize_state(state, module)
        module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Only for an older consolidated file: optimizer states, cut into shards."""
        if self._restored_from != "file":
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):  # type: ignore[attr-defined]
            optimizer = _plain(optimizer)
            optimizer.load_state_dict(state)
            localize_optimizer(optimizer)
