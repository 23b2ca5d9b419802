"""shard_data for torch: the sampler's contract, loader rebuilding, and bad inputs.

Sharding needs no collective, so these run in one process with RANK/WORLD_SIZE set."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import polyparallel as pp
from polyparallel_torch.data import TopologySampler


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), data=st.integers(1, 5), seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_uneven_shards_partition_the_dataset(n, data, seed, epoch):
    shards = [TopologySampler(n, r, data, seed=seed, remainder="uneven").indices(epoch) for r in range(data)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), data=st.integers(1, 5))
def test_pad_gives_equal_shards_covering_everything(n, data):
    shards = [TopologySampler(n, r, data, remainder="pad").indices(0) for r in range(data)]
    assert len({len(s) for s in shards}) == 1
    assert set(i for s in shards for i in s) == set(range(n))
    assert all(len(s) == len(TopologySampler(n, r, data, remainder="pad")) for r, s in enumerate(shards))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), data=st.integers(1, 5))
def test_drop_gives_equal_disjoint_shards(n, data):
    shards = [TopologySampler(n, r, data, remainder="drop").indices(0) for r in range(data)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == n - n % data
    assert len({len(s) for s in shards}) == 1


def test_shuffle_is_deterministic_and_epoch_advances_by_itself():
    s = TopologySampler(20, 0, 2, seed=3)
    first, second = list(s), list(s)  # two iterations: epochs 0 and 1
    assert first == TopologySampler(20, 0, 2, seed=3).indices(0)
    assert second == TopologySampler(20, 0, 2, seed=3).indices(1)
    assert first != second
    s.set_epoch(0)
    assert list(s) == first
    assert TopologySampler(20, 0, 2, seed=3, shuffle=False).indices(5) == list(range(0, 20, 2))


def _loader_for(rank, world, monkeypatch, data, **overrides):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    strategy = pp.Strategy(data=2, tensor=world // 2, seed=1)
    loader = strategy.shard_data(data, **overrides)
    strategy.session().close()
    return loader


def test_replicas_share_batches_and_data_ranks_differ(monkeypatch):
    ds = TensorDataset(torch.arange(23))
    got = {r: [b[0].tolist() for b in _loader_for(r, 4, monkeypatch, ds, batch_size=6)] for r in range(4)}
    # data x tensor = 2 x 2: ranks 0,1 are data coordinate 0; ranks 2,3 are data coordinate 1
    assert got[0] == got[1] and got[2] == got[3]
    assert len(set(sum(got[0], [])) | set(sum(got[2], []))) == 23  # padded to 24: every sample seen
    assert all(len(b) == 3 for b in got[0][:-1])  # global batch 6 over data=2


def test_dataloader_is_rebuilt_with_its_settings(monkeypatch):
    ds = TensorDataset(torch.arange(10).float())
    collate = lambda items: torch.stack([i[0] for i in items]) * 10  # noqa: E731
    loader = DataLoader(ds, batch_size=2, collate_fn=collate)
    sharded = _loader_for(1, 2, monkeypatch, loader, shuffle=False)
    assert isinstance(sharded.sampler, TopologySampler)
    assert [b.tolist() for b in sharded] == [[10.0, 30.0], [50.0, 70.0], [90.0]]


def test_bad_inputs_are_refused_before_any_collective(monkeypatch):
    ds = TensorDataset(torch.arange(10))
    with pytest.raises(pp.TopologyError, match="global batch size 5 does not divide over data=2"):
        _loader_for(0, 2, monkeypatch, ds, batch_size=5)
    with pytest.raises(pp.TopologyError, match="needs the global batch size"):
        _loader_for(0, 2, monkeypatch, ds)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(pp.PluginError, match="IterableDataset"):
        _loader_for(0, 2, monkeypatch, DataLoader(Stream(), batch_size=1))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(pp.NoPluginError, match=r"No polyparallel plugin handles shard_data .*builtins\.set"):
        pp.Strategy(data=1).shard_data({1, 2, 3})
    with pytest.raises(ValueError, match="remainder"):
        pp.Strategy(data=1, batch_size=2).shard_data(ds, remainder="wrap")
