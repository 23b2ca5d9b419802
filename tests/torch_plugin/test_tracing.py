"""Hang and desync reports of the torch runtime: the trace records every collective, a timeout
says what every rank of the group was doing (through the store, while the group is stuck), a
desync names both sides' locations, and the launch writes every rank's trace."""

import os
import time

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel import _trace, _trace_report
from polyparallel_torch.testing import source_line

pytestmark = pytest.mark.multiprocess

SKIP_LINE = "# rank 1 skips reduce_metrics here"


def _skip_reduce(strategy):
    strategy.reduce_metrics({"loss": pp.Mean(1.0, 1)})  # #1: every rank
    if strategy.rank == 0:
        strategy.reduce_metrics({"loss": pp.Mean(2.0, 1)})  # #2: rank 0 only
    else:
        time.sleep(strategy.timeout + 8)  # rank 1 skips reduce_metrics here
    return strategy.rank


def _desync(strategy):
    model = nn.Linear(3, 2)
    strategy.reduce_metrics({"x": 1.0})
    model(torch.ones(1, 3)).sum().backward()
    if strategy.rank == 0:
        strategy.sync_states(model)  # rank 0: sync_states
    else:
        strategy.sync_grads(model)  # rank 1: sync_grads
    return strategy.rank


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_is_named_with_its_last_collective_and_stack(tmp_path):
    strategy = pp.Strategy(data=2, timeout=6)
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_skip_reduce, strategy, 2, args=(strategy,), timeout=90, trace_dir=str(tmp_path))
    text = str(info.value)
    first_line = text.splitlines()[0]
    here = os.path.basename(__file__)
    # rank 0's error, on its first line: where rank 1 is, and what rank 0 waits in.
    assert "rank 0 of 2 failed: CollectiveTimeout: reduce_metrics #2" in first_line, text
    assert (f"rank 1 has not entered any collective since reduce_metrics #1 ({here}:{source_line(_skip_reduce, '#1')}, "
            "done)") in first_line, text
    assert f"rank 0 waits in reduce_metrics #2 ({here}:{source_line(_skip_reduce, '#2')})" in first_line, text
    # rank 1's stack, read through the store while it sleeps: its line, not the launcher's.
    assert "rank 1's stack" in text and f"line {source_line(_skip_reduce, SKIP_LINE)}, in _skip_reduce" in text, text
    # every rank's trace was written
    traces = _trace_report.read_dir(str(tmp_path))
    assert sorted(traces) == [0, 1]
    ops = {r: [(e["operation"], e["seq"], e["state"]) for e in t["entries"] if e["axis"] == "data"]
           for r, t in traces.items()}
    assert ops[0][-2:] == [("reduce_metrics", 1, "done"), ("reduce_metrics", 2, "failed")], ops
    assert ops[1][-1] == ("reduce_metrics", 1, "done"), ops
    assert traces[0]["header"]["failure"].startswith("CollectiveTimeout") or "reduce_metrics #2" in \
        traces[0]["header"]["failure"], traces[0]["header"]
    header, rows = _trace_report.timeline(traces)
    assert header[-2:] == ["rank 0", "rank 1"]
    last = rows[-1]
    assert last[0] == "!" and last[2:4] == ["data", "2"] and "[failed]" in last[4] and last[5] == "-", rows


@pytest.mark.timeout(120)
def test_ranks_at_different_operations_fail_at_once_naming_both_locations():
    strategy = pp.Strategy(data=2, timeout=30)
    started = time.monotonic()
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_desync, strategy, 2, args=(strategy,), timeout=90)
    assert time.monotonic() - started < 25, "detected by the identity check, not by the timeout"
    text = str(info.value)
    here = os.path.basename(__file__)
    states_at, grads_at = source_line(_desync, "rank 0: sync_states"), source_line(_desync, "rank 1: sync_grads")
    assert "CollectiveError: operations out of step over the 'data' axis" in text, text
    first = text.splitlines()[0]
    assert "sync_grads #2 on rank 1 vs sync_states #2 on rank 0" in first or \
        "sync_states #2 on rank 0 vs sync_grads #2 on rank 1" in first, text
    assert f"rank 0: sync_states #2 at {here}:{states_at}" in text, text
    assert f"rank 1: sync_grads #2 at {here}:{grads_at}" in text, text
    assert f"{here}:{states_at}" in first and f"{here}:{grads_at}" in first, text


def _recorded(strategy):
    strategy.wrap_model(nn.Linear(3, 2))  # its parameter broadcast: a checked operation
    strategy.reduce_metrics({"x": 1.0})
    return [(e.operation, e.axis, e.seq, e.state) for e in _trace.get_recorder().entries]


@pytest.mark.timeout(120)
def test_every_runtime_collective_is_recorded_with_its_sequence_number(run):
    out = run(_recorded, pp.Strategy(data=2, timeout=30), 2, pp.Strategy(data=2, timeout=30))
    for entries in out:
        names = [(op, axis, seq) for op, axis, seq, state in entries]
        assert ("init_process_group", "world", None) in names
        assert ("start the torch runtime", "world", 1) in names
        assert ("reduce_metrics", "data", entries[-1][2]) == names[-1]
        assert all(state == "done" for *_, state in entries), entries


def _second_runtime_hang(strategy):
    first = strategy.replace(timeout=30)
    first.reduce_metrics({"loss": 1.0})
    first.session().close()
    strategy.session().close()  # the last runtime using the side channel closes: state "exited"
    second = strategy.replace(timeout=7)  # another runtime, a new channel in the same processes
    second.reduce_metrics({"loss": 1.0})
    if strategy.rank == 0:
        second.reduce_metrics({"loss": 2.0})  # only rank 0
    else:
        time.sleep(second.timeout + 8)  # rank 1 computes instead, alive
    return strategy.rank


@pytest.mark.timeout(120)
def test_a_later_runtime_reports_a_live_rank_as_live_not_as_the_earlier_runtime_exited():
    strategy = pp.Strategy(data=2, timeout=6)
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_second_runtime_hang, strategy, 2, args=(strategy,), timeout=90)
    first_line = str(info.value).splitlines()[0]
    assert "rank 0 of 2 failed: CollectiveTimeout: reduce_metrics #" in first_line, info.value
    assert "has exited" not in first_line and "rank 1 has not entered any collective since" in first_line, \
        info.value
    assert "rank 1's stack" in str(info.value), info.value


def test_a_new_channel_ignores_earlier_requests_and_replaces_an_earlier_exited_state(tmp_path):
    import torch.distributed as dist

    from polyparallel_torch.channel_auth import seal, unseal
    from polyparallel_torch.tracing import SideChannel

    key = os.urandom(32)
    state_of = lambda: unseal(key, "state/1", store.get("state/1"))[0]  # noqa: E731
    store = dist.HashStore()  # what an earlier channel of this process left under the same prefix
    store.set("request", seal(key, "request", {"gen": 3, "rank": 0}))
    store.set("state/1", seal(key, "state/1", {"rank": 1, "gen": 3, "exited": True, "entries": [], "time": 0.0,
                                               "stack": None}))
    recorder = _trace.Recorder()
    recorder.trace_dir = str(tmp_path)
    channel = SideChannel(store, 1, recorder, poll_s=0.02, key=key)
    try:
        time.sleep(0.2)  # several polls: request 3 is not for this channel
        state = state_of()
        assert state["exited"] is False and state["gen"] == 3, state
        assert list(tmp_path.iterdir()) == [], "no trace written for an earlier runtime's request"
        store.set("request", seal(key, "request", {"gen": 4, "rank": 0}))  # a new request is answered
        deadline = time.monotonic() + 5
        while state_of()["gen"] != 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state_of()["gen"] == 4
        assert channel.rejected_count == 0, channel.rejected
    finally:
        channel.close()


HANG_SCRIPT = """
import time
import polyparallel as pp

s = pp.Strategy(data=2, timeout=6)
s.reduce_metrics({"loss": 1.0})
if s.rank == 0:
    s.reduce_metrics({"loss": 2.0})  # only rank 0
else:
    time.sleep(40)  # rank 1 computes instead
"""


def _cli(*args, timeout=150):
    import sys

    return ["timeout", "-k", "10", str(timeout), sys.executable, "-m", "polyparallel.cli", *args]


@pytest.mark.timeout(200)
def test_cli_launch_prints_the_first_failing_rank_once_and_trace_shows_the_timelines(tmp_path):
    import subprocess

    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    traces = tmp_path / "traces"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(_cli("launch", "--nproc-per-node", "2", "--trace-dir", str(traces), str(script)),
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr
    err = proc.stderr
    report = err[err.index("polyparallel launch: "):]
    # The report's first line names the world size, as function mode's does (old: "rank 0 failed:").
    assert report.startswith("polyparallel launch: rank 0 of 2 failed: CollectiveTimeout: reduce_metrics #2"), err
    assert "rank 1 has not entered any collective since reduce_metrics #1 (hang.py:6, done)" in report, err
    assert "rank 0 waits in reduce_metrics #2 (hang.py:8)" in report, err
    assert 'hang.py", line 10, in <module>' in report, err  # rank 1's stack: its sleep
    assert err.count('hang.py", line 8, in <module>') == 1, err  # one report, not one traceback per rank
    shown = subprocess.run(_cli("trace", str(traces), "--rank", "1"), capture_output=True, text=True, env=env,
                           timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert any(line.startswith("rank 0 ") and "written at exit after: reduce_metrics #2 over the 'data' axis" in line
               for line in lines), shown.stdout
    hang_row = next(line for line in lines if line.startswith("!"))
    assert "data" in hang_row and "reduce_metrics [failed]" in hang_row and "(hang.py:8)" in hang_row, shown.stdout
    assert hang_row.rstrip().endswith("-"), shown.stdout  # rank 1 never entered #2
    assert "rank 1:" in shown.stdout and "hang.py:6" in shown.stdout



PEER_FAILS_SCRIPT = """
import polyparallel as pp


def bad_batch(step):
    raise ValueError(f"bad batch at step {step}")


s = pp.Strategy(data=2, timeout=60)
s.reduce_metrics({"loss": 1.0})
if s.rank == 1:
    bad_batch(3)
s.reduce_metrics({"loss": 2.0})  # rank 0 goes on
"""

PEER_FINISHES_SCRIPT = """
import polyparallel as pp
from polyparallel_torch.launchers.records import explains

s = pp.Strategy(data=2, timeout=60)
s.reduce_metrics({"loss": 1.0})
if s.rank == 0:
    try:
        s.reduce_metrics({"loss": 2.0})  # one more, rank 0 only
    except pp.CollectiveError as exc:
        print(f"explained: {explains(exc)}", flush=True)  # the launchers' root cause: it names the peers' side
        raise
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["fails", "finishes"])
def test_cli_launch_a_peer_that_failed_or_finished_is_named_with_its_outcome(tmp_path, case):
    # Before: "a peer did not join or has exited" (gloo's "Connection closed by peer" is not a
    # timeout, so the side channel was not asked). The strategy's timeout (60 s) is far above what
    # the launch may take: the report comes from the peer's published outcome, not from a timeout.
    import subprocess

    script = tmp_path / "job.py"
    script.write_text(PEER_FAILS_SCRIPT if case == "fails" else PEER_FINISHES_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run(_cli("launch", "--nproc-per-node", "2", str(script), timeout=100), capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=110)
    took = time.monotonic() - started
    err = proc.stderr
    assert proc.returncode not in (0, 124, 137), proc.stdout + err
    assert took < 40, (took, err)  # not the strategy's timeout of 60 s
    rank0 = next(line for line in err.splitlines() if line.startswith("[rank 0] CollectiveError: reduce_metrics #2"))
    assert "failed on rank 0 (group ranks [0, 1])" in rank0, err
    assert "did not join" not in rank0 and "has exited" not in rank0, err
    assert "rank 0 waits in reduce_metrics #2 (job.py:" in rank0, err
    report = err[err.index("polyparallel launch: "):]
    if case == "fails":
        assert ("rank 1 failed in bad_batch (job.py:6) with ValueError (its last collective: reduce_metrics #1 "
                "(job.py:10, done))") in rank0, err
        # The launcher's report: rank 1's ValueError is the cause, rank 0's failure a consequence naming it.
        assert report.startswith("polyparallel launch: rank 1 of 2 failed: ValueError: bad batch at step 3"), err
        assert "rank 0: CollectiveError" in report and "rank 1 failed in bad_batch (job.py:6)" in report, err
    else:
        assert "rank 1 finished (its last collective: reduce_metrics #1 (job.py:6, done))" in rank0, err
        assert "explained: True" in proc.stdout, proc.stdout
        assert report.startswith("polyparallel launch: rank 0 of 2 failed: CollectiveError: reduce_metrics #2"), err
        assert "rank 1 finished" in report.splitlines()[0], err


def _peer_fails_in_a_function(strategy):
    strategy.reduce_metrics({"loss": 1.0})  # both ranks
    if strategy.rank == 1:
        _bad_batch(3)
    strategy.reduce_metrics({"loss": 2.0})  # rank 0 goes on
    return strategy.rank


@pytest.mark.timeout(120)
def test_launch_a_peer_that_failed_is_named_where_and_how_by_the_rank_it_left_behind():
    # pp.launch (torch.multiprocessing): as under `polyparallel launch` above.
    strategy = pp.Strategy(data=2, timeout=60)
    started = time.monotonic()
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_peer_fails_in_a_function, strategy, 2, args=(strategy,), timeout=100)
    assert time.monotonic() - started < 40, "the peer's outcome, not the strategy's timeout"
    text = str(info.value)
    assert text.startswith("rank 1 of 2 failed: ValueError: bad batch at step 3"), text
    here = os.path.basename(__file__)
    rank0 = next(line for line in text.splitlines() if line.startswith("  rank 0: CollectiveError"))
    assert (f"rank 1 failed in _bad_batch ({here}:{source_line(_bad_batch, 'raise ValueError')}) with ValueError "
            f"(its last collective: reduce_metrics #1 ({here}:{source_line(_peer_fails_in_a_function, '# both ranks')}"
            ", done))") in rank0, text
    assert "did not join" not in rank0, text


def _bad_batch(step):
    raise ValueError(f"bad batch at step {step}")


def test_a_timeout_says_which_peer_finished_and_which_failed_where():
    # Before: "rank 1 has exited", "rank 2 has exited": a rank that finished and one that failed
    # read alike. Three ranks' channels over one store (one process: the outcome is process-wide,
    # so the ranks close one after the other); rank 0 asks, as its timeout does.
    import torch.distributed as dist

    from polyparallel_torch import tracing
    from polyparallel_torch.tracing import SideChannel

    key, store = os.urandom(32), dist.HashStore()
    channels = {}
    for rank in (0, 1, 2):
        recorder = _trace.Recorder()
        recorder.finish(recorder.enter("reduce_metrics", "data", 1))
        channels[rank] = SideChannel(store, rank, recorder, poll_s=0.02, key=key)
    try:
        tracing.set_outcome(None)  # what the launcher's worker says when the function returned
        channels[1].close()
        try:
            _bad_batch(3)
        except ValueError as exc:
            tracing.set_outcome(exc)  # ... and when it raised
            line = exc.__traceback__.tb_next.tb_lineno
        channels[2].close()
        states = channels[0].collect([0, 1, 2], 2.0)
    finally:
        tracing._SHARED["outcome"] = None
        channels[0].close()
    summary, _ = _trace_report.describe_group(states, 0, 2.0)
    assert "rank 1 finished (its last collective: reduce_metrics #1" in summary, summary
    here = os.path.basename(__file__)
    assert f"rank 2 failed in _bad_batch ({here}:{line}) with ValueError (its last collective: reduce_metrics #1" \
        in summary, summary
    assert "has exited" not in summary, summary
    # Without an outcome (a runtime closed outside any launcher, no exception): as before.
    assert tracing.outcome_of(None) == "finished"


def _ddp_hook_composition(strategy):
    """On a DDP model the runtime wrapped: a comm hook registered later is DDP's own (it reduces
    every bucket), the backward is still recorded, and a second hook is refused by torch."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from polyparallel_torch import ddp_trace
    from polyparallel_torch.runtime import get_runtime

    model = strategy.wrap_model(nn.Linear(4, 2))
    rt = get_runtime(strategy.session())
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    model(torch.ones(2, 4)).sum().backward()
    grad = model.module.weight.grad.clone()
    try:
        model.register_comm_hook(None, counting)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    entries = [e for e in _trace.get_recorder().last(8) if e["operation"] == ddp_trace.OPERATION]
    with model.no_sync():  # no synchronising backward: nothing recorded
        model(torch.ones(2, 4)).sum().backward()
    after_no_sync = [e for e in _trace.get_recorder().last(8) if e["operation"] == ddp_trace.OPERATION]
    return {"calls": calls, "refused": refused, "entries": entries, "installed": ddp_trace.is_installed(model),
            "name": model._get_ddp_logging_data().get("comm_hook"), "grad": grad.tolist(),
            "no_sync_entries": len(after_no_sync),
            "own_group": model.process_group is not rt.group("data")
            and sorted(dist.get_process_group_ranks(model.process_group)) == rt.group_ranks("data")}


@pytest.mark.timeout(120)
def test_a_hook_registered_on_the_ddp_model_reduces_and_the_backward_stays_recorded(run):
    results = run(_ddp_hook_composition, pp.Strategy(data=2), 2, pp.Strategy(data=2), timeout=100)
    for r in results:
        assert r["installed"] and r["calls"] == [0], r
        assert "can only be called once" in r["refused"], r
        assert r["name"].endswith("counting"), r
        assert len(r["entries"]) == 1 and r["entries"][-1]["state"] == "done", r
        assert r["entries"][-1]["seq"] is None, r  # recorded, not checked (GradPolicy.check_backward)
        assert r["entries"][-1]["detail"] == "2 gradients, 10 float32", r
        assert r["no_sync_entries"] == 1, r
        assert r["own_group"], r  # DDP's buckets over a second group of the data ranks
    assert results[0]["grad"] == results[1]["grad"], results


def _ddp_group_without_check(strategy, trace):
    """DDP's process group with the recording off: the data group itself, the gradients still
    averaged; recorded (the default): the second group."""
    from polyparallel_torch.runtime import get_runtime

    if not trace:
        os.environ["POLYPARALLEL_TRACE_DDP"] = "0"
    try:
        torch.manual_seed(0)
        model = strategy.wrap_model(nn.Linear(4, 2))
        rt = get_runtime(strategy.session())
        model(torch.full((2, 4), float(strategy.rank + 1))).sum().backward()
        return {"data_group": model.process_group is rt.group("data"), "second_group": rt._ddp_group is not None,
                "grad": model.module.weight.grad.tolist()}
    finally:
        os.environ.pop("POLYPARALLEL_TRACE_DDP", None)


@pytest.mark.timeout(200)
def test_an_unrecorded_ddp_backward_reduces_over_the_data_group_itself(run):
    # The second group serves the recording (an out-of-step operation waits into the hang report;
    # checked, the check's late answer); plain DDP needs none.
    for policy, trace in ((pp.GradPolicy(), True), (pp.GradPolicy(check_backward=True), False)):
        strategy = pp.Strategy(data=2, grad_policy=policy)
        results = run(_ddp_group_without_check, strategy, 2, strategy, trace, timeout=90)
        for r in results:
            assert r["data_group"] is not trace and r["second_group"] is trace, (policy, trace, r)
        # the mean of rank 0's input (1) and rank 1's (2), times the batch of 2: 3.0 for each weight
        assert results[0]["grad"] == results[1]["grad"] == [[3.0] * 4] * 2, results


def _fsdp_sync_grads_collectives(strategy):
    """The trace entries of ``sync_grads`` on an FSDP2 model (zero=2), whose gradients torch
    reduced in backward: none by default, its identity check with ``check_backward``."""
    model = strategy.wrap_model(nn.Linear(4, 2))
    model(torch.ones(2, 4)).sum().backward()
    before = len(_trace.get_recorder().entries)
    strategy.sync_grads(model)
    new = list(_trace.get_recorder().entries)[before:]
    return [(e.operation, e.seq) for e in new]


@pytest.mark.timeout(200)
def test_sync_grads_on_an_fsdp2_model_runs_no_collective_unless_the_backward_check_is_asked_for(run):
    # Before: a blocking identity check (0.5 ms a step on gloo) where DDP's sync_grads does nothing.
    for checked in (False, True):
        strategy = pp.Strategy(data=2, zero=2, grad_policy=pp.GradPolicy(check_backward=checked))
        for entries in run(_fsdp_sync_grads_collectives, strategy, 2, strategy, timeout=90):
            if checked:
                assert [op for op, _ in entries] == ["sync_grads"] and entries[0][1] is not None, entries
            else:
                assert entries == [], entries


def test_a_ddp_backend_error_is_explained_only_by_a_report_that_names_the_peers():
    # ddp_trace.explained runs in the launchers' except blocks: when no report naming the peers
    # can be had (a runtime closed, a side channel gone, a report without the peers), gloo's own
    # error is reported, and nothing raises there; a report that names them carries the raw
    # error's traceback, so the peers' "rank 0 failed in ..." names the user's line.
    from polyparallel_torch import ddp_trace

    class Runtime:
        closed = False

        def __init__(self, failure):
            self.failure = failure

        def _collective_failed(self, exc, operation, axis, label):
            raise self.failure from exc

    def raised():
        try:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                               "8000ms for recv operation to complete")  # gloo's words, as DDP raises them
        except RuntimeError as exc:
            return exc

    where = {"operation": ddp_trace.OPERATION, "axis": "data", "rank": 0}
    named = pp.CollectiveTimeout("DDP gradient all-reduce over the 'data' axis did not complete: rank 1 waits in x",
                                 **where)
    named.peers_named = True
    unnamed = pp.CollectiveTimeout("DDP gradient all-reduce ...: a peer did not join or has exited.", **where)
    closed = Runtime(named)
    closed.closed = True
    assert ddp_trace.explained(raised()) is None  # no backward in flight
    cases = [(Runtime(OSError("the side channel is closed")), raised(), None), (closed, raised(), None),
             (Runtime(unnamed), raised(), None), (Runtime(named), ValueError("not a backend error"), None),
             (Runtime(KeyboardInterrupt()), raised(), None), (Runtime(named), raised(), named)]
    try:
        for rt, exc, expected in cases:
            entry = _trace.Recorder().enter(ddp_trace.OPERATION, "data", None)
            ddp_trace._IN_FLIGHT[0] = (entry, rt)
            assert ddp_trace.explained(exc) is expected, (rt.failure, exc)
            assert entry.state == "failed" and type(exc).__name__ in entry.error, entry.to_dict()
            assert ddp_trace._IN_FLIGHT[0] is None
        assert named.__traceback__ is not None and named.__traceback__.tb_frame.f_code.co_name == "raised"
    finally:
        ddp_trace._IN_FLIGHT[0] = None
