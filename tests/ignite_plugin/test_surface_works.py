"""Every "works" entry of Ignite's surface (:mod:`polyparallel_ignite.surface`) against one process
with the same global batch (``surface_scenarios``), on an evaluation set of 23 samples (shards
of 12 and 11): metrics at data=2 and at data=2 x tensor=2, handlers and engine entry points at
data=2. Two launches in all (each costs seconds of start-up)."""

from __future__ import annotations

from typing import Any

import pytest

import polyparallel as pp

from . import surface_scenarios as sc

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    names = list(sc.SCENARIOS)
    data2 = pp.Strategy(data=2, timeout=60, seed=5)
    tensor = pp.Strategy(data=2, tensor=2, timeout=60, seed=5)
    return {
        "data2": pp.launch(sc.worker, data2, 2, args=(data2, names, str(tmp_path_factory.mktemp("ignite-d2"))),
                           timeout=600),
        "data2_tensor2": pp.launch(sc.worker, tensor, 4, args=(tensor, ["metrics"], str(tmp_path_factory.mktemp("ignite-t"))),
                                   timeout=600),
        "reference": sc.run(names, str(tmp_path_factory.mktemp("ignite-ref"))),
    }


def test_metrics_equal_single_process(runs: dict[str, Any]) -> None:
    want = runs["reference"]["metrics"]
    tasks = [k for k in want if k != "ran"]
    for topology in ("data2", "data2_tensor2"):
        for r in runs[topology]:
            for task in tasks:
                # float64 rows; some metrics keep float32 states (PearsonCorrelation: ignite default dtype)
                sc.close(r["metrics"][task], want[task], 1e-5, f"{topology} rank {r['rank']} {task}")
    assert want["multiclass"]["frequency.Frequency"] == float(sc.N)  # every sample counted once


def test_handlers_train_as_one_process(runs: dict[str, Any]) -> None:
    want = runs["reference"]["handlers"]
    for r in runs["data2"]:
        for case in [k for k in want if k != "ran"]:
            got, expected = dict(r["handlers"][case]), dict(want[case])
            sc.close(got, expected, 1e-5, f"rank {r['rank']} {case}")
    assert want["EarlyStopping"]["epoch"] < 8  # it stopped
    assert want["FastaiLRFinder"]["restored"]
    assert want["ModelCheckpoint"]["saved"]["files"]


def test_engine_entry_points_as_one_process(runs: dict[str, Any]) -> None:
    want = runs["reference"]["engine"]
    for r in runs["data2"]:
        for case in [k for k in want if k != "ran"]:
            sc.close(r["engine"][case], want[case], 1e-5, f"rank {r['rank']} {case}")
    assert want["custom"]["interrupted"] == 14


def test_every_works_entry_was_run_by_the_test_it_names(runs: dict[str, Any]) -> None:
    from polyparallel.testing.surface import check_exercised
    from polyparallel_ignite import surface

    tests = {"metrics": surface.METRICS, "handlers": surface.HANDLERS, "engine": surface.ENGINE}
    assert set(tests) == set(sc.SCENARIOS)
    for scenario, test in tests.items():
        group = {e.name for e in surface.SURFACE.entries if e.test == test}
        for run in (runs["reference"], *runs["data2"]):
            check_exercised(surface.SURFACE, run[scenario]["ran"], names=group)
