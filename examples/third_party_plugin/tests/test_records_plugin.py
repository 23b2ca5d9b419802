"""The example plugin's own tests: it can be tested with nothing but polyparallel installed."""

import pytest

import polyparallel as pp
import polyparallel_records as pr


@pytest.fixture
def manager():
    pm = pp.PluginManager(autoload=False)
    pm.register(pr, name="records")
    return pm


def test_shard_data_is_disjoint_and_complete(monkeypatch, manager):
    data = pr.Records([f"s{i}" for i in range(11)])
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        s = pp.Strategy(data=2, plugin_manager=manager)
        seen.append(s.shard_data(data, remainder="uneven"))
        s.session().close()
    assert set(seen[0].indices).isdisjoint(seen[1].indices)
    assert sorted(seen[0].indices + seen[1].indices) == list(range(11))


def _shards(monkeypatch, manager, data, data_size=2, **overrides):
    out = []
    for rank in range(data_size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(data_size))
        s = pp.Strategy(data=data_size, seed=5, plugin_manager=manager)
        out.append(s.shard_data(data, **overrides))
        s.session().close()
    return out


def test_shard_data_is_the_core_computation(monkeypatch, manager):
    data = pr.Records([f"s{i}" for i in range(11)])
    for remainder in ("pad", "drop", "uneven"):
        for rank, shard in enumerate(_shards(monkeypatch, manager, data, 3, remainder=remainder)):
            expected = pp.shard_indices(11, rank, 3, seed=5, epoch=0, shuffle=True, remainder=remainder)
            assert list(shard.indices) == expected and list(shard.items) == [f"s{i}" for i in expected]


def test_pad_gives_equal_shards_when_there_are_fewer_samples_than_ranks(monkeypatch, manager):
    shards = _shards(monkeypatch, manager, pr.Records(["a", "b", "c"]), 8, remainder="pad")
    assert [len(s) for s in shards] == [1] * 8
    assert {x for s in shards for x in s.items} == {"a", "b", "c"}


def test_every_epoch_reshuffles_and_replays(monkeypatch, manager):
    shards = _shards(monkeypatch, manager, pr.Records(range(20)))
    for rank, shard in enumerate(shards):
        epochs = [list(shard.at_epoch(e).indices) for e in range(3)]
        assert epochs[0] == list(shard.indices) and len({tuple(e) for e in epochs}) == 3
        assert epochs[2] == pp.shard_indices(20, rank, 2, seed=5, epoch=2)
        assert list(shard.at_epoch(2).at_epoch(1).indices) == epochs[1]
    assert set(shards[0].at_epoch(1).indices).isdisjoint(shards[1].at_epoch(1).indices)
    with pytest.raises(TypeError, match="at_epoch.. is for what strategy.shard_data"):
        pr.Records([1, 2]).at_epoch(1)


def test_shuffle_defaults_to_on_and_can_be_turned_off(monkeypatch, manager):
    # A Records is no loader, so DataPolicy(shuffle=None) shuffles it.
    shuffled, = _shards(monkeypatch, manager, pr.Records(range(10)), 1)
    assert list(shuffled.indices) == pp.shard_indices(10, 0, 1, seed=5) != list(range(10))
    kept, = _shards(monkeypatch, manager, pr.Records(range(10)), 1, shuffle=False)
    assert list(kept.indices) == list(range(10)) == list(kept.at_epoch(3).indices)


def test_adapter_refuses_tensor_parallel(manager):
    with pytest.raises(pp.UnsupportedTopologyError, match="tensor=2"):
        pp.Strategy(data=2, tensor=2, plugin_manager=manager).adapt("records")


def test_adapter_batches(manager):
    loop = pp.Strategy(data=1, plugin_manager=manager).adapt("records", batch_size=5)
    batches = list(loop.batches(pr.Records(range(12))))
    assert [len(b) for b in batches] == [5, 5, 2]
    assert [x for b in batches for x in b] == pp.shard_indices(12, 0, 1, seed=0, epoch=0)
    second = [x for b in loop.batches(pr.Records(range(12)), epoch=1) for x in b]
    assert second == pp.shard_indices(12, 0, 1, seed=0, epoch=1)
