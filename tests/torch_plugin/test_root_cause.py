"""``plugins/polyparallel_torch/launchers/root_cause.py``: the one choice of the rank to report,
and its report, for function mode and script mode alike.

The records are real ones (:func:`failure_record` of raised exceptions); their clocks are set
where the order is the subject. The end-to-end reports run in test_launch.py and test_tracing.py.
"""

from __future__ import annotations

import signal

import pytest

import polyparallel as pp
from polyparallel_torch.launchers.records import failure_record
from polyparallel_torch.launchers.root_cause import RankEnd, exit_text, root_cause


def _record(exc, rank, world=4, at=0.0, host="node0"):
    try:
        raise exc
    except BaseException as raised:
        record = failure_record(raised, rank, world)
    record.update(time=1000.0 + at, monotonic=50.0 + at, host=host)
    return record


def _lost_peer(rank, at):
    return _record(pp.CollectiveError(f"sync_grads #3 over the 'data' axis failed on rank {rank}: Connection closed "
                                      "by peer", operation="sync_grads", axis="data", rank=rank), rank, at=at)


def test_an_own_error_is_the_cause_even_after_a_peers_collective_failure():
    ends = [RankEnd(0, _lost_peer(0, at=0.0), 1),
            RankEnd(1, _record(ValueError("rank 1 hit a bad batch at step 3"), 1, at=0.5), 1),
            RankEnd(2, None, 1, stopped=True)]
    cause = root_cause(ends, 3)
    assert cause.rank == 1
    assert cause.message.startswith("rank 1 of 3 failed: ValueError: rank 1 hit a bad batch at step 3\nTraceback")
    assert "ValueError: rank 1 hit a bad batch at step 3" in cause.traceback
    assert cause.message.endswith(
        "\nOther ranks:\n"
        "  rank 0: CollectiveError: sync_grads #3 over the 'data' axis failed on rank 0: Connection closed by peer "
        "(collective failure: probably a consequence)\n"
        "  rank 2: stopped by the launcher")


def test_a_rank_that_died_without_a_record_beats_a_collective_failure():
    ends = [RankEnd(0, _lost_peer(0, at=0.0), 1), RankEnd(3, None, -signal.SIGKILL), RankEnd(1, _lost_peer(1, at=1.0), 1)]
    cause = root_cause(ends, 4)
    assert (cause.rank, cause.traceback) == (3, "")
    assert cause.message.startswith("rank 3 of 4 was killed by SIGKILL without a traceback (killed, or it ended the "
                                    "process itself)\nOther ranks:\n  rank 0: CollectiveError")
    # Only collective failures: the earliest.
    assert root_cause([RankEnd(1, _lost_peer(1, at=1.0), 1), RankEnd(0, _lost_peer(0, at=2.0), 1)]).rank == 1


def test_torchruns_words_stay_in_the_report():
    # Script mode: the agent's message for a rank that left no record, SIGTERM for the ones it stopped.
    ends = [RankEnd(0, None, 3, detail="To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"),
            RankEnd(1, None, -signal.SIGTERM, stopped=True, detail="Signal 15 (SIGTERM) received by PID 4242")]
    cause = root_cause(ends)
    assert cause.rank == 0
    assert cause.message == (
        "rank 0 exited with code 3 without a traceback (killed, or it ended the process itself): To enable traceback "
        "see: https://pytorch.org/docs/stable/elastic/errors.html\nOther ranks:\n"
        "  rank 1: stopped by the launcher (Signal 15 (SIGTERM) received by PID 4242)")
    # A stopped rank is the cause only when nothing else is known.
    assert root_cause(ends[1:]).rank == 1


def test_the_clock_that_orders_failures():
    first, second = _record(ValueError("first"), 0, at=0.0), _record(ValueError("second"), 1, at=1.0)
    assert root_cause([RankEnd(1, second, 1), RankEnd(0, first, 1)]).rank == 0
    # One host: its monotonic clock decides (a wall clock may step between two failures).
    first["time"], second["time"] = 2000.0, 1000.0
    assert root_cause([RankEnd(0, first, 1), RankEnd(1, second, 1)]).rank == 0
    # Several hosts: their monotonic clocks do not compare; the wall clock decides.
    second["host"], second["monotonic"] = "node1", 0.0
    first["monotonic"] = 99.0
    assert root_cause([RankEnd(0, first, 1), RankEnd(1, second, 1)]).rank == 1


def test_exit_texts_and_no_ranks():
    assert exit_text(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_text(1) == "exited with code 1"
    assert exit_text(None) == "exited with code None"
    with pytest.raises(ValueError, match="needs the ranks that did not succeed"):
        root_cause([])


def _timed_out(rank, at):
    return _record(pp.CollectiveTimeout(f"sync_grads #3 over the 'data' axis timed out on rank {rank} after 20 s",
                                        operation="sync_grads", axis="data", rank=rank), rank, at=at)


def test_a_rank_its_peers_timed_out_waiting_for_is_the_suspect_frozen_first():
    ends = [RankEnd(0, _timed_out(0, at=0.0), 1), RankEnd(1, None, None, stopped=True),
            RankEnd(2, None, -signal.SIGKILL, stopped=True, frozen=True), RankEnd(3, _timed_out(3, at=0.1), 1)]
    cause = root_cause(ends, 4)
    assert cause.rank == 2 and cause.traceback == ""
    assert cause.message.startswith("rank 2 of 4 is the suspect: its peers' collectives timed out waiting for it, and "
                                    "it was frozen (stopped by a signal, SIGSTOP, or its machine paused)")
    assert "\n  rank 1: stopped by the launcher" in cause.message
    assert "\nRank 0's timeout:\n" in cause.message and "timed out on rank 0 after 20 s" in cause.message
    # Without a frozen rank: a peer's own CollectiveTimeout already names what every rank was
    # doing (its hang report), so it stays the cause; a backend's bare timeout (DDP's, in
    # backward) does not, and the rank alive but silent is the suspect.
    assert root_cause([RankEnd(0, _timed_out(0, at=0.0), 1), RankEnd(1, None, None, stopped=True)], 2).rank == 0
    from torch.distributed import DistBackendError

    bare = _record(DistBackendError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"), 0)
    cause = root_cause([RankEnd(0, bare, 1), RankEnd(1, None, None, stopped=True)], 2)
    assert cause.rank == 1 and "was still running but never answered" in cause.message
    # A peer's lost connection (no timeout) keeps the old order: the earliest collective
    # failure, not a rank the launcher stopped.
    assert root_cause([RankEnd(0, _lost_peer(0, at=0.0), 1), RankEnd(1, None, None, stopped=True)], 2).rank == 0


def test_a_polyparallel_report_naming_both_sides_beats_an_earlier_bare_backend_error():
    # Issue 23: rank 1's gloo timeout raised in DDP's backward came first and was the headline;
    # rank 0's report, which names both sides, was "probably a consequence".
    from torch.distributed import DistBackendError

    bare = _record(DistBackendError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"),
                   1, at=0.0)
    desync = pp.CollectiveError("operations out of step over the 'data' axis (group ranks [0, 1]): reduce #4 on "
                                "rank 0 vs DDP gradient all-reduce #4 on rank 1", operation="reduce", axis="data",
                                rank=0)
    desync.peers_named = True  # what the identity check sets on its desync error
    cause = root_cause([RankEnd(1, bare, 1), RankEnd(0, _record(desync, 0, at=0.5), 1)], 2)
    assert cause.rank == 0 and cause.message.startswith("rank 0 of 2 failed: CollectiveError: operations out of step")
    assert "\n  rank 1: DistBackendError: " in cause.message and "probably a consequence" in cause.message
    # A timeout with its hang report too; between two bare errors, the earliest still.
    cause = root_cause([RankEnd(1, bare, 1), RankEnd(0, _timed_out(0, at=0.5), 1)], 2)
    assert cause.rank == 0, cause.message
    other = _record(DistBackendError("Connection reset by peer"), 0, at=0.5)
    assert root_cause([RankEnd(1, bare, 1), RankEnd(0, other, 1)], 2).rank == 1
