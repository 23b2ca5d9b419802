"""polyparallel.launch (torch.multiprocessing) and `polyparallel launch` (torchrun)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import polyparallel as pp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _whoami(tag):
    s = pp.Strategy(data=-1, timeout=20)
    import torch.distributed as dist

    return {"tag": tag, "rank": s.rank, "world": s.world_size, "initialised": dist.is_initialized(),
            "sum": s.reduce_metrics({"r": float(s.rank)}), "env": os.environ["MASTER_ADDR"]}


def _fail_on_rank_one():
    if pp.Strategy(data=2).rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)  # must be stopped by the launcher, not waited for


def _sleep_forever():
    time.sleep(600)


def test_results_come_back_by_rank_with_groups_ready(run):
    results = run(_whoami, pp.Strategy(data=-1), 3, "x")
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["initialised"] and r["env"] == "127.0.0.1" for r in results)
    assert all(r["sum"] == {"r": 1.0} for r in results)


def test_failing_rank_shows_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(pp.LaunchError, match="rank one is broken") as info:
        pp.launch(_fail_on_rank_one, pp.Strategy(data=2), 2, timeout=120)
    assert info.value.rank == 1 and "ValueError" in info.value.traceback
    assert time.monotonic() - start < 45


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


SCRIPT = textwrap.dedent("""
    import json, sys, polyparallel as pp
    s = pp.Strategy(data=-1, timeout=30)
    got = s.reduce_metrics({"loss": pp.Mean(float(s.rank + 1), 1)})
    sys.stdout.write("RESULT " + json.dumps({"rank": s.rank, "world": s.world_size, **got}) + "\\n")
    sys.stdout.flush()
""")


def test_cli_launch_delegates_to_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["timeout", "-k", "10", "150", sys.executable, "-m", "polyparallel.cli", "launch",
         "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two ranks print to one pipe: lines may interleave, so find each JSON object after its marker.
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["world"] == 2 and r["loss"] == 1.5 for r in rows)


def test_cli_launch_reports_a_failing_script(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit(3)\n")
    proc = subprocess.run(
        ["timeout", "-k", "10", "150", sys.executable, "-m", "polyparallel.cli", "launch",
         "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
