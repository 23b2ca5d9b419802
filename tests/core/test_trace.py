"""The collective trace's ring buffer (framework-free): entries, caller locations, the off
switch, and the JSON-lines dump."""

import json
import subprocess
import sys

import polyparallel as pp
from polyparallel import _trace


def _user_calls_polyparallel(recorder):
    return recorder.enter("reduce_metrics", "data", 3, "loss:mean[1]")  # the user's line


def test_an_entry_holds_operation_axis_sequence_detail_and_the_users_line():
    recorder = _trace.Recorder(capacity=4)
    entry = _user_calls_polyparallel(recorder)
    assert (entry.operation, entry.axis, entry.seq, entry.detail, entry.state) == (
        "reduce_metrics", "data", 3, "loss:mean[1]", "entered")
    assert entry.user is not None and entry.user[0] == __file__
    import inspect

    assert entry.user[1] == inspect.getsourcelines(_user_calls_polyparallel)[1] + 1
    assert entry.site == entry.user  # no framework frame in between
    _trace.Recorder.finish(entry)
    assert entry.state == "done" and entry.t1 is not None and entry.t1 >= entry.t0
    failed = recorder.enter("sync_states", "data", 4)
    _trace.Recorder.finish(failed, "CollectiveTimeout: sync_states #4 ...")
    assert failed.state == "failed" and failed.error.startswith("CollectiveTimeout")
    _trace.Recorder.finish(failed)  # a finished entry stays as it ended
    assert failed.state == "failed"


def test_the_buffer_keeps_the_latest_entries_and_counts_the_dropped(tmp_path):
    recorder = _trace.Recorder(capacity=4)
    recorder.rank = 1
    for i in range(10):
        _trace.Recorder.finish(recorder.enter("op", "data", i + 1))
    assert [e["seq"] for e in recorder.last(3)] == [8, 9, 10]
    path = recorder.dump("exit", str(tmp_path))
    assert path == str(tmp_path / "rank1.jsonl")
    header, *entries = [json.loads(line) for line in open(path)]
    assert header["rank"] == 1 and header["dropped"] == 6 and header["failure"] is None
    assert [e["seq"] for e in entries] == [7, 8, 9, 10]
    assert entries[0]["user"].startswith(__file__ + ":")
    recorder.dump("CollectiveTimeout: op #11", str(tmp_path), failed=True)
    recorder.dump("exit", str(tmp_path))  # the exit dump keeps the failure in its header
    assert json.loads(open(path).readline())["failure"] == "CollectiveTimeout: op #11"


def test_frames_of_polyparallel_and_of_frameworks_are_skipped():
    # A collective issued from a framework's frame (here: a function whose module claims to be
    # Lightning's) is placed both there (site) and at the user's line that called the framework.
    recorder = _trace.Recorder()
    namespace = {"__name__": "lightning.pytorch.fake_loop", "recorder": recorder}
    exec(compile("def loop():\n    return recorder.enter('barrier', 'world', None)\n", "fake_loop.py", "exec"),
         namespace)
    entry = namespace["loop"]()  # the user's line
    assert entry.site == ("fake_loop.py", 2)
    assert entry.user is not None and entry.user[0] == __file__


def test_recording_is_off_with_polyparallel_trace_0():
    code = ("import os; os.environ['POLYPARALLEL_TRACE'] = '0'; from polyparallel import _trace; "
            "assert not _trace.enabled() and _trace.get_recorder() is None; print('off')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr


def test_a_trace_dir_is_written_at_exit(tmp_path):
    code = ("from polyparallel import _trace\n"
            f"_trace.configure(trace_dir={str(tmp_path)!r}, rank=2, world_size=4)\n"
            "_trace.Recorder.finish(_trace.get_recorder().enter('reduce_metrics', 'data', 1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header, entry = [json.loads(line) for line in open(tmp_path / "rank2.jsonl")]
    assert header["reason"] == "exit" and header["world_size"] == 4
    assert (entry["operation"], entry["state"]) == ("reduce_metrics", "done")


def test_launch_refuses_a_trace_dir_that_is_a_file(tmp_path):
    import pytest

    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(TypeError, match="is a file; pass a directory"):
        pp.launch(print, pp.Strategy(data=1), 1, trace_dir=afile)
    with pytest.raises(TypeError, match=r"trace_dir=\) must be a directory path"):
        pp.launch(print, pp.Strategy(data=1), 1, trace_dir=3)


_SCOPES = '''
import json, os, sys, threading
import polyparallel as pp
from polyparallel import _trace

_trace.configure(trace_dir=sys.argv[1], world_size=2)
process = _trace.get_recorder()
seen = {}
arrived = threading.Barrier(2)

def replica(rank):
    with pp.session_scope(rank):
        recorder = _trace.get_recorder()
        _trace.Recorder.finish(recorder.enter("reduce_metrics", "data", 1, f"rank {rank}"))
        arrived.wait()  # both scopes are live: each sees the other's recorder
        seen[rank] = (recorder, dict(_trace.scoped_recorders()))
        if rank == 1:
            raise ValueError("rank 1's own error")

def run(rank):
    try:
        replica(rank)
    except ValueError:
        pass

threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
for t in threads: t.start()
for t in threads: t.join()
zero, one = seen[0][0], seen[1][0]
assert zero is not one and process not in (zero, one) and not process.entries
assert _trace.get_recorder() is process
assert seen[0][1] == {0: zero, 1: one} == seen[1][1]
assert (zero.rank, zero.world_size, zero.trace_dir) == (0, 2, process.trace_dir)
assert zero.exited and zero.outcome == "finished" and one.outcome.startswith("failed in replica"), one.outcome
state = one.state()
assert state["exited"] and state["stack"] is None and state["entries"][0]["detail"] == "rank 1"
assert sorted(os.listdir(sys.argv[1])) == ["rank0.jsonl", "rank1.jsonl"]  # written when each scope ended
for rank in (0, 1):
    header, entry = [json.loads(line) for line in open(os.path.join(sys.argv[1], f"rank{rank}.jsonl"))]
    assert header["rank"] == rank and header["world_size"] == 2 and entry["detail"] == f"rank {rank}"
print("scoped")
'''


def test_each_session_scope_records_its_own_rank(tmp_path):
    # Ranks that are threads of one process (XLA replicas on PJRT CPU): each session scope has its
    # own recorder, its own file, and sees its peers' (hang reports); the process's stays empty and
    # writes no rank0.jsonl of its own over replica 0's.
    out = subprocess.run([sys.executable, "-c", _SCOPES, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "scoped", out.stderr
