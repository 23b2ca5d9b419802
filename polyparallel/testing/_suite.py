"""``ConformanceSuite``: the contract as pytest tests, one subclass per plugin and topology.

    from polyparallel.testing import ConformanceSuite

    class TestMyPluginData2(ConformanceSuite):
        driver = MyDriver()
        strategy = pp.Strategy(data=2, timeout=20)
        nprocs = 2

The processes are launched once per class (a class-scoped fixture); every test then checks one
clause of the contract on the collected results.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from .._errors import UnsupportedTopologyError
from .._launch import launch
from .._strategy import Strategy
from ._kit import ConformanceDriver, _close, check_states, run_contract, run_skipped_collective

__all__ = ["ConformanceSuite"]


def _never_called() -> None:  # pragma: no cover - launch must refuse before starting it
    raise AssertionError("launch() started processes for a topology the target cannot run")


@pytest.mark.polyparallel_multiprocess  # registered by polyparallel.testing.pytest_plugin
class ConformanceSuite:
    """Base class; set :attr:`driver`, :attr:`strategy` and :attr:`nprocs` in a subclass."""

    driver: ClassVar[ConformanceDriver]
    strategy: ClassVar[Strategy]
    nprocs: ClassVar[int] = 2
    #: Relative tolerance of the training-parity check.
    train_tolerance: ClassVar[float] = 1e-5
    #: Relative tolerance of the metric check (the reduction is exact; the forward pass may not be).
    metric_tolerance: ClassVar[float] = 1e-9

    # -- the launches (once per class) ----------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def contract(cls) -> list[dict[str, Any]]:
        return run_contract(cls.driver, cls.strategy, cls.nprocs)

    @pytest.fixture(scope="class")
    @classmethod
    def topology(cls) -> Any:
        return cls.strategy.topology.resolve(cls.nprocs)

    # -- (a) sharding -------------------------------------------------------------------------------
    def test_shards_are_disjoint_and_complete(self, contract: list[dict[str, Any]], topology: Any) -> None:
        for epoch in (0, 1):
            by_data: dict[int, list[int]] = {}
            for r in contract:
                by_data.setdefault(r["coords"]["data"], r["shards"][epoch])
            seen = [i for shard in by_data.values() for i in shard]
            assert len(by_data) == topology.size("data")
            assert sorted(seen) == list(range(self.driver.dataset_size)), (
                f"epoch {epoch}: the data shards are not a partition of the {self.driver.dataset_size} samples")

    # -- (b) replicas --------------------------------------------------------------------------------
    def test_replicas_get_identical_batches(self, contract: list[dict[str, Any]]) -> None:
        for epoch in (0, 1):
            first: dict[int, tuple[int, list[int]]] = {}
            for r in contract:
                rank, shard = first.setdefault(r["coords"]["data"], (r["rank"], r["shards"][epoch]))
                assert r["shards"][epoch] == shard, (
                    f"epoch {epoch}: ranks {rank} and {r['rank']} share data coordinate "
                    f"{r['coords']['data']} but got different samples")

    def test_shuffling_is_deterministic_per_epoch(self, contract: list[dict[str, Any]]) -> None:
        for r in contract:
            assert r["shards_again"] == r["shards"][0], f"rank {r['rank']}: epoch 0 differs between two runs"
        assert any(r["shards"][0] != r["shards"][1] for r in contract), "epochs 0 and 1 were not reshuffled"

    # -- (c) training parity ---------------------------------------------------------------------------
    def test_training_matches_single_process(self, contract: list[dict[str, Any]], topology: Any) -> None:
        reference = self.driver.train_reference(topology.size("data"))
        for r in contract:
            params = r["params"]
            if params is None:
                continue
            assert set(params) == set(reference), f"rank {r['rank']}: parameter names differ from the reference"
            for name, values in params.items():
                _close(values, reference[name], self.train_tolerance, f"parameter {name!r} on rank {r['rank']}")

    # -- (d) metrics -----------------------------------------------------------------------------------
    def test_metrics_equal_single_process(self, contract: list[dict[str, Any]]) -> None:
        reference = self.driver.evaluate_reference()
        holders = [r for r in contract if "metrics" in r["roles"]]
        assert holders, "no rank holds metrics"
        for r in holders:
            got = r["metrics"]
            assert got is not None and set(got) == set(reference), f"rank {r['rank']}: metrics {got} vs {reference}"
            for name, value in got.items():
                _close([value], [reference[name]], self.metric_tolerance, f"metric {name!r} on rank {r['rank']}")

    # -- (e) states ---------------------------------------------------------------------------------------
    def test_states_follow_policy(self, contract: list[dict[str, Any]], topology: Any) -> None:
        actions = {s["action"] for r in contract for s in r["states"].values()}
        assert {"mean", "broadcast"} <= actions, f"the driver's states exercise only {actions}"
        check_states(contract, topology)

    # -- (f) fail fast -------------------------------------------------------------------------------------
    def test_skipped_collective_fails_fast(self, topology: Any) -> None:
        strategy = self.strategy.replace(timeout=min(self.strategy.timeout, 5.0))
        results = run_skipped_collective(self.driver, strategy, self.nprocs)
        skipper = self.nprocs - 1
        waiting = set(topology.group_of(skipper, "data")) - {skipper}
        for r in results:
            if r["rank"] in waiting:
                assert r["outcome"] == "raised", f"rank {r['rank']} did not fail although rank {skipper} skipped"
                assert r["elapsed"] < strategy.timeout + 10, f"rank {r['rank']} took {r['elapsed']:.1f} s to fail"
                assert r["error_rank"] == r["rank"] and r["axis"] == "data" and r["operation"], r
                assert f"rank {r['rank']}" in r["message"] and "data" in r["message"], r["message"]

    # -- (g) refusal before launch ----------------------------------------------------------------------------
    def test_unsupported_topology_refused_before_launch(self) -> None:
        assert self.driver.unsupported, "the driver declares no unsupported topology to check"
        for topology in self.driver.unsupported:
            strategy = Strategy(topology=topology)
            with pytest.raises(UnsupportedTopologyError):
                strategy.check(self.driver.target)
            start = time.monotonic()
            with pytest.raises(UnsupportedTopologyError):
                launch(_never_called, strategy, topology.world_size, runtime=self.driver.target)
            assert time.monotonic() - start < 2.0
