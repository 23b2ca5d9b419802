"""The fastai adapter: ``strategy.adapt("fastai")`` is a fastai ``Callback``.

Add it to a ``Learner`` like any callback (``Learner(..., cbs=cb)``, ``learn.add_cb(cb)`` or
``with cb.distrib_ctx(learn):``). It replaces fastai's ``DistributedTrainer``/``distrib_ctx``,
which need ``accelerate`` and CUDA, with the strategy's five operations only — no
``torch.distributed`` call of its own — so it runs unchanged on every runtime the capabilities
name (torch gloo/nccl processes, XLA devices):

=====================  ==========================================================================
event                  what the callback does
=====================  ==========================================================================
``before_fit``         checks the metrics (refused before any collective if one cannot be made
                       global); ``learn.model = strategy.wrap_model(model)`` (DDP over the data
                       group on torch; the device the runtime chose)
``before_train``       ``learn.dl`` becomes ``strategy.shard_data(dl)`` (global batch, shuffled
                       from ``(seed, learn.epoch)``, every rank the same number of batches)
``before_step``        ``strategy.sync_grads(model)`` where the wrapper did not reduce gradients
                       in backward (not DDP: XLA, ...)
``after_train``        the recorder's smooth training loss (``learn.recorder.losses``,
                       ``learn.smooth_loss``) and training metrics become the global ones
``before_validate``    ``strategy.sync_states(model)`` (``StatePolicy``: BatchNorm statistics
                       averaged, ...), ``learn.dl`` sharded ``uneven`` (each sample once)
``after_validate``     the valid loss and every metric become the global values, count-weighted
                       (:mod:`polyparallel_fastai.metrics`), before the recorder prints them
``after_fit``          ``learn.model`` is the user's module again, its parameters the same
                       objects on the same device (a runtime that moved them, XLA, gets them
                       back with the trained values; the optimizer follows them both ways,
                       :mod:`polyparallel_fastai.placement`); nothing else stays changed
=====================  ==========================================================================

``learn.get_preds`` (and ``predict``, ``tta``, ``show_results``, ``Interpretation``) is not
sharded: every rank predicts every sample, so it returns all the predictions in the loader's
order, as in one process. While attached, ``learn.to_detach`` never gathers: fastai's own
(``maybe_gather``) all-gathers every batch over the whole ``WORLD_SIZE`` world, unbounded, which
gave ``get_preds`` every batch twice.

Before anything runs (``before_fit``, and ``before_validate`` of a ``validate``/``get_preds``), a
callback or metric the adapter refuses (:mod:`polyparallel_fastai.surface`: fastai's own
``DistributedTrainer``, loggers whose packages are not tested, ...) raises ``TypeError`` naming
it, why, and what to do instead. fastai's callbacks that decide per batch or save per rank
(``LRFinder``, ``TerminateOnNaNCallback``, ``GradientAccumulation``, ``ModelResetter``,
``CSVLogger``) are made collective-safe for the fit (:mod:`polyparallel_fastai.everyday`).
On ranks without the ``logger`` role, ``fit``, ``show_results`` and ``show_training_loop`` print nothing (progress bars,
tables and the trackers' messages appear once per job).

BatchNorm layers normalise each rank's share of the global batch during training; the running
statistics are averaged before validation (``StatePolicy``). Training with BatchNorm therefore
differs from one process with the same global batch (the logger rank warns once per fit).

While attached, ``learn.save``, ``learn.load`` and ``learn.export`` are the callback's
:meth:`~ParallelCallback.save`, :meth:`~ParallelCallback.load` and
:meth:`~ParallelCallback.export` (collective: call them on every rank). They keep fastai's own
file rather than a polyparallel checkpoint (``strategy.save``): fastai's optimizer is not a
``torch.optim.Optimizer`` (the DCP checkpoint restores those by parameter name), every rank holds
a full replica (data axis only), so one file is the whole model and loads at any data size, and
the callback also runs on XLA, where ``torch.distributed.checkpoint`` does not apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fastai.callback.core import Callback, GatherPredsCallback
from fastai.learner import AvgSmoothLoss, Learner
from fastai.torch_core import find_bs, to_detach

import polyparallel as pp

from . import accumulation as _accumulation
from . import everyday as _everyday
from . import files as _files
from . import metrics as _metrics
from . import precision as _precision
from . import surface as _surface
from .data import is_fastai_loader, local_to_detach
from .placement import Placement

__all__ = ["ParallelCallback", "LocalSmoothLoss"]


class LocalSmoothLoss(AvgSmoothLoss):
    """fastai's ``AvgSmoothLoss`` without its world-wide gather of every batch's loss (an
    unbounded ``torch.distributed.all_gather`` whenever ``WORLD_SIZE`` > 1). The callback makes
    the values global once per epoch instead (``after_train``)."""

    count: int
    val: torch.Tensor
    beta: float

    def accumulate(self, learn: Any) -> None:
        self.count += 1
        self.val = torch.lerp(to_detach(learn.loss.mean(), gather=False), self.val, self.beta)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


class ParallelCallback(Callback):
    """A fastai callback that runs a ``Learner`` under a :class:`polyparallel.Strategy` (data axis).

    Build it with ``strategy.adapt("fastai")``; see the module docstring for what each event does.
    A ``Learner`` with this callback is collective: ``fit``, ``validate``, ``save`` and ``load``
    must run on every rank of the data group, with the same metrics.
    """

    # After TrainEvalCallback (-10: it moves the model to the loaders' device before we wrap),
    # after GradientAccumulation (6: a step it cancels must not sync), before MixedPrecision (10:
    # it steps the optimizer in its before_step) and before the Recorder (50: it reads metrics).
    order = 8

    def __init__(self, strategy: pp.Strategy):
        super().__init__()
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "_state", _FitState())

    def __repr__(self) -> str:
        return f"ParallelCallback({self.strategy!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        # fastai sets `learn` when the callback is added (None when removed): learn.save/load are
        # ours exactly while attached, and restored to the Learner's own afterwards.
        if name == "learn":
            old = self.__dict__.get("learn")
            if old is not None and old is not value:
                _uninstall(old, self)
            object.__setattr__(self, name, value)
            if value is not None:
                _install(value, self)
            return
        object.__setattr__(self, name, value)  # fastai's warning about shadowing learner attributes is moot here

    # -- what a user may call ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def distrib_ctx(self, learn: Learner) -> Iterator[Learner]:
        """``with cb.distrib_ctx(learn):`` — the callback attached for the block (fastai's
        ``learn.distrib_ctx()`` without ``accelerate``)."""
        learn.add_cb(self)
        try:
            yield learn
        finally:
            learn.remove_cb(self)

    @property
    def session(self) -> pp.Session:
        """This process's :class:`polyparallel.Session`."""
        return self.strategy.session()

    def save(self, file: str | Path, with_opt: bool = True, pickle_protocol: int = 2) -> Path:
        """``learn.save``: written once, by the rank with the ``checkpoint`` role, to
        ``learn.path/learn.model_dir/file.pth`` in fastai's format (``learn.load`` and
        ``load_model`` read it). Collective: every rank returns once the file is complete, or
        raises if the writing rank failed."""
        from fastai.learner import join_path_file

        learn = self._learner("save")
        path = join_path_file(file, learn.path / learn.model_dir, ext=".pth")
        error: BaseException | None = None
        if "checkpoint" in self.session.roles:
            try:
                _files.write_model(path, learn, with_opt, pickle_protocol)
            except Exception as exc:  # reported to every rank below, then re-raised here
                error = exc
        # A barrier that also says whether the file was written (0 on a failed writer).
        written = _metrics.summing(self.strategy).reduce_metrics({"fastai.save.failed": float(error is not None)})
        if error is not None:
            raise error
        if written["fastai.save.failed"]:
            raise RuntimeError(f"learn.save({str(file)!r}): the checkpoint rank failed to write {path}; see its error.")
        return path

    def load(self, file: str | Path, device: Any = None, with_opt: bool = True, strict: bool = True,
             **torch_load_kwargs: Any) -> Learner:
        """``learn.load``: every rank reads the file the checkpoint rank wrote (after a barrier,
        as fastai's own ``load``, which waits on the whole ``torch.distributed`` world instead),
        onto the device of its model (``device=`` to override). Other keyword arguments go to
        ``torch.load``, as fastai's (``SaveModelCallback`` passes ``weights_only=False``)."""
        from fastai.learner import join_path_file

        learn = self._learner("load")
        if learn.opt is None:
            learn.create_opt()
        path = join_path_file(file, learn.path / learn.model_dir, ext=".pth")
        _metrics.summing(self.strategy).reduce_metrics({"fastai.load.barrier": 1.0})
        # Read onto the CPU; load_state_dict copies into the parameters wherever they live.
        _files.load_model(path, learn.model, learn.opt, with_opt=with_opt, device="cpu" if device is None else device,
                    strict=strict, **torch_load_kwargs)
        return learn

    def export(self, fname: str | Path = "export.pkl", pickle_module: Any = None, pickle_protocol: int = 2) -> Path:
        """``learn.export``: the Learner for inference (fastai's format, ``load_learner`` reads
        it), written once by the rank with the ``checkpoint`` role, without this callback (the
        exported Learner is a plain one-process Learner). Collective: every rank returns once
        the file is complete, or raises if the writing rank failed."""
        learn = self._learner("export")
        path = Path(learn.path) / fname
        error: BaseException | None = None
        if "checkpoint" in self.session.roles:
            try:
                _files.export_learner(learn, self, path, pickle_module, pickle_protocol)
            except Exception as exc:  # reported to every rank below, then re-raised here
                error = exc
        failed = _metrics.summing(self.strategy).reduce_metrics({"fastai.export.failed": float(error is not None)})
        if error is not None:
            raise error
        if failed["fastai.export.failed"]:
            raise RuntimeError(f"learn.export({str(fname)!r}): the checkpoint rank failed to write {path}; see its error.")
        return path

    def to_detach(self, b: Any, cpu: bool = True, gather: bool = True) -> Any:
        """``learn.to_detach`` that never gathers (see the module docstring): what a callback
        collects (``get_preds``, metrics) is this rank's; the adapter reduces metrics itself."""
        learn = self._learner("to_detach")
        return type(learn).to_detach(learn, b, cpu, False)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """``learn.fit``, silent on ranks without the ``logger`` role."""
        learn = self._learner("fit")
        with _everyday.quiet(self.session):
            return type(learn).fit(learn, *args, **kwargs)

    def show_training_loop(self) -> None:
        """``learn.show_training_loop``, silent on ranks without the ``logger`` role."""
        learn = self._learner("show_training_loop")
        with _everyday.quiet(self.session):
            type(learn).show_training_loop(learn)

    def show_results(self, *args: Any, **kwargs: Any) -> Any:
        """``learn.show_results``, silent on ranks without the ``logger`` role."""
        learn = self._learner("show_results")
        with _everyday.quiet(self.session):
            return type(learn).show_results(learn, *args, **kwargs)

    def _learner(self, what: str) -> Learner:
        learn = self.__dict__.get("learn")
        if learn is None:
            raise RuntimeError(f"ParallelCallback.{what}(): add the callback to a Learner first (learn.add_cb(cb)).")
        return learn

    # -- fastai events ----------------------------------------------------------------------------------------
    def before_fit(self) -> None:
        learn, state = self.learn, self._state
        recorder = getattr(learn, "recorder", None)
        # Before any collective, alike on every rank: refused callbacks and metrics.
        _surface.check_callbacks(learn.cbs)
        _metrics.check_supported(list(learn.metrics))
        if _is_ddp(learn.model):
            raise TypeError("the fastai adapter wraps the model itself (strategy.wrap_model); the Learner's model is "
                            "already DistributedDataParallel: give the Learner the bare module.")
        # Strategy(accumulate=): fastai's GradientAccumulation (before adjust, which makes n_acc global).
        state.accumulation = _accumulation.apply(learn, self.strategy, self.session.topology.size("data"))
        state.adjustments = _everyday.adjust(learn, self.strategy, self.session)
        _everyday.warn_batchnorm(learn.model, self.session)
        state.inner = learn.model
        state.placement = Placement(learn.model)
        # fastai's MixedPrecision applies Strategy(precision=) (.precision): not the torch runtime too.
        own = {"precision": None}  # both runtimes (torch, XLA) take precision=None: fastai applies it
        learn.model = self.strategy.wrap_model(learn.model, **own)
        _precision.apply(learn, self.strategy)  # Strategy(precision=) as fastai's MixedPrecision
        # A runtime that moves the model to its device (XLA) may give it new Parameter objects:
        # the optimizer fastai made before this event must step those.
        state.placement.moved(getattr(learn, "opt", None))
        state.reduces_in_backward = _is_ddp(learn.model)
        state.loaders = {}
        if recorder is not None and type(recorder.smooth_loss) is AvgSmoothLoss:
            state.smooth = recorder.smooth_loss
            # Through __dict__: a Callback's setattr warns about the Learner's `smooth_loss`.
            recorder.__dict__["smooth_loss"] = LocalSmoothLoss(beta=state.smooth.beta)

    def before_train(self) -> None:
        self.learn.dl = self._shard(self.learn.dl, train=True)
        smooth = self._smooth()
        state = self._state
        state.losses, state.sizes = [], []
        state.smooth_start = (smooth.count, smooth.val.clone()) if smooth is not None else None

    def before_batch(self) -> None:
        """Under ``Strategy(accumulate=)`` and DDP: the gradient all-reduce only in the backward of
        a step's last micro-batch (one reduction per optimizer step)."""
        state = self._state
        if state.accumulation is not None and state.reduces_in_backward and self.training:
            from polyparallel_torch.accumulation import set_gradient_sync

            set_gradient_sync(self.learn.model, _accumulation.last_of_step(state.accumulation, self.learn))

    def after_loss(self) -> None:
        """With a callback that decides on each batch's loss (LRFinder, TerminateOnNaN): the
        global batch loss, count-weighted, in ``learn.loss`` (``loss_grad`` stays this rank's)."""
        adjustments = self._state.adjustments
        if adjustments is None or not adjustments.global_batch_loss or not self.training:
            return
        learn = self.learn
        local = learn.loss.detach().double().mean()
        summed = _metrics.summing(self.strategy).reduce_metrics(
            {"fastai.batch_loss": float(local) * find_bs(learn.yb), "fastai.batch_size": float(find_bs(learn.yb))})
        value = summed["fastai.batch_loss"] / summed["fastai.batch_size"]
        learn.loss = torch.tensor(value, dtype=learn.loss.dtype, device=learn.loss.device)

    def after_batch(self) -> None:
        if self.training and len(self.learn.yb):
            self._state.losses.append(to_detach(self.learn.loss.mean(), cpu=False, gather=False))
            self._state.sizes.append(find_bs(self.learn.yb))

    def before_step(self) -> None:
        if not self._state.reduces_in_backward:
            self.strategy.sync_grads(self.learn.model)

    def after_train(self) -> None:
        state, recorder = self._state, getattr(self.learn, "recorder", None)
        if recorder is None:
            return
        train_metrics = list(recorder._train_mets[1:]) if recorder.train_metrics else []
        n = len(state.losses)
        losses = torch.stack(state.losses).detach().double().cpu() if n else torch.zeros(0, dtype=torch.float64)
        sizes = torch.tensor(state.sizes, dtype=torch.float64)
        extra = {"loss_sums": losses * sizes, "sizes": sizes} if n else {}
        summed = _metrics.reduce_states(self.strategy, train_metrics, extra)
        smooth = self._smooth()
        if n and smooth is not None and state.smooth_start is not None:
            global_losses = (summed["loss_sums"] / summed["sizes"]).to(smooth.val.dtype)
            _replay_smooth_loss(smooth, state.smooth_start, global_losses, recorder, self.learn)

    def before_validate(self) -> None:
        if self._state.inner is None:  # validate/get_preds outside a fit: nothing was checked yet
            _surface.check_callbacks(self.learn.cbs)
            _metrics.check_supported(list(self.learn.metrics))
        self.strategy.sync_states(self.learn.model)  # one model for every rank's share of the metrics
        # get_preds (a GatherPredsCallback) returns every prediction, in the loader's order, on
        # every rank: its loader is not sharded, and what it computes is global already.
        if not self._whole():
            self.learn.dl = self._shard(self.learn.dl, train=False)

    def after_validate(self) -> None:
        # Asked again (not remembered from before_validate): a get_preds inside this validation
        # (FetchPredsCallback) has come and gone in between.
        if self._whole():
            return
        recorder = getattr(self.learn, "recorder", None)
        adjustments = self._state.adjustments
        watch_nan = adjustments is not None and bool(adjustments.nan_watchers)
        if recorder is None and not watch_nan:
            return
        extra = {"nan": _everyday.validation_nan(adjustments)} if watch_nan and adjustments is not None else {}
        summed = _metrics.reduce_states(self.strategy, list(recorder._valid_mets) if recorder is not None else [],
                                        extra)
        if watch_nan and summed["nan"]:
            from fastai.callback.core import CancelFitException

            raise CancelFitException  # a NaN/inf validation loss on some rank: every rank stops here

    def after_fit(self) -> None:
        learn, state = self.learn, self._state
        if state.adjustments is not None:
            state.adjustments.undo()
        if state.inner is not None:
            learn.model = state.inner
        if state.placement is not None:
            state.placement.restore(getattr(learn, "opt", None))
        recorder = getattr(learn, "recorder", None)
        if state.smooth is not None and recorder is not None:
            # The recorder keeps fastai's own object, carrying the global value of this fit.
            state.smooth.count, state.smooth.val = recorder.smooth_loss.count, recorder.smooth_loss.val
            recorder.__dict__["smooth_loss"] = state.smooth
        object.__setattr__(self, "_state", _FitState())

    # -- helpers ----------------------------------------------------------------------------------------------
    def _whole(self) -> bool:
        return any(isinstance(cb, GatherPredsCallback) for cb in self.learn.cbs)

    def _smooth(self) -> Any:
        recorder = getattr(self.learn, "recorder", None)
        return recorder.smooth_loss if recorder is not None and isinstance(recorder.smooth_loss, LocalSmoothLoss) else None

    def _shard(self, dl: Any, train: bool) -> Any:
        """``dl`` sharded (once per fit, then reused), its epoch set from ``learn.epoch``."""
        loaders = self._state.loaders
        if dl is None:
            return dl
        if id(dl) in loaders and loaders[id(dl)][0] is dl:
            sharded = loaders[id(dl)][1]
        elif any(entry[1] is dl for entry in loaders.values()):
            sharded = dl  # already ours
        else:
            sharded = self._make_shard(dl, train)
            loaders[id(dl)] = (dl, sharded)
        epoch = getattr(self.learn, "epoch", 0) if train else 0
        if hasattr(sharded, "set_epoch"):
            sharded.set_epoch(int(epoch))
        elif hasattr(getattr(sharded, "sampler", None), "set_epoch"):
            sharded.sampler.set_epoch(int(epoch))
        return sharded

    def _make_shard(self, dl: Any, train: bool) -> Any:
        policy = self.strategy.data_policy
        topology = self.session.topology
        if train:
            overrides: dict[str, Any] = {}
            if policy.remainder == "uneven":
                lengths = {pp.shard_length(_length(dl), r, topology.size("data"), "uneven")
                           for r in range(topology.size("data"))}
                if len(lengths) > 1:
                    raise pp.TopologyError(
                        f"DataPolicy(remainder='uneven') gives the data ranks {sorted(lengths)} training samples of "
                        f"{_length(dl)}: they would run different numbers of steps and wait on each other. Use "
                        "remainder='pad' (the default) or 'drop' for training; validation is always 'uneven'.")
        else:
            overrides = {"remainder": "uneven"}  # every validation sample on exactly one data rank
        sharded = self.strategy.shard_data(dl, **overrides)
        if not is_fastai_loader(sharded):
            # A torch DataLoader inside fastai DataLoaders: metrics must not gather over the world.
            sharded.to_detach = local_to_detach
        return sharded


class _FitState:
    """What the callback holds during one ``fit`` (or ``validate``); reset by ``after_fit``."""

    def __init__(self) -> None:
        self.inner: Any = None
        self.placement: Placement | None = None
        self.reduces_in_backward = False
        self.adjustments: _everyday.Adjustments | None = None
        self.accumulation: Any = None  # the GradientAccumulation of Strategy(accumulate=N > 1)
        self.loaders: dict[int, tuple[Any, Any]] = {}
        self.smooth: Any = None
        self.smooth_start: tuple[int, torch.Tensor] | None = None
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []


def _length(dl: Any) -> int:
    n = getattr(dl, "n", None)
    return int(n) if n is not None else len(dl.dataset)


def _replay_smooth_loss(smooth: Any, start: tuple[int, torch.Tensor], losses: torch.Tensor, recorder: Any,
                        learn: Any) -> None:
    """Recompute the epoch's smoothed losses from the global per-batch losses, exactly as
    ``AvgSmoothLoss`` would have in one process, and put them where the recorder keeps them."""
    count, val = start
    values = []
    for loss in losses:
        count += 1
        val = torch.lerp(loss, val, smooth.beta)
        values.append(val / (1 - smooth.beta ** count))
    smooth.count, smooth.val = count, val
    n = len(values)
    if n and len(recorder.losses) >= n:
        recorder.losses[-n:] = values
        learn.smooth_loss = values[-1]


#: The Learner methods that are the callback's while it is attached.
_INSTALLED = ("save", "load", "export", "to_detach", "fit", "show_results", "show_training_loop")


def _install(learn: Any, cb: ParallelCallback) -> None:
    for name in _INSTALLED:
        learn.__dict__[name] = getattr(cb, name)


def _uninstall(learn: Any, cb: ParallelCallback) -> None:
    for name in _INSTALLED:
        bound = learn.__dict__.get(name)
        if getattr(bound, "__self__", None) is cb:
            del learn.__dict__[name]
