"""shard_data for torch: the sampler's contract, loader rebuilding, and bad inputs.

Sharding needs no collective, so these run in one process with RANK/WORLD_SIZE set."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import polyparallel as pp
from polyparallel_torch.data import TopologySampler


@pytest.mark.parametrize("remainder", ["pad", "drop", "uneven"])
def test_the_sampler_yields_the_core_shard_of_each_epoch(remainder):
    # The split itself is property-tested once, in tests/core/test_sharding.py.
    for rank in range(3):
        s = TopologySampler(23, rank, 3, seed=7, remainder=remainder)
        for epoch in range(2):
            s.set_epoch(epoch)
            expected = pp.shard_indices(23, rank, 3, seed=7, epoch=epoch, shuffle=True, remainder=remainder)
            assert list(s) == expected and len(s) == len(expected)
    assert list(TopologySampler(20, 0, 2, seed=3, shuffle=False)) == list(range(0, 20, 2))


def test_bad_sampler_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"data_rank must be in \[0, data_size=2\)\. Received: data_rank=2"):
        TopologySampler(10, 2, 2)
    with pytest.raises(ValueError, match="remainder must be one of"):
        TopologySampler(10, 0, 2, remainder="wrap")
    with pytest.raises(ValueError, match=r"set_epoch\(\) takes an int >= 0\. Received: -1"):
        TopologySampler(10, 0, 2).set_epoch(-1)


def test_the_epoch_advances_only_after_a_full_pass():
    s = TopologySampler(20, 0, 2, seed=3)
    peeked = next(iter(s))  # a peek ...
    partial = iter(s)
    started = [next(partial) for _ in range(4)]  # ... and an abandoned pass
    assert s.epoch == 0  # leave the epoch alone
    epoch = lambda e: pp.shard_indices(20, 0, 2, seed=3, epoch=e)  # noqa: E731
    assert [peeked] + started == epoch(0)[:1] + epoch(0)[:4]
    assert list(s) == epoch(0) and s.epoch == 1  # a full pass moves it on
    assert list(s) == epoch(1) and s.epoch == 2
    assert epoch(0) != epoch(1)


def test_set_epoch_pins_the_epoch():
    s = TopologySampler(20, 1, 2, seed=3)
    s.set_epoch(5)
    assert list(s) == list(s) == pp.shard_indices(20, 1, 2, seed=3, epoch=5)
    assert s.epoch == 5 and s.pinned


def test_a_peek_at_the_loader_does_not_move_the_epoch(monkeypatch):
    ds = TensorDataset(torch.arange(12))
    peeked = _loader_for(0, 2, monkeypatch, ds, batch_size=4)
    replica = _loader_for(0, 2, monkeypatch, ds, batch_size=4)  # the same data coordinate, not peeked at
    next(iter(peeked))  # what a logger does to show one batch
    orders = [pp.shard_indices(12, 0, 2, seed=1, epoch=e) for e in range(3)]
    for order in orders:  # a plain epoch loop: each pass is the next epoch, the peek not counted
        got = [i for (b,) in peeked for i in b.tolist()]
        assert got == [i for (b,) in replica for i in b.tolist()]
        assert got == order
    assert len({tuple(o) for o in orders}) == 3


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


def test_worker_options_are_kept(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    init = lambda worker: None  # noqa: E731
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, num_workers=2, prefetch_factor=3,
                        persistent_workers=True, drop_last=True, timeout=7.0, worker_init_fn=init,
                        generator=generator, multiprocessing_context="spawn", in_order=False)
    sharded = _loader_for(0, 2, monkeypatch, loader)
    for name in ("num_workers", "prefetch_factor", "persistent_workers", "drop_last", "timeout", "worker_init_fn",
                 "generator", "in_order", "collate_fn", "pin_memory"):
        assert getattr(sharded, name) == getattr(loader, name), name
    assert sharded.multiprocessing_context is loader.multiprocessing_context


def _flat(loader):
    return [i for (b,) in loader for i in b.tolist()]


def test_the_loader_keeps_its_shuffle_choice_unless_the_policy_sets_one(monkeypatch):
    ds = TensorDataset(torch.arange(20))
    in_order = list(range(1, 20, 2))  # data rank 1 of 2, no shuffling
    shuffled = pp.shard_indices(20, 1, 2, seed=1, epoch=0, shuffle=True)
    assert _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4, shuffle=False))) == in_order
    assert _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4))) == in_order
    assert _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4, shuffle=True))) == shuffled
    # a RandomSampler written out, with the length of the data set: the same as shuffle=True
    explicit = DataLoader(ds, batch_size=4, sampler=torch.utils.data.RandomSampler(ds, num_samples=20))
    assert _flat(_loader_for(1, 2, monkeypatch, explicit)) == shuffled
    # the policy (or the call) wins when it says so
    assert _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4), shuffle=True)) == shuffled
    assert _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4, shuffle=True), shuffle=False)) == in_order
    # a Dataset has no choice of its own: shuffled unless told otherwise
    assert _flat(_loader_for(1, 2, monkeypatch, ds, batch_size=8)) == shuffled
    assert _flat(_loader_for(1, 2, monkeypatch, ds, batch_size=8, shuffle=False)) == in_order


def test_a_distributed_sampler_keeps_its_shuffle_choice(monkeypatch):
    # A loader written for DDP (what Lightning injects too) is re-sharded over the data axis only.
    ds = TensorDataset(torch.arange(20))
    for shuffle in (True, False):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=4, rank=3, shuffle=shuffle)
        got = _flat(_loader_for(1, 2, monkeypatch, DataLoader(ds, batch_size=4, sampler=sampler)))
        assert got == pp.shard_indices(20, 1, 2, seed=1, epoch=0, shuffle=shuffle)


class _EvenOnly(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


@pytest.mark.parametrize(("make", "name"), [
    (lambda ds: dict(sampler=torch.utils.data.WeightedRandomSampler([1.0] * 19 + [50.0], 20)), "WeightedRandomSampler"),
    (lambda ds: dict(sampler=torch.utils.data.RandomSampler(ds, replacement=True)),
     r"RandomSampler\(replacement=True, num_samples=20\)"),
    (lambda ds: dict(sampler=torch.utils.data.RandomSampler(ds, num_samples=5)),
     r"RandomSampler\(replacement=False, num_samples=5\)"),
    (lambda ds: dict(sampler=torch.utils.data.SubsetRandomSampler(range(5))), "SubsetRandomSampler"),
    (lambda ds: dict(sampler=_EvenOnly(20)), "_EvenOnly"),
])
def test_a_sampler_whose_meaning_would_be_lost_is_refused(monkeypatch, make, name):
    ds = TensorDataset(torch.arange(20))
    loader = DataLoader(ds, batch_size=4, **make(ds))
    for overrides in ({}, {"shuffle": True}):  # an explicit shuffle does not make the loss of weights right
        with pytest.raises(pp.PluginError, match=f"cannot keep the meaning of this DataLoader's sampler {name}.*"
                                                 r"shuffle=True or shuffle=False.*polyparallel\.shard_indices"):
            _loader_for(0, 2, monkeypatch, loader, **overrides)


def test_a_custom_batch_sampler_is_refused(monkeypatch):
    ds = TensorDataset(torch.arange(20))
    batches = torch.utils.data.BatchSampler(_EvenOnly(20), batch_size=3, drop_last=False)
    with pytest.raises(pp.PluginError, match=r"custom batch_sampler \(BatchSampler\).*global batch_size"):
        _loader_for(0, 2, monkeypatch, DataLoader(ds, batch_sampler=batches))


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


def _peek_worker():
    s = pp.Strategy(data=2, tensor=2, batch_size=6, seed=2, timeout=30)
    ds = TensorDataset(torch.arange(23))
    loader = s.shard_data(ds)
    pinned = s.shard_data(ds)
    if s.rank == 0:
        next(iter(loader))  # a logger on rank 0 shows one batch; its tensor replica (rank 1) does not
        next(iter(pinned))
    epochs, pinned_epochs = [], []
    for epoch in range(3):
        epochs.append([b.tolist() for (b,) in loader])
        pinned.sampler.set_epoch(epoch)  # what Lightning and Ignite do
        pinned_epochs.append([b.tolist() for (b,) in pinned])
    return {"rank": s.rank, "data": s.session().coords["data"], "epochs": epochs, "pinned": pinned_epochs}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replicas_get_the_same_batches_after_one_rank_peeked(run):
    results = run(_peek_worker, pp.Strategy(data=2, tensor=2), 4, timeout=240)
    assert [r["data"] for r in results] == [0, 0, 1, 1]
    assert results[0]["epochs"] == results[1]["epochs"] and results[2]["epochs"] == results[3]["epochs"]
    for r in results:
        for epoch, batches in enumerate(r["epochs"]):
            expected = pp.shard_indices(23, r["data"], 2, seed=2, epoch=epoch)
            assert [i for b in batches for i in b] == expected, (r["rank"], epoch)
            assert [len(b) for b in batches] == [3, 3, 3, 3]  # 23 padded to 24: 12 per data rank
        assert r["pinned"] == r["epochs"]
    assert len({str(e) for e in results[0]["epochs"]}) == 3  # every epoch reshuffles
