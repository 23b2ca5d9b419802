"""Keras-style callbacks for :meth:`polyparallel_jax.Model.fit` (``fit(callbacks=[...])``).

A callback is a :class:`Callback` (or any object with some of its methods): ``set_model(model)``
once, ``on_train_begin(logs)``, ``on_epoch_end(epoch, logs)`` after every epoch (after its
validation and its ``checkpoint=`` save; ``logs`` is the epoch's history row: ``loss``, metrics,
``val_*``), ``on_train_end(logs)``. Setting ``model.stop_training = True`` ends ``fit`` after the
epoch.

Every process runs every callback with the same ``logs`` (they are reduced over the whole data
axis), so a decision taken from them (stop, save) is the same on every process: no process
leaves ``fit`` while another trains on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Callback", "EarlyStopping", "ModelCheckpoint", "check", "run"]


class Callback:
    """Base class: every method does nothing; ``self.model`` is the Model being fitted."""

    model: Any = None

    def set_model(self, model: Any) -> None:
        self.model = model

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        """Before the first epoch of this ``fit``."""

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        """After epoch ``epoch`` (0-based), with its history row."""

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        """After the last epoch (or the one a callback stopped at)."""


def _better(mode: str, monitor: str) -> Any:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max'. Received: {mode!r}.")
    if mode == "auto":
        mode = "max" if any(word in monitor for word in ("acc", "auc", "precision", "recall")) else "min"
    return (lambda new, best, delta: new < best - delta) if mode == "min" else (lambda new, best, delta: new > best + delta)


def _monitored(name: str, monitor: str, logs: Mapping[str, float] | None) -> float:
    if not logs or monitor not in logs:
        raise KeyError(f"{name}(monitor={monitor!r}): the epoch's logs have no {monitor!r}; they have "
                       f"{sorted(logs or {})}. Monitor one of them (val_* needs fit(validation_data=) or "
                       "validation_split=).")
    return float(logs[monitor])


class EarlyStopping(Callback):
    """Stop ``fit`` when ``monitor`` has not improved by more than ``min_delta`` for
    ``patience`` epochs (Keras' EarlyStopping).

    :param mode: ``"min"``, ``"max"`` or ``"auto"`` (``max`` for accuracy-like names).
    :param restore_best_weights: at the end, put back the module's state (parameters and
        statistics) of the best epoch; the optimizer state stays the last one's, as in Keras.
    :ivar stopped_epoch: the epoch ``fit`` stopped after (``None``: it did not stop early).
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, mode: str = "auto",
                 restore_best_weights: bool = False):
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience=) must be an int >= 0. Received: {patience!r}.")
        self.monitor, self.min_delta, self.patience = monitor, abs(float(min_delta)), patience
        self.mode, self._better = mode, _better(mode, monitor)
        self.restore_best_weights = restore_best_weights
        self.best, self.wait = math.nan, 0
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._best_state: Any = None

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self.best, self.best_epoch, self.wait, self.stopped_epoch, self._best_state = math.nan, None, 0, None, None

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        value = _monitored("EarlyStopping", self.monitor, logs)
        if self.best_epoch is None or self._better(value, self.best, self.min_delta):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best_weights:
                self._best_state = _copy_state(self.model)
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        if self._best_state is not None and self.best_epoch is not None:
            from flax import nnx

            nnx.update(self.model.module, self._best_state)


def _copy_state(model: Any) -> Any:
    """A copy of the module's state on its devices (the step donates the buffers it replaces)."""
    import jax
    from flax import nnx

    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, nnx.state(model.module))


class ModelCheckpoint(Callback):
    """Save the Model (:meth:`polyparallel_jax.Model.save`: a checkpoint directory, every
    process writing its shards) after every epoch, or only when ``monitor`` improved.

    :param filepath: a path formatted with the epoch (1-based, as Keras) and the logs, e.g.
        ``"ckpt/epoch-{epoch:02d}"`` or ``"ckpt/{epoch}-{val_loss:.3f}"``; without a field,
        one checkpoint is replaced every time.
    :param save_best_only: save only when ``monitor`` is better than at every earlier save.
    :ivar saved: the paths written, in order.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", save_best_only: bool = False, mode: str = "auto"):
        self.filepath, self.monitor, self.save_best_only = str(filepath), monitor, save_best_only
        self._better = _better(mode, monitor)
        self.best: float | None = None
        self.saved: list[str] = []

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if self.save_best_only:
            value = _monitored("ModelCheckpoint", self.monitor, logs)
            if self.best is not None and not self._better(value, self.best, 0.0):
                return
            self.best = value
        try:
            path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"ModelCheckpoint(filepath={self.filepath!r}) names a field the logs do not have "
                             f"({exc}); the fields are epoch and {sorted(logs or {})}.") from None
        self.saved.append(self.model.save(path))


_METHODS = ("set_model", "on_train_begin", "on_epoch_end", "on_train_end")


def check(callbacks: Sequence[Any] | Callback | None) -> list[Any]:
    """``fit(callbacks=)`` as a list, refused before training when it is not a list of callbacks."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    if isinstance(callbacks, str) or not isinstance(callbacks, Sequence):
        raise TypeError(f"fit(callbacks=) takes a list of callbacks. Received: {type(callbacks).__name__}.")
    for callback in callbacks:
        if not any(callable(getattr(callback, name, None)) for name in _METHODS):
            raise TypeError(f"fit(callbacks=) got {callback!r}, which has none of {', '.join(_METHODS)}: subclass "
                            "polyparallel_jax.callbacks.Callback.")
    return list(callbacks)


def run(callbacks: Sequence[Any], method: str, *args: Any) -> None:
    """Call ``method`` on every callback that has it."""
    for callback in callbacks:
        fn = getattr(callback, method, None)
        if callable(fn):
            fn(*args)
