"""``polyparallel.CheckpointManager``: numbered checkpoints in one folder, the newest ``keep`` kept
(what orbax's ``CheckpointManager(max_to_keep=)`` and Lightning's ``ModelCheckpoint(save_top_k=)``
give their users), for plain loops and any runtime (framework-free: it calls ``Strategy.save``,
``Strategy.async_save`` and ``Strategy.load``).

>>> manager = pp.CheckpointManager(strategy, "ckpts", keep=3)                     # doctest: +SKIP
>>> progress = manager.restore(model=model, optimizer=opt, loader=loader)         # doctest: +SKIP
>>> manager.save(step, model=model, optimizer=opt, loader=loader)                 # doctest: +SKIP
>>> manager.wait()                                                                # doctest: +SKIP
"""

from __future__ import annotations

import os
import string
from typing import TYPE_CHECKING, Any

from . import _checkpoints

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["CheckpointManager"]


def _pattern(name: str) -> str:
    """``name``'s glob pattern: each ``{step...}`` field a ``*``."""
    parts = []
    fields = []
    for literal, field, _, _ in string.Formatter().parse(name):
        parts.append(literal.replace("*", "[*]").replace("?", "[?]"))
        if field is not None:
            fields.append(field)
            parts.append("*")
    if fields != ["step"]:
        raise ValueError(f"CheckpointManager(name=) must hold the field {{step}} once (e.g. 'step-{{step:08d}}'). "
                         f"Received: {name!r}.")
    return "".join(parts)


class CheckpointManager:
    """Save ``directory/<name>`` per step, keep the ``keep`` newest committed checkpoints, restore
    the newest.

    :param strategy: the job's strategy (every rank makes the manager alike).
    :param directory: the folder of the checkpoints (made by the first save).
    :param keep: how many committed checkpoints stay (>= 1); after each commit, rank 0 removes the
        older ones and the staging directories of saves that failed or were killed (those older
        than the newest commit: a save in progress is never touched). ``None``: keep all.
    :param name: the name of step ``step``'s checkpoint (``{step}`` once, with any format spec);
        zero-padded by default, so that names sort like steps.
    :param asynchronous: save with ``Strategy.async_save`` (training goes on while the files are
        written; :meth:`save` returns the future; the next save or :meth:`wait` finishes it).
    """

    def __init__(self, strategy: Strategy, directory: str | os.PathLike[str], *, keep: int | None = 3,
                 name: str = "step-{step:08d}", asynchronous: bool = False):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"CheckpointManager(keep=) takes an int >= 1 or None (keep all). Received: {keep!r}.")
        self.strategy, self.directory = strategy, os.path.abspath(os.fspath(directory))
        self.keep, self.name, self.asynchronous = keep, name, bool(asynchronous)
        self.pattern = _pattern(name)
        self._pending: Any = None

    def path(self, step: int) -> str:
        """Where step ``step``'s checkpoint goes."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager: step must be an int >= 0. Received: {step!r}.")
        return os.path.join(self.directory, self.name.format(step=step))

    def save(self, step: int, **state: Any) -> Any:
        """``Strategy.save`` (or ``async_save``) of ``state`` at :meth:`path` ``(step)``, then the
        retention. Returns the path (asynchronously: the future of it)."""
        path = self.path(step)
        self.wait()  # the previous save is committed (or its error raised) before this one starts
        if self.asynchronous:
            self._pending = self.strategy.async_save(path, **state)
            return self._pending
        self.strategy.save(path, **state)
        self._prune()
        return path

    def wait(self) -> str | None:
        """Finish the asynchronous save in flight (raising its ``CheckpointError``, the same on every
        rank) and apply the retention. Returns its path, or ``None`` if none was in flight."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path = pending.result()
        self._prune()
        return path

    def _prune(self) -> None:
        if self.keep is not None and self.strategy.session().rank == 0:
            _checkpoints.prune(self.directory, self.keep, self.pattern)

    def latest(self) -> str | None:
        """The newest committed checkpoint of the folder (by commit time), or ``None``."""
        return _checkpoints.latest_checkpoint(self.directory, self.pattern)

    def checkpoints(self) -> list[str]:
        """The committed checkpoints of the folder, oldest first."""
        return [c["path"] for c in _checkpoints.list_checkpoints(self.directory, self.pattern) if c["committed"]]

    def restore(self, **state: Any) -> dict[str, Any] | None:
        """``Strategy.load`` of the newest committed checkpoint into ``state``'s objects; ``None``
        (nothing restored) when there is none yet: what a (re)started job calls first."""
        self.wait()
        latest = self.latest()
        return None if latest is None else self.strategy.load(latest, **state)
