"""The one sharding computation every plugin uses: which samples a data rank gets in an epoch.

Standard library only, so every runtime (torch, JAX, a third party's) shards the same way and a
single-process reference can recompute any rank's shard.
"""

from __future__ import annotations

import functools
import hashlib
import random

from ._policies import REMAINDERS

__all__ = ["micro_batch_size", "shard_indices", "shard_length"]

def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}. Received: {value!r}.")
    return value


def _check_split(length: int, data_rank: int, data_size: int, remainder: str) -> None:
    _check_int("length", length, 0)
    _check_int("data_size", data_size, 1)
    _check_int("data_rank", data_rank, 0)
    if data_rank >= data_size:
        raise ValueError(f"data_rank must be in [0, data_size={data_size}). Received: data_rank={data_rank}.")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {', '.join(map(repr, REMAINDERS))}. Received: {remainder!r}.")


def _rng(seed: int, epoch: int) -> random.Random:
    # A hash mixes (seed, epoch) so that no two pairs share a stream (seed + epoch would make
    # (0, 1) and (1, 0) equal, and random.Random(int) ignores the sign). random.Random seeded
    # with an int is Mersenne Twister with a seeding Python keeps stable across versions.
    digest = hashlib.sha256(f"polyparallel.shard:{seed}:{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


@functools.lru_cache(maxsize=4)
def _permutation(length: int, seed: int, epoch: int) -> tuple[int, ...]:
    # Cached: a runtime holding every data coordinate of one process (JAX) asks for each rank's
    # shard of the same epoch in turn, and the shuffle is the costly part.
    rng = _rng(seed, epoch)
    order = list(range(length))
    # Fisher-Yates written out, with uniform draws by rejection on getrandbits: random.shuffle's
    # algorithm is not promised to stay the same across Python versions; this one is fixed here.
    for i in range(length - 1, 0, -1):
        bits = i.bit_length()
        j = rng.getrandbits(bits)
        while j > i:
            j = rng.getrandbits(bits)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def shard_indices(length: int, data_rank: int, data_size: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, remainder: str = "pad") -> list[int]:
    """The indices of ``length`` samples that data coordinate ``data_rank`` of ``data_size`` gets
    in ``epoch``: the strided slice ``order[data_rank::data_size]`` of the epoch's order.

    The order is ``range(length)`` when ``shuffle`` is false, else a permutation determined by
    ``(seed, epoch)`` alone: a Fisher-Yates shuffle driven by ``random.Random`` (Mersenne
    Twister) seeded with the first 16 bytes of ``sha256(f"polyparallel.shard:{seed}:{epoch}")``,
    the same on every machine, process and framework (the shuffle is written out here rather than
    left to ``random.shuffle``, whose algorithm Python does not promise to keep). So a single process with
    the same seed sees global batch ``i`` of size ``B`` as ``order[i*B:(i+1)*B]`` where ``order =
    shard_indices(length, 0, 1, seed=seed, epoch=epoch)``, and each data coordinate holds the
    strided slice of it.

    Ranks that share a data coordinate (tensor/pipeline replicas) pass the same ``data_rank`` and
    get the same list; different coordinates get disjoint ones (``pad`` aside).

    :param remainder: when ``length`` does not divide by ``data_size``: ``"pad"`` repeats the order
        from its start (cyclically, also when ``length < data_size``) so every shard has
        ``ceil(length / data_size)`` samples and every sample is used (training; what
        ``DistributedSampler`` does); ``"drop"`` drops the last ``length % data_size`` samples of
        the order, so shards are equal and disjoint; ``"uneven"`` gives every sample to exactly one
        shard, lengths differing by at most one (evaluation).

    >>> shard_indices(5, 1, 2, shuffle=False, remainder="pad")
    [1, 3, 0]
    >>> shard_indices(5, 1, 2, shuffle=False, remainder="uneven")
    [1, 3]
    >>> shard_indices(5, 0, 2, seed=3, epoch=1) == shard_indices(5, 0, 2, seed=3, epoch=1)
    True
    """
    _check_split(length, data_rank, data_size, remainder)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int. Received: {seed!r}.")
    _check_int("epoch", epoch, 0)
    if not isinstance(shuffle, bool):
        raise ValueError(f"shuffle must be True or False. Received: {shuffle!r} (resolve a DataPolicy's "
                         "shuffle=None with DataPolicy.shuffles() first).")
    order = list(_permutation(length, seed, epoch)) if shuffle else list(range(length))
    tail = length % data_size
    if remainder == "drop" and tail:
        del order[length - tail:]
    elif remainder == "pad" and tail:
        pad = data_size - tail
        order += (order * -(-pad // length))[:pad]
    return order[data_rank::data_size]


def micro_batch_size(global_batch: int, data_size: int, accumulate: int = 1) -> int:
    """The batch one data rank takes per micro-step: ``global_batch / (data_size x accumulate)``
    (a global batch of 64 at data=2 with accumulate=2 is 16 samples per rank and micro-step).
    Every plugin uses it, so the global batch means the same in every framework.

    >>> micro_batch_size(64, 2), micro_batch_size(64, 2, accumulate=2)
    (32, 16)

    :raises ValueError: the global batch does not divide (the message names the nearest ones).
    """
    for name, value in (("global_batch", global_batch), ("data_size", data_size), ("accumulate", accumulate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"micro_batch_size({name}=) must be a positive int. Received: {value!r}.")
    parts = data_size * accumulate
    if global_batch % parts:
        lower, upper = global_batch // parts * parts, (global_batch // parts + 1) * parts
        over = f"data={data_size} ranks" + (f" x accumulate={accumulate} micro-batches" if accumulate > 1 else "")
        raise ValueError(f"the global batch size {global_batch} does not divide over {over}; use a multiple of "
                         f"{parts} ({' or '.join(str(b) for b in (lower, upper) if b)}).")
    return global_batch // parts


def shard_length(length: int, data_rank: int, data_size: int, remainder: str = "pad") -> int:
    """``len(shard_indices(length, data_rank, data_size, remainder=remainder, ...))`` without
    computing the order (it does not depend on the seed, the epoch or shuffling).

    >>> [shard_length(5, r, 2, "uneven") for r in range(2)], shard_length(5, 1, 2, "pad")
    ([3, 2], 3)
    """
    _check_split(length, data_rank, data_size, remainder)
    if remainder == "pad":
        return -(-length // data_size)
    if remainder == "drop":
        return length // data_size
    return len(range(data_rank, length, data_size))
