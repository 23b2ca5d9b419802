"""Ignite's everyday surface under the adapter: every ``ignite.metrics.Metric`` subclass, every name
in ``ignite.handlers`` and ``ignite.engine``, and every public ``Engine`` method, classified as
**works** (with the test that shows it at data=2 against one process, on an evaluation set that
does not divide) or **refused** (when the engine is attached or its run starts, before any
collective, saying why and what to do instead). The published table is ``docs/surface/ignite.md``
(``python tools/surface_tables.py``); ``tests/ignite_plugin/test_surface.py`` fails when the
installed ignite lists an entry this does not classify.

Importing this module imports neither torch nor ignite (:func:`discover` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from polyparallel.testing.surface import Entry, Surface, SurfaceError, discover_classes, discover_methods, discover_names
from polyparallel.testing.surface import refused as _refused
from polyparallel.testing.surface import works as _works

__all__ = ["SURFACE", "check_engine", "classify", "discover"]

_T = "tests/ignite_plugin/test_surface_works.py::"
METRICS = _T + "test_metrics_equal_single_process"
HANDLERS = _T + "test_handlers_train_as_one_process"
ENGINE = _T + "test_engine_entry_points_as_one_process"
SKLEARN = "tests/ignite_plugin/test_metrics.py::test_epoch_metrics_gather_shards_of_different_sizes_and_equal_sklearn"
CHECKPOINT = "tests/ignite_plugin/test_checkpoint.py::test_ignite_resumes_mid_epoch_exactly"
M, H, E = "ignite.metrics.", "ignite.handlers.", "ignite.engine."

GATHERED = ("every rank's rows all-gathered over the data group (sizes exchanged, padded, trimmed), computed once "
            "and broadcast as float64")
SUMMED = "its sums and counts reduced over the data group"
NOT_INSTALLED = ("its package ({pkg}) is not installed where polyparallel's Ignite adapter is tested, so its behaviour "
                 "under the adapter is unverified")
LOG_INSTEAD = ("log engine.state.metrics (global on every rank after the adapter's reduction) from the rank with the "
               "'logger' role with a handler of your own, or attach the logger in a one-process run")
PER_RANK_CLOCK = "times this rank's own events (each rank has its own clock)"
ON_EVERY_RANK = ("shows on every rank it is attached to: attach it where 'logger' in strategy.session().roles")


def _m(name: str, differs: str = SUMMED, test: str = METRICS) -> Entry:
    return _works(M + name, "metric", test, differs)


def _h(name: str, differs: str = "", test: str = HANDLERS) -> Entry:
    return _works(H + name, "handler", test, differs)


def _e(name: str, differs: str = "", test: str = ENGINE) -> Entry:
    return _works(name, "entry point", test, differs)


_EPOCH = ["roc_auc.ROC_AUC", "roc_auc.RocCurve", "average_precision.AveragePrecision",
          "precision_recall_curve.PrecisionRecallCurve", "epoch_metric.EpochMetric", "cohen_kappa.CohenKappa",
          "matthews_corrcoef.MatthewsCorrCoef", "mean_average_precision.MeanAveragePrecision",
          "regression.kendall_correlation.KendallRankCorrelation", "regression.median_absolute_error.MedianAbsoluteError",
          "regression.median_absolute_percentage_error.MedianAbsolutePercentageError",
          "regression.median_relative_absolute_error.MedianRelativeAbsoluteError",
          "regression.spearman_correlation.SpearmanRankCorrelation",
          "regression.geometric_mean_relative_absolute_error.GeometricMeanRelativeAbsoluteError",
          "clustering.silhouette_score.SilhouetteScore", "clustering.davies_bouldin_score.DaviesBouldinScore",
          "clustering.calinski_harabasz_score.CalinskiHarabaszScore"]
_SUMMED = ["accuracy.Accuracy", "precision.Precision", "recall.Recall", "confusion_matrix.ConfusionMatrix",
           "multilabel_confusion_matrix.MultiLabelConfusionMatrix", "top_k_categorical_accuracy.TopKCategoricalAccuracy",
           "loss.Loss", "entropy.Entropy", "mutual_information.MutualInformation", "cosine_similarity.CosineSimilarity",
           "mean_pairwise_distance.MeanPairwiseDistance", "kl_divergence.KLDivergence", "js_divergence.JSDivergence",
           "mean_absolute_error.MeanAbsoluteError", "mean_squared_error.MeanSquaredError",
           "root_mean_squared_error.RootMeanSquaredError", "psnr.PSNR", "ssim.SSIM", "rec_sys.ndcg.NDCG",
           "rec_sys.hitrate.HitRate", "nlp.bleu.Bleu", "nlp.rouge.Rouge", "nlp.rouge.RougeL", "nlp.rouge.RougeN",
           "nlp.character_error_rate.CharacterErrorRate", "nlp.perplexity.Perplexity", "gan.fid.FID",
           "gan.inception_score.InceptionScore", "fairness.demographic_parity.SelectionRate",
           "fairness.base.SubgroupMetric", "fairness.base.SubgroupDifference",
           "fairness.accuracy_difference.SubgroupAccuracyDifference",
           "fairness.demographic_parity.DemographicParityDifference", "metric_group.MetricGroup",
           *[f"regression.{m}" for m in (
               "canberra_metric.CanberraMetric", "fractional_absolute_error.FractionalAbsoluteError",
               "fractional_bias.FractionalBias", "geometric_mean_absolute_error.GeometricMeanAbsoluteError",
               "manhattan_distance.ManhattanDistance", "maximum_absolute_error.MaximumAbsoluteError",
               "mean_absolute_relative_error.MeanAbsoluteRelativeError", "mean_error.MeanError",
               "mean_normalized_bias.MeanNormalizedBias", "pearson_correlation.PearsonCorrelation",
               "r2_score.R2Score", "wave_hedges_distance.WaveHedgesDistance")]]
_ACCUMULATION = ("each row of a 2-d output (batch, ...) is an example, as in one process; a 0-d or 1-d output (a value "
                 "per batch) is one example per rank's batch, so at data=N there are N times as many")

_METRICS = [
    *[_m(n) for n in _SUMMED],
    *[_m(n, GATHERED) for n in _EPOCH],
    _m("metrics_lambda.MetricsLambda", "computed from its sources, each reduced over the data group"),
    _m("metric.Metric", "a Metric of your own: its sync_all_reduce (or idist) collectives run over the data group"),
    _m("running_average.RunningAverage", "of a metric (src=): that metric reduced at every iteration, exact. Of an "
       "output (output_transform=): the data ranks' values averaged unweighted, equal to one process when their "
       "batches hold the same number of samples (training; an evaluation batch split 4 + 3 is weighed 1:1). It "
       "reduces at every iteration, so every data rank must run the same number of iterations"),
    _m("frequency.Frequency", "items per second of the whole data group (each sample counted once: tensor and "
       "pipeline replicas are not); reduces at every iteration, so every data rank must run the same number"),
    _m("accumulation.Average", _ACCUMULATION), _m("accumulation.GeometricAverage", _ACCUMULATION),
    _m("accumulation.VariableAccumulation", _ACCUMULATION),
    *[_refused(M + n, "metric", "it averages a statistic of each batch, and at data=N each rank's batch holds 1/N "
               "of the samples: the value would differ from one process silently",
               "compute it in one process, or from gathered rows with EpochMetric(compute_fn)")
      for n in ("hsic.HSIC", "maximum_mean_discrepancy.MaximumMeanDiscrepancy")],
    _refused(M + "gpu_info.GpuInfo", "metric", "it reports this process's GPU (pynvml, CUDA): there is no data-group "
             "value, and CUDA is not where the adapter is tested",
             "attach it to an engine the adapter does not manage, or log it per rank"),
    *[_refused(M + f"vision.object_detection_average_precision_recall.{n}", "metric",
               "it needs torchvision, which cannot be imported where the adapter is tested (no build for the installed "
               "torch), so it is unverified", "compute detection metrics in one process")
      for n in ("ObjectDetectionAvgPrecisionRecall", "CommonObjectDetectionMetrics")],
]

_SCHEDULERS = ["LRScheduler", "CosineAnnealingScheduler", "LinearCyclicalScheduler", "ConcatScheduler", "PiecewiseLinear",
               "ParamGroupScheduler", "ReduceLROnPlateauScheduler", "LambdaStateScheduler",
               "PiecewiseLinearStateScheduler", "ExpStateScheduler", "StepStateScheduler", "MultiStepStateScheduler",
               "StateParamScheduler", "BaseParamScheduler", "ParamScheduler", "CyclicalScheduler",
               "create_lr_scheduler_with_warmup"]
_HANDLERS = [
    *[_h(n, "every rank steps its own optimizer (or engine state) alike") for n in _SCHEDULERS],
    _h("EarlyStopping", "its score reads the evaluator's metrics, global on every rank, so every rank stops alike "
       "(a score_function of your own must be global too)"),
    _h("EMAHandler", "every rank averages its replica, which DDP keeps equal"),
    _h("FastaiLRFinder", "the loss it records is the data group's mean (ignite sums it over the whole world); every "
       "rank keeps its own copy of the state in a temporary directory"),
    _h("Timer", PER_RANK_CLOCK), _h("BasicTimeProfiler", PER_RANK_CLOCK), _h("HandlersTimeProfiler", PER_RANK_CLOCK),
    _h("global_step_from_engine"), _h("ProgressBar", ON_EVERY_RANK), _h("FBResearchLogger", ON_EVERY_RANK),
    _h("Checkpoint", "with the adapter's save handler (ignite.checkpoint(...)): polyparallel checkpoints that reshard",
       test=CHECKPOINT),
    _h("ModelCheckpoint", "written by global rank 0 (ignite's DiskSaver); the data axis only: with tensor or "
       "pipeline > 1 or zero >= 2 (each rank holds shards) it is refused"),
    _h("DiskSaver", "as ModelCheckpoint: the data axis only"),
    _refused(H + "EpochOutputStore", "handler", "it keeps this rank's outputs only (its shard), so a value computed "
             "from it would be this rank's silently", "use EpochMetric(compute_fn): every rank's outputs are gathered"),
    _refused(H + "TerminateOnNan", "handler", "it stops the rank whose output is NaN; the other ranks go on into the "
             "next collective and wait for it",
             "decide globally: @trainer.on(Events.ITERATION_COMPLETED) def stop(engine): if "
             "strategy.reduce_metrics({'nan': float(math.isnan(engine.state.output))})['nan'] > 0: engine.terminate()"),
    _refused(H + "TimeLimit", "handler", "each rank reads its own clock, so ranks stop at different iterations and "
             "the others wait on a collective", "bound the run by epochs or iterations (max_epochs, epoch_length)"),
    _refused(H + "BatchSizeScheduler", "handler", "it sets the batch size of this rank's loader, so the global batch "
             "becomes data x that value (the adapter's batch size is global)",
             "rebuild the loader with ignite.auto_dataloader(batch_size=<global>) between runs"),
    *[_refused(H + cls, "handler", NOT_INSTALLED.format(pkg=pkg), LOG_INSTEAD) for cls, pkg in (
        ("ClearMLLogger", "clearml"), ("MLflowLogger", "mlflow"), ("NeptuneLogger", "neptune"),
        ("PolyaxonLogger", "polyaxon"), ("TensorboardLogger", "tensorboard / tensorboardX"), ("VisdomLogger", "visdom"),
        ("WandBLogger", "wandb"))],
]

_ENGINE_METHODS = ["add_event_handler", "fire_event", "has_event_handler", "has_registered_events", "interrupt",
                   "load_state_dict", "on", "register_events", "remove_event_handler", "run", "set_data", "state_dict",
                   "state_dict_user_keys", "terminate", "terminate_epoch"]
_ENTRY_POINTS = [
    *[_e(f"{E}Engine.{n}", "call it on every rank alike" if n in ("terminate", "terminate_epoch", "interrupt") else "")
      for n in _ENGINE_METHODS],
    *[_e(E + n) for n in ("CallableEventWithFilter", "Engine", "EventEnum", "Events", "EventsList",
                          "RemovableEventHandle", "State", "create_supervised_evaluator", "create_supervised_trainer",
                          "supervised_evaluation_step", "supervised_training_step")],
    _refused(E + "DeterministicEngine", "entry point", "it replaces the loader's batch sampler with ignite's "
             "ReproducibleBatchSampler, which the adapter's sharded loader does not take (its first pass fails)",
             "use Engine: the adapter's loaders are deterministic from (seed, epoch), also on resume "
             "(ignite.load_checkpoint)"),
    *[_refused(E + n, "entry point", why, instead) for n, why, instead in (
        ("supervised_training_step_amp", "CUDA's automatic mixed precision, and CUDA is not where the adapter is tested",
         "set Strategy(precision='bf16-mixed' or 'fp16-mixed'): the adapter's create_supervised_trainer autocasts "
         "(and scales) on the runtime's device"),
        ("supervised_evaluation_step_amp", "CUDA's automatic mixed precision, and CUDA is not where the adapter is "
         "tested", "evaluate in float32 (amp_mode=None)"),
        ("supervised_training_step_apex", NOT_INSTALLED.format(pkg="apex"), "train with amp_mode=None"),
        ("supervised_training_step_tpu", "a TPU step (torch_xla); the Ignite adapter runs on the torch runtime",
         "use the torch runtime's devices, or the fastai / plain-loop path on XLA"))],
]

SURFACE = Surface(
    framework="PyTorch-Ignite", version="0.5.5", adapter="polyparallel's Ignite adapter (strategy.adapt('ignite'))",
    entries=[*_METRICS, *_HANDLERS, *_ENTRY_POINTS],
    kinds={
        "metric": "Every `ignite.metrics.Metric` subclass in ignite's source. Tested by evaluating 23 samples "
                  "(shards of 12 and 11) at data=2 and at data=2 x tensor=2 against one process (and scikit-learn "
                  "for ROC_AUC and AveragePrecision); a refused metric raises `TypeError` when its engine is "
                  "attached or its run starts.",
        "handler": "Every name in `ignite.handlers.__all__`. A refused handler raises `TypeError` when the engine it "
                   "is attached to is attached to the adapter or starts, before any collective.",
        "entry point": "Every name in `ignite.engine.__all__` and every public `Engine` method. A refused step "
                       "function raises `TypeError` when its engine is attached.",
    },
    preamble="*works*: tested at data=2 (and data=2 x tensor=2 for metrics) on gloo processes against a single process "
             "with the same global batch, on an evaluation set that does not divide evenly. *refused*: the adapter "
             "raises `TypeError` naming the entry, why and what to do instead, before any collective. Metrics that "
             "reduce at every iteration (RunningAverage, Frequency, metrics attached batch-wise) need every data "
             "rank to run the same number of iterations.",
)


def classify(obj: Any, kind: str) -> Entry | None:
    """The entry ``obj`` falls under: that of the first class of its MRO the surface classifies
    (ignite's classes are exported under ``ignite.metrics``/``ignite.handlers``: both the
    defining module and the package are tried)."""
    for cls in type(obj).__mro__:
        module = cls.__module__
        names = [f"{module}.{cls.__qualname__}"]
        if module.startswith("ignite.handlers."):
            names.append(f"ignite.handlers.{cls.__qualname__}")
        for name in names:
            entry = SURFACE.get(name)
            if entry is not None and entry.kind == kind:
                return entry
    return None


_STEPS = {"supervised_training_step_amp", "supervised_evaluation_step_amp", "supervised_training_step_apex",
          "supervised_training_step_tpu"}


def _candidates(engine: Any) -> Iterable[tuple[str, Any]]:
    """(kind, object) of what is attached to ``engine``: metrics, handler objects, their arguments."""
    from ignite.metrics import Metric

    for entries in engine._event_handlers.values():
        for handler, args, _ in entries:
            handler = getattr(handler, "_polyparallel_original", handler)
            parent = getattr(handler, "_parent", None)
            if parent is not None and callable(parent):
                handler = parent() or handler
            owner = getattr(handler, "__self__", None)
            for obj in (owner, handler, *args):
                if obj is None or isinstance(obj, (str, int, float)) or obj is engine:
                    continue
                yield ("metric" if isinstance(obj, Metric) else "handler"), obj


def check_engine(engine: Any, strategy: Any) -> None:
    """Raise :class:`~polyparallel.testing.surface.SurfaceError` (a ``TypeError``) if ``engine``
    runs a refused step function or has a refused metric or handler attached (under
    ``strategy``: ModelCheckpoint is refused where ranks hold shards). Also an ``Events.STARTED``
    handler of attached engines."""
    step = getattr(getattr(engine, "_process_function", None), "__qualname__", "").split(".")[0]
    if step in _STEPS:
        raise SurfaceError(SURFACE[E + step].message(SURFACE.adapter))
    if any(c.__name__ == "DeterministicEngine" and c.__module__.startswith("ignite.engine") for c in type(engine).__mro__):
        raise SurfaceError(SURFACE[E + "DeterministicEngine"].message(SURFACE.adapter))
    topology = strategy.topology
    shards = topology.size("tensor") > 1 or topology.size("pipeline") > 1 or strategy.shard_policy.stage >= 2
    for kind, obj in _candidates(engine):
        entry = classify(obj, kind)
        if entry is None:
            continue
        if entry.status == "refused":
            raise SurfaceError(entry.message(SURFACE.adapter) + f" (attached: {type(obj).__name__})")
        if entry.short in ("ModelCheckpoint", "DiskSaver") and shards:
            raise SurfaceError(
                f"{SURFACE.adapter} refuses {entry.name} at {topology!r}: each rank's state_dict holds shards of the "
                "model, and ignite's DiskSaver writes global rank 0's alone. Instead: ignite.checkpoint(to_save, "
                "dirname) (polyparallel checkpoints, every rank its shards, reshardable).")


def discover() -> dict[str, list[str]]:
    """kind -> the names the installed ignite lists (imports ignite.handlers and ignite.engine)."""
    engine = discover_names("ignite.engine")
    engine += [f"{E}Engine.{n}" for n in discover_methods("ignite.engine", "Engine")]
    return {"metric": discover_classes("ignite.metrics", ["Metric"]), "handler": discover_names("ignite.handlers"),
            "entry point": sorted(engine)}
