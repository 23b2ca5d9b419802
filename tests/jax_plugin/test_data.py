"""polyparallel_jax.data: host arrays -> global batches sharded over the data axis."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import polyparallel as pp
from polyparallel_jax.data import Batch, DataError, ShardedArrays, is_host_data, shard_order


def _x(n: int) -> np.ndarray:
    # Row i holds i in every column: a row's value names its sample.
    return np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    """The single-process order of an epoch (the split itself is property-tested once, in
    tests/core/test_sharding.py)."""
    return pp.shard_indices(n, 0, 1, seed=seed, epoch=epoch)


# -- shard_order: which samples each data coordinate trains on --------------------------------


@pytest.mark.parametrize("remainder", ["pad", "drop", "uneven"])
def test_shard_order_is_the_core_computation_for_every_coordinate(remainder):
    shards = shard_order(37, 8, seed=3, epoch=1, shuffle=True, remainder=remainder)
    assert len(shards) == 8
    for d, shard in enumerate(shards):
        assert shard.dtype == np.int64
        assert shard.tolist() == pp.shard_indices(37, d, 8, seed=3, epoch=1, shuffle=True, remainder=remainder)


def test_pad_with_fewer_samples_than_the_padding_needed_still_gives_equal_shards():
    shards = shard_order(3, 8, seed=0, epoch=0, shuffle=True, remainder="pad")
    assert len(shards) == 8 and {len(s) for s in shards} == {1}
    assert set(np.concatenate(shards).tolist()) == {0, 1, 2}


def test_without_shuffle_the_order_is_the_identity():
    shards = shard_order(10, 4, seed=9, epoch=7, shuffle=False, remainder="uneven")
    assert [s.tolist() for s in shards] == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


def test_is_host_data():
    a = np.zeros(3)
    assert is_host_data(a) and is_host_data((a, a)) and is_host_data([a]) and is_host_data({"x": a})
    assert not is_host_data(()) and not is_host_data({}) and not is_host_data([1, 2, 3])
    assert not is_host_data((a, [1.0])) and not is_host_data(object())


# -- ShardedArrays: global batches ------------------------------------------------------------


def test_global_batches_are_consecutive_slices_of_the_order_and_hold_their_rows(jax_strategy):
    strategy = jax_strategy(data=8, batch_size=16, seed=4)
    sharded = strategy.shard_data(_x(64))
    assert isinstance(sharded, ShardedArrays) and len(sharded) == 4
    order = _order(64, seed=4, epoch=0)
    batches = list(sharded.batches(0))
    assert len(batches) == 4
    for i, batch in enumerate(batches):
        assert isinstance(batch, Batch) and batch.size == 16
        assert batch.data.shape == (16, 3) and batch.data.sharding.spec == P("data")
        # the rows a single device would see with the same global batch size and seed
        assert sorted(batch.indices.tolist()) == sorted(order[i * 16:(i + 1) * 16])
        np.testing.assert_array_equal(np.asarray(batch.data), _x(64)[batch.indices])
        np.testing.assert_array_equal(np.asarray(batch.mask), np.ones(16, np.float32))


def test_each_device_holds_its_data_coordinates_rows_and_tensor_replicas_match(jax_strategy):
    strategy = jax_strategy(data=4, tensor=2, batch_size=8)
    sharded = strategy.shard_data(_x(40))
    assert sharded.runtime.data_size == 4 and sharded.per_device == 2
    shards = sharded.indices(0)
    batch = next(iter(sharded.batches(0)))
    mesh = sharded.runtime.mesh
    for piece in batch.data.addressable_shards:
        coord = int(np.argwhere(mesh.devices == piece.device)[0][mesh.axis_names.index("data")])
        np.testing.assert_array_equal(np.asarray(piece.data)[:, 0], shards[coord][:2].astype(np.float32))


def test_uneven_masks_count_every_sample_exactly_once(jax_strategy):
    strategy = jax_strategy(data=8, batch_size=16)
    sharded = strategy.shard_data(_x(37), remainder="uneven", shuffle=False)
    batches = list(sharded.batches(0))
    assert len(sharded) == len(batches) == 3  # longest shard 5 rows, 2 per device per step
    assert [b.size for b in batches] == [16, 16, 8]
    real = np.concatenate([b.indices[np.asarray(b.mask) == 1] for b in batches])
    assert sorted(real.tolist()) == list(range(37))
    assert sum(float(np.asarray(b.mask).sum()) for b in batches) == 37
    assert [b.count for b in batches] == [int(np.asarray(b.mask).sum()) for b in batches]
    for b in batches:  # every row, padding included, holds the sample its index names
        np.testing.assert_array_equal(np.asarray(b.data)[:, 0], b.indices.astype(np.float32))


def test_pad_and_drop_batches(jax_strategy):
    strategy = jax_strategy(data=8, batch_size=16)
    padded = list(strategy.shard_data(_x(37), remainder="pad").batches(0))
    assert sum(b.size for b in padded) == 40 and all(float(np.asarray(b.mask).min()) == 1.0 for b in padded)
    assert set(np.concatenate([b.indices for b in padded]).tolist()) == set(range(37))
    dropped = list(strategy.shard_data(_x(37), remainder="drop").batches(0))
    seen = np.concatenate([b.indices for b in dropped])
    assert len(seen) == 32 and len(set(seen.tolist())) == 32


def test_host_arrays_shuffle_unless_told_not_to(jax_strategy):
    # No loader to inherit from: the default DataPolicy(shuffle=None) shuffles, shuffle=False keeps the order.
    strategy = jax_strategy(data=8, batch_size=16, seed=2)
    assert strategy.data_policy.shuffle is None
    shuffled = strategy.shard_data(_x(32))
    assert [s.tolist() for s in shuffled.indices(1)] == [
        pp.shard_indices(32, d, 8, seed=2, epoch=1) for d in range(8)]
    assert np.concatenate([b.indices for b in strategy.shard_data(_x(32), shuffle=False).batches(0)]).tolist() == [
        d + 8 * i for start in (0, 2) for d in range(8) for i in (start, start + 1)]


def test_epochs_reshuffle_the_batches(jax_strategy):
    sharded = jax_strategy(data=8, batch_size=16).shard_data(_x(32))
    first = [b.indices.tolist() for b in sharded.batches(0)]
    assert first == [b.indices.tolist() for b in sharded.batches(0)]
    assert first != [b.indices.tolist() for b in sharded.batches(1)]


def test_tuple_and_dict_structure_is_kept(jax_strategy):
    strategy = jax_strategy(data=8, batch_size=8)
    x, y = _x(16), np.arange(16, dtype=np.int32)
    xb, yb = next(iter(strategy.shard_data((x, y)).batches(0))).data
    np.testing.assert_array_equal(np.asarray(xb)[:, 0], np.asarray(yb).astype(np.float32))
    batch = next(iter(strategy.shard_data({"x": x, "y": y}).batches(0)))
    assert set(batch.data) == {"x", "y"}
    np.testing.assert_array_equal(np.asarray(batch.data["y"]), batch.indices)


# -- under Strategy(accumulate=N): each step as its N micro-batches --------------------------------


def test_under_accumulation_micro_batch_k_is_the_kth_slice_of_the_step_at_every_data_size(jax_strategy):
    # Global batch 32 in 4 micro-batches: micro-batch k of step i is order[32 i + 8 k : 32 i + 8 (k + 1)],
    # whatever the data size (a loader of 8 / data rows per rank gives the same in every runtime).
    order = _order(64, seed=1, epoch=0)
    for sizes in (dict(data=8), dict(data=4, tensor=2), dict(data=2, tensor=4)):
        sharded = jax_strategy(**sizes, batch_size=32, seed=1, accumulate=4).shard_data(_x(64))
        assert sharded.accumulate == 4 and sharded.micro_batch == 8 // sizes["data"] and len(sharded) == 2
        assert "accumulate=4" in repr(sharded)
        for i, batch in enumerate(sharded.batches(0)):
            assert batch.data.shape == (4, 8, 3) and batch.data.sharding.spec == P(None, "data")
            assert batch.mask.shape == batch.indices.shape == (4, 8) and batch.size == 32 and batch.count == 32
            for k in range(4):
                assert sorted(batch.indices[k].tolist()) == sorted(order[32 * i + 8 * k:32 * i + 8 * (k + 1)])
                assert batch.data[k].sharding.spec[0] == "data"  # x[k]: one micro-batch, sharded over data
            np.testing.assert_array_equal(np.asarray(batch.data)[..., 0], batch.indices.astype(np.float32))


def test_a_partial_step_fills_its_micro_batches_in_order_and_pads_the_rest(jax_strategy):
    # 40 samples, global batch 32 at data=4 x accumulate=2: the second step has 8 rows, 2 per
    # device: all in micro-batch 0 (4 rows a device), micro-batch 1 is padding only (mask 0).
    sharded = jax_strategy(data=4, tensor=2, batch_size=32, accumulate=2).shard_data(_x(40), shuffle=False)
    last = list(sharded.batches(0))[1]
    assert last.data.shape == (2, 16, 3) and last.count == 8
    mask = np.asarray(last.mask)
    assert mask[1].sum() == 0 and mask[0].reshape(4, 4).sum(axis=1).tolist() == [2, 2, 2, 2]
    assert sorted(last.indices[0][mask[0] == 1].tolist()) == list(range(32, 40))


def test_under_accumulation_the_batch_must_divide_into_micro_batches(jax_strategy):
    with pytest.raises(pp.TopologyError, match=r"global batch size 24 does not divide over data=8 ranks x "
                                               r"accumulate=2 micro-batches.*multiple of 16 \(16 or 32\)"):
        jax_strategy(data=8, batch_size=24, accumulate=2)
    runtime = jax_strategy(data=8).shard_data(_x(8), batch_size=8).runtime
    with pytest.raises(DataError, match=r"shard_data\(\): the global batch size 24 does not divide over data=8 ranks x "
                                        r"accumulate=2"):
        ShardedArrays(_x(64), runtime, pp.DataPolicy(24), 0, accumulate=2)


# -- errors before anything is compiled -------------------------------------------------------


def test_batch_size_not_divisible_by_the_data_axis(jax_strategy):
    # Refused by the core when the Strategy is built, before any data or device is touched.
    with pytest.raises(pp.TopologyError, match=r"global batch size 30 does not divide over data=8 ranks .*Use a "
                                               r"multiple of 8 \(24 or 32\)"):
        jax_strategy(data=8, batch_size=30).shard_data(_x(64))
    assert issubclass(DataError, ValueError) and issubclass(DataError, pp.PolyparallelError)


def test_missing_batch_size_unequal_lengths_and_empty_data(jax_strategy):
    strategy = jax_strategy(data=8)
    with pytest.raises(DataError, match="needs a global batch size"):
        strategy.shard_data(_x(16))
    with pytest.raises(DataError, match=r"equal length.*\[16, 15\]"):
        strategy.shard_data((_x(16), np.zeros(15)), batch_size=8)
    with pytest.raises(DataError, match="empty data set"):
        strategy.shard_data(np.zeros((0, 3)), batch_size=8)


# -- position: exact resumption -------------------------------------------------------------------


def test_a_saved_position_resumes_the_epoch_at_another_data_size(jax_strategy):
    written = jax_strategy(data=4, tensor=2, batch_size=16, seed=2).shard_data(_x(80))
    uninterrupted = [b.indices for b in written.batches(1)]
    passes = written.batches(1)
    for _ in range(2):
        next(passes)  # two batches of epoch 1 consumed, then the job stops
    state = written.state_dict()
    # global_step: the 5 batches of the uninterrupted pass above, then these 2
    assert state == {"epoch": 1, "batches": 2, "global_step": 7, "global_batch": 16, "seed": 2, "dataset_len": 80,
                     "shuffle": True, "remainder": "pad"}

    read = jax_strategy(data=8, batch_size=16, seed=2).shard_data(_x(80))
    read.load_state_dict(state)
    rest = [b.indices for b in read.batches(1)]  # the rest of epoch 1: the same rows, once each
    assert [sorted(r.tolist()) for r in rest] == [sorted(u.tolist()) for u in uninterrupted[2:]]
    assert read.state_dict()["epoch"] == 2 and read.state_dict()["global_step"] == 7 + len(rest)
    assert len(list(read.batches(1))) == len(uninterrupted)  # the resume point is used once
    assert [b.indices.tolist() for b in read.batches(1, start=3)] == [b.indices.tolist() for b in read.batches(1)][3:]


def test_a_position_of_other_samples_is_refused(jax_strategy):
    state = jax_strategy(data=8, batch_size=16, seed=2).shard_data(_x(80)).state_dict()
    with pytest.raises(pp.CheckpointError, match=r"global batch size 16, this loader has 32"):
        jax_strategy(data=8, batch_size=32, seed=2).shard_data(_x(80)).load_state_dict(state)
    with pytest.raises(pp.CheckpointError, match=r"Strategy seed 2, this loader has 3"):
        jax_strategy(data=8, batch_size=16, seed=3).shard_data(_x(80)).load_state_dict(state)
    with pytest.raises(DataError, match=r"batches\(start=\) must be an int in \[0, 5\]"):
        next(jax_strategy(data=8, batch_size=16).shard_data(_x(80)).batches(0, start=6))
