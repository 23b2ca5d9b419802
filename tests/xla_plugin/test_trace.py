"""The XLA runtime's collective trace on 2 XLA CPU devices (replica threads of one process): each
replica records its own rank's host checks and XLA all-reduces (operation, axis, sequence number,
detail, the user's line), a replica whose host check times out names what its peer is doing
(another operation on another axis, with its line), and ``launch(trace_dir=)`` writes one file per
rank that ``polyparallel trace`` aligns. One launch (start-up costs seconds)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch_xla")
import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel import _trace_report  # noqa: E402
from polyparallel.cli import cli  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TIMEOUT = 3


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line(" not in line)


def hang() -> dict:
    strategy = pp.Strategy(data=2, runtime="xla", timeout=TIMEOUT)
    rank = strategy.session().rank
    loader = strategy.shard_data(TensorDataset(torch.arange(8)), batch_size=4)
    strategy.reduce_metrics({"loss": 1.0})  # both ranks: reduce_metrics #1
    try:
        if rank == 0:
            strategy.reduce_metrics({"loss": 2.0})  # rank 0: reduce_metrics #2, waits for rank 1
        else:
            time.sleep(0.5)  # rank 0 times out first, while rank 1 still waits
            next(iter(loader))  # rank 1: a loader pass, checked over the world axis
    except pp.CollectiveTimeout as exc:
        return {"rank": rank, "error": str(exc)}
    return {"rank": rank, "error": None}


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[list[dict], str]:
    directory = str(tmp_path_factory.mktemp("xla-trace"))
    strategy = pp.Strategy(data=2, runtime="xla", timeout=TIMEOUT)
    return pp.launch(hang, strategy, nprocs=2, trace_dir=directory, timeout=200), directory


def test_a_timed_out_host_check_names_the_peers_operation_and_line(traced):
    results, _ = traced
    first = str(_line("rank 0: reduce_metrics #2"))
    loop = str(_line("rank 1: a loader pass"))
    zero, one = (r["error"] for r in results)
    assert zero is not None and one is not None, results
    assert zero.startswith(f"reduce_metrics #2 over the 'data' axis did not complete within the strategy's timeout "
                           f"of {TIMEOUT} s on rank 0"), zero
    assert "rank 1 entered shard_data pass" in zero and f"#1 over the 'world' axis (test_trace.py:{loop})" in zero, zero
    assert f"rank 0 waits in reduce_metrics #2 (test_trace.py:{first})" in zero, zero
    # Rank 1 times out later: rank 0's replica has returned by then (it caught its timeout).
    assert f"rank 0 finished (its last collective: reduce_metrics #2 (test_trace.py:{first}, failed))" in one, one
    assert "rank 1 waits in shard_data pass" in one, one


def test_every_replica_writes_its_own_ranks_trace(traced):
    _, directory = traced
    traces = _trace_report.read_dir(directory)
    assert sorted(traces) == [0, 1]
    assert [traces[r]["header"]["rank"] for r in (0, 1)] == [0, 1]
    assert {t["header"]["world_size"] for t in traces.values()} == {2}
    assert traces[0]["header"]["failure"].startswith("reduce_metrics #2 over the 'data' axis did not complete")
    zero = [(e["operation"], e["axis"], e["seq"], e["state"]) for e in traces[0]["entries"]]
    one = [(e["operation"], e["axis"], e["seq"], e["state"]) for e in traces[1]["entries"]]
    reduce = ("reduce_metrics", "data", 1, "done")
    all_reduce = ("reduce_metrics: XLA all-reduce", "data", None, "done")
    assert zero == [reduce, all_reduce, ("reduce_metrics", "data", 2, "failed")], zero
    assert one[:2] == [reduce, all_reduce] and one[2][1:] == ("world", 1, "failed") and len(one) == 3, one
    assert one[2][0].startswith("shard_data pass")
    first = traces[0]["entries"][0]
    assert first["user"].endswith(f"test_trace.py:{_line('both ranks: reduce_metrics #1')}")
    assert first["detail"] == "loss:mean[1]" and traces[0]["entries"][1]["detail"] == "sum 1 tensor(s): float64[1]"
    assert traces[0]["entries"][2]["error"].startswith("CollectiveTimeout: reduce_metrics #2")


def test_polyparallel_trace_aligns_the_xla_ranks(traced):
    _, directory = traced
    result = CliRunner().invoke(cli, ["trace", directory])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("rank 0" in line and "rank 1" in line for line in lines), result.output
    data1 = next(line for line in lines if " data " in line and " 1 " in line and "reduce_metrics" in line)
    assert data1.count("reduce_metrics") == 2 and not data1.startswith("!"), result.output
    data2 = next(line for line in lines if " data " in line and " 2 " in line)
    assert data2.startswith("!") and "[failed]" in data2 and data2.rstrip().endswith("-"), result.output
    world = next(line for line in lines if " world " in line)
    assert world.startswith("!") and "shard_data" in world, result.output
