"""Scenarios of Ignite's everyday surface, each run twice: under the adapter (launched, data=2 and
data=2 x tensor=2) and in one plain process (``ignite=None``, the reference), with the same
global batch, on an evaluation set of 23 samples (shards of 12 and 11).

Metrics see rows of (prediction, target) directly: an ``Engine`` whose step returns the batch,
so every metric gets exactly the rows of the data set. Each scenario returns plain values and
the surface entries it ran (``"ran"``), which ``test_surface_works.py`` checks against
:mod:`polyparallel_ignite.surface`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polyparallel as pp

N, GLOBAL = 23, 8
M, H, E = "ignite.metrics.", "ignite.handlers.", "ignite.engine."


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A data set of per-sample tuples (tensors, strings or token lists)."""

    def __init__(self, *columns: Any):
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(c[i] for c in self.columns)


def _collate(batch: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    out = []
    for column in zip(*batch):
        out.append(torch.stack(column) if isinstance(column[0], torch.Tensor) else list(column))
    return tuple(out)


def _data(task: str, n: int = N) -> Rows:
    g = _gen(17)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if task == "multiclass":
        x = randn(n, 4)
        return Rows(x, (x + randn(n, 4)).argmax(1))
    if task == "binary":
        p = torch.rand(n, generator=g, dtype=torch.float64)
        return Rows(p, (torch.rand(n, generator=g, dtype=torch.float64) < p).long())
    if task == "labels":  # predicted and true labels
        y = torch.randint(0, 3, (n,), generator=g)
        return Rows(torch.where(torch.rand(n, generator=g) < 0.6, y, torch.randint(0, 3, (n,), generator=g)), y)
    if task == "multilabel":
        y = (randn(n, 3) > 0).long()
        return Rows(torch.where(torch.rand(n, 3, generator=g) < 0.7, y, 1 - y), y)
    if task == "regression":
        y = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        return Rows(y + 0.3 * randn(n), y)
    if task == "vectors":
        return Rows(randn(n, 4), randn(n, 4))
    if task == "images":
        y = torch.rand(n, 3, 11, 11, generator=g, dtype=torch.float64)
        return Rows((y + 0.1 * randn(n, 3, 11, 11)).clamp(0, 1), y)
    if task == "clusters":
        y = torch.randint(0, 3, (n,), generator=g)
        return Rows(randn(n, 2) + 2 * torch.stack([y.double(), -y.double()], 1), y)
    if task == "ranking":
        return Rows(randn(n, 5), (torch.rand(n, 5, generator=g) < 0.4).double())
    if task == "fairness":
        x = randn(n, 3)
        return Rows(x, (x + randn(n, 3)).argmax(1), torch.randint(0, 2, (n,), generator=g))
    if task == "tokens":
        words = [[int(w) for w in torch.randint(0, 6, (5,), generator=g)] for _ in range(n)]
        refs = [[[w if torch.rand(1, generator=g) < 0.7 else 9 for w in s]] for s in words]
        return Rows(words, refs)
    if task == "strings":
        texts = ["".join("abcde"[int(i)] for i in torch.randint(0, 5, (6,), generator=g)) for _ in range(n)]
        return Rows([t[::-1] if k % 3 == 0 else t for k, t in enumerate(texts)], texts)
    if task == "language":
        x = randn(n, 5, 7)
        return Rows(x, (x + randn(n, 5, 7)).argmax(-1))
    raise ValueError(task)


class SumOfSquares:
    """A user's Metric: reduces with ``sync_all_reduce`` (made a class on first use: ignite is
    imported in the process that runs it)."""

    @staticmethod
    def make() -> Any:
        from ignite.metrics import Metric
        from ignite.metrics.metric import reinit__is_reduced, sync_all_reduce

        class _SumOfSquares(Metric):
            @reinit__is_reduced
            def reset(self) -> None:
                self._sum, self._n = torch.tensor(0.0, dtype=torch.float64), 0

            @reinit__is_reduced
            def update(self, output: Any) -> None:
                y_pred, y = output
                self._sum += ((y_pred - y) ** 2).sum()
                self._n += len(y)

            @sync_all_reduce("_sum", "_n")
            def compute(self) -> float:
                return float(self._sum) / self._n

        return _SumOfSquares()


def _per_sample_loss(output: Any) -> torch.Tensor:
    """(batch, 1): ignite's accumulations count the rows of a 2-d output as examples."""
    return nn.functional.cross_entropy(output[0], output[1], reduction="none")[:, None]


def _argmax(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return output[0].argmax(1), output[1]


def _one_second() -> Any:
    from ignite.metrics import Frequency

    class FixedClockFrequency(Frequency):  # items per second on a clock that reads 1 s: a count
        def reset(self) -> None:
            super().reset()
            self._timer = type("OneSecond", (), {"value": lambda self: 1.0})()

    return FixedClockFrequency(output_transform=lambda output: len(output[1]))


def metric_tasks() -> dict[str, list[tuple[str, Callable[[], Any]]]]:
    """task -> [(surface entry, factory of the metric)]."""
    import ignite.metrics as im
    from ignite.metrics import clustering as ic
    from ignite.metrics import fairness as fair
    from ignite.metrics import regression as rm

    def f1() -> Any:
        precision, recall = im.Precision(average=False), im.Recall(average=False)
        return im.MetricsLambda(lambda p, r: (2 * p * r / (p + r + 1e-20)).mean(), precision, recall)

    def epoch_metric() -> Any:
        return im.EpochMetric(lambda p, y: float((p.argmax(1) == y).double().mean()), check_compute_fn=False)

    multiclass = [
        ("accuracy.Accuracy", im.Accuracy), ("precision.Precision", lambda: im.Precision(average="macro")),
        ("recall.Recall", lambda: im.Recall(average="weighted")),
        ("confusion_matrix.ConfusionMatrix", lambda: im.ConfusionMatrix(num_classes=4)),
        ("top_k_categorical_accuracy.TopKCategoricalAccuracy", lambda: im.TopKCategoricalAccuracy(k=2)),
        ("loss.Loss", lambda: im.Loss(nn.functional.cross_entropy)),
        ("entropy.Entropy", im.Entropy), ("mutual_information.MutualInformation", im.MutualInformation),
        ("mean_average_precision.MeanAveragePrecision", im.MeanAveragePrecision),
        ("metrics_lambda.MetricsLambda", f1),
        ("metric_group.MetricGroup", lambda: im.MetricGroup({"acc": im.Accuracy(), "p": im.Precision(average="macro")})),
        ("running_average.RunningAverage", lambda: im.RunningAverage(im.Accuracy())),
        ("accumulation.Average", lambda: im.Average(output_transform=_per_sample_loss)),
        ("accumulation.GeometricAverage", lambda: im.GeometricAverage(output_transform=_per_sample_loss)),
        ("accumulation.VariableAccumulation", lambda: im.VariableAccumulation(
            lambda acc, x: acc + x.sum(), output_transform=_per_sample_loss)),
        ("epoch_metric.EpochMetric", epoch_metric),
        ("frequency.Frequency", _one_second),
        ("cohen_kappa.CohenKappa", lambda: im.CohenKappa(output_transform=_argmax)),
        ("matthews_corrcoef.MatthewsCorrCoef", lambda: im.MatthewsCorrCoef(output_transform=_argmax)),
    ]
    binary = [("roc_auc.ROC_AUC", im.ROC_AUC), ("roc_auc.RocCurve", im.RocCurve),
              ("average_precision.AveragePrecision", im.AveragePrecision),
              ("precision_recall_curve.PrecisionRecallCurve", im.PrecisionRecallCurve)]
    multilabel = [("multilabel_confusion_matrix.MultiLabelConfusionMatrix", lambda: im.MultiLabelConfusionMatrix(3)),
                  ("accuracy.Accuracy@multilabel", lambda: im.Accuracy(is_multilabel=True)),
                  ("fairness.demographic_parity.SelectionRate", lambda: fair.SelectionRate(is_multilabel=True))]
    regression = [("metric.Metric", lambda: _Squares()), ("mean_absolute_error.MeanAbsoluteError", im.MeanAbsoluteError),
                  ("mean_squared_error.MeanSquaredError", im.MeanSquaredError),
                  ("root_mean_squared_error.RootMeanSquaredError", im.RootMeanSquaredError),
                  *[(f"regression.{module}.{name}", getattr(rm, name)) for module, name in (
                      ("canberra_metric", "CanberraMetric"), ("fractional_absolute_error", "FractionalAbsoluteError"),
                      ("fractional_bias", "FractionalBias"), ("geometric_mean_absolute_error", "GeometricMeanAbsoluteError"),
                      ("geometric_mean_relative_absolute_error", "GeometricMeanRelativeAbsoluteError"),
                      ("kendall_correlation", "KendallRankCorrelation"), ("manhattan_distance", "ManhattanDistance"),
                      ("maximum_absolute_error", "MaximumAbsoluteError"),
                      ("mean_absolute_relative_error", "MeanAbsoluteRelativeError"), ("mean_error", "MeanError"),
                      ("mean_normalized_bias", "MeanNormalizedBias"), ("median_absolute_error", "MedianAbsoluteError"),
                      ("median_absolute_percentage_error", "MedianAbsolutePercentageError"),
                      ("median_relative_absolute_error", "MedianRelativeAbsoluteError"),
                      ("pearson_correlation", "PearsonCorrelation"), ("r2_score", "R2Score"),
                      ("spearman_correlation", "SpearmanRankCorrelation"), ("wave_hedges_distance", "WaveHedgesDistance"))]]
    return {
        "multiclass": multiclass, "binary": binary, "multilabel": multilabel, "regression": regression,
        "vectors": [("cosine_similarity.CosineSimilarity", im.CosineSimilarity),
                    ("mean_pairwise_distance.MeanPairwiseDistance", im.MeanPairwiseDistance),
                    ("kl_divergence.KLDivergence", im.KLDivergence), ("js_divergence.JSDivergence", im.JSDivergence),
                    ("gan.fid.FID", lambda: im.FID(num_features=4, feature_extractor=nn.Identity())),
                    ("gan.inception_score.InceptionScore",
                     lambda: im.InceptionScore(num_features=4, feature_extractor=nn.Softmax(dim=1),
                                               output_transform=lambda o: o[0]))],
        "images": [("psnr.PSNR", lambda: im.PSNR(data_range=1.0)), ("ssim.SSIM", lambda: im.SSIM(data_range=1.0))],
        "clusters": [("clustering.silhouette_score.SilhouetteScore", ic.SilhouetteScore),
                     ("clustering.davies_bouldin_score.DaviesBouldinScore", ic.DaviesBouldinScore),
                     ("clustering.calinski_harabasz_score.CalinskiHarabaszScore", ic.CalinskiHarabaszScore)],
        "ranking": [("rec_sys.ndcg.NDCG", lambda: im.NDCG(top_k=[1, 3])), ("rec_sys.hitrate.HitRate", lambda: im.HitRate(top_k=[1, 3]))],
        "fairness": [("fairness.base.SubgroupMetric", lambda: fair.SubgroupMetric(im.Accuracy(), groups=[0, 1])),
                     ("fairness.base.SubgroupDifference", lambda: fair.SubgroupDifference(im.Accuracy(), groups=[0, 1])),
                     ("fairness.accuracy_difference.SubgroupAccuracyDifference",
                      lambda: fair.SubgroupAccuracyDifference(groups=[0, 1])),
                     ("fairness.demographic_parity.DemographicParityDifference",
                      lambda: fair.DemographicParityDifference(groups=[0, 1]))],
        "tokens": [("nlp.bleu.Bleu", lambda: im.Bleu(ngram=2, smooth="smooth1")),
                   ("nlp.rouge.Rouge", lambda: im.Rouge(variants=["L", 2])), ("nlp.rouge.RougeL", im.RougeL),
                   ("nlp.rouge.RougeN", lambda: im.RougeN(ngram=2))],
        "strings": [("nlp.character_error_rate.CharacterErrorRate", im.CharacterErrorRate)],
        "language": [("nlp.perplexity.Perplexity", lambda: im.Perplexity(
            output_transform=lambda o: (o[0].permute(0, 2, 1), o[1])))],
        "labels": [],
    }


def _Squares() -> Any:  # noqa: N802 - a factory named for the metric it makes
    return SumOfSquares.make()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return float(value) if isinstance(value, (int, float)) else value


def _evaluate(ignite: Any, task: str, metrics: dict[str, Any], n: int = N) -> dict[str, Any]:
    from ignite.engine import Engine

    data = _data(task, n)
    if ignite is not None:
        loader = ignite.auto_dataloader(data, batch_size=GLOBAL, shuffle=False, remainder="uneven")
        loader.collate_fn = _collate
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL, shuffle=False, collate_fn=_collate)
    engine = Engine(lambda engine, batch: batch)
    if ignite is not None:
        ignite.attach(engine, loader)
    for name, metric in metrics.items():
        metric.attach(engine, name)
    engine.run(loader)
    return {name: _plain(engine.state.metrics[name]) for name in metrics}


def metrics_scenario(ignite: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ran": []}
    for task, entries in metric_tasks().items():
        if not entries:
            continue
        out[task] = _evaluate(ignite, task, {name: make() for name, make in entries})
        out["ran"] += [M + name.split("@")[0] for name, _ in entries]
    # RunningAverage of an output: the data ranks' batch values averaged (equal shards: 24 samples)
    from ignite.metrics import RunningAverage

    out["running_output"] = _evaluate(ignite, "multiclass", {"loss": RunningAverage(
        output_transform=lambda o: nn.functional.cross_entropy(o[0], o[1]))}, n=24)
    return out


# -- training: handlers and engine entry points ------------------------------------------------------------------
N_TRAIN = 48


def _train_data(n: int = N_TRAIN, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = _gen(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).argmax(1))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


class _Setup:
    """A trainer (and an evaluator on N samples) through the adapter, or plain ignite."""

    def __init__(self, ignite: Any, lr: float = 0.1, engine_cls: Any = None):
        from ignite.engine import Engine, create_supervised_evaluator, supervised_training_step
        from ignite.metrics import Loss

        self.ignite, self.plain = ignite, _model()
        data, valid = _train_data(), _train_data(N, seed=2)
        if ignite is not None:
            self.model = ignite.auto_model(self.plain)
            self.opt = ignite.auto_optim(torch.optim.SGD(self.model.parameters(), lr=lr), self.model)
            self.loader = ignite.auto_dataloader(data, batch_size=GLOBAL, shuffle=False)
            self.valid = ignite.auto_dataloader(valid, batch_size=GLOBAL, shuffle=False, remainder="uneven")
        else:
            self.model = self.plain
            self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
            self.loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL, shuffle=False)
            self.valid = torch.utils.data.DataLoader(valid, batch_size=GLOBAL, shuffle=False)
        step = supervised_training_step(self.model, self.opt, nn.functional.cross_entropy)
        self.trainer = (engine_cls or Engine)(step)
        self.evaluator = create_supervised_evaluator(self.model, metrics={"loss": Loss(nn.functional.cross_entropy)})
        if ignite is not None:
            ignite.attach(self.trainer, self.loader)
            ignite.attach(self.evaluator)
        self.lrs: list[float] = []

        from ignite.engine import Events

        @self.trainer.on(Events.ITERATION_STARTED)
        def record(engine: Any) -> None:
            self.lrs.append(float(self.opt.param_groups[0]["lr"]))

    def run(self, epochs: int = 2, **extra: Any) -> dict[str, Any]:
        self.trainer.run(self.loader, max_epochs=epochs)
        return {"params": {k: v.reshape(-1).tolist() for k, v in self.plain.state_dict().items()}, "lrs": self.lrs,
                "epoch": self.trainer.state.epoch, "iteration": self.trainer.state.iteration, **extra}


def handlers_scenario(ignite: Any, workdir: str = "") -> dict[str, Any]:
    import logging
    import os
    import tempfile

    import ignite.handlers as ih
    from ignite.engine import Events

    out: dict[str, Any] = {"ran": [H + n for n in ("StateParamScheduler", "BaseParamScheduler", "ParamScheduler",
                                                    "CyclicalScheduler")]}

    def case(name: str, attach: Callable[[_Setup], Any], epochs: int = 2, lr: float = 0.1) -> None:
        setup = _Setup(ignite, lr=lr)
        extra = attach(setup) or {}
        out[name] = setup.run(epochs)
        out[name].update({k: v() if callable(v) else v for k, v in extra.items()})
        out["ran"].append(H + name)

    def lr_scheduler(s: _Setup) -> None:
        s.trainer.add_event_handler(Events.ITERATION_COMPLETED,
                                    ih.LRScheduler(torch.optim.lr_scheduler.StepLR(s.opt, step_size=3, gamma=0.5)))

    def on_iterations(scheduler: Any) -> Callable[[_Setup], None]:
        def attach(s: _Setup) -> None:
            s.trainer.add_event_handler(Events.ITERATION_STARTED, scheduler(s.opt))
        return attach

    case("LRScheduler", lr_scheduler)
    case("CosineAnnealingScheduler", on_iterations(lambda o: ih.CosineAnnealingScheduler(o, "lr", 0.1, 0.01, cycle_size=6)))
    case("LinearCyclicalScheduler", on_iterations(lambda o: ih.LinearCyclicalScheduler(o, "lr", 0.01, 0.1, cycle_size=4)))
    case("ConcatScheduler", on_iterations(lambda o: ih.ConcatScheduler(
        [ih.LinearCyclicalScheduler(o, "lr", 0.01, 0.1, cycle_size=4), ih.CosineAnnealingScheduler(o, "lr", 0.1, 0.01, 6)],
        durations=[4])))
    case("PiecewiseLinear", on_iterations(lambda o: ih.PiecewiseLinear(o, "lr", [(0, 0.1), (6, 0.01)])))
    case("ParamGroupScheduler", on_iterations(lambda o: ih.ParamGroupScheduler(
        [ih.PiecewiseLinear(o, "lr", [(0, 0.1), (6, 0.02)])], names=["all"])))
    case("create_lr_scheduler_with_warmup", on_iterations(lambda o: ih.create_lr_scheduler_with_warmup(
        torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), warmup_start_value=0.01, warmup_duration=3)))

    def plateau(s: _Setup) -> None:
        scheduler = ih.ReduceLROnPlateauScheduler(s.opt, metric_name="loss", factor=0.5, patience=0, threshold=0.5,
                                                  trainer=s.trainer)
        s.evaluator.add_event_handler(Events.COMPLETED, scheduler)
        s.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: s.evaluator.run(s.valid))

    case("ReduceLROnPlateauScheduler", plateau, epochs=3)

    def state_schedulers(s: _Setup) -> dict[str, Any]:
        values: list[list[float]] = []
        schedulers = [
            ih.LambdaStateScheduler(lambda event_index: 1.0 / (1 + event_index), param_name="alpha", create_new=True),
            ih.PiecewiseLinearStateScheduler([(0, 1.0), (6, 0.0)], param_name="beta", create_new=True),
            ih.ExpStateScheduler(initial_value=1.0, gamma=0.9, param_name="gamma_p", create_new=True),
            ih.StepStateScheduler(initial_value=1.0, gamma=0.5, step_size=2, param_name="step", create_new=True),
            ih.MultiStepStateScheduler(initial_value=1.0, gamma=0.5, milestones=[2, 4], param_name="ms", create_new=True)]
        for scheduler in schedulers:
            scheduler.attach(s.trainer, Events.ITERATION_COMPLETED)
        s.trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: values.append(
            [float(getattr(e.state, n)) for n in ("alpha", "beta", "gamma_p", "step", "ms")]))
        return {"values": values}

    case("LambdaStateScheduler", state_schedulers)
    out["ran"] += [H + n for n in ("PiecewiseLinearStateScheduler", "ExpStateScheduler", "StepStateScheduler",
                                   "MultiStepStateScheduler")]

    def early(s: _Setup) -> None:
        stop = ih.EarlyStopping(patience=1, score_function=lambda e: -e.state.metrics["loss"], trainer=s.trainer,
                                threshold=0.05)
        s.evaluator.add_event_handler(Events.COMPLETED, stop)
        s.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: s.evaluator.run(s.valid))

    case("EarlyStopping", early, epochs=8, lr=0.5)

    def ema(s: _Setup) -> dict[str, Any]:
        handler = ih.EMAHandler(s.plain, momentum=0.5)
        handler.attach(s.trainer)
        return {"ema": lambda: [float(v) for p in handler.ema_model.parameters() for v in p.reshape(-1)]}

    case("EMAHandler", ema)

    def timers(s: _Setup) -> dict[str, Any]:
        timer, basic, profiler = ih.Timer(average=True), ih.BasicTimeProfiler(), ih.HandlersTimeProfiler()
        timer.attach(s.trainer, start=Events.EPOCH_STARTED, step=Events.ITERATION_COMPLETED)
        basic.attach(s.trainer)
        profiler.attach(s.trainer)
        ih.ProgressBar(persist=False).attach(s.trainer)
        ih.FBResearchLogger(logger=logging.getLogger("polyparallel.test.fbresearch")).attach(s.trainer, name="train")
        step = ih.global_step_from_engine(s.trainer)
        return {"timer": lambda: timer.value() >= 0, "basic": lambda: len(basic.get_results()) > 0,
                "handlers": lambda: len(profiler.get_results()) > 0,
                "global_step": lambda: int(step(s.evaluator, Events.EPOCH_COMPLETED))}

    case("Timer", timers)
    out["ran"] += [H + n for n in ("BasicTimeProfiler", "HandlersTimeProfiler", "ProgressBar", "FBResearchLogger",
                                   "global_step_from_engine")]

    def checkpoint(s: _Setup) -> dict[str, Any]:
        directory = os.path.join(workdir or tempfile.mkdtemp(), "model-checkpoint")
        saver = ih.ModelCheckpoint(directory, "net", n_saved=1, require_empty=False)
        s.trainer.add_event_handler(Events.COMPLETED, saver, {"model": s.model})

        def saved() -> Any:
            if ignite is not None:
                ignite.barrier("data")  # rank 0 wrote it
            files = sorted(os.listdir(directory))
            state = torch.load(os.path.join(directory, files[-1]))
            return {"files": files, "state": {k: v.reshape(-1).tolist() for k, v in state.items()}}

        return {"saved": saved}

    case("ModelCheckpoint", checkpoint)
    out["ran"].append(H + "DiskSaver")

    # FastaiLRFinder: the loss history of the data group's global batches, the model restored.
    s = _Setup(ignite)
    before = {k: v.clone() for k, v in s.plain.state_dict().items()}
    finder = ih.FastaiLRFinder()
    with finder.attach(s.trainer, to_save={"model": s.model, "optimizer": s.opt}, end_lr=50.0, num_iter=12) as t:
        t.run(s.loader, max_epochs=3)
    results = finder.get_results()
    out["FastaiLRFinder"] = {"lr": [float(v) for v in results["lr"]], "loss": [float(v) for v in results["loss"]],
                             "restored": all(torch.equal(before[k], v) for k, v in s.plain.state_dict().items())}
    out["ran"].append(H + "FastaiLRFinder")
    return out


def engine_scenario(ignite: Any) -> dict[str, Any]:
    from ignite.engine import (
        CallableEventWithFilter,
        EventEnum,
        Events,
        EventsList,
        RemovableEventHandle,
        State,
        create_supervised_evaluator,
        create_supervised_trainer,
        supervised_evaluation_step,
    )

    out: dict[str, Any] = {}

    class Custom(EventEnum):
        HALFWAY = "halfway"

    s = _Setup(ignite)
    fired: list[int] = []
    s.trainer.register_events(*Custom)
    s.trainer.add_event_handler(Custom.HALFWAY, lambda e: fired.append(e.state.iteration))
    handle = s.trainer.add_event_handler(Events.ITERATION_COMPLETED(every=3), lambda e: e.fire_event(Custom.HALFWAY))
    assert isinstance(handle, RemovableEventHandle) and isinstance(Events.ITERATION_COMPLETED(every=3), CallableEventWithFilter)

    @s.trainer.on(EventsList() | Events.EPOCH_COMPLETED)
    def cut(engine: Any) -> None:
        pass

    s.trainer.add_event_handler(Events.ITERATION_COMPLETED(once=9), lambda e: e.terminate_epoch())
    s.trainer.add_event_handler(Events.ITERATION_COMPLETED(once=14), lambda e: e.interrupt())
    s.trainer.run(s.loader, max_epochs=3)  # interrupted at iteration 14
    interrupted = s.trainer.state.iteration
    saved = s.trainer.state_dict()
    s.trainer.run()  # resumes
    out["custom"] = {"fired": fired, "registered": s.trainer.has_registered_events(Custom.HALFWAY),
                     "has": s.trainer.has_event_handler(cut), "interrupted": interrupted, "saved": dict(saved),
                     "user_keys": list(s.trainer.state_dict_user_keys)}
    s.trainer.remove_event_handler(cut, Events.EPOCH_COMPLETED)
    s.trainer.load_state_dict(saved)
    s.trainer.set_data(s.loader)
    s.trainer.add_event_handler(Events.ITERATION_COMPLETED(once=20), lambda e: e.terminate())
    out["custom"].update(s.run(4, state=isinstance(s.trainer.state, State)))

    plain = _model()
    if ignite is not None:
        model = ignite.auto_model(plain)
        opt = ignite.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1), model)
        loader = ignite.auto_dataloader(_train_data(), batch_size=GLOBAL, shuffle=False)
        trainer = ignite.create_supervised_trainer(model, opt, nn.functional.cross_entropy, data=loader)
    else:
        model, loader = plain, torch.utils.data.DataLoader(_train_data(), batch_size=GLOBAL)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = create_supervised_trainer(model, opt, nn.functional.cross_entropy)
    trainer.run(loader, max_epochs=2)
    from ignite.metrics import Accuracy

    evaluator = create_supervised_evaluator(model, metrics={"acc": Accuracy()})
    if ignite is not None:
        ignite.attach(evaluator)
        valid = ignite.auto_dataloader(_train_data(N, 2), batch_size=GLOBAL, shuffle=False, remainder="uneven")
    else:
        valid = torch.utils.data.DataLoader(_train_data(N, 2), batch_size=GLOBAL)
    evaluator.run(valid)
    assert callable(supervised_evaluation_step(model))
    out["factories"] = {"params": {k: v.reshape(-1).tolist() for k, v in plain.state_dict().items()},
                        "acc": float(evaluator.state.metrics["acc"])}
    out["ran"] = [f"{E}Engine.{n}" for n in (
        "add_event_handler", "fire_event", "has_event_handler", "has_registered_events", "interrupt", "load_state_dict",
        "on", "register_events", "remove_event_handler", "run", "set_data", "state_dict", "state_dict_user_keys",
        "terminate", "terminate_epoch")] + [E + n for n in (
        "CallableEventWithFilter", "Engine", "EventEnum", "Events", "EventsList", "RemovableEventHandle", "State",
        "create_supervised_evaluator", "create_supervised_trainer", "supervised_evaluation_step",
        "supervised_training_step")]
    return out


def worker(strategy: pp.Strategy, names: list[str], workdir: str) -> dict[str, Any]:
    """In every launched process."""
    torch.set_num_threads(1)
    ignite = strategy.adapt("ignite")
    return {"rank": strategy.session().rank, **run(names, workdir, ignite)}


def run(names: list[str], workdir: str, ignite: Any = None) -> dict[str, Any]:
    """The scenarios ``names`` (the single-process reference when ``ignite`` is ``None``)."""
    return {name: SCENARIOS[name](ignite, workdir) if name == "handlers" else SCENARIOS[name](ignite) for name in names}


SCENARIOS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "metrics": metrics_scenario, "handlers": handlers_scenario, "engine": engine_scenario}


def close(got: Any, want: Any, tol: float, where: str = "") -> None:
    """Nested values equal to ``tol`` (relative, at least absolute); NaN equals NaN."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            close(got[k], want[k], tol, f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got} vs {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, tol, f"{where}[{i}]")
    elif isinstance(want, float):
        if got == want or (math.isnan(want) and math.isnan(got)):
            return
        assert abs(got - want) <= tol * max(1.0, abs(want)), f"{where}: {got} vs {want}"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"
