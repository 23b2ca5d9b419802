"""fastai metric states made global over the data group through ``strategy.reduce_metrics``.

A fastai metric accumulates batch by batch, then ``Recorder`` reads ``metric.value``. Each rank
accumulates its own shard; before the recorder reads, :func:`reduce_states` replaces every
metric's state by the state a single process would hold after seeing every rank's samples:

==========================================  ===================================================
metric                                      global state
==========================================  ===================================================
``AvgMetric`` (``accuracy``, ``error_rate``,  ``total`` and ``count`` summed over the data group:
any function), ``AvgLoss`` (the recorder's     count-weighted, as a single process's
valid loss), ``LossMetric``, ``Perplexity``    ``sum(batch mean * batch size) / samples``
``AccumMetric`` (``RocAuc``, ``F1Score``,      the ``preds`` and ``targs`` of every rank,
every ``skm_to_fastai`` metric, ``rmse``)      concatenated rank after rank (their row counts
                                               summed first, so shards of any size fit)
``Dice``, ``JaccardCoeff``                     ``inter`` and ``union`` summed
``DiceMulti``, ``JaccardCoeffMulti``           per-class ``inter`` and ``union`` summed
``CorpusBLEUMetric``                           n-gram counts and lengths summed
==========================================  ===================================================

Other metric types are refused by :func:`check_supported` before training starts (the same list
on every rank, so every rank refuses). The sums go through ``strategy.reduce_metrics`` of a
strategy with ``MetricPolicy(op="sum")``: a sum of one rank's rows and zeros elsewhere is exact,
so gathered predictions are bit-identical to the ranks' own. Everything is packed into two
reductions at most (totals and row counts; then the rows), in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import polyparallel as pp

__all__ = ["check_supported", "reduce_states", "summing"]


def _kind(metric: Any) -> str | None:
    from fastai.learner import AvgLoss, AvgMetric
    from fastai.metrics import AccumMetric, CorpusBLEUMetric, Dice, DiceMulti

    if isinstance(metric, (AvgMetric, AvgLoss)):
        return "avg"
    if isinstance(metric, AccumMetric):
        return "accum"
    if isinstance(metric, DiceMulti):  # and JaccardCoeffMulti
        return "dicemulti"
    if isinstance(metric, Dice):  # and JaccardCoeff
        return "dice"
    if isinstance(metric, CorpusBLEUMetric):
        return "bleu"
    return None


def check_supported(metrics: Sequence[Any]) -> None:
    """Refuse, before any collective, a metric whose state this module cannot make global (the
    refused entries of :mod:`polyparallel_fastai.surface`, and any other kind it does not know)."""
    from .surface import SURFACE, metric_refusal

    for metric in metrics:
        what = f"the metric {getattr(metric, 'name', metric)!r} ({type(metric).__name__})"
        entry = metric_refusal(metric)
        if entry is not None:
            raise TypeError(f"the fastai adapter cannot make {what} global over the data group: "
                            + entry.message(SURFACE.adapter))
        if _kind(metric) is None:
            raise TypeError(
                f"the fastai adapter cannot make {what} global over the data group: it reduces AvgMetric (any "
                "function metric such as accuracy), AvgLoss/LossMetric, AccumMetric (RocAuc, F1Score, "
                "skm_to_fastai, ...), Dice/JaccardCoeff, DiceMulti/JaccardCoeffMulti and CorpusBLEUMetric. Write "
                "the metric as a function (it becomes an AvgMetric) or as an AccumMetric(func), so every rank's "
                "samples count."
            )


def summing(strategy: pp.Strategy) -> pp.Strategy:
    """``strategy`` whose ``reduce_metrics`` sums plain values (the runtime and its groups are
    the same: policies are per call)."""
    return strategy.replace(metric_policy=pp.MetricPolicy(op="sum"))


def _float(value: Any) -> float:
    return float(value.detach().double().cpu()) if isinstance(value, torch.Tensor) else float(value)


def _rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat([p.detach().cpu() for p in parts]) if parts else None


def reduce_states(strategy: pp.Strategy, metrics: Sequence[Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Make the states of ``metrics`` global (in place); also sum ``extra`` (name -> number or
    tensor) in the first reduction and return its sums. Collective: every rank of the data
    group calls it with the same metrics in the same order."""
    total = summing(strategy)
    session = strategy.session()
    data_size, coord = session.topology.size("data"), session.coords["data"]
    first: dict[str, Any] = {f"extra.{k}": v for k, v in (extra or {}).items()}
    accum: list[tuple[int, Any, torch.Tensor | None, torch.Tensor | None]] = []
    for i, metric in enumerate(metrics):
        kind = _kind(metric)
        if kind == "avg":
            first[f"{i}.total"], first[f"{i}.count"] = _float(metric.total), float(metric.count)
        elif kind == "dice":
            first[f"{i}.inter"], first[f"{i}.union"] = _float(metric.inter), _float(metric.union)
        elif kind == "bleu":
            first[f"{i}.lens"] = torch.tensor([metric.pred_len, metric.targ_len], dtype=torch.float64)
            first[f"{i}.corrects"] = torch.tensor(metric.corrects, dtype=torch.float64)
            first[f"{i}.counts"] = torch.tensor(metric.counts, dtype=torch.float64)
        elif kind == "dicemulti":
            classes = torch.zeros(data_size, dtype=torch.float64)
            classes[coord] = len(metric.inter)
            first[f"{i}.classes"] = classes
        elif kind == "accum":
            preds, targs = _rows(metric.preds), _rows(metric.targs)
            rows = torch.zeros(data_size, dtype=torch.float64)
            rows[coord] = 0 if preds is None else len(preds)
            first[f"{i}.rows"] = rows
            accum.append((i, metric, preds, targs))
    if not first:
        return {}
    summed = total.reduce_metrics(first)
    for i, metric in enumerate(metrics):
        kind = _kind(metric)
        if kind == "avg":
            metric.total, metric.count = torch.tensor(summed[f"{i}.total"], dtype=torch.float64), summed[f"{i}.count"]
            if float(metric.count).is_integer():
                metric.count = int(metric.count)
        elif kind == "dice":
            metric.inter, metric.union = summed[f"{i}.inter"], summed[f"{i}.union"]
        elif kind == "bleu":
            metric.pred_len, metric.targ_len = (int(v) for v in summed[f"{i}.lens"].tolist())
            metric.corrects = summed[f"{i}.corrects"].tolist()
            metric.counts = [int(v) for v in summed[f"{i}.counts"].tolist()]
    second, layout = _rows_to_gather(accum, summed, data_size, coord)
    second.update(_classes_to_sum(metrics, summed))
    if second:
        gathered = total.reduce_metrics(second)
        for i, metric, pdtype, tdtype in layout:
            metric.preds = [gathered[f"{i}.preds"].to(pdtype)]
            metric.targs = [gathered[f"{i}.targs"].to(tdtype)]
        for i, metric in enumerate(metrics):
            if _kind(metric) == "dicemulti":
                inter, union = gathered[f"{i}.inter"].tolist(), gathered[f"{i}.union"].tolist()
                metric.inter, metric.union = dict(enumerate(inter)), dict(enumerate(union))
    return {k[len("extra."):]: v for k, v in summed.items() if k.startswith("extra.")}


def _classes_to_sum(metrics: Sequence[Any], summed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``DiceMulti``: per-class intersections and unions as vectors (a rank without batches
    contributes zeros); ranks that saw different numbers of classes are refused alike."""
    out: dict[str, torch.Tensor] = {}
    for i, metric in enumerate(metrics):
        if _kind(metric) != "dicemulti":
            continue
        counts = [int(c) for c in summed[f"{i}.classes"].tolist()]
        seen = sorted({c for c in counts if c})
        if len(seen) > 1:
            raise pp.TopologyError(f"the fastai metric {metric.name!r} (DiceMulti) saw different numbers of classes "
                                   f"on the data ranks ({counts}): the model's outputs must have the same classes "
                                   "on every rank.")
        n = seen[0] if seen else 0
        out[f"{i}.inter"] = torch.tensor([metric.inter.get(c, 0.0) for c in range(n)], dtype=torch.float64)
        out[f"{i}.union"] = torch.tensor([metric.union.get(c, 0.0) for c in range(n)], dtype=torch.float64)
    return out


def _rows_to_gather(accum: list[tuple[int, Any, torch.Tensor | None, torch.Tensor | None]], summed: dict[str, Any],
                    data_size: int, coord: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, Any, Any, Any]]]:
    """``AccumMetric``: this rank's rows placed at its offset in zeros of every rank's rows
    (summed over the group, they are every rank's rows, exactly)."""
    second: dict[str, torch.Tensor] = {}
    layout = []
    for i, metric, preds, targs in accum:
        counts = [int(c) for c in summed[f"{i}.rows"].tolist()]
        empty = [r for r, c in enumerate(counts) if c == 0]
        if empty:
            # Every rank sees the same counts, so every rank raises here: nobody waits.
            raise pp.TopologyError(
                f"the fastai metric {metric.name!r} (AccumMetric) has no predictions on data rank(s) {empty} "
                f"(rows per data rank: {counts}): the data set is smaller than the data axis, or those ranks "
                "skipped every batch. Use at least one sample per data rank.")
        assert preds is not None and targs is not None
        start, rows = sum(counts[:coord]), sum(counts)
        for name, part in (("preds", preds), ("targs", targs)):
            full = torch.zeros((rows, *part.shape[1:]), dtype=torch.float64)
            full[start:start + len(part)] = part.double()
            second[f"{i}.{name}"] = full
        layout.append((i, metric, preds.dtype, targs.dtype))
    return second, layout
