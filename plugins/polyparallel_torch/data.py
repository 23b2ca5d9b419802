"""``shard_data`` for torch: a sampler that shards over the data axis only."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import polyparallel as pp

__all__ = ["TopologySampler", "shard_loader"]


class TopologySampler(Sampler[int]):
    """Indices of one data-parallel shard.

    Ranks that share a data coordinate (tensor/pipeline replicas) get the same indices; different
    data coordinates get disjoint ones. Order is a permutation seeded by ``(seed, epoch)``, the
    same on every rank (``torch.randperm`` with a seeded generator, as DistributedSampler does).

    The epoch advances by itself: each ``iter()`` uses the current epoch and moves to the next,
    so a plain ``for epoch in ...: for batch in loader`` loop reshuffles. ``set_epoch(e)`` (what
    Lightning and Ignite call) pins the epoch for the next iteration instead.

    :param remainder: ``pad`` (repeat the first samples so every shard has the same length),
        ``drop`` (drop the tail), ``uneven`` (every sample exactly once; shard lengths differ by
        at most one — for evaluation).
    """

    def __init__(self, dataset_len: int, data_rank: int, data_size: int, *, seed: int = 0,
                 shuffle: bool = True, remainder: str = "pad"):
        if not 0 <= data_rank < data_size:
            raise ValueError(f"data_rank {data_rank} out of range for data_size {data_size}")
        self.dataset_len, self.data_rank, self.data_size = dataset_len, data_rank, data_size
        self.seed, self.shuffle, self.remainder = seed, shuffle, remainder
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (deterministic shuffling from (seed, epoch))."""
        self.epoch = epoch

    def indices(self, epoch: int) -> list[int]:
        """This shard's indices for ``epoch``."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.remainder == "drop":
            order = order[: n - n % self.data_size]
        elif self.remainder == "pad" and n % self.data_size:
            pad = self.data_size - n % self.data_size
            order += (order * math.ceil(pad / max(n, 1)))[:pad]
        return order[self.data_rank :: self.data_size]

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        self.epoch = epoch + 1
        return iter(self.indices(epoch))

    def __len__(self) -> int:
        n, d = self.dataset_len, self.data_size
        if self.remainder == "drop":
            return n // d
        if self.remainder == "pad":
            return math.ceil(n / d)
        return len(range(self.data_rank, n, d))


def _per_rank_batch(global_batch: int | None, fallback: int | None, data_size: int) -> int | None:
    if global_batch is None:
        return fallback
    if global_batch % data_size:
        raise pp.TopologyError(
            f"global batch size {global_batch} does not divide over data={data_size} ranks; "
            f"use a multiple of {data_size} (e.g. {data_size * max(1, global_batch // data_size)})."
        )
    return global_batch // data_size


def shard_loader(data: Any, session: pp.Session, policy: pp.DataPolicy, strategy: pp.Strategy) -> DataLoader:
    """A ``DataLoader`` over this rank's shard of ``data`` (a ``Dataset`` or a ``DataLoader``)."""
    data_size = session.topology.size("data")
    if isinstance(data, DataLoader):
        dataset, template = data.dataset, data
        if isinstance(data.dataset, torch.utils.data.IterableDataset):
            raise TypeError("shard_data() cannot shard an IterableDataset by index; shard it in the dataset "
                            "itself using strategy.session().coords['data'] and the data axis size.")
        if data.batch_sampler is not None and data.batch_size is None:
            raise TypeError("shard_data() got a DataLoader with a custom batch_sampler; give the Dataset "
                            "(and a global batch_size) instead.")
        batch = _per_rank_batch(policy.batch_size, data.batch_size, data_size)
    elif isinstance(data, Dataset):
        dataset, template = data, None
        if policy.batch_size is None:
            raise pp.TopologyError("shard_data(Dataset) needs the global batch size: Strategy(batch_size=...) "
                                   "or shard_data(dataset, batch_size=...).")
        batch = _per_rank_batch(policy.batch_size, None, data_size)
    else:
        return None  # type: ignore[return-value]
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"shard_data() needs a sized dataset; {type(dataset).__name__} has no __len__.") from None
    sampler = TopologySampler(length, session.coords["data"], data_size, seed=strategy.seed,
                              shuffle=policy.shuffle, remainder=policy.remainder)
    kwargs: dict[str, Any] = {}
    if template is not None:
        kwargs = dict(num_workers=template.num_workers, collate_fn=template.collate_fn,
                      pin_memory=template.pin_memory, timeout=template.timeout,
                      worker_init_fn=template.worker_init_fn, persistent_workers=template.persistent_workers,
                      drop_last=template.drop_last)
        if template.num_workers > 0:
            kwargs.update(multiprocessing_context=template.multiprocessing_context,
                          prefetch_factor=template.prefetch_factor)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, **kwargs)
