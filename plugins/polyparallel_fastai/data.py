"""``shard_data`` for fastai ``DataLoader``s: the same loader, over one shard of the data axis.

fastai's loader takes its sample order from ``get_idxs()`` (called once per pass, in the main
process, before any worker starts). The shard is a ``dl.new(...)`` copy whose ``get_idxs`` is a
:class:`ShardIndices`: :func:`polyparallel.shard_indices` for the epoch set with ``set_epoch``, so
every runtime and a single-process reference agree on which samples each data coordinate gets.
Everything else of the loader is kept (its dataset, transforms, ``after_batch`` pipeline, device,
``n_inp``, decoding): the result is a fastai ``DataLoader`` of the same class.

Two attributes are added to the copy (never to the user's loader):

- ``set_epoch(e)``: the order of the next passes comes from ``(seed, e)``; the fastai adapter
  sets it from ``learn.epoch`` before every training pass, so every rank (and a resumed run)
  shuffles alike;
- ``to_detach(b, cpu, gather)``: fastai's ``Learner.to_detach`` calls it for metrics; it never
  gathers. fastai's own gather (``maybe_gather``) is an unbounded ``all_gather`` over the whole
  ``WORLD_SIZE`` world, not the data group; the adapter reduces metric states through
  ``strategy.reduce_metrics`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polyparallel as pp

__all__ = ["ShardIndices", "is_fastai_loader", "local_to_detach", "shard_fastai_loader"]


def is_fastai_loader(data: Any) -> bool:
    """Whether ``data`` is a fastai ``DataLoader`` (``False`` whenever fastai was never imported)."""
    import sys

    module = sys.modules.get("fastai.data.load")
    return module is not None and isinstance(data, module.DataLoader)


def local_to_detach(b: Any, cpu: bool = True, gather: bool = True) -> Any:
    """fastai's ``to_detach`` without its world-wide gather (see the module docstring)."""
    from fastai.torch_core import to_detach

    return to_detach(b, cpu, gather=False)


@dataclass
class ShardIndices:
    """The ``get_idxs`` of a sharded fastai loader: this data coordinate's indices of an epoch.

    ``keep`` truncates the shard (``drop_last``: only full global batches). Picklable, so
    loaders with workers work.
    """

    length: int
    data_rank: int
    data_size: int
    seed: int
    shuffle: bool
    remainder: str
    keep: int
    epoch: int = 0

    def __call__(self) -> list[int]:
        idxs = pp.shard_indices(self.length, self.data_rank, self.data_size, seed=self.seed, epoch=self.epoch,
                                shuffle=self.shuffle, remainder=self.remainder)
        return idxs[: self.keep]


class _SetEpoch:
    """``loader.set_epoch(e)``: a picklable callable bound to the loader's :class:`ShardIndices`."""

    def __init__(self, indices: ShardIndices):
        self.indices = indices

    def __call__(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch() takes an int >= 0. Received: {epoch!r}.")
        self.indices.epoch = epoch


def per_rank_batch(global_batch: int | None, loader_bs: int | None, data_size: int, what: str,
                   accumulate: int = 1) -> int:
    """The batch size of one data rank and micro-step: the global one divided over the data axis
    and the ``accumulate`` micro-batches, else the loader's own (per rank and optimizer step)
    divided by ``accumulate``, as for every other loader ``shard_data`` takes."""
    if global_batch is not None:
        if global_batch % (data_size * accumulate):  # the core refuses this first; kept for direct callers
            parts = f"data={data_size} ranks" + (f" x accumulate={accumulate}" if accumulate > 1 else "")
            raise pp.TopologyError(f"{what}: the global batch size {global_batch} does not divide over {parts}; use a "
                                   f"multiple of {data_size * accumulate}.")
        return global_batch // (data_size * accumulate)
    if loader_bs is None:
        raise TypeError(f"{what}: the fastai DataLoader has bs=None (its dataset yields whole batches), which cannot be "
                        "sharded by sample. Give it a batch size (bs=) or shard the batches in the dataset with "
                        "polyparallel.shard_indices.")
    if loader_bs % accumulate:
        raise pp.TopologyError(f"{what}: the DataLoader's bs={loader_bs} (per rank and optimizer step) does not divide "
                               f"into accumulate={accumulate} micro-batches; use a multiple of {accumulate}, or "
                               "Strategy(batch_size=<global>).")
    return loader_bs // accumulate


def shard_fastai_loader(data: Any, session: pp.Session, policy: pp.DataPolicy, strategy: pp.Strategy) -> Any:
    """A copy of the fastai loader ``data`` over this rank's shard (see the module docstring).

    - batch size: ``policy.batch_size`` is global (each data rank gets ``batch_size // data``);
      without one, the loader's ``bs`` is per rank; under ``Strategy(accumulate=N)`` either is
      divided by N (micro-batches, :mod:`.accumulation`);
    - shuffling: ``policy.shuffles(data.shuffle)``, from ``(strategy.seed, epoch)``;
    - ``drop_last``: only full *global* batches (``length // global batch`` of them, whole
      optimizer steps under accumulation), as a single
      process with that batch size would; else every sample of the shard;
    - ``remainder``: ``pad`` / ``drop`` / ``uneven`` as :func:`polyparallel.shard_indices`.
    """
    data_size = session.topology.size("data")
    what = f"shard_data({type(data).__name__})"
    if not getattr(data, "indexed", True):
        raise TypeError(f"{what}: the fastai DataLoader reads an iterable dataset, which cannot be sharded by index. "
                        "Shard it in the dataset with strategy.session().coords['data'] and the data axis size.")
    length = data.n
    if length is None:
        raise TypeError(f"{what}: the fastai DataLoader has no length (n=None); sharding needs a sized dataset.")
    steps = strategy.accumulate
    bs = per_rank_batch(policy.batch_size, data.bs, data_size, what, steps)
    shuffle = policy.shuffles(bool(data.shuffle))
    rank = session.coords["data"]
    shard = pp.shard_length(length, rank, data_size, policy.remainder)
    keep = shard
    if data.drop_last:
        # Full global batches of real samples only: the padded tail (remainder="pad") sits at the
        # end of the order, so global batch i is whole iff (i + 1) * global <= samples.
        samples = length if policy.remainder != "drop" else length - length % data_size
        keep = min(shard, samples // (bs * data_size * steps) * bs * steps)
    indices = ShardIndices(length, rank, data_size, strategy.seed, shuffle, policy.remainder, keep)
    # drop_last is applied above (over the global batch), so the copy keeps every index it gets.
    out = data.new(bs=bs, shuffle=False, drop_last=False, n=keep, get_idxs=indices)
    out.set_epoch = _SetEpoch(indices)
    out.to_detach = local_to_detach
    out.shard_indices = indices
    return out
