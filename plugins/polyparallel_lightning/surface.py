"""Lightning's everyday surface under the adapter: every callback in ``lightning.pytorch.callbacks``
(``__all__``; the same classes under ``pytorch_lightning.callbacks``), every public method of the
``Trainer`` and the ``Tuner``, and the module-side calls users make (``self.log(sync_dist=True)``,
``LightningDataModule``, resuming with ``ckpt_path=``), classified as **works** (with the test
that shows it at data=2 against one process with the same global batch, on an evaluation set
that does not divide) or **refused** (when the Trainer's run sets up its environment, before any
process group or collective, saying why and what to do instead). The published table is
``docs/surface/lightning.md`` (``python tools/surface_tables.py``);
``tests/lightning_plugin/test_surface.py`` fails when the installed Lightning lists an entry this
does not classify.

Importing this module imports neither torch nor Lightning (:func:`discover` does).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from polyparallel.testing.surface import Entry, Surface, SurfaceError, discover_names
from polyparallel.testing.surface import refused as _refused
from polyparallel.testing.surface import works as _works

__all__ = ["SURFACE", "check_trainer", "classify", "discover"]

_T = "tests/lightning_plugin/test_surface_works.py::"
TRAIN = _T + "test_callbacks_train_as_one_process"
EVALUATE = _T + "test_validate_and_test_metrics_equal_one_process"
PREDICT = _T + "test_predict_returns_every_row_once_in_order"
SHOWN = _T + "test_display_and_monitor_callbacks_run_and_write_once"
CHECKPOINT = "tests/lightning_plugin/test_strategy.py::test_hybrid_checkpoints_are_polyparallel_checkpoints_and_resume_exactly"
C = "lightning.pytorch.callbacks."

RANK_ZERO = "shows or logs from global rank 0 only (Lightning's rank-zero utilities)"
UNVERIFIED = "its behaviour under the adapter's process groups is not tested, so a result could differ silently"


def _c(name: str, test: str, differs: str = "") -> Entry:
    return _works(C + name, "callback", test, differs)


def _rc(name: str, reason: str, instead: str) -> Entry:
    return _refused(C + name, "callback", reason, instead)


_CALLBACKS = [
    _c("Callback", TRAIN, "a callback of your own runs on every rank, on this rank's share of each batch; decisions "
       "(trainer.should_stop) must be the same on every rank"),
    _c("LambdaCallback", TRAIN, "as Callback"),
    _c("EarlyStopping", TRAIN, "its monitored value is the data group's (self.log(sync_dist=True)), and the stop is "
       "decided over the world, so every rank stops at the epoch one process stops at"),
    _c("ModelCheckpoint", TRAIN, "the monitored value is the data group's, so the best model and score are one "
       "process's; each checkpoint is one polyparallel (DCP) directory, written once, that reshards"),
    _c("Checkpoint", TRAIN, "the base of ModelCheckpoint (shown by it)"),
    _c("GradientAccumulationScheduler", TRAIN, "accumulates the same number of global batches as one process"),
    _c("StochasticWeightAveraging", TRAIN, "every rank averages its replica, which DDP keeps equal"),
    _c("WeightAveraging", TRAIN, "every rank averages its replica, which DDP keeps equal"),
    _c("EMAWeightAveraging", TRAIN, "every rank averages its replica, which DDP keeps equal"),
    _c("Timer", SHOWN, "its stop is decided from global rank 0's clock and broadcast: every rank stops at the same "
       "step"),
    _c("ProgressBar", SHOWN, RANK_ZERO), _c("TQDMProgressBar", SHOWN, RANK_ZERO),
    _c("RichProgressBar", SHOWN, RANK_ZERO), _c("ModelSummary", SHOWN, RANK_ZERO),
    _c("RichModelSummary", SHOWN, RANK_ZERO),
    _c("LearningRateMonitor", SHOWN, "logged by global rank 0's logger (every rank has the same learning rate)"),
    _c("BasePredictionWriter", PREDICT, "each rank writes its own rows, with their indices in the data set "
       "(batch_indices); the ranks' rows together are every row once (Lightning's own DDP sampler repeats rows)"),
    _rc("LearningRateFinder", "its loss curve, stopping and suggestion come from global rank 0's loss on its own "
        "share of each batch (then broadcast), not from the global batch's loss, so the learning rate it finds "
        "differs from one process silently",
        "find the learning rate in one process (a Trainer without the adapter, the same global batch) and pass "
        "it to the parallel run"),
    _rc("BatchSizeFinder", "it scales this rank's loader, whose batch is a 1/data share of the global batch (and "
        "Lightning's Tuner refuses it with any distributed strategy)",
        "find the batch size in one process and pass the global batch to Strategy(batch_size=) or the loader"),
    _rc("BaseFinetuning", "it freezes and unfreezes parameters during fit, and DDP reduces only the parameters that "
        "required gradients when the model was wrapped: unfrozen ones would train differently on every rank, "
        "silently", "freeze and unfreeze between fits (a new Trainer wraps the model again), or train one stage "
        "per fit"),
    _rc("BackboneFinetuning", "as BaseFinetuning: it unfreezes the backbone during fit, and DDP would not reduce "
        "its gradients", "fit the head, then fit again with the backbone unfrozen (each fit wraps the model again)"),
    _rc("ModelPruning", "it re-parametrises the model's layers during fit, after DDP (or the tensor plan) wrapped "
        "them; " + UNVERIFIED, "prune between fits, or in one process, and fit the pruned model"),
    _rc("OnExceptionCheckpoint", "it saves when this rank raises; the adapter's checkpoints are collective (every "
        "rank writes its part), and the other ranks are not saving, so it would wait for them",
        "save periodically with ModelCheckpoint(every_n_train_steps=...) and resume from the last one"),
    _rc("SpikeDetection", "it reacts to this rank's loss (raising or skipping on this rank alone), so the ranks "
        "would go on to different collectives", "detect spikes from a loss logged with sync_dist=True in a callback "
        "of your own, and stop with trainer.should_stop on every rank"),
    _rc("DeviceStatsMonitor", "it reads this process's accelerator statistics; " + UNVERIFIED,
        "log the statistics you need per rank from a callback of your own, or in one process"),
    _rc("ThroughputMonitor", "it counts samples as world_size times this rank's batch, which counts tensor-parallel "
        "replicas once each; " + UNVERIFIED, "measure throughput from the global batch (Strategy(batch_size=)) and "
        "a Timer, or use polyparallel's benchmarks"),
]

_TRAINER = "lightning.pytorch.trainer.trainer.Trainer."
_TUNER = "lightning.pytorch.tuner.tuning.Tuner."


def _e(name: str, test: str, differs: str = "") -> Entry:
    return _works(name, "entry point", test, differs)


_ENTRY_POINTS = [
    _e(_TRAINER + "fit", TRAIN, "trains as one process with the same global batch (the loader's batch_size is each "
       "data rank's share); as under Lightning's own DDP, the training loader is shuffled (by the Strategy's seed) "
       "even when the loader is not, so one process equals it when it takes the global batches in that order"),
    _e(_TRAINER + "validate", EVALUATE, "every sample once (no padding): metrics logged with sync_dist=True are the "
       "whole set's"),
    _e(_TRAINER + "test", EVALUATE, "as validate"),
    _e(_TRAINER + "predict", PREDICT, "returns every row once, in the loader's order, on every rank (gathered at "
       "on_predict_end): batch k holds every data rank's batch k, as one process with the global batch"),
    _e(_TRAINER + "save_checkpoint", CHECKPOINT, "a polyparallel (DCP) directory, every rank writing its part"),
    _e(_TRAINER + "init_module", TRAIN), _e(_TRAINER + "print", SHOWN, RANK_ZERO),
    _refused(_TUNER + "lr_find", "entry point", "it runs LearningRateFinder: the loss curve and suggestion are global "
             "rank 0's share of each batch, not the global batch's, so the learning rate differs from one process",
             "run Tuner(trainer).lr_find in one process (a Trainer without the adapter, the same global batch) and "
             "pass the learning rate to the parallel run"),
    _refused(_TUNER + "scale_batch_size", "entry point", "it would scale each rank's share of the batch; Lightning "
             "itself refuses it with a distributed strategy (ValueError at the call, before anything runs)",
             "run Tuner(trainer).scale_batch_size in one process and give the parallel run that global batch"),
]

_MODULE = [
    _works("LightningModule.log(sync_dist=True)", "module call", EVALUATE, "reduced over the data group only "
           "(tensor replicas are not counted twice); epoch means are weighted by batch_size"),
    _works("LightningDataModule", "module call", TRAIN, "its loaders are sharded like loaders passed to fit"),
    _works("Trainer.fit(ckpt_path=)", "module call", CHECKPOINT, "resumes exactly, mid-epoch included, at any "
           "topology (the checkpoint reshards)"),
]

SURFACE = Surface(
    framework="PyTorch Lightning", version="2.6.6",
    adapter="polyparallel's Lightning adapter (Trainer(strategy=strategy.adapt('lightning')))",
    entries=[*_CALLBACKS, *_ENTRY_POINTS, *_MODULE],
    kinds={
        "callback": "Every name in `lightning.pytorch.callbacks.__all__` (the same classes under "
                    "`pytorch_lightning.callbacks`). A refused callback, or a subclass of it, raises `TypeError` "
                    "when the Trainer's run sets up its environment, before any process group or collective.",
        "entry point": "Every public method of `Trainer` and `Tuner`. `Tuner.lr_find` is refused when the fit it "
                       "starts sets up its environment; `Tuner.scale_batch_size` by Lightning itself, at the call.",
        "module call": "What a LightningModule or a run uses around the Trainer: logging, data modules, resuming.",
    },
    preamble="*works*: tested at data=2 on gloo processes against one process with the same global batch, on an "
             "evaluation set of 23 samples (shards of 12 and 11). *refused*: the adapter raises `TypeError` naming "
             "the entry, why and what to do instead, before any collective. Both namespaces (`lightning.pytorch`, "
             "`pytorch_lightning`) are classified alike.",
)

_NAMESPACES = ("lightning.pytorch.", "pytorch_lightning.")


def classify(obj: Any) -> Entry | None:
    """The callback entry ``obj`` falls under: that of the first class of its MRO that is one of
    Lightning's callbacks (either namespace); ``None`` for a class that is not."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(_NAMESPACES) and ".callbacks" in cls.__module__:
            entry = SURFACE.get(C + cls.__qualname__)
            if entry is not None:
                return entry
    return None


def check_trainer(trainer: Any) -> None:
    """Raise :class:`~polyparallel.testing.surface.SurfaceError` (a ``TypeError``) for the first
    refused callback of ``trainer`` (the Tuner's, which Lightning marks ``_early_exit``, under the
    Tuner's entry)."""
    for callback in getattr(trainer, "callbacks", None) or []:
        entry = classify(callback)
        if entry is None or entry.status != "refused":
            continue
        if getattr(callback, "_early_exit", False) and entry.short in ("LearningRateFinder", "BatchSizeFinder"):
            entry = SURFACE[_TUNER + ("lr_find" if entry.short == "LearningRateFinder" else "scale_batch_size")]
        raise SurfaceError(entry.message(SURFACE.adapter) + f" (the Trainer's callback {type(callback).__name__!r})")


def _public_methods(module: str, name: str) -> list[str]:
    cls = getattr(importlib.import_module(module), name)
    return [n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")]


def discover(namespace: str = "lightning.pytorch") -> dict[str, list[str]]:
    """kind -> the names the installed Lightning of ``namespace`` lists, spelled as under
    ``lightning.pytorch`` (imports Lightning)."""
    callbacks = [C + n.rsplit(".", 1)[-1] for n in discover_names(f"{namespace}.callbacks")]
    entry = [_TRAINER + n for n in _public_methods(f"{namespace}.trainer.trainer", "Trainer")]
    entry += [_TUNER + n for n in _public_methods(f"{namespace}.tuner.tuning", "Tuner")]
    return {"callback": sorted(callbacks), "entry point": sorted(entry)}

