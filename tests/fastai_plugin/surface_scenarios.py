"""Scenarios of fastai's everyday surface, each run twice: under the adapter at data=2 (in the
launched processes) and in one plain process (the reference, ``strategy=None``), with the same
global batch and a validation set of 23 samples (shards of 12 and 11).

Every scenario returns plain values and the surface entries it exercised (``"ran"``), so
``test_surface_works.py`` compares the two runs and checks that every "works" entry of
:mod:`polyparallel_fastai.surface` was run by the test its entry names.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp

GLOBAL, N_TRAIN, N_VALID, SEED = 8, 48, 23, 5
L = "fastai.learner.Learner."
M, CB = "fastai.metrics.", "fastai.callback."


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Ident(nn.Module):
    """The input is the prediction: the metrics see exactly the rows of the data set."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * self.w


def mlp(seed: int = 3, inputs: int = 6, classes: int = 3, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(16, classes))


def classification(n: int, seed: int, inputs: int = 6, classes: int = 3) -> TensorDataset:
    g = _gen(seed)
    x = torch.randn(n, inputs, generator=g)
    w = torch.randn(inputs, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


def learner(strategy: pp.Strategy | None, train: Any, valid: Any, model: nn.Module, *, cbs: Any = (),
            metrics: Any = (), loss_func: Any = None, lr: float = 0.1, opt_func: Any = None, splitter: Any = None,
            quiet: bool = True, valid_bs: int = GLOBAL, **options: Any) -> Any:
    """A fastai Learner on two data sets (no shuffling: the data ranks' strided shards of each
    global batch are one process's batch); with the adapter when ``strategy`` is given."""
    import fastai.callback.all  # noqa: F401  (fastai's patches: fit_one_cycle, lr_find, to_fp16, ...)
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.optimizer import SGD
    from fastai.torch_core import trainable_params

    cbs = list(cbs) + ([strategy.adapt("fastai")] if strategy is not None else [])
    dls = DataLoaders(DataLoader(train, bs=GLOBAL, shuffle=False, drop_last=True),
                      DataLoader(valid, bs=valid_bs), device="cpu")
    learn = Learner(dls, model, loss_func=loss_func or nn.functional.cross_entropy, opt_func=opt_func or SGD, lr=lr,
                    metrics=list(metrics), cbs=cbs, splitter=splitter or trainable_params, **options)
    if quiet:
        learn.remove_cb(ProgressCallback)
        learn.logger = lambda *args, **kwargs: None
    return learn


def params(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().reshape(-1).double().tolist() for k, v in model.state_dict().items()}


def floats(values: Any) -> list[float]:
    return [float(v) for v in values]


# -- metrics: validate() on prediction rows ------------------------------------------------------------------------
def _rows(task: str) -> tuple[TensorDataset, Any]:
    """(data set of (prediction, target) rows, loss) of ``task``; N_VALID rows."""
    from fastai.losses import BCEWithLogitsLossFlat, CrossEntropyLossFlat

    g, n = _gen(11), N_VALID
    if task == "multiclass":
        x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        return TensorDataset(x, (x + torch.randn(n, 4, generator=g, dtype=torch.float64)).argmax(1)), None
    if task == "binary":
        x = torch.randn(n, 2, generator=g, dtype=torch.float64)
        return TensorDataset(x, (x[:, 1] - x[:, 0] + torch.randn(n, generator=g, dtype=torch.float64) > 0).long()), None
    if task == "multilabel":
        x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        return (TensorDataset(x, (x + torch.randn(n, 3, generator=g, dtype=torch.float64) > 0).double()),
                BCEWithLogitsLossFlat())
    if task == "regression":
        y = torch.rand(n, 1, generator=g, dtype=torch.float64) + 0.5
        return TensorDataset(y + 0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64).abs(), y), nn.functional.mse_loss
    if task in ("segmentation", "segmentation2"):
        classes = 3 if task == "segmentation" else 2
        x = torch.randn(n, classes, 4, 4, generator=g, dtype=torch.float64)
        y = (x + torch.randn(n, classes, 4, 4, generator=g, dtype=torch.float64)).argmax(1)
        return TensorDataset(x, y), CrossEntropyLossFlat(axis=1)
    if task == "language":
        x = torch.randn(n, 5, 7, generator=g, dtype=torch.float64)
        return TensorDataset(x, (x + torch.randn(n, 5, 7, generator=g, dtype=torch.float64)).argmax(-1)), CrossEntropyLossFlat()
    raise ValueError(task)


class PartsLoss:
    """A loss that keeps its parts as attributes (what ``LossMetric`` reads)."""

    def __call__(self, pred: torch.Tensor, targ: torch.Tensor) -> torch.Tensor:
        self.nll = nn.functional.cross_entropy(pred, targ)
        self.top = (pred.max(1).values - pred.mean(1)).mean()
        return self.nll + 0.1 * self.top


def _metric_tasks() -> dict[str, tuple[list[Any], list[str], Any]]:
    """task -> (metrics, the surface entries they are, a loss overriding the task's)."""
    import fastai.metrics as fm
    from fastai.learner import AvgMetric
    from sklearn import metrics as skm

    def argmax_accuracy(inp: torch.Tensor, targ: torch.Tensor) -> torch.Tensor:
        return (inp.argmax(-1) == targ).double().mean()

    return {
        "multiclass": ([fm.accuracy, fm.error_rate, functools.partial(fm.top_k_accuracy, k=2), fm.F1Score(average="macro"),
                        fm.FBeta(beta=2, average="macro"), fm.Precision(average="macro"), fm.Recall(average="macro"),
                        fm.RocAuc(), fm.BalancedAccuracy(), fm.CohenKappa(), fm.MatthewsCorrCoef(),
                        fm.Jaccard(average="macro"), fm.HammingLoss(), fm.AccumMetric(argmax_accuracy, flatten=False),
                        fm.skm_to_fastai(skm.accuracy_score), AvgMetric(argmax_accuracy), fm.Perplexity(), fm.perplexity],
                       [M + n for n in ("accuracy", "error_rate", "top_k_accuracy", "F1Score", "FBeta", "Precision",
                                        "Recall", "RocAuc", "BalancedAccuracy", "CohenKappa", "MatthewsCorrCoef", "Jaccard",
                                        "HammingLoss", "AccumMetric", "skm_to_fastai", "Perplexity", "perplexity")]
                       + ["fastai.learner.AvgMetric", "fastai.learner.AvgLoss", L + "validate", L + "metrics"], None),
        "binary": ([fm.APScoreBinary(), fm.RocAucBinary(), fm.BrierScore()],
                   [M + "APScoreBinary", M + "RocAucBinary", M + "BrierScore"], None),
        "multilabel": ([fm.accuracy_multi, fm.APScoreMulti(), fm.BrierScoreMulti(), fm.F1ScoreMulti(), fm.FBetaMulti(beta=2),
                        fm.HammingLossMulti(), fm.JaccardMulti(), fm.PrecisionMulti(),
                        fm.RecallMulti(), fm.RocAucMulti()],
                       [M + n for n in ("accuracy_multi", "APScoreMulti", "BrierScoreMulti", "F1ScoreMulti", "FBetaMulti",
                                        "HammingLossMulti", "JaccardMulti", "PrecisionMulti",
                                        "RecallMulti", "RocAucMulti")], None),
        "regression": ([fm.mse, fm.mae, fm.msle, fm.rmse, fm.exp_rmspe, fm.ExplainedVariance(), fm.R2Score(),
                        fm.PearsonCorrCoef(), fm.SpearmanCorrCoef()],
                       [M + n for n in ("mse", "mae", "msle", "rmse", "exp_rmspe", "ExplainedVariance", "R2Score",
                                        "PearsonCorrCoef", "SpearmanCorrCoef")], None),
        "segmentation": ([fm.DiceMulti(), fm.JaccardCoeffMulti(), fm.AccumMetric(fm.foreground_acc, flatten=False)],
                         [M + "DiceMulti", M + "JaccardCoeffMulti"], None),
        "segmentation2": ([fm.Dice(), fm.JaccardCoeff()], [M + "Dice", M + "JaccardCoeff"], None),
        "language": ([fm.CorpusBLEUMetric(vocab_sz=7)], [M + "CorpusBLEUMetric"], None),
        "loss_parts": ([fm.LossMetric("nll"), *fm.LossMetrics("nll,top")], [M + "LossMetric", M + "LossMetrics"],
                       PartsLoss()),
    }


def metrics_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    out: dict[str, Any] = {"ran": []}
    for task, (metrics, entries, loss) in _metric_tasks().items():
        data, task_loss = _rows("multiclass" if task == "loss_parts" else task)
        learn = learner(strategy, data, data, Ident(), metrics=metrics, loss_func=loss or task_loss)
        out[task] = floats(learn.validate())
        out["ran"] += entries
    return out


# -- get_preds and everything built on it -----------------------------------------------------------------------------
def preds_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    from fastai.callback.core import FetchPredsCallback
    from fastai.data.load import DataLoader
    out: dict[str, Any] = {"ran": []}
    # The case: 77 rows of an identity model, in batches of 64 (the last one short).
    n = 77
    rows = torch.arange(n, dtype=torch.float64)[:, None].repeat(1, 2)
    ident = TensorDataset(rows, torch.zeros(n, dtype=torch.long))
    learn = learner(strategy, ident, ident, Ident())
    learn.dls.valid.bs = 64
    preds, targs = learn.get_preds(act=lambda x: x)
    out["identity"] = preds[:, 0].tolist()
    inputs, preds, targs, losses = learn.get_preds(with_input=True, with_loss=True, act=lambda x: x)
    out["with_input_loss"] = [inputs[:, 0].tolist(), preds[:, 0].tolist(), losses.tolist()]
    out["reorder_false"] = learn.get_preds(reorder=False, act=lambda x: x)[0][:, 0].tolist()
    out["train_rows"] = learn.get_preds(ds_idx=0, act=lambda x: x)[0][:, 0].tolist()
    own = DataLoader(TensorDataset(rows[:13], torch.zeros(13, dtype=torch.long)), bs=5)
    out["own_dl"] = learn.get_preds(dl=own, act=lambda x: x)[0][:, 0].tolist()
    # A trained-ish classifier: decoded predictions, interpretation, summary, FetchPredsCallback.
    train, valid = classification(N_TRAIN, 1), classification(N_VALID, 2)
    learn = learner(strategy, train, valid, mlp())
    learn.fit(1)
    preds, targs, decoded = learn.get_preds(with_decoded=True)
    out["decoded"] = [preds.tolist(), decoded.tolist()]
    fetch = FetchPredsCallback()
    learn.fit(1, cbs=[fetch])
    out["fetched"] = fetch.preds[0].tolist()
    out["after_fetch"] = floats(learn.recorder.values[-1])
    out["summary_lines"] = len(str(learn.summary()).splitlines()) > 5
    # tta needs fastai Datasets (set_split_idx), as one process does.
    from fastai.data.core import Datasets
    from fastai.learner import Learner

    x, y = valid.tensors
    dsets = Datasets(list(range(N_VALID)), [[x.__getitem__], [y.__getitem__]], splits=[list(range(N_VALID))] * 2)
    cbs = [strategy.adapt("fastai")] if strategy is not None else []
    tta = Learner(dsets.dataloaders(bs=GLOBAL, shuffle=False, device="cpu"), learn.model, cbs=cbs,
                  loss_func=nn.functional.cross_entropy)
    with tta.no_bar():
        out["tta"] = tta.tta(n=2)[0].tolist()
    with learn.no_mbar(), learn.validation_context(), learn.loss_not_reduced(), learn.removed_cbs([]):
        pass
    out["ran"] += [L + n for n in ("get_preds", "tta", "summary", "no_mbar", "validation_context", "loss_not_reduced",
                                   "removed_cbs", "to_detach")]
    out["ran"] += [CB + "core.GatherPredsCallback", CB + "core.FetchPredsCallback"]
    return out


# -- training with fastai's callbacks ------------------------------------------------------------------------------------
def _two_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    return [list(model[0].parameters()) + (list(model[1].parameters()) if len(model) > 3 else []),
            list(model[-1].parameters())]


def _fit(strategy: pp.Strategy | None, name: str, run: Callable[[Any], Any], *, model: nn.Module | None = None,
         train: Any = None, valid: Any = None, **kwargs: Any) -> dict[str, Any]:
    learn = learner(strategy, train if train is not None else classification(N_TRAIN, 1),
                    valid if valid is not None else classification(N_VALID, 2), model if model is not None else mlp(),
                    **kwargs)
    extra = run(learn) or {}
    return {"params": params(learn.model), "values": [floats(v) for v in learn.recorder.values],
            "losses": floats(learn.recorder.losses), **extra}


def _nan_train() -> TensorDataset:
    data = classification(N_TRAIN, 1)
    x = data.tensors[0].clone()
    x[21, 0] = float("nan")  # global batch 2; in the shard of data rank 1 only
    return TensorDataset(x, data.tensors[1])


def _conv() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _images(n: int, seed: int) -> TensorDataset:
    g = _gen(seed)
    x = torch.randn(n, 2, 5, 5, generator=g)
    return TensorDataset(x, (x.mean((2, 3)) @ torch.randn(2, 3, generator=g)).argmax(1))


class TinyLM(nn.Module):
    """A stateful language model shaped as fastai's (AWD_LSTM's reset fails under torch 2.13 in one
    process too): returns (decoded, raw outputs, outputs), keeps its hidden state between batches
    of the same size, and ``reset()`` forgets it (what ModelResetter calls)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.emb, self.rnn, self.dec = nn.Embedding(11, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 11)
        self.hidden: Any = None

    def reset(self) -> None:
        self.hidden = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        if self.hidden is not None and self.hidden[0].shape[1] != x.shape[0]:
            self.hidden = None
        raw, hidden = self.rnn(self.emb(x), self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)
        return self.dec(raw), [raw], [raw]


def _language_model() -> nn.Module:
    return TinyLM()


def _tokens(n: int, seed: int) -> TensorDataset:
    x = torch.randint(0, 11, (n, 6), generator=_gen(seed))
    return TensorDataset(x, torch.roll(x, -1, dims=1))


def train_scenario(strategy: pp.Strategy | None, workdir: str) -> dict[str, Any]:
    from fastai.callback.progress import CSVLogger
    from fastai.callback.rnn import ModelResetter, RNNCallback, RNNRegularizer
    from fastai.callback.tracker import EarlyStoppingCallback, ReduceLROnPlateau, TerminateOnNaNCallback
    from fastai.callback.training import BnFreeze, GradientAccumulation, GradientClip, ShortEpochCallback
    from fastai.losses import CrossEntropyLossFlat

    out: dict[str, Any] = {"ran": []}

    def case(name: str, entries: list[str], run: Callable[[Any], Any], **kwargs: Any) -> None:
        out[name] = _fit(strategy, name, run, **kwargs)
        out["ran"] += entries

    case("one_cycle", [L + "fit_one_cycle", CB + "schedule.ParamScheduler"], lambda learn: learn.fit_one_cycle(2, 0.2))
    case("flat_cos", [L + "fit_flat_cos"], lambda learn: learn.fit_flat_cos(2, 0.2))
    case("sgdr", [L + "fit_sgdr"], lambda learn: learn.fit_sgdr(1, 1, 0.2))
    case("fine_tune", [L + "fine_tune", L + "freeze"], lambda learn: learn.fine_tune(1, 0.1, freeze_epochs=1),
         splitter=_two_groups)

    def frozen(learn: Any) -> None:
        learn.freeze_to(1)
        learn.fit(1)
        learn.unfreeze()
        learn.fit(1)

    case("freeze_to", [L + "freeze_to", L + "unfreeze"], frozen, splitter=_two_groups)
    case("start_epoch", ["fastai.learner.SkipToEpoch"], lambda learn: learn.fit(3, start_epoch=1))

    def early(learn: Any) -> dict[str, Any]:
        learn.fit(6, lr=0.5, cbs=[EarlyStoppingCallback(patience=0, min_delta=0.05)])
        return {"epochs": len(learn.recorder.values)}

    case("early_stopping", [CB + "tracker.EarlyStoppingCallback"], early)
    case("plateau", [CB + "tracker.ReduceLROnPlateau"],
         lambda learn: learn.fit(4, cbs=[ReduceLROnPlateau(patience=0, min_delta=0.05, factor=5.0)]))

    def nan(learn: Any) -> dict[str, Any]:
        learn.fit(2, cbs=[TerminateOnNaNCallback()])
        return {"iterations": learn.train_iter, "epoch": learn.epoch}

    case("terminate_on_nan", [CB + "tracker.TerminateOnNaNCallback"], nan, train=_nan_train())
    case("accumulate", [CB + "training.GradientAccumulation"],
         lambda learn: learn.fit(2, cbs=[GradientAccumulation(n_acc=16)]))
    case("clip", [CB + "training.GradientClip"], lambda learn: learn.fit(2, lr=0.5, cbs=[GradientClip(max_norm=0.05)]))

    def bn_frozen(learn: Any) -> None:
        learn.freeze()
        learn.fit(2, cbs=[BnFreeze()])

    # train_bn=False: the frozen group's BatchNorm (in eval mode by BnFreeze) is not trained either.
    case("bn_freeze", [CB + "training.BnFreeze"], bn_frozen, model=mlp(batchnorm=True), splitter=_two_groups,
         train_bn=False)
    case("short_epoch", [CB + "training.ShortEpochCallback"],
         lambda learn: learn.fit(2, cbs=[ShortEpochCallback(pct=0.5, short_valid=False)]))

    def precision(learn: Any) -> None:
        learn.to_fp16()
        learn.fit(1)
        learn.to_fp32()
        learn.to_bf16()
        learn.fit(1)
        learn.to_fp32()

    case("mixed_precision", [CB + "fp16.MixedPrecision", L + "to_fp16", L + "to_bf16", L + "to_fp32"], precision)

    def channels_last(learn: Any) -> None:
        learn.to_channelslast(use_amp=False)
        learn.fit(1)
        learn.to_contiguous()
        learn.fit(1)

    case("channels_last", [CB + "channelslast.ChannelsLast", L + "to_channelslast", L + "to_contiguous"],
         channels_last, model=_conv(), train=_images(N_TRAIN, 1), valid=_images(N_VALID, 2))

    rank = strategy.session().rank if strategy is not None else 0

    def csv(learn: Any) -> dict[str, Any]:
        own = os.path.join(workdir, f"rank{rank}")
        os.makedirs(own, exist_ok=True)
        learn.path = type(learn.path)(own)
        logger = CSVLogger(fname="history.csv")
        learn.add_cbs([logger])
        learn.fit(2)
        learn.remove_cbs([logger])
        file = os.path.join(own, "history.csv")
        written = os.path.exists(file)
        rows = [line.split(",")[:-1] for line in open(file).read().splitlines()] if written else None
        return {"csv_written": written, "csv": rows}

    case("csv_logger", [CB + "progress.CSVLogger", L + "add_cbs", L + "remove_cbs"], csv)

    def train_metrics(learn: Any) -> None:
        learn.recorder.train_metrics = True
        learn.fit(2)

    from fastai.metrics import F1Score, accuracy

    case("train_metrics", [L + "added_cbs"], train_metrics, metrics=[accuracy, F1Score(average="macro")])

    def language(learn: Any) -> None:
        learn.fit(2, cbs=[ModelResetter(), RNNCallback(), RNNRegularizer(alpha=2.0, beta=1.0)])

    # 24 validation sequences (shards of 12): a stateful model carries its hidden state from batch
    # to batch, and an uneven shard would reset it at another batch than one process does.
    out["rnn"] = _fit(strategy, "rnn", language, model=_language_model(), train=_tokens(N_TRAIN, 1),
                      valid=_tokens(24, 2), loss_func=CrossEntropyLossFlat(), lr=0.5)
    out["ran"] += [CB + "rnn.ModelResetter", CB + "rnn.RNNCallback", CB + "rnn.RNNRegularizer"]
    return out


# -- lr_find -----------------------------------------------------------------------------------------------------------------
def lr_find_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), mlp())
    before = params(learn.model)
    suggestion = learn.lr_find(num_it=30, show_plot=False, end_lr=100)
    out = {"suggestion": float(suggestion.valley), "lrs": floats(learn.recorder.lrs),
           "losses": floats(learn.recorder.losses), "restored": params(learn.model) == before,
           "stopped_after": len(learn.recorder.losses)}
    learn.fit(1)
    out["after"] = params(learn.model)
    out["ran"] = [CB + "schedule.LRFinder", L + "lr_find", L + "no_logging"]
    return out


# -- SaveModelCallback ---------------------------------------------------------------------------------------------------------
def save_model_scenario(strategy: pp.Strategy | None, workdir: str) -> dict[str, Any]:
    from fastai.callback.tracker import SaveModelCallback

    out: dict[str, Any] = {"ran": [CB + "tracker.SaveModelCallback", CB + "tracker.TrackerCallback"]}
    for name, kwargs in (("best", {}), ("every_epoch", {"every_epoch": True}), ("at_end", {"at_end": True, "with_opt": True})):
        own = os.path.join(workdir, name)  # one directory for every rank: what is saved is loaded
        learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), mlp(), lr=0.8)
        learn.path = type(learn.path)(own)
        learn.fit(4, cbs=[SaveModelCallback(**kwargs)])
        models = os.path.join(own, "models")
        out[name] = {"params": params(learn.model), "values": [floats(v) for v in learn.recorder.values],
                     "files": sorted(os.listdir(models)) if os.path.isdir(models) else []}
    return out


# -- tabular_learner: BatchNorm, predict, show_results ------------------------------------------------------------------------
def _tabular(strategy: pp.Strategy | None) -> Any:
    import pandas as pd
    from fastai.tabular.all import Categorify, CategoryBlock, Normalize, TabularDataLoaders, accuracy, tabular_learner

    g = _gen(9)
    n = N_TRAIN + N_VALID
    df = pd.DataFrame({"a": torch.randn(n, generator=g).tolist(), "b": torch.randn(n, generator=g).tolist(),
                       "kind": [["x", "y", "z"][int(i)] for i in torch.randint(0, 3, (n,), generator=g)]})
    df["label"] = [("hi" if a + 0.5 * b > 0 else "lo") for a, b in zip(df.a, df.b)]
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=["kind"], cont_names=["a", "b"],
                                     y_names="label", y_block=CategoryBlock(), valid_idx=list(range(N_TRAIN, n)),
                                     bs=GLOBAL, shuffle=False, device="cpu")
    torch.manual_seed(8)
    cbs = [strategy.adapt("fastai")] if strategy is not None else []
    return df, tabular_learner(dls, layers=[8], metrics=[accuracy], cbs=cbs)


def tabular_scenario(strategy: pp.Strategy | None, workdir: str) -> dict[str, Any]:
    from fastai.interpret import ClassificationInterpretation, Interpretation
    from fastai.learner import load_learner

    df, learn = _tabular(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with learn.no_bar(), learn.no_logging():
            learn.fit(2, lr=0.05)
    out: dict[str, Any] = {"params": params(learn.model), "values": [floats(v) for v in learn.recorder.values],
                           "warned": [str(w.message) for w in caught if "BatchNorm" in str(w.message)]}
    out["running"] = {k: v.reshape(-1).tolist() for k, v in learn.model.state_dict().items() if "running" in k}
    with learn.no_bar():
        out["probs"] = learn.predict(df.iloc[N_TRAIN])[2].tolist()
        out["validated"] = floats(learn.validate())
        out["preds"] = learn.get_preds()[0].tolist()
        interp = ClassificationInterpretation.from_learner(learn)
        out["confusion"] = interp.confusion_matrix().tolist()
        out["top_losses"] = Interpretation.from_learner(learn).top_losses(5)[0].tolist()
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            learn.show_results(max_n=3, shuffle=False)
        out["shown"] = buffer.getvalue()
    # export: once, from the checkpoint rank, without the adapter; load_learner on every rank.
    rank = strategy.session().rank if strategy is not None else 0
    os.makedirs(os.path.join(workdir, f"rank{rank}"), exist_ok=True)
    learn.path = type(learn.path)(os.path.join(workdir, f"rank{rank}"))
    learn.export("model.pkl")
    out["exported"] = os.path.exists(os.path.join(workdir, f"rank{rank}", "model.pkl"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_learner warns about pickle
        loaded = load_learner(os.path.join(workdir, "rank0", "model.pkl"))
    out["loaded_callbacks"] = sorted(type(c).__name__ for c in loaded.cbs)
    if strategy is not None:
        # A plain fastai Learner in a launched job would all-gather every batch over WORLD_SIZE.
        loaded.add_cb(strategy.adapt("fastai"))
    with loaded.no_bar():
        out["loaded_preds"] = loaded.get_preds(dl=loaded.dls.test_dl(df.iloc[N_TRAIN:]))[0].tolist()
    out["ran"] = ["fastai.tabular.learner.tabular_learner", L + "predict", L + "show_results",
                  L + "export", "fastai.learner.load_learner", "fastai.interpret.Interpretation.from_learner",
                  "fastai.interpret.ClassificationInterpretation.from_learner"]
    return out


# -- what ranks print --------------------------------------------------------------------------------------------------------
def quiet_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    from fastai.callback.progress import ShowGraphCallback
    from fastai.callback.tracker import EarlyStoppingCallback
    from fastai.test_utils import VerboseCallback

    learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), mlp(), quiet=False)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        learn.fit(2, lr=0.5, cbs=[ShowGraphCallback(), VerboseCallback(), EarlyStoppingCallback(patience=0, min_delta=1)])
        learn.show_training_loop()
        with learn.no_bar():
            learn.fit(1)
    ordered = [type(c).__name__ for c in learn.ordered_cbs("before_fit")]
    return {"printed": buffer.getvalue(), "ordered": ordered,
            "ran": [CB + "progress.ProgressCallback", CB + "progress.ShowGraphCallback", "fastai.test_utils.VerboseCallback",
                    L + "show_training_loop", L + "ordered_cbs", L + "no_bar"]}


# -- random callbacks -----------------------------------------------------------------------------------------------------------
def random_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    from fastai.callback.mixup import CutMix, MixUp
    from fastai.callback.preds import MCDropoutCallback
    from fastai.losses import CrossEntropyLossFlat

    out: dict[str, Any] = {"ran": [CB + "mixup.MixHandler", CB + "mixup.MixUp", CB + "mixup.CutMix",
                                   CB + "preds.MCDropoutCallback"]}
    torch.manual_seed(0)
    learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), mlp(), loss_func=CrossEntropyLossFlat())
    learn.fit(2, cbs=[MixUp()])
    out["mixup"] = {"params": params(learn.model), "losses": floats(learn.recorder.losses)}
    torch.manual_seed(0)
    learn = learner(strategy, _images(N_TRAIN, 1), _images(N_VALID, 2), _conv(), loss_func=CrossEntropyLossFlat())
    learn.fit(2, cbs=[CutMix()])
    out["cutmix"] = {"params": params(learn.model), "losses": floats(learn.recorder.losses)}
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), model)
    torch.manual_seed(2)  # every rank alike: the same masks
    out["mc_dropout"] = learn.get_preds(cbs=[MCDropoutCallback()])[0].tolist()
    return out


# -- callbacks that see this rank's share ---------------------------------------------------------------------------------------
def per_rank_scenario(strategy: pp.Strategy | None) -> dict[str, Any]:
    from fastai.callback.core import Callback
    from fastai.callback.data import CollectDataCallback
    from fastai.callback.hook import ActivationStats

    class BatchSizes(Callback):
        def before_fit(self) -> None:
            self.sizes: list[int] = []

        def after_batch(self) -> None:
            if self.training:
                self.sizes.append(len(self.learn.yb[0]))

    sizes, collect, stats = BatchSizes(), CollectDataCallback(), ActivationStats(with_hist=False)
    learn = learner(strategy, classification(N_TRAIN, 1), classification(N_VALID, 2), mlp())
    learn.fit(1, cbs=[sizes, collect, stats])
    return {"sizes": sizes.sizes, "collected": [len(b[1][0]) for b in collect.data],
            "stats_finite": bool(all(torch.isfinite(torch.tensor(s["mean"])).all() for s in stats.stats[0] if s)),
            "stats_batches": len(stats.stats),
            "ran": [CB + "core.Callback", CB + "data.CollectDataCallback", CB + "hook.HookCallback",
                    CB + "hook.ActivationStats"]}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "metrics": metrics_scenario, "preds": preds_scenario, "train": train_scenario, "lr_find": lr_find_scenario,
    "save_model": save_model_scenario, "tabular": tabular_scenario,
    "quiet": quiet_scenario, "random": random_scenario, "per_rank": per_rank_scenario,
}
WITH_WORKDIR = {"train", "save_model", "tabular"}


def run(strategy: pp.Strategy | None, names: list[str], workdir: str) -> dict[str, Any]:
    """Run the scenarios ``names`` (each in its own sub-directory of ``workdir``)."""
    out = {}
    for name in names:
        args = (os.path.join(workdir, name),) if name in WITH_WORKDIR else ()
        out[name] = SCENARIOS[name](strategy, *args)
    return out


def worker(strategy: pp.Strategy, names: list[str], workdir: str) -> dict[str, Any]:
    """In every launched process."""
    torch.set_num_threads(1)
    return {"rank": strategy.session().rank, **run(strategy, names, workdir)}
