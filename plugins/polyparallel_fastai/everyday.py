"""fastai's everyday callbacks made collective-safe for the length of one ``fit``.

fastai's own callbacks assume one process, or a ``torch.distributed`` world they gather over
themselves. Under :class:`~polyparallel_fastai.callback.ParallelCallback` each of these would
either diverge between ranks (a decision taken on one rank's share of the batch) or wait on a
collective only some ranks enter. :func:`adjust` makes them safe at ``before_fit`` (before any
collective) and returns what :meth:`Adjustments.undo` puts back at ``after_fit``:

=========================  ==========================================================================
callback                   under the adapter
=========================  ==========================================================================
``LRFinder`` (lr_find)     keeps the model and optimizer state in memory on every rank (fastai saves
                           them to a temporary directory of its own, a different one per rank, and
                           reloads only where the file exists: the checkpoint rank alone entered the
                           collective ``learn.load``); its stop-on-divergence reads the global
                           smoothed loss
``TerminateOnNaN``         a NaN/inf training loss is the global batch loss's (every rank stops at the
                           same batch); a NaN validation loss on any rank cancels the fit on every
                           rank at the end of that validation
``GradientAccumulation``   ``n_acc`` counts the samples of the whole data group (each rank sees
                           ``n_acc / data`` of them), so weights step after the same global batches
``ModelResetter``          resets the user's module (``learn.model`` is the DDP wrapper during fit)
``CSVLogger``              writes its file on the rank with the ``logger`` role only
=========================  ==========================================================================

With ``LRFinder`` or ``TerminateOnNaN`` attached, ``learn.loss`` after the loss is computed is the
global batch loss (one small reduction per training batch), so the recorder's smoothed loss,
``learn.smooth_loss`` and every decision taken on them are those of one process with the global
batch. Without them, no per-batch collective is added.

:func:`quiet` drops what a rank without the ``logger`` role writes to ``sys.stdout`` (fastai's
progress bars and result tables, the trackers' messages) while it runs: fastai then prints once
per job, as Lightning's rank-zero utilities do. Only the calling thread is silenced (the replica
threads of an XLA process print on their own), and ``sys.stdout`` is restored afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import polyparallel as pp

__all__ = ["Adjustments", "adjust", "quiet", "warn_batchnorm"]


class Adjustments:
    """What :func:`adjust` changed (undone by :meth:`undo`) and what the callback must do."""

    def __init__(self) -> None:
        self.undos: list[Callable[[], None]] = []
        #: ``learn.loss`` made global after every training loss (``after_loss``).
        self.global_batch_loss = False
        #: ``TerminateOnNaN`` callbacks that saw a NaN/inf validation loss on this rank.
        self.nan_watchers: list[Any] = []

    def undo(self) -> None:
        for fn in reversed(self.undos):
            fn()
        self.undos.clear()

    def _override(self, obj: Any, name: str, fn: Callable[..., Any], *, until_its_after_fit: bool = False) -> None:
        """``obj.name`` is ``fn`` (bound to ``obj``) until :meth:`undo` — or, with
        ``until_its_after_fit``, until ``obj``'s own ``after_fit`` has run (the adapter's
        ``after_fit``, order 8, comes before those of LRFinder and CSVLogger, order 60)."""
        had = name in obj.__dict__
        old = obj.__dict__.get(name)
        obj.__dict__[name] = types.MethodType(fn, obj)
        if until_its_after_fit:
            obj.__dict__.setdefault("_pp_overridden", []).append(name)
            return

        def restore() -> None:
            if had:
                obj.__dict__[name] = old
            else:
                obj.__dict__.pop(name, None)

        self.undos.append(restore)


def _own(cb: Any, cls: type, *methods: str) -> bool:
    """Whether ``cb`` uses ``cls``'s own ``methods`` (a subclass may have replaced them)."""
    return all(getattr(type(cb), m, None) is getattr(cls, m) for m in methods)


def adjust(learn: Any, strategy: pp.Strategy, session: pp.Session) -> Adjustments:
    """Make the Learner's callbacks collective-safe for one fit (see the module docstring).
    Raises ``TypeError`` before any collective for a subclass whose replaced methods the
    adapter cannot vouch for. The same callbacks on every rank give the same result."""
    from fastai.callback.rnn import ModelResetter
    from fastai.callback.schedule import LRFinder
    from fastai.callback.tracker import TerminateOnNaNCallback
    from fastai.callback.training import GradientAccumulation

    try:
        from fastai.callback.progress import CSVLogger
    except ImportError:  # pragma: no cover - part of fastai's basics
        CSVLogger = None  # noqa: N806

    out = Adjustments()
    data = session.topology.size("data")
    logger = "logger" in session.roles
    for cb in list(learn.cbs):
        if isinstance(cb, LRFinder):
            if not _own(cb, LRFinder, "before_fit", "after_fit", "after_batch"):
                raise TypeError(f"the fastai adapter runs fastai's LRFinder (learn.lr_find) on every rank; "
                                f"{type(cb).__name__} replaces its before_fit/after_fit/after_batch, which save, "
                                "reload and stop per rank. Use LRFinder itself, or learn.lr_find().")
            out._override(cb, "before_fit", _lr_before_fit, until_its_after_fit=True)
            out._override(cb, "after_fit", _lr_after_fit, until_its_after_fit=True)
            out.global_batch_loss = True
        elif isinstance(cb, TerminateOnNaNCallback):
            if not _own(cb, TerminateOnNaNCallback, "after_batch"):
                raise TypeError(f"the fastai adapter makes TerminateOnNaNCallback's decision global; "
                                f"{type(cb).__name__} replaces its after_batch. Use TerminateOnNaNCallback itself.")
            cb.__dict__["_pp_nan"] = False
            out._override(cb, "after_batch", _nan_after_batch)
            out.nan_watchers.append(cb)
            out.global_batch_loss = True
        elif isinstance(cb, GradientAccumulation):
            n_acc = cb.n_acc
            if n_acc % data:
                raise pp.TopologyError(
                    f"GradientAccumulation(n_acc={n_acc}) counts samples; at data={data} each rank sees 1/{data} of "
                    f"them, so n_acc must be a multiple of {data}. Use n_acc={n_acc + data - n_acc % data}.")
            cb.n_acc = n_acc // data

            def restore_n_acc(cb: Any = cb, n_acc: int = n_acc) -> None:
                cb.n_acc = n_acc

            out.undos.append(restore_n_acc)
        elif isinstance(cb, ModelResetter) and _own(cb, ModelResetter, "before_train", "before_validate"):
            for event in ("before_train", "before_validate", "after_fit"):
                out._override(cb, event, _reset_model)
        elif CSVLogger is not None and isinstance(cb, CSVLogger) and not logger:
            out._override(cb, "before_fit", _nothing, until_its_after_fit=True)
            out._override(cb, "after_fit", _restore_after_fit, until_its_after_fit=True)
    return out


def _restore(self: Any) -> None:
    """Drop the overrides made ``until_its_after_fit`` (from within that ``after_fit``)."""
    for name in self.__dict__.pop("_pp_overridden", []):
        self.__dict__.pop(name, None)


def _nothing(self: Any) -> None:
    """What a ``CSVLogger`` does on a rank without the ``logger`` role: the file is the logger's."""


def _restore_after_fit(self: Any) -> None:
    _restore(self)


# -- LRFinder -------------------------------------------------------------------------------------------
def _inner(model: Any) -> Any:
    from fastai.torch_core import get_model

    return get_model(model)


def _lr_before_fit(self: Any) -> None:
    """``LRFinder.before_fit`` with the state kept in memory (every rank holds the same replica)."""
    from fastai.callback.schedule import ParamScheduler

    ParamScheduler.before_fit(self)
    opt = self.learn.opt
    self.__dict__["_pp_saved"] = (copy.deepcopy(_inner(self.learn.model).state_dict()),
                                  copy.deepcopy(opt.state_dict()) if opt is not None else None)
    self.best_loss = float("inf")


def _lr_after_fit(self: Any) -> None:
    """``LRFinder.after_fit``: the model and optimizer back as they were before ``lr_find``."""
    _restore(self)
    self.learn.opt.zero_grad()
    saved = self.__dict__.pop("_pp_saved", None)
    if saved is not None:
        model_state, opt_state = saved
        _inner(self.learn.model).load_state_dict(model_state)
        if opt_state is not None:
            self.learn.opt.load_state_dict(opt_state)


# -- TerminateOnNaN -------------------------------------------------------------------------------------------
def _nan_after_batch(self: Any) -> None:
    """Training: the loss is the global batch loss here, so every rank decides alike. Validation
    (each rank its own samples): noted, and made global by the callback's ``after_validate``."""
    import torch
    from fastai.callback.core import CancelFitException

    bad = bool(torch.isinf(self.loss).any() or torch.isnan(self.loss).any())
    if not bad:
        return
    if self.training:
        raise CancelFitException
    self.__dict__["_pp_nan"] = True


def validation_nan(adjustments: Adjustments) -> float:
    """1.0 if a ``TerminateOnNaN`` saw a NaN/inf validation loss on this rank (then reset)."""
    seen = any(cb.__dict__.get("_pp_nan") for cb in adjustments.nan_watchers)
    for cb in adjustments.nan_watchers:
        cb.__dict__["_pp_nan"] = False
    return float(seen)


# -- ModelResetter ------------------------------------------------------------------------------------------
def _reset_model(self: Any) -> None:
    from fastcore.basics import getcallable

    getcallable(_inner(self.learn.model), "reset")()


# -- BatchNorm -------------------------------------------------------------------------------------------------
BATCHNORM_NOTE = (
    "BatchNorm layers normalise each rank's share of the global batch during training (batch / data "
    "samples: 'ghost batches'), not the whole global batch: training differs from one process with that "
    "batch (torch's SyncBatchNorm is CUDA-only). The running statistics are averaged over the data group "
    "(StatePolicy) before every validation, so validation and predictions use one model on every rank.")


def warn_batchnorm(model: Any, session: pp.Session) -> None:
    """Say, once per job (on the logger rank), that BatchNorm trains on ghost batches."""
    import warnings

    from torch import nn

    if session.topology.size("data") == 1 or "logger" not in session.roles:
        return
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()):
        warnings.warn(f"polyparallel fastai adapter at data={session.topology.size('data')}: {BATCHNORM_NOTE}",
                      UserWarning, stacklevel=3)


# -- quiet ranks -------------------------------------------------------------------------------------------------
_QUIET_LOCK = threading.Lock()
_QUIET: dict[int, int] = {}  # thread id -> nesting depth


class _ThreadFilteredStream:
    """``sys.stdout`` while a thread is quiet: that thread's writes are dropped, others pass."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        if threading.get_ident() in _QUIET:
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        if threading.get_ident() not in _QUIET:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet(session: pp.Session) -> Iterator[None]:
    """Inside the block, this thread's writes to ``sys.stdout`` are dropped unless this rank has
    the ``logger`` role (see the module docstring)."""
    if "logger" in session.roles:
        yield
        return
    ident = threading.get_ident()
    with _QUIET_LOCK:
        if not _QUIET and not isinstance(sys.stdout, _ThreadFilteredStream):
            sys.stdout = _ThreadFilteredStream(sys.stdout)
        _QUIET[ident] = _QUIET.get(ident, 0) + 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET[ident] -= 1
            if not _QUIET[ident]:
                del _QUIET[ident]
            if not _QUIET and isinstance(sys.stdout, _ThreadFilteredStream):
                sys.stdout = sys.stdout._stream
