"""Failed jobs end: ``polyparallel launch`` takes its workers along when it is killed, refuses a
script that cannot run before any agent or worker starts, and a frozen rank ends the job within
its timeout, named as the suspect."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from polyparallel_torch.testing import source_line

from .test_launch import _running  # whether a process is alive (not a zombie)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _cli(*args):
    return [sys.executable, "-m", "polyparallel.cli", "launch", *args]




SLEEPER = textwrap.dedent("""
    import os, sys, time
    with open(os.path.join(sys.argv[1], f"worker{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_cli_launcher_killed_by_sigkill_takes_its_workers_along(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen(_cli("--nproc-per-node", "2", str(script), str(tmp_path)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the workers did not start"
            time.sleep(0.2)
            workers = [int(p.read_text()) for p in tmp_path.glob("worker*") if p.read_text()]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in workers):
            assert time.monotonic() < deadline, "workers outlived their SIGKILLed `polyparallel launch`"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:  # only the workers this test started
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("missing.py", None, r"^polyparallel launch: no such script: '.*missing\.py'\. No process was started"),
    ("broken.py", "import os\n\ndef f(:\n    pass\n", r"broken\.py:3: SyntaxError: .*\n    def f\(:\nNo process was started"),
])
def test_a_script_that_cannot_run_is_refused_before_any_agent_starts(tmp_path, name, text, message):
    script = tmp_path / name
    if text is not None:
        script.write_text(text)
    start = time.monotonic()
    proc = subprocess.run(_cli("--nproc-per-node", "2", str(script)), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCHELASTIC_LOG_LEVEL": "INFO"})
    assert proc.returncode == 2
    assert __import__("re").search(message, proc.stderr), proc.stderr
    # Nothing started: no agent, no rendezvous, no worker (torchrun logs its agent's start).
    assert "Starting elastic_operator" not in proc.stderr and "rdzv" not in proc.stderr.lower()
    assert time.monotonic() - start < 10


# -- a frozen rank, a silent one ---------------------------------------------------------------------------------

TIMEOUT = 8.0  # the strategy's collective timeout in these tests


def _freeze_rank_one(marker):
    """DDP training; rank 1 freezes itself (SIGSTOP) at step 3, saying when."""
    import torch

    import polyparallel as pp

    s = pp.Strategy(data=-1, timeout=TIMEOUT)
    model = s.wrap_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10**6):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        if step == 3 and s.rank == 1:
            with open(marker, "w") as f:
                f.write(str(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process of this host
            os.kill(os.getpid(), signal.SIGSTOP)


def _rank_one_goes_silent(marker, record=False, checked=False):
    """DDP training; rank 1 stops training at step 3 (alive, busy elsewhere) while rank 0 goes on.
    Without DDP's bucket recording (``record``), rank 0's error is gloo's bare timeout in
    backward, which names no peer; with it, the launcher turns that timeout into polyparallel's,
    with the hang report (with ``GradPolicy(check_backward=True)``, the identity check of rank 0's
    backward times out with it)."""
    import torch

    import polyparallel as pp

    if not record:
        os.environ["POLYPARALLEL_TRACE_DDP"] = "0"

    s = pp.Strategy(data=-1, timeout=TIMEOUT, grad_policy=pp.GradPolicy(check_backward=checked))
    model = s.wrap_model(torch.nn.Linear(4, 1))
    for step in range(10**6):
        if step == 3 and s.rank == 1:
            with open(marker, "w") as f:
                f.write(str(time.monotonic()))
            time.sleep(600)  # rank 1 goes silent
        model(torch.ones(2, 4)).sum().backward()  # rank 0 trains on


@pytest.mark.timeout(120)
def test_a_frozen_rank_is_killed_at_once_and_named_as_the_suspect(tmp_path):
    import polyparallel as pp

    marker = tmp_path / "frozen-at"
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_freeze_rank_one, pp.Strategy(data=2, timeout=TIMEOUT), 2, args=(str(marker),), timeout=100)
    took = time.monotonic() - float(marker.read_text())
    # The peer times out after TIMEOUT; the frozen process is killed at once, not waited for nor
    # sent a SIGTERM it cannot receive (before: + 5 s grace + 5 s SIGTERM wait, and rank 0 was
    # named). The bound: the 5 s, plus 1 s for the peer's teardown on a loaded machine.
    assert took < TIMEOUT + 6, took
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("rank 1 of 2 is the suspect: its peers' collectives timed out waiting for it, and it "
                              "was frozen (stopped by a signal, SIGSTOP"), message
    assert "\n  rank 0: " in message and "collective failure" in message


@pytest.mark.slow  # the peer's timeout, the grace period and the SIGTERM teardown: ~20 s
@pytest.mark.timeout(120)
def test_a_rank_alive_but_silent_while_its_peers_time_out_is_named_as_the_suspect(tmp_path):
    import polyparallel as pp

    marker = tmp_path / "silent-at"
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_rank_one_goes_silent, pp.Strategy(data=2, timeout=TIMEOUT), 2, args=(str(marker),), timeout=100)
    took = time.monotonic() - float(marker.read_text())
    assert took < TIMEOUT + 5 + 5 + 3, took  # the peer's timeout, the grace period, the SIGTERM teardown
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("rank 1 of 2 is the suspect: its peers' collectives timed out waiting for it, and it "
                              "was still running but never answered"), message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checked", [False, True], ids=["recorded", "checked"])
def test_with_ddps_buckets_recorded_a_silent_rank_is_named_by_its_peers_timeout(tmp_path, checked):
    # DDP's bucket all-reduces recorded (the default): gloo's timeout raised out of rank 0's
    # backward becomes polyparallel's CollectiveTimeout, whose hang report names rank 1, its last
    # operation and its stack (before: the bare gloo timeout, naming no peer). Checked
    # (GradPolicy(check_backward=True)): the backward's identity check times out with that report.
    import polyparallel as pp

    marker = str(tmp_path / "silent-at")
    strategy = pp.Strategy(data=2, timeout=TIMEOUT, grad_policy=pp.GradPolicy(check_backward=checked))
    with pytest.raises(pp.LaunchError) as info:
        pp.launch(_rank_one_goes_silent, strategy, 2, args=(marker, True, checked), timeout=100)
    message, here = str(info.value), os.path.basename(__file__)
    first = message.splitlines()[0]
    backward = source_line(_rank_one_goes_silent, "rank 0 trains on")
    if checked:
        assert first.startswith("rank 0 of 2 failed: CollectiveTimeout: DDP gradient all-reduce #"), message
        assert re.search(rf"rank 1 has not entered any collective since DDP gradient all-reduce #\d+ \({here}:{backward}",
                         first), message
    else:
        assert first.startswith("rank 0 of 2 failed: CollectiveTimeout: DDP gradient all-reduce over the 'data' axis "
                                "did not complete within the strategy's timeout"), message
        assert f"rank 0 waits in DDP gradient all-reduce ({here}:{backward}" in first, message
        assert f"rank 1 has not entered any collective since DDP gradient all-reduce ({here}:{backward}" in first, message
        assert "Timed out waiting" in first, message  # gloo's words, as what the backend said
    assert f"line {source_line(_rank_one_goes_silent, 'rank 1 goes silent')}, in _rank_one_goes_silent" in message, message


FREEZING_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import polyparallel as pp

    s = pp.Strategy(data=-1, timeout=float(sys.argv[2]))
    model = s.wrap_model(torch.nn.Linear(4, 1))
    for step in range(10**6):
        model(torch.ones(2, 4)).sum().backward()
        if step == 3 and s.rank == 1:
            with open(sys.argv[1], "w") as f:
                f.write(str(time.monotonic()))
            os.kill(os.getpid(), signal.SIGSTOP)
""")


@pytest.mark.timeout(150)
def test_a_frozen_rank_of_a_cli_launch_is_killed_at_once_and_named(tmp_path):
    script = tmp_path / "freeze.py"
    script.write_text(FREEZING_SCRIPT)
    marker = tmp_path / "frozen-at"
    proc = subprocess.run(_cli("--nproc-per-node", "2", str(script), str(marker), str(TIMEOUT)), capture_output=True,
                          text=True, timeout=140)
    took = time.monotonic() - float(marker.read_text())
    assert proc.returncode == 1, proc.stderr[-3000:]
    # Before: torchrun's agent sent the frozen worker a SIGTERM it cannot receive and waited 30 s.
    assert took < TIMEOUT + 6, took
    assert "polyparallel launch: rank 1 of 2 is the suspect: its peers' collectives timed out waiting for it, and it " \
           "was frozen" in proc.stderr, proc.stderr[-3000:]


SILENT_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import polyparallel as pp

    s = pp.Strategy(data=-1, timeout=float(sys.argv[1]))
    model = s.wrap_model(torch.nn.Linear(4, 1))
    for step in range(10**6):
        if step == 3 and s.rank == 1:
            time.sleep(600)  # rank 1 goes silent
        model(torch.ones(2, 4)).sum().backward()  # rank 0 trains on
""")


@pytest.mark.timeout(150)
def test_under_the_cli_launcher_a_ddp_backwards_backend_timeout_is_reported_with_the_hang_report(tmp_path):
    # polyparallel launch's workers translate gloo's timeout raised out of a recorded DDP
    # backward as pp.launch's do (before: gloo's bare "Timed out waiting" naming no peer).
    script = tmp_path / "silent.py"
    script.write_text(SILENT_SCRIPT)
    proc = subprocess.run(["timeout", "-k", "10", "140", *_cli("--nproc-per-node", "2", str(script), str(TIMEOUT))],
                          capture_output=True, text=True, timeout=145, env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = proc.stderr
    assert proc.returncode not in (0, 124), err[-3000:]
    report = err[err.index("polyparallel launch: "):]
    assert report.startswith("polyparallel launch: rank 0 of 2 failed: CollectiveTimeout: DDP gradient all-reduce over "
                             "the 'data' axis did not complete within the strategy's timeout"), err[-3000:]
    first = report.splitlines()[0]
    assert "rank 0 waits in DDP gradient all-reduce (silent.py:11" in first, err[-3000:]
    assert "rank 1 has not entered any collective since DDP gradient all-reduce (silent.py:11" in first, err[-3000:]
    assert 'silent.py", line 10, in <module>' in report, err[-3000:]  # rank 1's stack: its sleep
