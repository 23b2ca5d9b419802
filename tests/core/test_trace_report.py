"""Reading traces (framework-free): what every rank of a group was doing, and `polyparallel
trace DIR`'s aligned timelines (`_trace_report`, `_trace_cli`)."""

import json

import pytest
from click.testing import CliRunner

from polyparallel import _trace_report
from polyparallel.cli import cli


def _entry(op, seq, state, line, axis="data", user="/job/train.py", site=None, t0=100.0):
    return {"operation": op, "axis": axis, "seq": seq, "state": state, "user": f"{user}:{line}",
            "site": site or f"{user}:{line}", "t0": t0, "t1": None if state in ("entered", "running") else t0 + 0.01,
            "detail": "", "error": None}


def _state(rank, entries, stack=None, exited=False):
    return {"rank": rank, "gen": 1, "entries": entries, "stack": stack, "exited": exited}


def test_a_rank_outside_any_collective_is_named_with_its_last_one_and_its_stack():
    states = {
        0: _state(0, [_entry("reduce_metrics", 13, "done", 40), _entry("reduce_metrics", 14, "entered", 63)]),
        1: _state(1, [_entry("reduce_metrics", 13, "done", 40)], stack='  File "train.py", line 70, in step\n'),
    }
    summary, details = _trace_report.describe_group(states, me=0, answer_s=2)
    assert summary == ("rank 1 has not entered any collective since reduce_metrics #13 (train.py:40, done); "
                       "rank 0 waits in reduce_metrics #14 (train.py:63)")
    assert details == ["rank 1's stack (the thread that runs its collectives):",
                       '      File "train.py", line 70, in step']


def test_ranks_at_another_operation_or_axis_silent_or_exited_are_told_apart():
    waiting = [_entry("reduce_metrics", 14, "entered", 63)]
    states = {
        0: _state(0, waiting), 1: _state(1, waiting), 2: _state(2, waiting),
        3: _state(3, [_entry("sync_states", 14, "entered", 57)]),
        4: _state(4, [_entry("train_step", 2, "running", 80, axis="pipeline")]),
        5: None,
        6: _state(6, [_entry("reduce_metrics", 13, "done", 40)], exited=True),
        7: _state(7, []),
    }
    summary, _ = _trace_report.describe_group(states, me=0, answer_s=1.5)
    parts = summary.split("; ")
    assert "rank 3 entered sync_states #14 (train.py:57)" in parts
    assert "rank 4 entered train_step #2 over the 'pipeline' axis (train.py:80)" in parts
    assert ("rank 5 did not answer within 1.5 s (its process exited or is frozen, or it has no side channel)"
            in parts)
    assert "rank 6 has exited (its last collective: reduce_metrics #13 (train.py:40, done))" in parts
    assert "rank 7 has not entered any collective yet" in parts
    assert parts[-1] == "ranks 0\u20132 wait in reduce_metrics #14 (train.py:63)"  # grouped, and last


def test_a_frameworks_frame_is_shown_after_the_users_line():
    entry = _entry("barrier", None, "entered", 12, site="/venv/lightning/pytorch/loops/fit_loop.py:301")
    assert _trace_report.location(entry) == "train.py:12 via fit_loop.py:301"
    assert _trace_report.label(entry) == "barrier"
    assert _trace_report.rank_ranges([4, 0, 2]) == "ranks 0, 2, 4"


def _write(directory, rank, entries, **header):
    lines = [{"rank": rank, "world_size": 3, "host": "h", "pid": 10 + rank, "reason": "exit", "failure": None,
              "dropped": 0, **header}, *entries]
    (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_trace_aligns_the_ranks_and_marks_where_they_differ(tmp_path):
    _write(tmp_path, 0, [_entry("init_process_group", None, "done", 5, axis="world", t0=1.0),
                         _entry("reduce_metrics", 1, "done", 40, t0=2.0),
                         _entry("reduce_metrics", 2, "failed", 63, t0=3.0)],
           failure="reduce_metrics #2 over the 'data' axis did not complete")
    _write(tmp_path, 1, [_entry("init_process_group", None, "done", 5, axis="world", t0=1.1),
                         _entry("reduce_metrics", 1, "done", 40, t0=2.1)])
    header, rows = _trace_report.timeline(_trace_report.read_dir(str(tmp_path)))
    assert header == ["", "t (s)", "axis", "#", "rank 0", "rank 1"]
    assert [r[:4] for r in rows] == [["", "0.000", "world", "1u"], ["", "1.000", "data", "1"],
                                     ["!", "2.000", "data", "2"]]
    assert rows[2][4] == "reduce_metrics [failed] 10.0ms (train.py:63)" and rows[2][5] == "-"
    result = CliRunner().invoke(cli, ["trace", str(tmp_path), "--rank", "0", "--last", "2"])
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    assert out[0] == ("rank 0 (host h, pid 10): 3 collectives; written at exit after: reduce_metrics #2 over the "
                      "'data' axis did not complete")
    assert out[1] == "rank 1 (host h, pid 11): 2 collectives; written at exit"
    assert out[2] == "no trace from rank(s) [2] of 3: killed before writing, or another directory"
    assert sum(line.startswith(("  ", "! ")) and " data " in line for line in out) >= 2
    assert "init_process_group" not in "\n".join(out[3:8])  # --last 2: the first row is left out
    assert "rank 0:" in out and any("failed" in line and "/job/train.py:63" in line for line in out)
    as_json = json.loads(CliRunner().invoke(cli, ["trace", str(tmp_path), "--json"]).output)
    assert sorted(as_json) == ["0", "1"] and len(as_json["0"]["entries"]) == 3


def test_trace_refuses_what_is_not_a_trace_directory(tmp_path):
    result = CliRunner().invoke(cli, ["trace", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "is not a directory" in result.output
    result = CliRunner().invoke(cli, ["trace", str(tmp_path)])
    assert result.exit_code != 0 and "holds no rank<r>.jsonl trace file" in result.output
    (tmp_path / "rank0.jsonl").write_text("not json\n")
    result = CliRunner().invoke(cli, ["trace", str(tmp_path)])
    assert result.exit_code != 0 and "is not a trace file (JSON lines)" in result.output
    _write(tmp_path, 0, [])
    result = CliRunner().invoke(cli, ["trace", str(tmp_path), "--rank", "5"])
    assert result.exit_code != 0 and "no trace of rank(s) [5]" in result.output


@pytest.mark.parametrize(("lines", "message"), [
    (['{"rank": 0}', '{"foo": 1}'], "line 2: a trace entry needs 'operation'"),
    (['{"rank": 0}', '{"operation": "x", "axis": 3, "state": "done", "t0": 0}'], "line 2: the trace entry's 'axis' is int"),
    (['{"rank": 0}', '[1, 2]'], "line 2: a trace entry is a JSON object, not list"),
    (['[1]'], "line 1: the header is a JSON object, not list"),
])
def test_trace_names_the_file_and_line_of_a_record_of_the_wrong_shape(tmp_path, lines, message):
    (tmp_path / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["trace", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert f"{tmp_path / 'rank0.jsonl'} is not a trace file (JSON lines): {message}" in result.output, result.output


def test_trace_names_a_binary_file(tmp_path):
    (tmp_path / "rank0.jsonl").write_bytes(bytes(range(256)) * 4)
    result = CliRunner().invoke(cli, ["trace", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert f"{tmp_path / 'rank0.jsonl'} is not a trace file (JSON lines): it is not UTF-8 text" in result.output


@pytest.mark.parametrize("bad", ["-1"])
def test_trace_refuses_a_negative_row_count(tmp_path, bad):
    _write(tmp_path, 0, [])
    result = CliRunner().invoke(cli, ["trace", str(tmp_path), "--last", bad])
    assert result.exit_code != 0 and "expected 0 (all) or more rows" in result.output


@pytest.mark.parametrize("world", [2, 4, 8])
def test_trace_fits_long_operation_names_in_100_columns_and_lists_them_in_full_below(tmp_path, world):
    long_op = "reduce_metrics[" + "train/loss_of_a_lightning_metric_key_" * 4 + "]"  # ~165 characters
    assert len(long_op) >= 150
    for rank in range(world):
        _write(tmp_path, rank, [_entry("init_process_group", None, "done", 5, axis="world", t0=1.0),
                                _entry(long_op, 1, "done", 40, t0=2.0),
                                _entry(f"{long_op}{rank}", 2, "entered", 63, t0=3.0)], world_size=world)
    result = CliRunner().invoke(cli, ["trace", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.output.splitlines()
    table_end = next(i for i, line in enumerate(out) if line.startswith("[1] "))
    assert all(len(line) <= 100 for line in out[:table_end]), "\n".join(out)
    assert all(len(line) <= 100 for line in out if not line.startswith("["))
    below = out[table_end:]
    notes = {line.partition("] ")[2] for line in below if line.startswith("[")}
    assert f"{long_op} 10.0ms (train.py:40)" in notes
    for rank in range(world):
        assert f"{long_op}{rank} [entered] (train.py:63)" in notes, rank
        assert any(f"rank {rank}" in line for line in out[:table_end])
    assert sum(line.count("...[") for line in out[:table_end]) >= 2 * world  # each long cell cut, keyed to a note
    legend = " ".join(below)
    assert "u after it: not identity-checked, paired by its order on the axis" in legend
    assert "!: the ranks differ" in legend
    # the rows themselves are unchanged: one per sequence number, the unchecked one marked 1u
    header, rows = _trace_report.timeline(_trace_report.read_dir(str(tmp_path)))
    assert [r[3] for r in rows] == ["1u", "1", "2"] and rows[1][4] == f"{long_op} 10.0ms (train.py:40)"
