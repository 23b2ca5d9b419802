"""shard_data for torch: the sampler's contract, loader rebuilding, and bad inputs.

Sharding needs no collective, so these run in one process with RANK/WORLD_SIZE set."""

import time

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


def test_each_pass_is_the_next_epoch_until_pinned():
    s = TopologySampler(20, 0, 2, seed=3)
    epoch = lambda e: pp.shard_indices(20, 0, 2, seed=3, epoch=e)  # noqa: E731
    partial = iter(s)
    started = [next(partial) for _ in range(4)]  # a pass broken off after 4 steps (steps per epoch) ...
    assert started == epoch(0)[:4] and s.epoch == 1
    assert list(s) == epoch(1) and s.epoch == 2  # ... still makes the next pass reshuffle
    assert list(s) == epoch(2)
    assert len({tuple(epoch(e)) for e in range(3)}) == 3


def test_set_epoch_pins_the_epoch():
    s = TopologySampler(20, 1, 2, seed=3)
    s.set_epoch(5)
    assert list(s) == list(s) == pp.shard_indices(20, 1, 2, seed=3, epoch=5)
    assert s.epoch == 5 and s.pinned


def test_a_peek_at_a_pinned_loader_does_not_move_the_epoch(monkeypatch):
    ds = TensorDataset(torch.arange(12))
    peeked = _loader_for(0, 2, monkeypatch, ds, batch_size=4)
    replica = _loader_for(0, 2, monkeypatch, ds, batch_size=4)  # the same data coordinate, not peeked at
    orders = [pp.shard_indices(12, 0, 2, seed=1, epoch=e) for e in range(3)]
    for e, order in enumerate(orders):  # an epoch loop that pins each epoch, as Lightning and Ignite do
        peeked.sampler.set_epoch(e)
        replica.sampler.set_epoch(e)
        next(iter(peeked))  # what a logger does to show one batch
        got = [i for (b,) in peeked for i in b.tolist()]
        assert got == [i for (b,) in replica for i in b.tolist()]
        assert got == order
    assert len({tuple(o) for o in orders}) == 3


def test_the_pass_check_stays_behind_when_the_sampler_is_pickled():
    import pickle

    s = TopologySampler(10, 0, 2, agree=lambda epoch: None)
    assert pickle.loads(pickle.dumps(s))._agree is None


def _loader_for(rank, world, monkeypatch, data, **overrides):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    strategy = pp.Strategy(data=2, tensor=world // 2, seed=1)
    loader = strategy.shard_data(data, **overrides)
    strategy.session().close()
    # One rank of a world that is not running: its epoch is pinned, so its passes need no check
    # with the peers (the unpinned path is tested on real processes below).
    loader.sampler.set_epoch(0)
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
    s = pp.Strategy(data=2, tensor=2, batch_size=6, seed=2, timeout=12)
    ds = TensorDataset(torch.arange(23))
    pinned = s.shard_data(ds)
    out: dict = {"rank": s.rank, "data": s.session().coords["data"], "pinned": []}
    for epoch in range(3):
        pinned.sampler.set_epoch(epoch)  # what Lightning and Ignite do
        if s.rank == 0:
            next(iter(pinned))  # a logger on rank 0 shows one batch; its tensor replica (rank 1) does not
        out["pinned"].append([b.tolist() for (b,) in pinned])
        s.reduce_metrics({"passes": 1.0})  # the training step's collectives
    # Unpinned, each pass is the next epoch: a peek on rank 0 would move it one epoch ahead of its
    # replica. Every pass is checked over all ranks, so the ranks fail naming shard_data.
    loader = s.shard_data(ds)
    start = time.monotonic()
    try:
        if s.rank == 0:
            next(iter(loader))
        for _ in range(2):
            [b.tolist() for (b,) in loader]
            s.reduce_metrics({"passes": 1.0})
        out["unpinned"] = "no error"
    except pp.PolyparallelError as exc:
        out["unpinned"] = f"{type(exc).__name__}: {exc}"
    out["elapsed"] = time.monotonic() - start
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replicas_never_train_on_different_batches_after_one_rank_peeked(run):
    results = run(_peek_worker, pp.Strategy(data=2, tensor=2), 4, timeout=240)
    assert [r["data"] for r in results] == [0, 0, 1, 1]
    assert results[0]["pinned"] == results[1]["pinned"] and results[2]["pinned"] == results[3]["pinned"]
    for r in results:
        for epoch, batches in enumerate(r["pinned"]):
            expected = pp.shard_indices(23, r["data"], 2, seed=2, epoch=epoch)
            assert [i for b in batches for i in b] == expected, (r["rank"], epoch)
            assert [len(b) for b in batches] == [3, 3, 3, 3]  # 23 padded to 24: 12 per data rank
    assert len({str(e) for e in results[0]["pinned"]}) == 3  # every epoch reshuffles
    # The unpinned peek: no rank trains on; rank 0 is told which operation it waits in.
    assert all(r["unpinned"].startswith(("CollectiveTimeout", "CollectiveError")) for r in results), results
    assert "shard_data pass" in results[0]["unpinned"] and "set_epoch" in results[0]["unpinned"], results[0]
    assert all(r["elapsed"] < 60 for r in results)


# -- the loader's position (ShardedLoader.state_dict / load_state_dict) ------------------------------------
def _loaders(length: int, data: int, global_batch: int, **kw) -> list:
    """The loaders of every data coordinate of a data=`data` run, in one process."""
    from polyparallel_torch.data import ShardedLoader

    dataset = TensorDataset(torch.arange(length))
    return [ShardedLoader(dataset, batch_size=global_batch // data,
                          sampler=TopologySampler(length, d, data, seed=5, **kw)) for d in range(data)]


def _global_batches(loaders, steps=None) -> list[list[int]]:
    """Each step's global batch (the union over data coordinates, sorted)."""
    iterators = [iter(loader) for loader in loaders]
    out = []
    for step, parts in enumerate(zip(*iterators)):
        out.append(sorted(int(i) for (batch,) in parts for i in batch))
        if steps is not None and step + 1 == steps:
            break
    return out


def test_step_s_consumes_the_same_global_positions_at_every_data_size():
    # The property exact resumption relies on: data coordinate d takes order[d::D], so step s of a
    # per-rank batch B/D holds order[s*B:(s+1)*B] whatever D is.
    order = pp.shard_indices(48, 0, 1, seed=5, epoch=0)
    for data in (1, 2, 4):
        assert _global_batches(_loaders(48, data, 8)) == [sorted(order[s * 8:(s + 1) * 8]) for s in range(6)]


@pytest.mark.parametrize("resume_data", [2, 4, 1])
def test_a_loader_resumed_mid_epoch_continues_the_global_order_at_any_data_size(resume_data):
    uninterrupted = _loaders(48, 2, 8)
    full = _global_batches(uninterrupted) + _global_batches(uninterrupted)  # epochs 0 and 1
    first = _loaders(48, 2, 8)
    seen = _global_batches(first, steps=2)
    states = [loader.state_dict() for loader in first]
    assert all(s == states[0] for s in states) and states[0]["epoch"] == 0 and states[0]["batches"] == 2
    assert states[0]["global_batch"] == 8 and states[0]["dataset_len"] == 48 and states[0]["global_step"] == 2
    resumed = _loaders(48, resume_data, 8)
    for loader in resumed:
        loader.load_state_dict(states[0])
        assert len(loader) == 4  # the rest of epoch 0
    rest = _global_batches(resumed)
    assert resumed[0].state_dict()["epoch"] == 1 and resumed[0].state_dict()["batches"] == 0
    assert seen + rest + _global_batches(resumed) == full  # the rest of epoch 0, then epoch 1 whole
    assert resumed[0].global_step == 12


def test_the_position_follows_the_last_pass_started_and_pinned_epochs():
    (loader,) = _loaders(20, 1, 4)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["batches"] == 0
    list(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (1, 0)
    loader.sampler.set_epoch(3)  # pinned (what Lightning and Ignite call)
    it = iter(loader)
    next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (3, 1)
    list(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (4, 0)  # complete: the next epoch
    assert loader.state_dict()["pinned"] is True


def test_a_loader_with_another_global_batch_or_data_is_refused():
    (saved,) = _loaders(48, 1, 8)
    state = saved.state_dict()
    with pytest.raises(pp.CheckpointError, match=r"global batch size 8, this loader has 12"):
        _loaders(48, 2, 12)[0].load_state_dict(state)
    with pytest.raises(pp.CheckpointError, match=r"data set length 48, this loader has 40"):
        _loaders(40, 2, 8)[0].load_state_dict(state)


def test_shard_data_returns_a_loader_that_counts_what_it_yields(monkeypatch):
    from polyparallel_torch.data import ShardedLoader

    # With workers the sampler runs ahead (prefetching); the position counts yielded batches.
    loader = pp.Strategy(data=1, batch_size=4).shard_data(
        DataLoader(TensorDataset(torch.arange(40)), shuffle=True, num_workers=1, prefetch_factor=4))
    assert isinstance(loader, ShardedLoader)
    it = iter(loader)
    next(it)
    time.sleep(0.2)  # let the worker prefetch
    assert loader.state_dict()["batches"] == 1


def test_a_peek_at_a_resumed_pinned_loader_keeps_the_resume_position():
    # After strategy.load(loader=) a rank that peeks (next(iter(loader)), as a logger does under
    # Lightning/Ignite, which pin the epoch) must still resume its real pass at batch k, as its
    # peers that did not peek do; else the ranks train on different positions of the epoch.
    uninterrupted, first = _loaders(48, 2, 8), _loaders(48, 2, 8)
    for loader in (*uninterrupted, *first):
        loader.sampler.set_epoch(0)
    full = _global_batches(uninterrupted)
    seen = _global_batches(first, steps=2)
    state = first[0].state_dict()
    peeked, plain = _loaders(48, 2, 8)
    for loader in (peeked, plain):
        loader.load_state_dict(state)
        loader.sampler.set_epoch(0)  # what the framework calls at the start of the resumed epoch
    next(iter(peeked))
    assert len(peeked) == len(plain) == 4
    assert seen + _global_batches([peeked, plain]) == full
    # A completed pass uses up the resume: the same pinned epoch again is whole, and the next one too.
    assert len(peeked) == 6 and len(_global_batches([peeked, plain])) == 6
    for loader in (peeked, plain):
        loader.sampler.set_epoch(1)
    assert len(_global_batches([peeked, plain])) == 6


def test_set_epoch_to_another_epoch_drops_a_resume_that_was_not_used():
    (loader,) = _loaders(48, 1, 8)
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "batches": 3, "pinned": True})
    assert len(loader) == 3
    loader.sampler.set_epoch(5)
    loader.sampler.set_epoch(2)  # the resume was for epoch 2 of before; it is gone once the epoch changed
    assert len(loader) == 6 and loader.state_dict()["batches"] == 0


def test_a_loader_restored_from_a_pinned_run_moves_on_in_a_plain_loop():
    # Saved under Lightning or Ignite (set_epoch pins the epoch), resumed in a plain loop (no
    # set_epoch): the restored position is for the saved epoch only; every later pass is the next
    # epoch, not the saved epoch's order again.
    (saved,) = _loaders(48, 1, 8)
    saved.sampler.set_epoch(1)
    _global_batches([saved], steps=2)
    state = saved.state_dict()
    assert state["pinned"] is True and (state["epoch"], state["batches"]) == (1, 2)
    (resumed,) = _loaders(48, 1, 8)
    resumed.load_state_dict(state)
    (reference,) = _loaders(48, 1, 8)
    reference.sampler.set_epoch(1)
    epoch1 = _global_batches([reference])
    passes = [_global_batches([resumed]) for _ in range(3)]
    assert passes[0] == epoch1[2:]  # the rest of the saved epoch
    for epoch, got in zip((2, 3), passes[1:]):
        reference.sampler.set_epoch(epoch)
        assert got == _global_batches([reference]), f"pass of epoch {epoch}"
    assert resumed.state_dict()["epoch"] == 4 and resumed.state_dict()["pinned"] is False


def test_a_loader_resumed_with_another_accumulate_says_so_before_anything_runs():
    # batch_size=16: accumulate=2 gives micro-batches of 8 (the position counts those), accumulate=1
    # batches of 16. The refusal names accumulate, old and new, not only the loader's batch.
    saved = pp.Strategy(data=1, batch_size=16, accumulate=2).shard_data(TensorDataset(torch.arange(48)))
    state = saved.state_dict()
    assert state["accumulate"] == 2 and state["global_batch"] == 8
    resumed = pp.Strategy(data=1, batch_size=16, accumulate=1).shard_data(TensorDataset(torch.arange(48)))
    with pytest.raises(pp.CheckpointError, match=r"saved with Strategy\(accumulate=2\) \(global micro-batch 8\), this "
                                                 r"run has accumulate=1 \(global micro-batch 16\).*Resume with "
                                                 r"Strategy\(accumulate=2\)"):
        resumed.load_state_dict(state)
    # The same micro-batch at another accumulate consumes the same samples: resumed.
    same = pp.Strategy(data=1, batch_size=8, accumulate=1).shard_data(TensorDataset(torch.arange(48)))
    same.load_state_dict(state)
