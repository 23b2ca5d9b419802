"""``polyparallel/_sharding.py``: the one sharding computation, property-tested once.

Every runtime (torch's sampler, JAX's global batches, the example third-party plugin) calls
``shard_indices``; their own tests check that they do, not the split again."""

from __future__ import annotations

import doctest
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyparallel as pp
from polyparallel import _sharding
from polyparallel._sharding import shard_indices, shard_length

SPLITS = dict(length=st.integers(0, 80), data_size=st.integers(1, 9), seed=st.integers(-5, 5),
              epoch=st.integers(0, 4), shuffle=st.booleans())


def _all(length, data_size, **kw):
    return [shard_indices(length, r, data_size, **kw) for r in range(data_size)]


@settings(max_examples=150, deadline=None)
@given(**SPLITS)
def test_uneven_shards_partition_the_range(length, data_size, seed, epoch, shuffle):
    shards = _all(length, data_size, seed=seed, epoch=epoch, shuffle=shuffle, remainder="uneven")
    assert sorted(i for s in shards for i in s) == list(range(length))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@settings(max_examples=150, deadline=None)
@given(**SPLITS)
def test_drop_shards_are_equal_disjoint_and_drop_only_the_tail(length, data_size, seed, epoch, shuffle):
    shards = _all(length, data_size, seed=seed, epoch=epoch, shuffle=shuffle, remainder="drop")
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == length - length % data_size
    assert len({len(s) for s in shards}) == 1
    order = shard_indices(length, 0, 1, seed=seed, epoch=epoch, shuffle=shuffle)
    assert set(flat) == set(order[:len(flat)])


@settings(max_examples=150, deadline=None)
@given(**SPLITS)
def test_pad_shards_are_equal_and_cover_everything(length, data_size, seed, epoch, shuffle):
    # including length < data_size (every rank still gets one sample) and length 0 (no rank gets any)
    shards = _all(length, data_size, seed=seed, epoch=epoch, shuffle=shuffle, remainder="pad")
    assert {len(s) for s in shards} == {-(-length // data_size)}
    assert set(i for s in shards for i in s) == set(range(length))
    # the padding repeats the order from its start: no sample is used twice before all are used once
    counts = [sum(s.count(i) for s in shards) for i in range(length)]
    assert not counts or max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(remainder=st.sampled_from(["pad", "drop", "uneven"]), **SPLITS)
def test_lengths_match_and_shards_are_strided_slices_of_one_order(length, data_size, seed, epoch, shuffle, remainder):
    order = shard_indices(length, 0, 1, seed=seed, epoch=epoch, shuffle=shuffle)
    assert sorted(order) == list(range(length))
    for rank, shard in enumerate(_all(length, data_size, seed=seed, epoch=epoch, shuffle=shuffle, remainder=remainder)):
        assert len(shard) == shard_length(length, rank, data_size, remainder)
        # the real samples of a shard are the strided slice of the single-process order
        assert shard[:len(order[rank::data_size])] == order[rank::data_size][:len(shard)]


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 60), data_size=st.integers(1, 6), seed=st.integers(0, 9), epoch=st.integers(0, 4),
       remainder=st.sampled_from(["pad", "drop", "uneven"]))
def test_replicas_agree_and_the_result_is_deterministic(length, data_size, seed, epoch, remainder):
    # A tensor/pipeline replica passes the same data_rank: it must get the same list, whenever it asks.
    for rank in range(data_size):
        first = shard_indices(length, rank, data_size, seed=seed, epoch=epoch, remainder=remainder)
        _sharding._permutation.cache_clear()  # computed afresh, not served from the cache
        assert shard_indices(length, rank, data_size, seed=seed, epoch=epoch, remainder=remainder) == first


def test_the_order_is_the_same_in_another_process():
    code = "import polyparallel as pp; print(pp.shard_indices(50, 1, 3, seed=11, epoch=2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(shard_indices(50, 1, 3, seed=11, epoch=2))


def test_epochs_and_seeds_reshuffle():
    orders = {tuple(shard_indices(100, 0, 1, seed=s, epoch=e)) for s in (-1, 0, 1) for e in range(4)}
    assert len(orders) == 12  # no two (seed, epoch) pairs share an order, negative seeds included
    assert sorted(orders.pop()) == list(range(100))


def test_without_shuffle_the_order_is_kept():
    assert _all(10, 4, seed=9, epoch=7, shuffle=False, remainder="uneven") == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert _all(10, 4, shuffle=False, remainder="pad") == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert _all(10, 4, shuffle=False, remainder="drop") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _all(2, 5, shuffle=False, remainder="pad") == [[0], [1], [0], [1], [0]]


def test_the_permutation_is_uniform_enough():
    # Every sample lands in every position about equally often over many epochs (a biased draw,
    # e.g. the classic naive shuffle, fails this by far more than the tolerance).
    n, epochs = 5, 4000
    counts = [[0] * n for _ in range(n)]
    for epoch in range(epochs):
        for position, sample in enumerate(shard_indices(n, 0, 1, seed=0, epoch=epoch)):
            counts[position][sample] += 1
    expected = epochs / n
    assert all(abs(c - expected) < 0.15 * expected for row in counts for c in row), counts


def test_it_does_not_touch_the_global_random_state():
    random.seed(123)
    before = random.random()
    random.seed(123)
    shard_indices(100, 0, 2, seed=4, epoch=1)
    assert random.random() == before


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((-1, 0, 2), {}, r"length must be an int >= 0\. Received: -1\."),
    ((10.0, 0, 2), {}, r"length must be an int >= 0\. Received: 10\.0\."),
    ((10, 0, 0), {}, r"data_size must be an int >= 1\. Received: 0\."),
    ((10, 2, 2), {}, r"data_rank must be in \[0, data_size=2\)\. Received: data_rank=2\."),
    ((10, -1, 2), {}, r"data_rank must be an int >= 0\. Received: -1\."),
    ((10, 0, 2), {"remainder": "wrap"}, r"remainder must be one of 'pad', 'drop', 'uneven'\. Received: 'wrap'\."),
    ((10, 0, 2), {"seed": "1"}, r"seed must be an int\. Received: '1'\."),
    ((10, 0, 2), {"epoch": -1}, r"epoch must be an int >= 0\. Received: -1\."),
    ((10, 0, 2), {"shuffle": None}, r"shuffle must be True or False\. Received: None.*DataPolicy\.shuffles\(\)"),
])
def test_bad_arguments_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        shard_indices(*args, **kwargs)


def test_shard_length_refuses_what_shard_indices_refuses():
    with pytest.raises(ValueError, match=r"data_rank must be in \[0, data_size=3\)"):
        shard_length(10, 3, 3)


def test_exported_and_documented():
    assert pp.shard_indices is shard_indices and pp.shard_length is shard_length
    assert {"shard_indices", "shard_length"} <= set(pp.__all__)
    result = doctest.testmod(_sharding, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_micro_batch_size_divides_the_global_batch_over_data_and_accumulation():
    assert pp.micro_batch_size(64, 2) == 32 and pp.micro_batch_size(64, 2, 2) == 16 and pp.micro_batch_size(8, 8) == 1
    with pytest.raises(ValueError, match=r"the global batch size 60 does not divide over data=4 ranks x accumulate=2 "
                                         r"micro-batches; use a multiple of 8 \(56 or 64\)"):
        pp.micro_batch_size(60, 4, 2)
    with pytest.raises(ValueError, match=r"accumulate=\) must be a positive int"):
        pp.micro_batch_size(8, 2, 0)
