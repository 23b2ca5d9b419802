"""The XLA runtime's host checks exchange JSON, checked when read: a value in the store that
polyparallel did not write (a pickle, garbage, another shape) is refused with a clear error, never
unpickled. Needs torch only (runs in the default environment and in the XLA lane)."""

import pickle
import threading

import pytest
import torch.distributed as dist

import polyparallel as pp
from polyparallel_xla.runtime import HostChannel


class _Boom:
    def __reduce__(self):
        return (exec, ("import polyparallel_xla; polyparallel_xla.PWNED = True",))


def _pair(store, values):
    channel = HostChannel(store, timeout=5)
    out = {}

    def run(rank):
        out[rank] = channel.exchange("data/0", 1, rank, [0, 1], values[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_descriptors_and_extras_round_trip_as_tuples_and_lists():
    values = {0: (("sync_grads", "mean abc", None, "train.py:3"), [True, False]), 1: (("sync_grads", "mean abc", None, "train.py:3"), [False, True])}
    out = _pair(dist.HashStore(), values)
    assert out[0] == out[1] == {0: (("sync_grads", "mean abc", None, "train.py:3"), [True, False]),
                                1: (("sync_grads", "mean abc", None, "train.py:3"), [False, True])}
    assert out[0][1][0] == ("sync_grads", "mean abc", None, "train.py:3")  # compared with a rank's own tuple


@pytest.mark.parametrize("raw", [
    pickle.dumps((("reduce_metrics", "", None), _Boom())),  # what main unpickled: code run in the rank
    b"\xff\xfe not json",
    b'{"operation": "reduce_metrics"}',
    b'[["reduce_metrics", 3, null, "train.py:3"], null]',
    b'[["reduce_metrics", "", null, "train.py:3"], {"a": 1}]',
    b'[["reduce_metrics", "", null, 3], null]',  # the caller's line is text
    b'[["reduce_metrics", "", null], null]',  # no caller
])
def test_a_value_polyparallel_did_not_write_is_refused_not_run(raw):
    import polyparallel_xla

    store = dist.HashStore()
    store.set("data/0/1/1", raw)  # rank 1's entry, written by someone else
    channel = HostChannel(store, timeout=5)
    with pytest.raises(pp.CollectiveError, match=r"read a value for rank 1 \('data/0/1/1'\) that polyparallel did not"):
        channel.exchange("data/0", 1, 0, [0, 1], (("reduce_metrics", "", None, "train.py:3"), None))
    assert not getattr(polyparallel_xla, "PWNED", False)


def test_a_rank_that_timed_out_withdraws_its_entry_so_a_late_peer_fails_at_once():
    # Without it, the late peer would pass the check on the stale entry and wait alone in the XLA
    # collective (XLA aborts the process, or the ordered sync's barrier waits 120 s).
    store = dist.HashStore()
    mine = ("reduce_metrics", "loss:mean[1]", None, "train.py:3")
    assert HostChannel(store, timeout=0.5).exchange("data/0", 1, 0, [0, 1], (mine, None)) == [1]
    late = HostChannel(store, timeout=5).exchange("data/0", 1, 1, [0, 1], (mine, None))
    assert isinstance(late, dict) and late[1][0] == mine
    assert late[0][0] == ("reduce_metrics", "loss:mean[1]", "rank 0 gave up waiting for it after the strategy's "
                          "timeout of 0.5 s", "train.py:3")
