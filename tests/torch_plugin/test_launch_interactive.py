"""``pp.launch`` of a function an interactive ``__main__`` defines (``python -``, as a notebook cell
does): the workers are forked, with a fresh polyparallel state; forking is refused where unsafe.

(The notebooks themselves run through a real Jupyter kernel in ``test_notebooks.py``.)
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _stdin(script, tmp_path, timeout=120):
    """Run ``script`` as ``python - < script`` (``__main__.__file__`` is ``<stdin>``)."""
    env = dict(os.environ, L22_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-"], input=textwrap.dedent(script), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


WORKS = """
    import atexit, json, os
    import polyparallel as pp

    out = os.environ["L22_DIR"]
    atexit.register(lambda: open(os.path.join(out, "parent-atexit"), "a").write(f"{os.getpid()}\\n"))

    class Scale:  # a class of this __main__, used by the function and in its arguments
        def __init__(self, k):
            self.k = k

    def helper(strategy):
        return float(strategy.rank)

    def train(strategy, scale, post):
        total = strategy.reduce_metrics({"rank": helper(strategy) * scale.k})
        return {"rank": strategy.rank, "world": strategy.world_size, "mean": post(total["rank"]), "pid": os.getpid()}

    strategy = pp.Strategy(data=-1, timeout=60)
    assert strategy.world_size == 1 and strategy.reduce_metrics({"x": 1.0}) == {"x": 1.0}  # a session here, first
    results = pp.launch(train, strategy, nprocs=2, args=(strategy, Scale(4.0), lambda v: v + 1), timeout=90,
                        trace_dir=os.path.join(out, "trace"))
    print("RESULT " + json.dumps(results))
"""


def test_a_function_of_python_stdin_runs_in_forked_processes(tmp_path):
    out = _stdin(WORKS, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # Each process sees the world of 2 (not the parent's session of 1); mean of 0*4 and 1*4, plus 1.
    assert [(r["rank"], r["world"], r["mean"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert len({r["pid"] for r in results}) == 2
    # The parent's atexit handler ran once (in the parent), never in the forked workers; the
    # workers' own handlers did run (the trace is written at exit).
    lines = (tmp_path / "parent-atexit").read_text().split()
    assert len(lines) == 1 and int(lines[0]) not in {r["pid"] for r in results}
    assert sorted(os.listdir(tmp_path / "trace")) == ["rank0.jsonl", "rank1.jsonl"]


FAILS = """
    import polyparallel as pp

    def train(strategy):
        if strategy.rank == 1:
            raise ValueError("bad batch on rank 1")
        return strategy.reduce_metrics({"loss": 1.0})

    strategy = pp.Strategy(data=-1, timeout=20)
    try:
        pp.launch(train, strategy, nprocs=2, args=(strategy,), timeout=60)
    except pp.LaunchError as error:
        print("ERROR", error.rank, str(error).splitlines()[0])
        print("TRACEBACK", "in train" in error.traceback)
"""


def test_a_failing_rank_of_python_stdin_is_reported_with_its_traceback(tmp_path):
    out = _stdin(FAILS, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR 1 rank 1 of 2 failed: ValueError: bad batch on rank 1" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "TRACEBACK True" in out.stdout


LIVE_GROUP = """
    import os, time
    import torch.distributed as dist
    import polyparallel as pp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0])

    def train(strategy):
        dist.all_reduce(__import__("torch").ones(1), group=group)  # a closure over the parent's group

    strategy = pp.Strategy(data=-1, timeout=20)
    start = time.monotonic()
    try:
        pp.launch(train, strategy, nprocs=2, args=(strategy,), timeout=60)
    except pp.LaunchError as error:
        print("REFUSED", f"{time.monotonic() - start:.2f}", str(error))
"""


def test_forking_with_a_live_process_group_is_refused_before_any_process(tmp_path):
    out = _stdin(LIVE_GROUP, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED "))
    _, seconds, message = line.split(" ", 2)
    assert float(seconds) < 2.0
    assert "train is defined in an interactive __main__" in message
    assert "live torch.distributed process group" in message and "inside the function" in message


def test_spawned_payload_problems_are_named_before_any_process():
    import threading

    import torch.distributed as dist

    import polyparallel as pp

    start = time.monotonic()
    s = pp.Strategy(data=2, timeout=20)
    with pytest.raises(TypeError, match=r"args\[1\] \(_thread\.lock\) cannot be pickled"):
        pp.launch(print, s, 2, args=(s, threading.Lock()), timeout=30)
    with pytest.raises(TypeError, match=r"kwargs\['store'\] holds a torch.distributed process group or store, which "
                                        r"lives only in the process that made it: build it inside fn"):
        pp.launch(print, s, 2, kwargs={"store": dist.HashStore()}, timeout=30)
    assert time.monotonic() - start < 2.0


OPENMP = """
    import torch
    import polyparallel as pp

    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    for _ in range(10):
        a = (a @ a).tanh()  # the parent's OpenMP pool is live before the fork

    def train(strategy):
        b = torch.randn(256, 256)
        for _ in range(10):
            b = (b @ b).tanh()  # would wait forever for the parent's pool threads, absent in the copy
        return strategy.reduce_metrics({"threads": float(torch.get_num_threads())})

    strategy = pp.Strategy(data=-1, timeout=30)
    print("RESULT", pp.launch(train, strategy, nprocs=2, args=(strategy,), timeout=60))
"""


def test_forked_processes_do_not_hang_on_the_parents_openmp_pool(tmp_path):
    out = subprocess.run([sys.executable, "-"], input=textwrap.dedent(OPENMP), capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="2"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT [{'threads': 1.0}, {'threads': 1.0}]" in out.stdout  # one thread each, as torchrun gives
