"""polyparallel.launch (spawned processes) and `polyparallel launch` (torchrun).

Every scenario runs real gloo processes; the ones that guard against a race (teardown aborts, the
wrong rank reported) run several launches in one test, so a flaky outcome fails it.
"""

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import polyparallel as pp
from polyparallel_torch.launchers.base import free_port
from polyparallel_torch.launchers.launch_dir import remove_stale_launch_dirs
from polyparallel_torch.launchers.multiprocess import launch_function

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FINISH_PLUGIN = textwrap.dedent("""
    import os
    import polyparallel as pp

    @pp.hookimpl
    def polyparallel_session_finish(session):
        path = os.path.join(os.environ["TEARDOWN_DIR"], f"finish-{session.rank}")
        with open(path, "a") as f:
            f.write("finished\\n")
""")

_OPEN_FILES = []  # files fn leaves open: the interpreter's normal exit must flush them


def _whoami(tag):
    s = pp.Strategy(data=-1, timeout=20)
    import torch.distributed as dist

    return {"tag": tag, "rank": s.rank, "world": s.world_size, "initialised": dist.is_initialized(),
            "sum": s.reduce_metrics({"r": float(s.rank)}), "env": os.environ["MASTER_ADDR"]}


def _fail_on_rank_one():
    if pp.Strategy(data=2).rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)  # must be stopped by the launcher, not waited for


def _fail_everywhere():
    raise ValueError(f"rank {pp.Strategy(data=-1).rank} is broken")


def _sleep_forever():
    time.sleep(600)


def _touch(path, text):
    with open(path, "w") as f:
        f.write(text)


def _train_ddp(fail_rank=None, fail_step=3, steps=8):
    """A few DDP steps (gloo); ``fail_rank`` raises ValueError in the middle of training while its
    peers wait in DDP's all-reduce. Registers an atexit handler and leaves a buffered file open."""
    import torch

    s = pp.Strategy(data=-1, timeout=30)  # the launch's own strategy: one session, one set of groups
    directory = os.environ["TEARDOWN_DIR"]
    atexit.register(_touch, os.path.join(directory, f"atexit-{s.rank}"), "atexit ran")
    buffered = open(os.path.join(directory, f"buffered-{s.rank}"), "w", buffering=1 << 16)  # noqa: SIM115
    buffered.write("written but never flushed by fn")
    _OPEN_FILES.append(buffered)
    torch.manual_seed(0)
    model = s.wrap_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if s.rank == fail_rank and step == fail_step:
            raise ValueError(f"rank {s.rank} hit a bad batch at step {step}")
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def teardown_env(tmp_path, monkeypatch):
    """A plugin module with a session_finish hook, handed to the workers by POLYPARALLEL_PLUGINS."""
    (tmp_path / "finish_hook_plugin.py").write_text(FINISH_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn passes sys.path to the children
    monkeypatch.setenv("POLYPARALLEL_PLUGINS", "finish_hook_plugin")

    def fresh(name):
        directory = tmp_path / name
        directory.mkdir()
        monkeypatch.setenv("TEARDOWN_DIR", str(directory))
        return directory
    return fresh


def test_results_come_back_by_rank_with_groups_ready(run):
    results = run(_whoami, pp.Strategy(data=-1), 3, "x")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["initialised"] and r["env"] == "127.0.0.1" for r in results)
    assert all(r["sum"] == {"r": 1.0} for r in results)


@pytest.mark.timeout(600)
def test_teardown_runs_hooks_atexit_and_flushes_files_without_aborting(teardown_env):
    # Old code: workers ended with os._exit(0): no session_finish hook, no atexit, no flush.
    for attempt in range(5):
        directory = teardown_env(f"run{attempt}")
        params = pp.launch(_train_ddp, pp.Strategy(data=-1, timeout=30), 2, timeout=240)
        assert all(a.equal(b) for a, b in zip(params[0], params[1], strict=True))  # replicas agree: DDP really ran
        for rank in (0, 1):
            assert (directory / f"finish-{rank}").read_text() == "finished\n", (attempt, rank)
            assert (directory / f"atexit-{rank}").read_text() == "atexit ran", (attempt, rank)
            assert (directory / f"buffered-{rank}").read_text() == "written but never flushed by fn", (attempt, rank)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_the_failing_rank_is_reported_not_the_peer_that_lost_it(teardown_env, nprocs):
    # Old code: rank 0's gloo "Connection closed by peer" was reported in 3 of 5 runs.
    for attempt in range(5):
        directory = teardown_env(f"run{attempt}")
        with pytest.raises(pp.LaunchError) as info:
            pp.launch(_train_ddp, pp.Strategy(data=-1, timeout=30), nprocs, kwargs={"fail_rank": 1},
                      timeout=240)
        error = info.value
        assert error.rank == 1, (attempt, str(error))
        assert str(error).startswith(f"rank 1 of {nprocs} failed: ValueError: rank 1 hit a bad batch at step 3")
        assert "ValueError: rank 1 hit a bad batch at step 3" in error.traceback
        assert "Other ranks:" in str(error)
        # The failing rank tore down like any other: its hook and atexit handler ran.
        assert (directory / "finish-1").read_text() == "finished\n"
        assert (directory / "atexit-1").read_text() == "atexit ran"


def test_failing_rank_shows_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(pp.LaunchError, match="rank one is broken") as info:
        pp.launch(_fail_on_rank_one, pp.Strategy(data=2), 2, timeout=120)
    assert info.value.rank == 1 and "ValueError" in info.value.traceback
    assert "rank 0: stopped by the launcher" in str(info.value)
    assert time.monotonic() - start < 45


def test_every_rank_failing_reports_the_earliest_and_lists_the_others():
    with pytest.raises(pp.LaunchError, match=r"^rank [01] of 2 failed: ValueError: rank [01] is broken") as info:
        pp.launch(_fail_everywhere, pp.Strategy(data=2), 2, timeout=120)
    other = 1 - info.value.rank
    assert f"rank {other}: ValueError: rank {other} is broken" in str(info.value)


def test_a_failed_launch_leaves_no_descriptor_or_directory_behind(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def failing_launch():
        try:
            pp.launch(_fail_everywhere, pp.Strategy(data=2), 2, timeout=120)
        except pp.LaunchError:
            pass
        else:
            raise AssertionError("the launch should have failed")

    failing_launch()  # the first one may start multiprocessing's resource tracker, which stays
    before = sorted(os.listdir("/proc/self/fd"))
    failing_launch()
    after = sorted(os.listdir("/proc/self/fd"))  # no gc.collect(): closed now, not when collected
    assert after == before
    assert list(tmp_path.iterdir()) == []


def test_launch_timeout_terminates_everything():
    start = time.monotonic()
    with pytest.raises(pp.LaunchError, match="did not finish within 3 s"):
        pp.launch(_sleep_forever, pp.Strategy(data=2), 2, timeout=3)
    assert time.monotonic() - start < 30


def test_world_size_mismatch_refused_before_any_process():
    start = time.monotonic()
    with pytest.raises(pp.TopologyError, match=r"needs 2 ranks but the world size is 3"):
        pp.launch(_sleep_forever, pp.Strategy(data=2), 3, timeout=5)
    with pytest.raises(pp.TopologyError, match="does not divide world size 3"):
        pp.launch(_sleep_forever, pp.Strategy(data=-1, tensor=2), 3, timeout=5)
    with pytest.raises(pp.UnsupportedTopologyError, match="cannot combine pipeline=2 with tensor=2"):
        pp.launch(_sleep_forever, pp.Strategy(tensor=2, pipeline=2), 4, runtime="torch", timeout=5)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(("timeout", "error", "message"), [
    ("60", TypeError, r"must be a number of seconds or None\. Received: '60' \(str\)"),
    (True, TypeError, r"Received: True \(bool\)"),
    (0, ValueError, r"positive, finite number of seconds .* Received: 0\."),
    (-5.0, ValueError, r"Received: -5\.0\."),
    (float("nan"), ValueError, r"Received: nan\."),
    (float("inf"), ValueError, r"Received: inf\."),
])
def test_a_bad_timeout_is_refused_before_any_process(timeout, error, message):
    # Old code: timeout="60" failed after the processes started and left them running.
    start = time.monotonic()
    with pytest.raises(error, match=message):
        launch_function(_sleep_forever, pp.Strategy(data=2), 2, (), {}, timeout=timeout)
    assert time.monotonic() - start < 1.0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_is_refused_before_any_process():
    start = time.monotonic()
    with pytest.raises(pp.TopologyError, match=r"backend='nccl'\) needs CUDA GPUs.*Use backend='gloo'"):
        pp.launch(_sleep_forever, pp.Strategy(data=2, backend="nccl"), 2, timeout=60)
    # Other backends are refused by the core before a strategy exists: a per-device mapping is
    # not a backend name, and no installed runtime declares 'glo'.
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend=\) must be a name .* Received: 'cpu:gloo,cuda:nccl'"):
        pp.Strategy(data=2, backend="cpu:gloo,cuda:nccl")
    with pytest.raises(pp.TopologyError, match=r"Strategy\(backend='glo'\) is a backend of no installed runtime"):
        pp.launch(_sleep_forever, pp.Strategy(data=2, backend="glo"), 2, timeout=60)
    assert time.monotonic() - start < 1.0


LONG_LAUNCH = textwrap.dedent("""
    import time, polyparallel as pp

    def sleep():
        time.sleep(600)

    if __name__ == "__main__":
        pp.launch(sleep, pp.Strategy(data=2), 2, timeout=300)
""")


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_directory_of_a_killed_launcher_is_removed_by_the_next_launch(tmp_path):
    script = tmp_path / "long_launch.py"
    script.write_text(LONG_LAUNCH)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "TMPDIR": str(tmp)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (list(tmp.glob("polyparallel-launch-*")) and len(_children(parent.pid)) >= 2):
            assert time.monotonic() < deadline and parent.poll() is None, "the launch did not start"
            time.sleep(0.2)
        (directory,) = tmp.glob(f"polyparallel-launch-{parent.pid}-*")
        workers = _children(parent.pid)
        assert remove_stale_launch_dirs(str(tmp)) == []  # its launcher is alive
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60  # the orphaned workers end (parent-death signal) ...
        while any(_running(pid) for pid in workers):
            assert time.monotonic() < deadline, "workers outlived their killed launcher"
            time.sleep(0.2)
        assert directory.is_dir()  # ... but a SIGKILLed launcher cannot clean up ...
        assert remove_stale_launch_dirs(str(tmp)) == [str(directory)]  # ... the next launch does
        assert not directory.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_another_users_or_foreign_directories_are_left_alone(tmp_path):
    (tmp_path / "polyparallel-launch-abc123").mkdir()  # an old-style name, no lock: not ours to judge
    (tmp_path / "polyparallel-launch-1-x").mkdir()  # our pattern but no lock file
    assert remove_stale_launch_dirs(str(tmp_path)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["polyparallel-launch-1-x", "polyparallel-launch-abc123"]


# -- polyparallel launch (torchrun) --------------------------------------------------------------------------------


SCRIPT = textwrap.dedent("""
    import json, os, sys, polyparallel as pp
    s = pp.Strategy(data=-1, timeout=30)
    got = s.reduce_metrics({"loss": pp.Mean(float(s.rank + 1), 1)})
    row = {"rank": s.rank, "world": s.world_size, "node_rank": int(os.environ["GROUP_RANK"]), **got}
    sys.stdout.write("RESULT " + json.dumps(row) + "\\n")
    sys.stdout.flush()
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], f"{s.rank}.json"), "w") as f:
            json.dump(row, f)
""")


def _cli(*args, timeout=150):
    return ["timeout", "-k", "10", str(timeout), sys.executable, "-m", "polyparallel.cli", "launch", *args]


def test_cli_launch_delegates_to_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(_cli("--nproc-per-node", "2", str(script)), capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two ranks print to one pipe: lines may interleave, so find each JSON object after its marker.
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["world"] == 2 and r["loss"] == 1.5 for r in rows)


@pytest.mark.timeout(400)
def test_cli_launch_two_nodes_on_this_machine(tmp_path):
    # Two agents (node 0 and node 1) of 2 processes each meet at one endpoint: a 4-rank job.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(_cli("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                    "--rdzv-endpoint", endpoint, "--rdzv-timeout", "120", str(script), str(out),
                                    timeout=300),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for node in (0, 1)]
    outputs = [agent.communicate(timeout=330)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    rows = sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert sorted(r["node_rank"] for r in rows) == [0, 0, 1, 1]  # two ranks from each agent
    # A real all-reduce over the 4 ranks: the count-weighted mean of 1, 2, 3, 4 on every rank.
    assert all(r["world"] == 4 and r["loss"] == 2.5 for r in rows)


def test_cli_launch_gives_up_when_a_node_never_joins(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    proc = subprocess.run(_cli("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                               "--rdzv-timeout", "5", str(script)),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr  # 124: killed by `timeout`, a hang
    assert f"RendezvousTimeoutError (rendezvous at {endpoint}, --nnodes 2). Not every node joined" in proc.stderr
    assert time.monotonic() - start < 120


def test_cli_launch_reports_a_failing_script(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit(3)\n")
    proc = subprocess.run(_cli("--nproc-per-node", "2", str(script)), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0


def test_a_launched_script_has_its_folder_first_on_sys_path_and_not_the_working_directory(tmp_path):
    # `polyparallel launch` runs each worker through polyparallel_torch.launchers.script_worker; sys.path must be what
    # `python SCRIPT` gives: the script's folder first and the working directory absent, so that a
    # json.py there shadows nothing (a plain `python -m` wrapper put it first).
    work, code = tmp_path / "work", tmp_path / "code"
    work.mkdir()
    code.mkdir()
    (work / "json.py").write_text("raise ImportError('the working directory shadowed json')\n")
    (code / "train.py").write_text(
        "import json, os, sys\n"
        "print('PATHS ' + json.dumps([sys.path[0], os.getcwd() in sys.path, os.path.realpath(json.__file__)]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["timeout", "-k", "10", "150", sys.executable, "-P", "-m", "polyparallel.cli", "launch",
                "--nproc-per-node", "1", str(code / "train.py")]  # -P: the launcher's own imports stay safe
    outputs = []
    for command in ([sys.executable, str(code / "train.py")], launcher):
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, (command, done.stdout + done.stderr)
        outputs.append(json.loads(re.findall(r"PATHS (\[.*\])", done.stdout)[-1]))
    plain, launched = outputs
    assert launched == plain, outputs
    assert launched[0] == str(code) and launched[1] is False and not launched[2].startswith(str(work)), outputs
