"""Host data -> globally sharded batches over the ``data`` axis.

Every data coordinate gets the strided shard ``order[d::data]`` of a permutation seeded by
``(seed, epoch)`` (:func:`polyparallel.shard_indices`, the same computation as every other
runtime's); devices that share a data coordinate (``tensor``/``pipeline`` replicas) get the
same rows because the batch sharding is ``P("data")`` (replicated along the other axes). Global
batch ``i`` is exactly ``order[i*B:(i+1)*B]``, the batch a single device would see with the same
global batch size ``B`` and seed: this is what makes distributed training equal single-device
training.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import polyparallel as pp

from .runtime import JaxRuntime

__all__ = ["Batch", "DataError", "ShardedArrays", "host_rows", "is_host_data", "shard_order", "validation_rows"]


class DataError(pp.PolyparallelError, ValueError):
    """Host data that cannot be sharded as asked (raised before compiling; a ``PolyparallelError``,
    so the plugin manager passes it through unwrapped)."""


def is_host_data(data: Any) -> bool:
    """Whether ``data`` is host data this plugin owns: a numpy array, or a tuple/list/dict of
    equally long numpy arrays. (torch objects are never numpy arrays, so no other runtime's
    data is taken.)"""
    if isinstance(data, np.ndarray):
        return True
    leaves = list(data.values()) if isinstance(data, Mapping) else list(data) if isinstance(data, (tuple, list)) else []
    return bool(leaves) and all(isinstance(x, np.ndarray) for x in leaves)


def shard_order(n: int, data_size: int, seed: int, epoch: int, shuffle: bool, remainder: str) -> list[np.ndarray]:
    """The sample indices of each data coordinate for one epoch: :func:`polyparallel.shard_indices`
    of every coordinate (the computation every runtime shares), as numpy arrays.

    ``pad`` repeats samples from the start of the order so every shard has the same length;
    ``drop`` drops the tail; ``uneven`` gives each sample exactly once (shard lengths differ by <= 1).
    """
    return [np.asarray(pp.shard_indices(n, d, data_size, seed=seed, epoch=epoch, shuffle=shuffle, remainder=remainder),
                       dtype=np.int64) for d in range(data_size)]


@dataclass(frozen=True)
class Batch:
    """One global batch: ``data`` (the input's structure, sharded ``P("data")``; under
    accumulation ``(accumulate, micro x data, ...)`` sharded ``P(None, "data")``), ``mask``
    (float32, 1 for a real sample, 0 for padding added by ``remainder="uneven"`` or a partial
    accumulated step; shaped like the rows), ``size`` (rows), ``count`` (real rows: the global
    sum of ``mask``, a host int) and ``indices`` (which sample each global row is, host numpy,
    shaped like ``mask``)."""

    data: Any
    mask: Any
    size: int
    count: int  # rows with mask 1 over all data coordinates (size minus the uneven padding)
    indices: np.ndarray  # the sample index of every global row (padding rows included)


class ShardedArrays:
    """Host arrays sharded over the data axis of a JAX mesh (what ``Strategy.shard_data`` returns
    for numpy input). Iterate :meth:`batches` per epoch; :meth:`indices` tells which samples each
    data coordinate holds.

    Under ``Strategy(accumulate=N)`` a batch is still one optimizer step (``batch_size`` rows),
    given as its N micro-batches: arrays of shape ``(N, micro x data, ...)`` sharded
    ``P(None, "data")``, where ``micro = polyparallel.micro_batch_size(batch_size, data, N)``;
    ``x[k]`` is micro-batch ``k`` (sharded ``P("data")``, as a batch is without accumulation).
    Data coordinate ``d`` holds in micro-batch ``k`` the rows ``k*micro ... (k+1)*micro`` of its
    share of the step: what a loader of ``micro`` rows per rank gives in every runtime, so global
    micro-batch ``k`` of step ``i`` is ``order[i*B + k*B/N : i*B + (k+1)*B/N]`` at every data
    size. A last, partial step keeps that shape: its rows fill the micro-batches in order and the
    rest is padding with mask 0 (a micro-batch may be all padding; ``Model.fit`` skips those, as
    a loader would end the epoch there). Losses, metrics and gradients are exact; in training
    mode BatchNorm's statistics of the last non-empty micro-batch see its padding rows, as with
    ``remainder="uneven"``.

    The epoch is always explicit (``batches(epoch)``): nothing advances by itself, so looking at a
    batch never changes what a later epoch holds. Host arrays have no loader to inherit a shuffle
    choice from: ``DataPolicy(shuffle=None)`` (the default) shuffles, ``shuffle=False`` keeps
    the order.
    """

    def __init__(self, data: Any, runtime: JaxRuntime, policy: pp.DataPolicy, seed: int, accumulate: int = 1):
        self._structure, self._arrays = _flatten(data)
        lengths = {len(a) for a in self._arrays}
        if len(lengths) != 1:
            raise DataError(f"shard_data() needs arrays of equal length (one row per sample). Received lengths "
                             f"{[len(a) for a in self._arrays]}.")
        self.num_samples = lengths.pop()
        if self.num_samples == 0:
            raise DataError("shard_data() received an empty data set (0 samples).")
        self.runtime, self.policy, self.seed = runtime, policy, seed
        data_size = runtime.data_size
        if policy.batch_size is None:
            raise DataError("shard_data() of arrays needs a global batch size: Strategy(batch_size=B) or "
                             "strategy.shard_data(arrays, batch_size=B).")
        try:
            self.micro_batch = pp.micro_batch_size(policy.batch_size, data_size, accumulate)
        except ValueError as exc:
            raise DataError(f"shard_data(): {exc}") from None
        self.accumulate = accumulate
        self.batch_size = policy.batch_size
        self.per_device = policy.batch_size // data_size
        self.global_step = 0  # batches yielded since these arrays were sharded
        self._position = (0, 0)  # (epoch, batches of it yielded): what state_dict() saves
        self._resume: tuple[int, int] | None = None  # set by load_state_dict: where batches(epoch) starts

    def __len__(self) -> int:
        """Batches per epoch."""
        longest = max(len(s) for s in self.indices(0))
        return -(-longest // self.per_device)

    def indices(self, epoch: int = 0) -> list[np.ndarray]:
        """Per data coordinate, the sample indices it trains on in ``epoch`` (no padding of
        ``uneven`` included)."""
        return shard_order(self.num_samples, self.runtime.data_size, self.seed, epoch,
                           self.policy.shuffles(), self.policy.remainder)

    def batches(self, epoch: int = 0, start: int | None = None) -> Iterator[Batch]:
        """The global batches of ``epoch``, as ``jax.Array``s sharded over the data axis, from
        batch ``start`` on: the batches an uninterrupted pass would give next. ``start=None`` is 0,
        or, once after :meth:`load_state_dict`, the saved position when ``epoch`` is the saved one."""
        import jax

        if start is None:
            start = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None  # consumed by the first pass after load_state_dict, whichever epoch it is
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(self):
            raise DataError(f"batches(start=) must be an int in [0, {len(self)}] (batches per epoch). Received: {start!r}.")
        self._position = (epoch, start)
        shards = self.indices(epoch)
        longest = max(len(s) for s in shards)
        # uneven: shorter shards are padded with their first sample and a 0 mask.
        padded = [np.concatenate([s, np.full(longest - len(s), s[0] if len(s) else 0)]) for s in shards]
        masks = [np.concatenate([np.ones(len(s), np.float32), np.zeros(longest - len(s), np.float32)]) for s in shards]
        local, size, n = self.runtime.local_data_coords(), self.runtime.data_size, self.accumulate
        sharding = self.runtime.sharding(*((None,) * (n > 1)), "data")
        for row in range(start * self.per_device, longest, self.per_device):
            stop = min(row + self.per_device, longest)
            rows = [padded[d][row:stop] for d in range(size)]
            mask = [masks[d][row:stop] for d in range(size)]
            if n > 1:  # (N, micro) per coordinate; a partial step padded to full micro-batches, mask 0
                full = self.per_device
                rows = [np.concatenate([r, np.full(full - len(r), r[0])]).reshape(n, -1) for r in rows]
                mask = [np.concatenate([m, np.zeros(full - len(m), np.float32)]).reshape(n, -1) for m in mask]
            axis = 1 if n > 1 else 0  # the rows' axis: coordinates side by side along it
            here = np.concatenate([rows[d] for d in local], axis=axis)
            every = np.concatenate(rows, axis=axis)
            arrays = [jax.make_array_from_process_local_data(sharding, a[here], (*every.shape, *a.shape[1:]))
                      for a in self._arrays]
            count = int(sum(m.sum() for m in mask))
            self._position = (epoch, self._position[1] + 1)
            self.global_step += 1
            yield Batch(_unflatten(self._structure, arrays),
                        jax.make_array_from_process_local_data(sharding, np.concatenate([mask[d] for d in local],
                                                                                         axis=axis), every.shape),
                        every.size, count, every)
        if self._position == (epoch, len(self)):
            self._position = (epoch + 1, 0)  # a complete pass: the next one is epoch + 1

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch`` to continue, ``batches`` of it yielded, ``global_step``) and
        what exact resumption must agree on (``global_batch``, ``seed``, ``dataset_len``,
        ``shuffle``, ``remainder``); the same in every process. A batch counts as consumed once
        yielded."""
        return {"epoch": self._position[0], "batches": self._position[1], "global_step": self.global_step,
                "global_batch": self.batch_size, "seed": self.seed, "dataset_len": self.num_samples,
                "shuffle": self.policy.shuffles(), "remainder": self.policy.remainder}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (possibly of another data size): the next
        ``batches(state["epoch"])`` skips its first ``state["batches"]`` global batches, so the
        rest of the epoch is consumed exactly once, in the saved run's order.

        :raises polyparallel.CheckpointError: the global batch, data set length, seed, shuffling
            or remainder policy differ from the saved ones (the samples would differ).
        """
        from polyparallel import _checkpoints

        _checkpoints.check_loader_resume("loader state", state, self.state_dict())
        epoch, batches = int(state["epoch"]), int(state["batches"])
        self._position, self._resume = (epoch, batches), (epoch, batches) if batches else None
        self.global_step = int(state.get("global_step", 0))

    def __repr__(self) -> str:
        accumulate = f" x accumulate={self.accumulate}" if self.accumulate > 1 else ""
        return (f"ShardedArrays({self.num_samples} samples, batch_size={self.batch_size} over "
                f"data={self.runtime.data_size}{accumulate}, remainder={self.policy.remainder!r})")


def _flatten(data: Any) -> tuple[Any, list[np.ndarray]]:
    if isinstance(data, np.ndarray):
        return None, [data]
    if isinstance(data, Mapping):
        keys = list(data)
        return ("dict", keys), [np.asarray(data[k]) for k in keys]
    if isinstance(data, (tuple, list)):
        return (type(data).__name__, len(data)), [np.asarray(x) for x in data]
    raise TypeError(f"shard_data() takes a numpy array or a tuple/list/dict of them. Received: {type(data).__name__}.")


def _unflatten(structure: Any, arrays: Sequence[Any]) -> Any:
    if structure is None:
        return arrays[0]
    kind, info = structure
    if kind == "dict":
        return dict(zip(info, arrays))
    return tuple(arrays) if kind == "tuple" else list(arrays)


def host_rows(x: Any) -> np.ndarray:
    """``x`` as a host array, refused when it is an iterator, a dataset or a mapping (rows that
    the strategy could not shard)."""
    from .surface import refusal

    if isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "__array__"):
        return np.asarray(x)
    raise TypeError(f"{refusal('fit(x=<iterator or dataset>)')} Received: {type(x).__name__}.")


def validation_rows(x: Any, y: Any, data: Any, split: float, freq: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """``(x, y, validation_data)`` after ``validation_split`` (Keras: the last rows, before any
    shuffling), every argument checked before anything runs."""
    x, y = host_rows(x), host_rows(y)
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"fit(validation_freq=) must be a positive int (validate every N epochs). Received: {freq!r}.")
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 <= split < 1:
        raise ValueError(f"fit(validation_split=) must be a fraction in [0, 1). Received: {split!r}.")
    if data is not None:
        if split:
            raise ValueError("fit() takes validation_data= or validation_split=, not both.")
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise ValueError(f"fit(validation_data=) must be (x_val, y_val). Received: {type(data).__name__}.")
        return x, y, (host_rows(data[0]), host_rows(data[1]))
    if not split:
        return x, y, None
    held = int(len(x) * split)
    if held < 1 or held >= len(x):
        raise ValueError(f"fit(validation_split={split}) of {len(x)} rows holds out {held}; it must leave rows on both sides.")
    return x[:-held], y[:-held], (x[-held:], y[-held:])
