"""``plugins/polyparallel_torch/launchers/records.py`` and ``script_worker.py``: the failure record
both ways to launch write and read, and its file, written whole or not at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import polyparallel as pp
from polyparallel_torch.launchers.records import read_failure, record_of, write_failure


def test_one_record_for_both_ways_to_launch(tmp_path):
    path = str(tmp_path / "0.err.json")
    try:
        raise pp.CollectiveError("sync_grads #2 failed\nmore lines", operation="sync_grads", axis="data", rank=1)
    except pp.CollectiveError as exc:
        write_failure(path, exc, 1, 4)
    with open(path) as f:
        data = json.load(f)
    record = read_failure(path)
    assert record == record_of(data)  # what function mode reads is what torchrun's agent hands back
    assert (record["rank"], record["world_size"], record["collective"]) == (1, 4, True)
    assert record["summary"] == "CollectiveError: sync_grads #2 failed"
    assert "Traceback" in record["traceback"] and "more lines" in record["traceback"]
    assert {"host", "time", "monotonic"} <= set(record)
    # The layout of torch's ErrorHandler, which the agent parses.
    assert data["message"]["message"] == "CollectiveError: sync_grads #2 failed\nmore lines"
    assert data["message"]["extraInfo"]["py_callstack"] == record["traceback"]
    assert int(data["message"]["extraInfo"]["timestamp"]) == int(record["time"])


def test_a_file_that_is_not_ours_has_no_record(tmp_path):
    assert read_failure(str(tmp_path / "missing.json")) is None
    (tmp_path / "torch.json").write_text(json.dumps({"message": "written by torch's own @record"}))
    assert read_failure(str(tmp_path / "torch.json")) is None
    (tmp_path / "half.json").write_text('{"message": {"mess')
    assert read_failure(str(tmp_path / "half.json")) is None
    assert record_of(None) is None and record_of({"polyparallel": "?"}) is None


WORKER = """
from polyparallel_torch.launchers.script_worker import record_error
try:
    raise ValueError("x" * 40_000_000)  # long enough that writing the file takes a while
except ValueError as exc:
    print("ready", flush=True)
    record_error(exc)
"""


@pytest.mark.timeout(120)
def test_a_worker_stopped_while_writing_its_record_leaves_no_half_file(tmp_path):
    # Old code: the worker opened TORCHELASTIC_ERROR_FILE and wrote into it; torchrun's agent, which
    # SIGTERMs the other workers when one fails and then parses their files, read an empty one
    # and failed the whole launch with a JSONDecodeError instead of restarting it (seen in
    # test_checkpoint.py's elastic restart).
    path = tmp_path / "error.json"
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(path), "RANK": "2"})
    assert worker.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 60
    while not path.exists() and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    worker.send_signal(signal.SIGTERM)  # what the agent does; the default action ends the process at once
    worker.wait(30)
    worker.stdout.close()
    if path.exists():  # then it is whole
        record = read_failure(str(path))
        assert record is not None and record["rank"] == 2 and record["summary"].startswith("ValueError: xxx")
