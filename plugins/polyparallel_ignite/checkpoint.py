"""Ignite checkpoints as polyparallel checkpoints: ``Checkpoint`` handlers that write through
``strategy.save``, and a resume that reads through ``strategy.load``.

Ignite's :class:`~ignite.handlers.Checkpoint` decides *when* to save and which files to keep
(``n_saved``, scores, ``global_step_transform``); what it writes is the job of its
``save_handler``. :class:`PolyparallelSaver` is such a handler: instead of ``torch.save`` of the
state dicts on one rank, every rank calls ``strategy.save(dirname/filename, ...)`` with the live
objects of ``to_save``, which writes one ``torch.distributed.checkpoint`` directory (each shard once,
committed atomically) that loads at another topology, in Lightning or a plain loop:

- the ``nn.Module`` is ``model=``, the ``torch.optim.Optimizer`` ``optimizer=`` (one each);
- the trainer ``Engine`` is saved as the extra ``engine`` (its ``state_dict()``: epoch,
  iteration, epoch length), and the loader it runs (``engine.state.dataloader``, when it is a
  loader ``strategy.shard_data`` / ``auto_dataloader`` made) as ``loader=``: its epoch and the
  batches of it consumed;
- any other object with ``state_dict()`` (an LR scheduler, a metric) as an extra under its
  name; its state must be plain data and tensors (nothing is pickled).

:func:`load_checkpoint` restores them: model and optimizer in place (resharded to this
topology), the loader's position (its next pass continues the saved epoch after the consumed
batches), the engine's epoch and iteration, the other objects' ``load_state_dict``. A following
``trainer.run(loader, max_epochs=N)`` continues the saved epoch where it stopped, so the run
ends with the parameters of an uninterrupted one.
"""

from __future__ import annotations

import numbers
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine
from ignite.handlers.checkpoint import Checkpoint, DiskSaver
from torch import nn

import polyparallel as pp

__all__ = ["PolyparallelSaver", "make_checkpoint", "load_checkpoint"]

#: The extra the trainer engine's state is saved under.
ENGINE = "engine"


def _directory_pattern(kwargs: Mapping[str, Any]) -> str:
    """Ignite's default file name pattern for these ``Checkpoint`` options, without the ``.pt``
    extension: a polyparallel checkpoint is a directory."""
    scored = kwargs.get("score_function") is not None or kwargs.get("score_name") is not None
    pattern = Checkpoint.setup_filename_pattern(
        with_prefix=bool(kwargs.get("filename_prefix")), with_score=scored,
        with_score_name=kwargs.get("score_name") is not None,
        # Ignite names a global step unless a score decides and no transform gives one.
        with_global_step=kwargs.get("global_step_transform") is not None or not scored)
    return pattern.removesuffix(".{ext}")


def _sorted_objects(where: str, objects: Mapping[str, Any]) -> dict[str, Any]:
    """``objects`` by role: ``model``, ``optimizer``, ``engine`` (name -> Engine), ``others``.
    One model and at most one optimizer and one engine; anything else needs ``state_dict``."""
    if not isinstance(objects, Mapping) or not objects:
        raise TypeError(f"{where} takes a non-empty dict of name -> object (model, optimizer, trainer engine, "
                        f"...). Received: {objects!r}.")
    roles: dict[str, Any] = {"model": {}, "optimizer": {}, "engine": {}, "others": {}}
    for name, obj in objects.items():
        if not isinstance(name, str):
            raise TypeError(f"{where}: names must be strings. Received: {name!r}.")
        if isinstance(obj, nn.Module):
            roles["model"][name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            roles["optimizer"][name] = obj
        elif isinstance(obj, Engine):
            roles["engine"][name] = obj
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            if name in (*pp_reserved(), ENGINE):  # its state is an extra saved under its name
                raise TypeError(f"{where}: {name!r} cannot name a {type(obj).__name__} (reserved: "
                                f"{[*pp_reserved(), ENGINE]}); use another name, e.g. 'scheduler'.")
            roles["others"][name] = obj
        else:
            raise TypeError(f"{where}: {name!r} is a {type(obj).__name__}, which has no state_dict/load_state_dict.")
    for role in ("model", "optimizer", "engine"):
        if len(roles[role]) > 1:
            raise TypeError(f"{where}: a polyparallel checkpoint holds one {role}; received {sorted(roles[role])}.")
    if not roles["model"]:
        raise TypeError(f"{where}: no nn.Module among {sorted(objects)}: a checkpoint holds one model.")
    return roles


def pp_reserved() -> tuple[str, ...]:
    """Names ``Strategy.save`` keeps for itself (objects, framework, progress)."""
    return ("model", "optimizer", "loader", "framework", "epoch", "step", "global_step")


def _one(objects: dict[str, Any]) -> Any:
    return next(iter(objects.values()), None)


class PolyparallelSaver(DiskSaver):
    """An Ignite ``save_handler`` that writes ``to_save`` with ``strategy.save`` (module docstring).

    Every rank runs it (polyparallel writes each shard on the rank that holds it); the
    ``checkpoint`` mapping Ignite computed is not used: the live objects are saved. A
    ``DiskSaver`` for Ignite (so ``Checkpoint.last_checkpoint`` is the full path), but none of
    its ``torch.save`` machinery is used: ``strategy.save`` commits each directory atomically.

    :param strategy: the strategy of the job.
    :param dirname: the folder the checkpoint directories go to (made if missing).
    :param to_save: the same mapping given to ``Checkpoint(to_save, ...)``.
    """

    def __init__(self, strategy: pp.Strategy, dirname: str | os.PathLike[str], to_save: Mapping[str, Any]):
        # DiskSaver.__init__ is not called: its checks are about .pt files on one rank.
        self.strategy = strategy
        self.dirname = Path(dirname).expanduser().absolute()
        self.roles = _sorted_objects("PolyparallelSaver(to_save=)", to_save)
        self._atomic, self.save_on_rank, self.kwargs = True, 0, {}
        self._pending: list[str] = []  # names remove() was given, deleted after the next save commits

    def state(self) -> dict[str, Any]:
        """The keywords of ``strategy.save``: objects, the engine's state and the other objects' states."""
        roles = self.roles
        state: dict[str, Any] = {"model": _one(roles["model"]), "optimizer": _one(roles["optimizer"]),
                                 "framework": "ignite"}
        engine = _one(roles["engine"])
        if engine is not None:
            state[ENGINE] = {k: v for k, v in engine.state_dict().items() if v is not None}
            loader = engine.state.dataloader
            if _is_sharded_loader(loader):
                state["loader"] = loader
        for name, obj in roles["others"].items():
            state[name] = obj.state_dict()
        return state

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        """Write ``dirname/filename`` (a directory) on every rank through ``strategy.save``, then
        remove the checkpoints ``Checkpoint`` dropped before calling it (:meth:`remove`)."""
        self.strategy.save(self.dirname / filename, **self.state())
        pending, self._pending = self._pending, []
        if self.strategy.session().rank == 0:
            for name in pending:
                if name != filename:  # re-saved under the same name: strategy.save replaced it atomically
                    shutil.rmtree(self.dirname / name, ignore_errors=True)

    def remove(self, filename: str) -> None:
        """Remove a checkpoint ``Checkpoint`` no longer keeps (``n_saved``): once, by rank 0, after
        the save ``Checkpoint`` makes next has committed. Ignite calls ``remove`` *before* that save,
        also for a file name it is about to write again; removing at once would delete the last
        committed checkpoint before its successor exists (a failed or killed save would leave none,
        and peers checking the path would see a directory half deleted)."""
        self._pending.append(filename)


def _is_sharded_loader(loader: Any) -> bool:
    """Whether ``loader`` is one ``strategy.shard_data`` made (its sampler follows the topology)."""
    from polyparallel_torch.data import TopologySampler

    return isinstance(getattr(loader, "sampler", None), TopologySampler)


def make_checkpoint(strategy: pp.Strategy, to_save: Mapping[str, Any], dirname: str | os.PathLike[str], *,
                    every: int | None = None, **kwargs: Any) -> Checkpoint:
    """An Ignite ``Checkpoint`` over :class:`PolyparallelSaver` (``IgniteAdapter.checkpoint``).

    :param every: attach it to the trainer engine of ``to_save`` at every ``every``-th
        ``ITERATION_COMPLETED`` (default: not attached; attach it yourself to any event).
    :param kwargs: ``Checkpoint``'s (``n_saved=``, ``score_function=``, ``filename_prefix=``...;
        every rank uses rank 0's score, so all of them decide alike whether to save);
        ``filename_pattern`` defaults to Ignite's without ``.pt`` (``checkpoint_70``: a directory).
    """
    if "save_handler" in kwargs:
        raise TypeError("checkpoint(save_handler=) is the polyparallel saver; use Checkpoint(...) directly for "
                        "another handler.")
    saver = PolyparallelSaver(strategy, dirname, to_save)
    if kwargs.get("filename_pattern") is None:
        kwargs["filename_pattern"] = _directory_pattern(kwargs)
    if kwargs.get("score_function") is not None:
        kwargs["score_function"] = _rank0_score(strategy, kwargs["score_function"])
    handler = Checkpoint(to_save, saver, **kwargs)
    if every is not None:
        from ignite.engine import Events

        engine = _one(saver.roles["engine"])
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint(every=) takes an int >= 1. Received: {every!r}.")
        if engine is None:
            raise TypeError("checkpoint(every=) attaches the handler to the trainer engine in to_save; there is none. "
                            "Add it (to_save={'trainer': trainer, ...}) or attach the handler yourself.")
        engine.add_event_handler(Events.ITERATION_COMPLETED(every=every), handler)
    return handler


def _rank0_score(strategy: pp.Strategy, score_function: Callable[[Engine], Any]) -> Callable[[Engine], Any]:
    """``score_function`` with rank 0's value on every rank. ``Checkpoint`` decides from the score
    whether to save, and the save is collective: a score computed per rank (a metric of the
    rank's shard) would make some ranks save and others not, and the savers wait forever. Every
    rank calls the score at the same event, so one broadcast (bounded by the strategy's timeout)
    gives all of them rank 0's, with its type (an int names the file ``..._5``, a float ``..._5.0000``)."""
    from polyparallel_torch.runtime import get_runtime

    def score(engine: Engine) -> Any:
        value = score_function(engine)
        session = strategy.session()
        if session.world_size == 1:
            return value
        number = isinstance(value, numbers.Number) and not isinstance(value, complex)
        shared = torch.tensor([float(value) if number else 0.0, float(number),
                               float(isinstance(value, numbers.Integral))], dtype=torch.float64)
        get_runtime(session).broadcast(shared, "ignite checkpoint (score of rank 0)", "world")
        if not shared[1]:
            raise ValueError("checkpoint(score_function=) must return a number (every rank uses rank 0's); "
                             f"on rank 0 it returned something else{'' if session.rank else f': {value!r}'}.")
        return int(shared[0].item()) if shared[2] else float(shared[0].item())

    return score


def load_checkpoint(strategy: pp.Strategy, path: str | os.PathLike[str], to_load: Mapping[str, Any],
                    loader: Any = None) -> dict[str, Any]:
    """Restore ``to_load`` (the ``to_save`` mapping) from a polyparallel checkpoint
    (``IgniteAdapter.load_checkpoint``): model and optimizer in place at this topology, the trainer
    engine's epoch and iteration, the other objects' ``load_state_dict``, and — with ``loader``,
    the sharded training loader the engine will run — its position, for exact resumption.

    :return: what ``strategy.load`` returned (progress and extras).
    """
    roles = _sorted_objects("load_checkpoint(to_load=)", to_load)
    state = {"model": _one(roles["model"]), "optimizer": _one(roles["optimizer"]), "loader": loader}
    restored = strategy.load(path, **{k: v for k, v in state.items() if v is not None})
    engine = _one(roles["engine"])
    if engine is not None:
        saved = restored.get(ENGINE)
        if not isinstance(saved, Mapping):
            raise pp.CheckpointError(f"{os.fspath(path)!r} holds no Ignite engine state (another framework or a "
                                     "plain loop wrote it); leave the engine out of to_load (the model, optimizer "
                                     "and loader were restored), or resume from a checkpoint an Ignite job wrote.")
        engine.load_state_dict(dict(saved))
    for name, obj in roles["others"].items():
        if name not in restored:
            raise pp.CheckpointError(f"{os.fspath(path)!r} holds no state for {name!r} (saved: "
                                     f"{sorted(k for k in restored if k not in pp_reserved())}).")
        obj.load_state_dict(restored[name])
    return restored
