"""Failed jobs end: ``polyparallel launch`` takes its workers along when it is killed, refuses a
script that cannot run before any agent or worker starts, and a frozen rank ends the job within
its timeout, named as the suspect."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _cli(*args):
    return [sys.executable, "-m", "polyparallel.cli", "launch", *args]


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
