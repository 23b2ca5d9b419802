"""fastai's everyday surface under the adapter: every metric, callback and ``Learner`` method,
classified as **works** (with the test that shows it at data=2 against one process, on a
validation set that does not divide) or **refused** (before anything runs, saying why and what
to do instead). The published table is ``docs/surface/fastai.md``
(``python tools/surface_tables.py``); ``tests/fastai_plugin/test_surface.py`` fails when the
installed fastai lists an entry this does not classify.

Importing this module imports neither torch nor fastai (:func:`discover` does, to list them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from polyparallel.testing.surface import Entry, Surface, SurfaceError, discover_classes, discover_names, refused, works

__all__ = ["SURFACE", "check_callbacks", "classify", "discover", "metric_refusal"]

_T = "tests/fastai_plugin/test_surface_works.py::"
METRICS = _T + "test_metrics_equal_single_process"
TRAIN = _T + "test_callbacks_train_as_one_process"
PREDS = _T + "test_get_preds_returns_every_row_in_order"
LR_FIND = _T + "test_lr_find_equals_single_process"
SAVE_MODEL = _T + "test_save_model_callback_reloads_the_best_model"
TABULAR = _T + "test_tabular_learner_with_batchnorm_differs_as_documented"
QUIET = _T + "test_ranks_without_the_logger_role_print_nothing"
RANDOM = _T + "test_random_callbacks_keep_replicas_identical"
PER_RANK = _T + "test_per_rank_callbacks_see_their_share"
SAVE_LOAD = "tests/fastai_plugin/test_callback.py::test_save_writes_once_from_the_checkpoint_role_and_load_restores"
FIT = "tests/fastai_plugin/test_callback.py::test_training_matches_a_single_process_learner"
LEFT_AS_MADE = "tests/fastai_plugin/test_plugin.py::test_learner_is_left_as_fastai_made_it"
REFUSED_METRIC = "tests/fastai_plugin/test_plugin.py::test_unsupported_metric_refused_before_any_operation"

# -- what differs, said once ---------------------------------------------------------------------------------
AVG = ("count-weighted over every rank's samples: equal to one process for a mean over samples (accuracy, mse, ...); "
       "a function that is not one (an F1 of the batch) is averaged over each rank's share of the batch, as fastai "
       "averages it over batches (use AccumMetric for those)")
PER_RANK_NOTE = "runs on every rank on this rank's share of each batch (learn.xb, learn.yb, learn.pred)"
NOT_INSTALLED = ("its package ({pkg}) is not installed where polyparallel's fastai adapter is tested, so its behaviour "
                 "under the adapter is unverified")
LOG_INSTEAD = ("log learn.recorder.values (global on every rank) from the rank with the 'logger' role after fit, "
               "or attach this logger in a one-process run")
VISION = ("fastai.vision cannot be imported where the adapter is tested (no torchvision built for the installed "
          "torch), so this is unverified")
VISION_INSTEAD = "train the networks with the torch runtime (strategy.wrap_model, strategy.shard_data) directly"
CPU_ONLY = ("fails on CPU in one process too (fastai's version needs CUDA), and CUDA is not where the adapter is "
            "tested")
BATCHNORM = ("BatchNorm layers normalise each rank's share of the global batch (ghost batches; torch's SyncBatchNorm "
             "is CUDA-only): training differs from one process with the same global batch. Running statistics are "
             "averaged (StatePolicy) before every validation, so every rank validates and predicts with one model")


def _m(name: str, test: str = METRICS, differs: str = "") -> Entry:
    return works(name, "metric", test, differs)


def _c(name: str, test: str, differs: str = "") -> Entry:
    return works(name, "callback", test, differs)


def _e(name: str, test: str, differs: str = "") -> Entry:
    return works(name, "entry point", test, differs)


_ACCUM = "predictions and targets of every rank gathered (row counts exchanged first), then computed once"

_METRIC_ENTRIES = [
    # functions: an AvgMetric each
    *[_m(f"fastai.metrics.{n}", differs=AVG) for n in (
        "accuracy", "error_rate", "top_k_accuracy", "accuracy_multi", "mse", "mae", "msle")],
    refused("fastai.metrics.foreground_acc", "metric",
            "as a function metric (fastai's AvgMetric) it is a ratio over each batch's foreground pixels, averaged "
            "over batches by their sample counts: the value depends on which samples share a batch, and each data "
            "rank's batches hold other samples than one process's, so it would differ silently",
            "use AccumMetric(foreground_acc, flatten=False): computed once over every rank's pixels"),
    # AccumMetric factories and instances
    *[_m(f"fastai.metrics.{n}", differs=_ACCUM) for n in (
        "rmse", "exp_rmspe", "APScoreBinary", "BalancedAccuracy", "BrierScore", "CohenKappa", "F1Score", "FBeta",
        "HammingLoss", "Jaccard", "Precision", "Recall", "RocAuc", "RocAucBinary", "MatthewsCorrCoef",
        "APScoreMulti", "BrierScoreMulti", "F1ScoreMulti", "FBetaMulti", "HammingLossMulti", "JaccardMulti",
        "PrecisionMulti", "RecallMulti", "RocAucMulti", "ExplainedVariance", "R2Score",
        "PearsonCorrCoef", "SpearmanCorrCoef", "AccumMetric", "skm_to_fastai")],
    _m("fastai.metrics.perplexity", differs="the loss summed over every rank's samples, then exponentiated"),
    _m("fastai.metrics.Perplexity", differs="the loss summed over every rank's samples, then exponentiated"),
    _m("fastai.metrics.Dice", differs="intersections and unions summed over the data group"),
    _m("fastai.metrics.JaccardCoeff", differs="intersections and unions summed over the data group"),
    _m("fastai.metrics.DiceMulti", differs="per-class intersections and unions summed over the data group"),
    _m("fastai.metrics.JaccardCoeffMulti", differs="per-class intersections and unions summed over the data group"),
    _m("fastai.metrics.CorpusBLEUMetric", differs="n-gram counts and lengths summed over the data group"),
    _m("fastai.metrics.LossMetric", differs="count-weighted over every rank's samples"),
    _m("fastai.metrics.LossMetrics", differs="count-weighted over every rank's samples"),
    _m("fastai.learner.AvgMetric", differs=AVG),
    _m("fastai.learner.AvgLoss", differs="the valid loss: count-weighted over every rank's samples"),
    _m("fastai.learner.AvgSmoothLoss", test=FIT,
       differs="the recorder's training loss: recomputed each epoch from the global per-batch losses (during the "
               "epoch learn.smooth_loss is this rank's, unless LRFinder or TerminateOnNaNCallback is attached)"),
    refused("fastai.metrics.MatthewsCorrCoefMulti", "metric",
            "scikit-learn's matthews_corrcoef rejects multi-label targets ('multilabel-indicator is not supported'), "
            "in one process too",
            "compute it per label: one AccumMetric(func) per column, func calling sklearn.metrics.matthews_corrcoef"),
    refused("fastai.metrics.optim_metric", "metric",
            "it optimises its argument on each batch, which at data=N is each rank's 1/N of the batch: the value "
            "would differ from one process silently",
            "wrap the optimised function in AccumMetric (AccumMetric(optim_metric(f, ...))), which optimises over "
            "the whole validation set, gathered from every rank"),
    refused("fastai.learner.ValueMetric", "metric",
            "its value is whatever its function returns on each rank; the adapter cannot know how to combine it",
            "compute the value from global quantities (learn.recorder.values, strategy.reduce_metrics) or write the "
            "metric as a function (AvgMetric) or AccumMetric"),
    refused("fastai.learner.Metric", "metric",
            "a Metric subclass of your own keeps a state the adapter cannot combine over the data group",
            "write it as a function (it becomes an AvgMetric) or as AccumMetric(func), so every rank's samples count"),
]

_CALLBACK_ENTRIES = [
    _c("fastai.callback.core.Callback", PER_RANK, PER_RANK_NOTE + "; learn.loss is this rank's batch loss unless "
       "LRFinder or TerminateOnNaNCallback is attached (then the global one)"),
    _c("fastai.callback.core.TrainEvalCallback", FIT),
    _c("fastai.callback.core.GatherPredsCallback", PREDS, "every rank predicts every sample (not sharded)"),
    _c("fastai.callback.core.FetchPredsCallback", PREDS, "every rank predicts every sample (not sharded)"),
    _c("fastai.learner.Recorder", FIT, "values are the global ones; learn.smooth_loss during an epoch is this "
       "rank's (recomputed from the global losses at the epoch's end)"),
    _c("fastai.learner.CastToTensor", FIT),
    _c("fastai.learner.SkipToEpoch", TRAIN, "fit(start_epoch=) shards each epoch from (seed, epoch), as an "
       "uninterrupted run"),
    _c("fastai.callback.progress.ProgressCallback", QUIET, "shown on the rank with the 'logger' role only"),
    _c("fastai.callback.progress.ShowGraphCallback", QUIET, "shown on the rank with the 'logger' role only"),
    _c("fastai.callback.progress.CSVLogger", TRAIN, "the file is written by the rank with the 'logger' role only"),
    _c("fastai.callback.schedule.ParamScheduler", TRAIN),
    _c("fastai.callback.schedule.LRFinder", LR_FIND, "the model and optimizer state are kept in memory on every "
       "rank (fastai writes a temporary file); learn.loss is the global batch loss (one reduction per batch)"),
    _c("fastai.callback.tracker.TrackerCallback", SAVE_MODEL),
    _c("fastai.callback.tracker.EarlyStoppingCallback", TRAIN),
    _c("fastai.callback.tracker.ReduceLROnPlateau", TRAIN),
    _c("fastai.callback.tracker.SaveModelCallback", SAVE_MODEL, "saved once, by the rank with the 'checkpoint' role"),
    _c("fastai.callback.tracker.TerminateOnNaNCallback", TRAIN, "the global batch loss decides (one reduction per "
       "training batch); a NaN validation loss on any rank stops every rank at the end of that validation"),
    _c("fastai.callback.training.GradientAccumulation", TRAIN, "n_acc counts the samples of the whole data group "
       "(a multiple of the data size)"),
    _c("fastai.callback.training.GradientClip", TRAIN, "clips the averaged (global) gradients"),
    _c("fastai.callback.training.BnFreeze", TRAIN),
    _c("fastai.callback.training.ShortEpochCallback", TRAIN, "pct of each rank's batches: of the validation shards "
       "(which may differ by one sample) when short_valid"),
    _c("fastai.callback.fp16.MixedPrecision", TRAIN, "follows Strategy(precision=): 'bf16-mixed'/'fp16-mixed' "
       "autocast (and scale) on the model's device, CPU too, another mode is refused; with precision=None fastai's "
       "own, whose CUDA autocast does nothing on CPU (float32); untested on CUDA"),
    _c("fastai.callback.channelslast.ChannelsLast", TRAIN),
    _c("fastai.callback.mixup.MixHandler", RANDOM, "random: each rank draws its own mixing, and partners come from "
       "this rank's share of the batch"),
    _c("fastai.callback.mixup.MixUp", RANDOM, "random: each rank draws its own lambda and partners from this "
       "rank's share of the batch (statistically the same augmentation, not the same draws)"),
    _c("fastai.callback.mixup.CutMix", RANDOM, "random: each rank draws its own boxes and partners from this "
       "rank's share of the batch (statistically the same augmentation, not the same draws)"),
    _c("fastai.callback.preds.MCDropoutCallback", RANDOM, "dropout masks come from each rank's torch generator: the "
       "same on every rank (and as one process) when every rank seeds torch alike"),
    _c("fastai.callback.data.CollectDataCallback", PER_RANK, "collects this rank's share of each batch"),
    _c("fastai.callback.hook.HookCallback", PER_RANK, "hooks see this rank's share of each batch"),
    _c("fastai.callback.hook.ActivationStats", PER_RANK, "statistics of this rank's share of each batch"),
    _c("fastai.callback.rnn.ModelResetter", TRAIN, "resets the user's module (learn.model is the DDP wrapper "
       "during fit)"),
    _c("fastai.callback.rnn.RNNCallback", TRAIN),
    _c("fastai.callback.rnn.RNNRegularizer", TRAIN, "activation penalties of each rank's share, averaged with the "
       "gradients: equal to one process for equal shares (training batches are)"),
    _c("fastai.test_utils.VerboseCallback", QUIET, "prints on the rank with the 'logger' role only"),
    refused("fastai.callback.fp16.NonNativeMixedPrecision", "callback", CPU_ONLY,
            "use MixedPrecision (learn.to_fp16()), or train in float32"),
    refused("fastai.callback.fp16.ModelToHalf", "callback", CPU_ONLY + " (float inputs meet half weights)",
            "use MixedPrecision (learn.to_fp16()), or train in float32"),
    refused("fastai.distributed.DistributedTrainer", "callback",
            "fastai's own data parallelism (accelerate, CUDA, its own process group) would run under the adapter's",
            "leave it out: strategy.adapt('fastai') is the data-parallel callback (remove learn.to_distributed / "
            "learn.distrib_ctx())"),
    refused("fastai.distributed.ParallelTrainer", "callback",
            "it wraps the model in nn.DataParallel (threads over CUDA devices of one process) inside the adapter's DDP",
            "leave it out: one process per device with strategy.adapt('fastai')"),
    *[refused(f"fastai.callback.{mod}.{cls}", "callback", NOT_INSTALLED.format(pkg=pkg), LOG_INSTEAD) for mod, cls, pkg in (
        ("azureml", "AzureMLCallback", "azureml"), ("comet", "CometCallback", "comet_ml"),
        ("tensorboard", "TensorBoardBaseCallback", "tensorboard"), ("tensorboard", "TensorBoardCallback", "tensorboard"),
        ("tensorboard", "TensorBoardProjectorCallback", "tensorboard"), ("wandb", "WandbCallback", "wandb"))],
    *[refused(f"fastai.vision.gan.{cls}", "callback", VISION, VISION_INSTEAD) for cls in (
        "AdaptiveGANSwitcher", "FixedGANSwitcher", "GANDiscriminativeLR", "GANTrainer")],
]

_L = "fastai.learner.Learner."
_ENTRY_POINTS = [
    _e(_L + "fit", FIT), _e(_L + "fit_one_cycle", TRAIN), _e(_L + "fit_flat_cos", TRAIN), _e(_L + "fit_sgdr", TRAIN),
    _e(_L + "fine_tune", TRAIN), _e(_L + "lr_find", LR_FIND, "learn.loss is the global batch loss during lr_find"),
    _e(_L + "validate", METRICS), _e(_L + "get_preds", PREDS, "every rank predicts every sample (not sharded)"),
    _e(_L + "predict", TABULAR), _e(_L + "tta", PREDS, "every rank predicts every sample (not sharded)"),
    _e(_L + "show_results", TABULAR, "shown on the rank with the 'logger' role only; each rank draws its own "
       "shuffled batch"),
    _e(_L + "save", SAVE_LOAD, "written once, by the rank with the 'checkpoint' role"),
    _e(_L + "load", SAVE_LOAD, "every rank reads the file after a barrier"),
    _e(_L + "export", TABULAR, "written once, by the rank with the 'checkpoint' role, without the adapter's callback"),
    _e("fastai.learner.load_learner", TABULAR, "it returns a plain fastai Learner: inside a launched job add the "
       "adapter before predicting (loaded.add_cb(strategy.adapt('fastai'))), or fastai's own get_preds all-gathers "
       "every batch over WORLD_SIZE (every row twice); it waits on fastai's world-wide barrier, so call it on every "
       "process (not bounded by the strategy's timeout)"),
    _e(_L + "summary", PREDS, "collective (it runs a batch through get_preds): call it on every rank"),
    _e(_L + "freeze", TRAIN), _e(_L + "freeze_to", TRAIN), _e(_L + "unfreeze", TRAIN),
    _e(_L + "to_fp16", TRAIN, "see MixedPrecision"), _e(_L + "to_bf16", TRAIN, "see MixedPrecision"),
    _e(_L + "to_fp32", TRAIN), _e(_L + "to_channelslast", TRAIN, "to_fp16=False: fastai's own signature passes "
       "to_fp16 to GradScaler otherwise"),
    _e(_L + "to_contiguous", TRAIN),
    _e(_L + "add_cb", LEFT_AS_MADE), _e(_L + "add_cbs", TRAIN), _e(_L + "remove_cb", LEFT_AS_MADE),
    _e(_L + "remove_cbs", TRAIN), _e(_L + "added_cbs", TRAIN), _e(_L + "removed_cbs", PREDS),
    _e(_L + "ordered_cbs", QUIET), _e(_L + "show_training_loop", QUIET, "prints on the 'logger' rank only"),
    _e(_L + "create_opt", FIT), _e(_L + "one_batch", FIT), _e(_L + "all_batches", FIT),
    _e(_L + "no_bar", QUIET), _e(_L + "no_logging", LR_FIND), _e(_L + "no_mbar", PREDS),
    _e(_L + "validation_context", PREDS), _e(_L + "loss_not_reduced", PREDS),
    _e(_L + "metrics", METRICS), _e(_L + "to_detach", PREDS, "never gathers over the world while the adapter is "
       "attached (fastai's all-gathers every batch over WORLD_SIZE, unbounded)"),
    _e("fastai.interpret.Interpretation.from_learner", TABULAR, "every rank predicts every sample"),
    _e("fastai.interpret.ClassificationInterpretation.from_learner", TABULAR, "every rank predicts every sample"),
    _e("fastai.tabular.learner.tabular_learner", TABULAR, BATCHNORM),
    refused(_L + "to_distributed", "entry point", "it adds fastai's DistributedTrainer (accelerate, CUDA)",
            "use strategy.adapt('fastai') (Learner(..., cbs=cb) or with cb.distrib_ctx(learn):)"),
    refused(_L + "distrib_ctx", "entry point", "fastai's own adds DistributedTrainer (accelerate, CUDA)",
            "use the adapter's cb.distrib_ctx(learn), with cb = strategy.adapt('fastai')"),
    refused(_L + "detach_distributed", "entry point", "it undoes fastai's to_distributed, which is refused",
            "remove the adapter with learn.remove_cb(cb)"),
    refused(_L + "to_parallel", "entry point", "it adds fastai's ParallelTrainer (nn.DataParallel)",
            "one process per device with strategy.adapt('fastai')"),
    refused(_L + "detach_parallel", "entry point", "it undoes fastai's to_parallel, which is refused",
            "remove the adapter with learn.remove_cb(cb)"),
    refused(_L + "parallel_ctx", "entry point", "it adds fastai's ParallelTrainer (nn.DataParallel)",
            "one process per device with strategy.adapt('fastai')"),
    refused(_L + "to_non_native_fp16", "entry point", "it adds NonNativeMixedPrecision: " + CPU_ONLY,
            "use learn.to_fp16()"),
    refused(_L + "to_non_native_fp32", "entry point", "it undoes to_non_native_fp16, which is refused",
            "use learn.to_fp32()"),
    refused(_L + "gather_args", "entry point", "WandbCallback's (patched onto Learner): " +
            NOT_INSTALLED.format(pkg="wandb"), LOG_INSTEAD),
]

SURFACE = Surface(
    framework="fastai", version="2.8.12", adapter="polyparallel's fastai adapter (strategy.adapt('fastai'))",
    entries=[*_METRIC_ENTRIES, *_CALLBACK_ENTRIES, *_ENTRY_POINTS],
    kinds={
        "metric": "Every name in `fastai.metrics.__all__` and every `fastai.learner.Metric` subclass in fastai's "
                  "source. Tested by validating at data=2 on 23 samples (shards of 12 and 11) against one "
                  "process; a refused metric raises `TypeError` in `before_fit` / `before_validate`.",
        "callback": "Every `Callback` subclass in fastai's source (modules that cannot be imported here "
                    "included). A refused callback raises `TypeError` in `before_fit` / `before_validate`, before "
                    "any collective.",
        "entry point": "Every public `Learner` method (its class and fastai's `@patch`es), plus `load_learner`, "
                       "`Interpretation` and `tabular_learner`.",
    },
    preamble="*works*: tested at data=2 (2 gloo processes) against a single process with the same global batch, "
             "on a validation set that does not divide evenly. *refused*: the adapter raises `TypeError` naming "
             "the entry, why and what to do instead, before any collective. Applies to everything: on ranks "
             "without the `logger` role `fit`, `show_results` and `show_training_loop` print nothing; BatchNorm trains on each rank's "
             "share of the batch (see `tabular_learner`).",
)


# -- used by the callback ---------------------------------------------------------------------------------
def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def classify(obj: Any, kind: str) -> Entry | None:
    """The entry ``obj`` falls under: that of the first class of its MRO the surface classifies
    (a subclass of your own of a refused callback is refused, one of ``Callback`` works)."""
    for cls in type(obj).__mro__:
        entry = SURFACE.get(f"{cls.__module__}.{cls.__qualname__}")
        if entry is not None and entry.kind == kind:
            return entry
    return None


def check_callbacks(cbs: Iterable[Any]) -> None:
    """Raise :class:`~polyparallel.testing.surface.SurfaceError` (a ``TypeError``) for the first
    refused callback in ``cbs``."""
    for cb in cbs:
        entry = classify(cb, "callback")
        if entry is not None and entry.status == "refused":
            raise SurfaceError(entry.message(SURFACE.adapter) + f" (the Learner's callback {type(cb).__name__!r})")


def metric_refusal(metric: Any) -> Entry | None:
    """The refused entry ``metric`` (a Learner's metric object) falls under, if any."""
    func = getattr(metric, "func", None)
    if getattr(func, "__qualname__", "").startswith("optim_metric.<locals>"):
        return SURFACE["fastai.metrics.optim_metric"]
    if getattr(func, "__name__", "") == "matthews_corrcoef" and getattr(metric, "thresh", None) is not None:
        return SURFACE["fastai.metrics.MatthewsCorrCoefMulti"]
    if getattr(func, "__name__", "") == "foreground_acc" and type(metric).__name__ == "AvgMetric":
        return SURFACE["fastai.metrics.foreground_acc"]
    entry = classify(metric, "metric")
    return entry if entry is not None and entry.status == "refused" else None


def discover() -> dict[str, list[str]]:
    """kind -> the names the installed fastai lists (imports fastai's metrics)."""
    from polyparallel.testing.surface import discover_methods

    metrics = set(discover_names("fastai.metrics")) | set(discover_classes("fastai", ["fastai.learner.Metric"]))
    callbacks = discover_classes("fastai", ["fastai.callback.core.Callback"])
    methods = [f"{_L}{name}" for name in discover_methods("fastai", "Learner")]
    extra = ["fastai.learner.load_learner", "fastai.interpret.Interpretation.from_learner",
             "fastai.interpret.ClassificationInterpretation.from_learner", "fastai.tabular.learner.tabular_learner"]
    return {"metric": sorted(metrics), "callback": callbacks, "entry point": sorted(methods + extra)}
