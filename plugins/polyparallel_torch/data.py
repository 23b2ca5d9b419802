"""``shard_data`` for torch: a sampler that shards over the data axis only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler

import polyparallel as pp

__all__ = ["ShardedLoader", "TopologySampler", "shard_loader"]


class TopologySampler(Sampler[int]):
    """Indices of one data-parallel shard: :func:`polyparallel.shard_indices` for each epoch.

    Ranks that share a data coordinate (tensor/pipeline replicas) get the same indices; different
    data coordinates get disjoint ones. With ``shuffle``, the order is a permutation determined by
    ``(seed, epoch)`` alone, the same on every rank and in a single-process reference.

    Which epoch a pass uses, so that replicas never drift apart:

    - ``set_epoch(e)`` (what Lightning's and Ignite's loops call, as for ``DistributedSampler``)
      pins the epoch: every later pass uses ``e`` until the next ``set_epoch``. A rank may then
      iterate its loader more often than its peers (a logger peeking at one batch with
      ``next(iter(loader))``) without changing what its replicas see; once a restored loader is
      pinned again (the framework's ``set_epoch`` of the resumed epoch), the resumed position
      stays until a pass of that epoch has yielded its last batch (a peek does not use it up).
    - Until then each pass (each ``iter()``) uses the current epoch and moves to the next, so a
      plain ``for epoch in ...: for batch in loader`` loop reshuffles every epoch, also when it
      breaks off a pass after a number of steps. Because a rank that iterates once more than its
      peers would then shuffle differently from its replicas, every pass first checks, over all
      ranks (``agree``), that they start the same pass: a rank out of step makes its group fail
      with an error naming ``shard_data`` instead of training on other data silently.

    :param remainder: ``pad`` (repeat samples from the start of the order so every shard has the
        same length), ``drop`` (drop the tail), ``uneven`` (every sample exactly once; shard
        lengths differ by at most one — for evaluation).
    """

    def __init__(self, dataset_len: int, data_rank: int, data_size: int, *, seed: int = 0,
                 shuffle: bool = True, remainder: str = "pad", agree: Callable[[int], None] | None = None):
        # shard_length validates the split now, not at the first iteration.
        self._len = pp.shard_length(dataset_len, data_rank, data_size, remainder)
        self.dataset_len, self.data_rank, self.data_size = dataset_len, data_rank, data_size
        self.seed, self.shuffle, self.remainder = seed, shuffle, remainder
        self.epoch = 0
        self.pinned = False  # True once set_epoch was called: the epoch no longer advances by itself
        # (epoch, samples to skip): set when a loader is resumed mid-epoch; passes of that epoch
        # start after them. Unpinned, only the next pass uses it (the one after is another epoch).
        # Pinned, it stays until a pass of that epoch runs to its end (ShardedLoader._finish) or
        # set_epoch moves to another epoch: a peek (next(iter(loader))) on one rank must not
        # make that rank's real pass restart at batch 0 while its peers continue at batch k.
        self.resume: tuple[int, int] | None = None
        # Called with the epoch at the start of every unpinned pass: a collective check that every
        # rank starts the same pass (None in one process, and when pickled into loader workers).
        self._agree = agree

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_agree": None}  # the check holds process groups: it stays here

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for every iteration from now on (deterministic shuffling from (seed, epoch));
        the epoch no longer advances by itself."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch() takes an int >= 0. Received: {epoch!r}.")
        if self.resume is not None and self.resume[0] != epoch:
            self.resume = None  # the resumed epoch was left: its position no longer applies
        self.epoch, self.pinned = epoch, True

    def indices(self, epoch: int) -> list[int]:
        """This shard's indices for ``epoch``."""
        return pp.shard_indices(self.dataset_len, self.data_rank, self.data_size, seed=self.seed, epoch=epoch,
                                shuffle=self.shuffle, remainder=self.remainder)

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        if not self.pinned:
            self.epoch = epoch + 1
            if self._agree is not None:
                self._agree(epoch)
        start = self._take_resume(epoch)
        return iter(self.indices(epoch)[start:])

    def _take_resume(self, epoch: int) -> int:
        resume = self.resume
        if not self.pinned:  # the next pass is another epoch: this one alone resumes
            self.resume = None
        return resume[1] if resume is not None and resume[0] == epoch else 0

    def finished(self, epoch: int) -> None:
        """A counted pass of ``epoch`` ran to its end: a resume position of that epoch is used up."""
        if self.resume is not None and self.resume[0] == epoch:
            self.resume = None

    def __len__(self) -> int:
        # A resumed pass is shorter: what DataLoader's len() (and the loops reading it) must see.
        if self.resume is not None and self.resume[0] == self.epoch:
            return max(0, self._len - self.resume[1])
        return self._len


class ShardedLoader(DataLoader):
    """The ``DataLoader`` that ``shard_data`` returns: a plain ``DataLoader`` over a
    :class:`TopologySampler` that also knows its position, for checkpoints (``Strategy.save(...,
    loader=)``) and exact resumption.

    It counts the batches it *yields* in each pass (not the indices its sampler handed out: with
    workers, or prefetching, the sampler runs ahead of the training loop). The position is the
    last pass started: its epoch and the batches consumed in it; once a pass is complete, the
    next epoch with none consumed. Because :func:`polyparallel.shard_indices` gives data
    coordinate ``d`` the positions ``d, d + D, d + 2D, ...`` of the epoch's order, step ``s`` of
    any data size ``D`` consumes the global positions ``[s*B, (s+1)*B)`` for a global batch ``B``:
    a count of batches is a position in the epoch at every topology with the same global batch.
    """

    _position: tuple[int, int] | None = None  # (epoch, batches consumed) of the pass in progress
    _current: object | None = None  # the iterator that counts (the latest one made)
    _finished_epoch: int | None = None  # the epoch of the last pass that ran to its end
    global_step: int = 0  # batches yielded by every pass since the loader was made (or as restored)
    accumulate: int = 1  # the Strategy's accumulate: its batches are micro-batches of 1 / accumulate of a step

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, TopologySampler)
        epoch = sampler.epoch  # the epoch this pass uses (its sampler reads it when the pass starts)
        start = sampler.resume[1] // self._per_rank() if sampler.resume and sampler.resume[0] == epoch else 0
        iterator = _Counting(self, super().__iter__())
        self._current, self._position = iterator, (epoch, start)
        return iterator

    def _per_rank(self) -> int:
        if self.batch_size is None:
            raise TypeError("a loader without batch_size has no position to save")
        return self.batch_size

    def _count(self, iterator: object) -> None:
        if iterator is self._current and self._position is not None:
            self._position = (self._position[0], self._position[1] + 1)
            self.global_step += 1
            sampler = self.sampler
            assert isinstance(sampler, TopologySampler)
            if self._position[1] >= self._epoch_batches(sampler):
                # The last batch of the epoch was yielded: a loop that stops at len() (Ignite's
                # epoch_length) never asks for the StopIteration, yet used the resume up.
                sampler.finished(self._position[0])

    def _epoch_batches(self, sampler: TopologySampler) -> int:
        """Batches of a whole pass of one epoch on this rank."""
        size = self._per_rank()
        return sampler._len // size if self.drop_last else -(-sampler._len // size)

    def _finish(self, iterator: object) -> None:
        if iterator is self._current and self._position is not None:
            self._finished_epoch, self._position, self._current = self._position[0], None, None
            sampler = self.sampler
            assert isinstance(sampler, TopologySampler)
            sampler.finished(self._finished_epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position and what exact resumption needs to agree on: ``epoch``, ``batches``
        (consumed of that epoch), ``global_step``, ``global_batch`` (this rank's batch size x
        the data size: a global micro-batch under ``Strategy(accumulate=)``), ``accumulate``,
        ``seed``, ``dataset_len``, ``shuffle``, ``remainder`` and ``pinned``.
        The same on every rank of a data-parallel run that iterates alike."""
        sampler = self.sampler
        assert isinstance(sampler, TopologySampler)
        if self._position is not None:
            epoch, batches = self._position
        elif sampler.resume is not None and sampler.resume[0] == sampler.epoch:  # restored, not yet resumed
            epoch, batches = sampler.epoch, sampler.resume[1] // self._per_rank()
        elif sampler.pinned and sampler.epoch == self._finished_epoch:
            # A pinned sampler keeps the epoch of the pass it completed; the position is the next
            # one all the same (a framework calls set_epoch(next) before its next pass).
            epoch, batches = sampler.epoch + 1, 0
        else:  # unpinned: the sampler moved on when the pass began
            epoch, batches = sampler.epoch, 0
        return {"epoch": epoch, "batches": batches, "global_step": self.global_step,
                "global_batch": self._per_rank() * sampler.data_size, "seed": sampler.seed,
                "dataset_len": sampler.dataset_len, "shuffle": sampler.shuffle, "remainder": sampler.remainder,
                "pinned": sampler.pinned, "accumulate": self.accumulate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (possibly of another data size): the next pass is
        epoch ``state["epoch"]`` and skips its first ``state["batches"]`` global batches, so the
        rest of the epoch is consumed exactly once, in the saved run's order.

        The restored position is for the saved epoch only: the sampler is left unpinned (whatever
        the saved run did), so a plain loop's later passes are the following epochs; a framework
        that pins epochs (Lightning's and Ignite's ``set_epoch``) pins it again, as in the saved run.

        :raises polyparallel.CheckpointError: the global batch, data set length, seed, shuffling
            or remainder policy differ from the saved ones (the samples would differ).
        """
        from polyparallel import _checkpoints

        _checkpoints.check_loader_resume("loader state", state, self.state_dict())
        sampler = self.sampler
        assert isinstance(sampler, TopologySampler)
        epoch, batches = int(state["epoch"]), int(state["batches"])
        # Not state["pinned"]: restored pinned, a plain loop would repeat the saved epoch's order
        # in every later pass.
        sampler.epoch, sampler.pinned = epoch, False
        sampler.resume = (epoch, batches * self._per_rank()) if batches else None
        self._position, self._current, self._finished_epoch = None, None, None
        self.global_step = int(state.get("global_step", 0))


class _Counting:
    """A ``ShardedLoader``'s iterator: the ``DataLoader`` iterator, counting what it yields."""

    def __init__(self, loader: ShardedLoader, inner: Iterator[Any]):
        self._loader, self._inner = loader, inner

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            self._loader._finish(self)
            raise
        self._loader._count(self)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


def _per_rank_batch(global_batch: int | None, fallback: int | None, data_size: int, accumulate: int = 1) -> int | None:
    if global_batch is not None and accumulate == 1 and global_batch % data_size:
        raise pp.TopologyError(
            f"global batch size {global_batch} does not divide over data={data_size} ranks; "
            f"use a multiple of {data_size} (e.g. {data_size * max(1, global_batch // data_size)})."
        )
    from .accumulation import per_rank_batch

    return per_rank_batch(global_batch, fallback, data_size, accumulate)


def _loader_shuffles(loader: DataLoader, length: int) -> bool:
    """Whether ``loader``'s sampler shuffles, for a sampler whose meaning a :class:`TopologySampler`
    keeps; anything else is refused rather than silently replaced."""
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == length:
        return True
    if type(sampler) is DistributedSampler:
        # A loader made for DDP (or injected by Lightning): its rank/world are re-derived from the
        # data axis; its shuffle choice is kept.
        return bool(sampler.shuffle)
    if type(sampler) is RandomSampler:
        what = f"RandomSampler(replacement={sampler.replacement}, num_samples={sampler.num_samples})"
    else:
        what = type(sampler).__name__
    raise TypeError(
        f"shard_data() cannot keep the meaning of this DataLoader's sampler {what}: sharding replaces it by "
        "a shard of the data axis (a permutation of every sample, or the data set's order), which would "
        "silently drop its weights, replacement or selection. Give shard_data() a loader made with "
        "shuffle=True or shuffle=False (or the Dataset itself), and put the selection into the Dataset "
        "(e.g. a torch.utils.data.Subset); or shard your sampler's indices yourself with "
        "polyparallel.shard_indices(len(indices), strategy.session().coords['data'], "
        "strategy.session().topology.size('data'), seed=..., epoch=...)."
    )


def _loader_options(loader: DataLoader) -> dict[str, Any]:
    """Every option of ``loader`` except what sharding decides (dataset, batch size, sampler)."""
    options: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
        drop_last=loader.drop_last, generator=loader.generator, pin_memory_device=loader.pin_memory_device,
        in_order=getattr(loader, "in_order", True),
    )
    if loader.num_workers > 0:
        # DataLoader refuses these two without workers.
        options.update(multiprocessing_context=loader.multiprocessing_context, prefetch_factor=loader.prefetch_factor)
    return options


#: The name passes are checked under: what a user sees when ranks iterate their loaders unequally.
PASS_CHECK = "shard_data pass (iterate the loader alike on every rank, or pin epochs with loader.sampler.set_epoch)"


def _pass_check(session: pp.Session, what: str) -> Callable[[int], None]:
    def agree(epoch: int) -> None:
        from .runtime import get_runtime  # made on first use, like every operation's groups

        get_runtime(session).check(PASS_CHECK, "world", f"epoch {epoch} of {what}")

    return agree


def shard_loader(data: Any, session: pp.Session, policy: pp.DataPolicy, strategy: pp.Strategy,
                 pass_check: Callable[[pp.Session, str], Callable[[int], None] | None] = _pass_check) -> ShardedLoader:
    """A :class:`ShardedLoader` (a ``DataLoader`` that knows its position) over this rank's shard of ``data`` (a ``Dataset`` or a ``DataLoader``).

    A loader keeps its options (workers, collate_fn, drop_last, pin_memory, generator, ...) and,
    unless the policy sets ``shuffle``, its shuffle choice; its ``batch_size`` is per rank unless
    the policy has a global one. A sampler whose meaning cannot be kept is refused. Under
    ``Strategy(accumulate=N)`` it yields micro-batches: ``batch_size / (data x N)`` samples (a
    loader's own ``batch_size``, per rank and optimizer step, divided by ``N``); see
    :mod:`.accumulation`.

    :param pass_check: makes the sampler's per-pass agreement check (default: over the torch
        runtime's groups); another runtime that shards through this function passes its own
        (the XLA runtime checks in the replica's thread instead and passes one returning ``None``).
    """
    data_size = session.topology.size("data")
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if isinstance(data.dataset, torch.utils.data.IterableDataset):
            raise TypeError("shard_data() cannot shard an IterableDataset by index; shard it in the dataset "
                            "itself using strategy.session().coords['data'] and the data axis size.")
        if data.batch_sampler is not None and data.batch_size is None:
            raise TypeError(
                f"shard_data() got a DataLoader with a custom batch_sampler ({type(data.batch_sampler).__name__}), "
                "whose batches sharding would silently replace. Give shard_data() the Dataset with a global "
                "batch_size (or a loader with batch_size= and shuffle=), or shard the batches yourself with "
                "polyparallel.shard_indices."
            )
        batch = _per_rank_batch(policy.batch_size, data.batch_size, data_size, strategy.accumulate)
    elif isinstance(data, Dataset):
        dataset = data
        if policy.batch_size is None:
            raise pp.TopologyError("shard_data(Dataset) needs the global batch size: Strategy(batch_size=...) "
                                   "or shard_data(dataset, batch_size=...).")
        batch = _per_rank_batch(policy.batch_size, None, data_size, strategy.accumulate)
    else:
        return None  # type: ignore[return-value]
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"shard_data() needs a sized dataset; {type(dataset).__name__} has no __len__.") from None
    if isinstance(data, DataLoader):
        shuffle, options = policy.shuffles(_loader_shuffles(data, length)), _loader_options(data)
    else:
        shuffle, options = policy.shuffles(), {}
    sampler = TopologySampler(length, session.coords["data"], data_size, seed=strategy.seed,
                              shuffle=shuffle, remainder=policy.remainder,
                              agree=pass_check(session, f"{length} samples, batch {batch}") if session.world_size > 1 else None)
    loader = ShardedLoader(dataset, batch_size=batch, sampler=sampler, **options)
    loader.accumulate = strategy.accumulate
    return loader
