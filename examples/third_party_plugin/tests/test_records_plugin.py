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


def test_adapter_refuses_tensor_parallel(manager):
    with pytest.raises(pp.UnsupportedTopologyError, match="tensor=2"):
        pp.Strategy(data=2, tensor=2, plugin_manager=manager).adapt("records")


def test_adapter_batches(manager):
    loop = pp.Strategy(data=1, plugin_manager=manager).adapt("records", batch_size=5)
    batches = list(loop.batches(pr.Records(range(12))))
    assert [len(b) for b in batches] == [5, 5, 2]
    assert sorted(x for b in batches for x in b) == list(range(12))
