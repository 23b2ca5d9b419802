"""``trainer.predict`` returns every row once, in order, on every rank: as in one process.

The adapter shards prediction loaders ``uneven`` (:meth:`StrategyMixin.process_dataloader`): data
rank ``r`` of ``N`` predicts the samples at positions ``r, r + N, r + 2N, ...`` of the loader's order,
each once (Lightning's own ``DistributedSampler`` pads the last shard with repeated rows). Left
there, ``trainer.predict`` would return this rank's rows only: a different, shorter result than
one process, and nothing says so. At ``on_predict_end`` every rank's predictions are gathered
(one bounded ``all_gather_object`` over the world, every rank alike) and merged: batch ``k`` of
the result holds the rows of every data rank's batch ``k`` in the loader's order, which is batch
``k`` of one process whose batch is the global one (``N`` times the loader's ``batch_size``).
Tensor-parallel replicas predict the same rows; one replica per data coordinate is used.

A batch's output may be a tensor whose first dimension is the batch, or a dict, list or tuple of
them (nested); anything else cannot be put in order and raises ``TypeError`` saying what to return.
With ``trainer.predict(..., return_predictions=False)`` nothing is gathered (a
``BasePredictionWriter`` writes each rank's rows with their ``batch_indices``).

**Lightning names relied on**: ``trainer.predict_loop.return_predictions`` (public) and its
``_predictions`` (private: one list of batch outputs per dataloader, read and replaced in place
at ``on_predict_end``, after Lightning has taken the result list it returns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["merge_predictions"]


def _rows(output: Any) -> int | None:
    """The number of rows of a batch output: the first dimension of its first tensor."""
    if isinstance(output, torch.Tensor):
        return int(output.shape[0]) if output.dim() > 0 else None
    if isinstance(output, dict):
        values: Sequence[Any] = list(output.values())
    elif isinstance(output, (list, tuple)):
        values = output
    else:
        return None
    for value in values:
        rows = _rows(value)
        if rows is not None:
            return rows
    return None


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"trainer.predict under polyparallel puts every data rank's rows back in order, as one process returns "
        f"them, and cannot do so for {what}. Return from predict_step a tensor whose first dimension is the batch "
        "(or a dict, list or tuple of such tensors), or call trainer.predict(..., return_predictions=False) and "
        "write each rank's rows with a BasePredictionWriter."
    )


def _merge(parts: list[Any], order: list[torch.Tensor]) -> Any:
    """One batch output from the data ranks' outputs ``parts`` of batch ``k`` (rows ``order[r]``
    are the loader positions of rank ``r``'s rows)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0 or any(not isinstance(p, torch.Tensor) or p.dim() == 0 or p.shape[0] != len(o)
                                   for p, o in zip(parts, order)):
            raise _refuse("a tensor whose first dimension is not the batch")
        rows = torch.cat(parts)
        return rows[torch.argsort(torch.cat(order))]
    if isinstance(first, dict):
        if any(not isinstance(p, dict) or p.keys() != first.keys() for p in parts):
            raise _refuse("dicts with different keys on different ranks")
        return type(first)((key, _merge([p[key] for p in parts], order)) for key in first)
    if isinstance(first, (list, tuple)):
        if any(not isinstance(p, (list, tuple)) or len(p) != len(first) for p in parts):
            raise _refuse("sequences of different lengths on different ranks")
        merged = [_merge([p[i] for p in parts], order) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    raise _refuse(f"a {type(first).__name__}")


def merge_predictions(per_rank: Sequence[Sequence[Any]]) -> list[Any]:
    """Batch outputs of one dataloader, one list per data rank (in data-rank order), merged into
    the batch outputs of one process with the global batch (see the module docstring)."""
    size = len(per_rank)
    out = []
    seen = [0] * size  # rows of each rank so far: its local positions
    for k in range(max((len(batches) for batches in per_rank), default=0)):
        parts, order = [], []
        for rank, batches in enumerate(per_rank):
            if k >= len(batches):
                continue
            rows = _rows(batches[k])
            if rows is None:
                raise _refuse(f"a batch output of type {type(batches[k]).__name__} without a batch dimension")
            local = torch.arange(seen[rank], seen[rank] + rows)
            seen[rank] += rows
            parts.append(batches[k])
            order.append(local * size + rank)
        out.append(_merge(parts, order))
    return out
