"""Every "works" entry of Lightning's surface (:mod:`polyparallel_lightning.surface`) against one
process with a plain Trainer and the same global batch (``surface_scenarios``), on evaluation
sets of 23 samples (shards of 12 and 11): one launch at data=2 runs every scenario (each launch
costs seconds of start-up), the one-process reference runs in this process. ``lightning.pytorch``
in the default suite, ``pytorch_lightning`` marked slow."""

from __future__ import annotations

import os
from typing import Any

import pytest

import polyparallel as pp
from polyparallel.testing.surface import check_exercised
from polyparallel_lightning import surface

from . import surface_scenarios as sc

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
TOL = dict(rel=1e-9, abs=1e-9)  # float64


@pytest.fixture(scope="module", params=["lightning.pytorch", pytest.param("pytorch_lightning", marks=pytest.mark.slow)])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ns = request.param
    pytest.importorskip(ns)
    names = list(sc.SCENARIOS)
    strategy = pp.Strategy(data=2, timeout=60, seed=5)
    data2_dir, ref_dir = tmp_path_factory.mktemp("lightning-d2"), tmp_path_factory.mktemp("lightning-ref")
    return {"data2": pp.launch(sc.worker, strategy, 2, args=(strategy, ns, names, str(data2_dir)), timeout=500),
            "reference": sc.run(ns, names, str(ref_dir)), "dirs": {"data2": str(data2_dir), "reference": str(ref_dir)}}


def test_callbacks_train_as_one_process(runs: dict[str, Any]) -> None:
    want = runs["reference"]["train"]
    for r in runs["data2"]:
        got = r["train"]
        for case in ("early", "StochasticWeightAveraging", "WeightAveraging", "EMAWeightAveraging"):
            assert got[case]["params"] == pytest.approx(want[case]["params"], **TOL), f"rank {r['rank']} {case}"
        for key in ("epochs", "hooks", "stopped", "best", "step"):
            assert got["early"][key] == want["early"][key], f"rank {r['rank']} {key}"
        for key in ("best_score", "val_loss"):
            assert got["early"][key] == pytest.approx(want["early"][key], **TOL), key
    assert want["early"]["stopped"] < 29, "EarlyStopping did not stop: the test shows nothing"
    best = {where: sorted(os.listdir(os.path.join(d, "train", "best"))) for where, d in runs["dirs"].items()}
    assert best["data2"] == best["reference"] == [want["early"]["best"]]  # save_top_k=1: one, written once


def test_validate_and_test_metrics_equal_one_process(runs: dict[str, Any]) -> None:
    want = runs["reference"]["evaluate"]
    assert want["validate"]["val_rows"] == want["test"]["test_rows"] == sc.N_EVAL
    for r in runs["data2"]:
        for stage in ("validate", "test"):
            assert r["evaluate"][stage] == pytest.approx(want[stage], **TOL), f"rank {r['rank']} {stage}"


def test_predict_returns_every_row_once_in_order(runs: dict[str, Any]) -> None:
    """Fails on main: each rank's trainer.predict returned its own shard (rows 0, 2, 4, ... on rank 0)."""
    want = runs["reference"]["predict"]
    assert [i for b in want["batches"] for i in b["index"]] == list(range(sc.N_EVAL))
    for r in runs["data2"]:
        got = r["predict"]["batches"]
        assert [b["index"] for b in got] == [b["index"] for b in want["batches"]], f"rank {r['rank']}"
        for g, w in zip(got, want["batches"]):
            assert g["pred"] == pytest.approx(w["pred"], **TOL)
    # BasePredictionWriter: each rank writes its rows with their data-set indices; together every row once.
    truth = {i: p for b in want["batches"] for i, p in zip(b["index"], b["pred"])}
    written = [(i, p) for r in runs["data2"] for indices, preds in r["predict"]["written"] for i, p in zip(indices, preds)]
    assert sorted(i for i, _ in written) == list(range(sc.N_EVAL))
    for i, p in written:
        assert p == pytest.approx(truth[i], **TOL), i


def test_display_and_monitor_callbacks_run_and_write_once(runs: dict[str, Any]) -> None:
    want = runs["reference"]["shown"]
    by_rank = {r["rank"]: r["shown"] for r in runs["data2"]}
    assert "printed once" in by_rank[0]["printed"] and "Total params" in by_rank[0]["printed"]
    for shown_text in ("printed once", "Total params", "Epoch 0"):
        assert shown_text not in by_rank[1]["printed"], f"rank 1 showed {shown_text!r}"
    for r in by_rank.values():
        assert r["logs"] == want["logs"] == ["version_0", "version_1"], "a CSV logger version per fit, not per rank"
        assert r["timer_step"] == by_rank[0]["timer_step"] < 20, "Timer: every rank stops at the same step, early"


def test_every_works_entry_was_run_by_the_test_it_names(runs: dict[str, Any]) -> None:
    tests = {"train": surface.TRAIN, "evaluate": surface.EVALUATE, "predict": surface.PREDICT, "shown": surface.SHOWN}
    assert set(tests) == set(sc.SCENARIOS)
    for scenario, test in tests.items():
        group = {e.name for e in surface.SURFACE.entries if e.test == test}
        for run in (runs["reference"], *runs["data2"]):
            check_exercised(surface.SURFACE, run[scenario]["ran"], names=group)
