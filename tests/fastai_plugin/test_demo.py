"""The fastai row of ``polyparallel demo`` (``bash tools/demo.sh``)."""

import pytest

import polyparallel as pp
from polyparallel_fastai.demo import run_demo

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_demo_row_trains_the_digits_as_the_plain_torch_row() -> None:
    from polyparallel_torch.demo import run_demo as run_torch_demo

    row = run_demo(pp.Strategy(data=2, timeout=60), 2)
    assert row["framework"] == "fastai (Learner + callback)"
    assert row["topology"] == repr(pp.Topology(data=2).resolve(2))
    assert row["accuracy"] > 0.9 and row["final_loss"] < 0.5 and row["step_time_ms"] > 0
    # The same strategy, data order, optimizer and epochs: the rows are the same numbers.
    torch_row = run_torch_demo(pp.Strategy(data=2, timeout=60), 2)
    assert row["final_loss"] == pytest.approx(torch_row["final_loss"], rel=1e-5)
    assert row["accuracy"] == pytest.approx(torch_row["accuracy"], abs=1e-9)
