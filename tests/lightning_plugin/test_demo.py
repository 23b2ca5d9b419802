"""``polyparallel demo``'s Lightning row: the same numbers as the plain PyTorch loop (slow: two
full trainings of the digits MLP)."""

import pytest

import polyparallel as pp

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]


def test_lightning_demo_matches_the_plain_torch_loop():
    from polyparallel_lightning.demo import run_demo
    from polyparallel_torch.demo import run_demo as run_torch_demo

    strategy = pp.Strategy(data=-1, timeout=120, seed=0)
    row = run_demo(strategy, 2)
    assert set(row) >= {"framework", "topology", "final_loss", "accuracy", "step_time_ms"}
    assert row["framework"].startswith("lightning") and "data=2" in row["topology"]
    assert row["accuracy"] > 0.9 and row["step_time_ms"] > 0
    torch_row = run_torch_demo(strategy, 2)
    assert row["final_loss"] == pytest.approx(torch_row["final_loss"], rel=1e-4)
    assert row["accuracy"] == pytest.approx(torch_row["accuracy"], abs=1e-6)  # logged in float32
