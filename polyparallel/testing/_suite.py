"""``ConformanceSuite``: the contract as pytest tests, one subclass per plugin and topology.

    from polyparallel.testing import ConformanceSuite

    class TestMyPluginData2(ConformanceSuite):
        driver = MyDriver()
        strategy = pp.Strategy(data=2, timeout=20)
        nprocs = 2

The processes are launched once per class (a class-scoped fixture); every test then checks one
clause of the contract (:mod:`polyparallel.testing._checks`) on the collected results. A clause
the topology gives nothing to check (no replicas, a data axis of size 1) is reported as skipped
with the reason, never passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from .._strategy import Strategy
from .._topology import Topology
from . import _checks
from ._kit import ConformanceDriver, run_contract

__all__ = ["ConformanceSuite"]


def _clause(check: Callable[..., None], *args: Any) -> None:
    try:
        check(*args)
    except _checks.NotApplicable as exc:
        pytest.skip(f"not applicable: {exc}")


@pytest.mark.polyparallel_multiprocess  # registered by polyparallel.testing.pytest_plugin
class ConformanceSuite:
    """Base class; set :attr:`driver`, :attr:`strategy` and :attr:`nprocs` in a subclass."""

    driver: ClassVar[ConformanceDriver]
    strategy: ClassVar[Strategy]
    #: Processes to launch.
    nprocs: ClassVar[int] = 2
    #: Ranks in all (``None``: one per process); more than ``nprocs`` when a process drives
    #: several ranks (JAX devices) — the driver's ``launch`` and ``local_ranks`` say how.
    world_size: ClassVar[int | None] = None
    #: Relative tolerance of the training-parity check.
    train_tolerance: ClassVar[float] = 1e-5
    #: Relative tolerance of the metric check (the reduction is exact; the forward pass may not be).
    metric_tolerance: ClassVar[float] = 1e-9
    #: Seconds the contract launch may take.
    launch_timeout: ClassVar[float] = 240.0

    # -- the launches (once per class) ----------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def contract(cls) -> list[dict[str, Any]]:
        return run_contract(cls.driver, cls.strategy, cls.nprocs, cls.launch_timeout, cls.world_size)

    @pytest.fixture(scope="class")
    @classmethod
    def topology(cls) -> Topology:
        return cls.strategy.topology.resolve(cls.nprocs if cls.world_size is None else cls.world_size)

    # -- (a) sharding -------------------------------------------------------------------------------
    def test_shards_are_disjoint_and_complete(self, contract: list[dict[str, Any]], topology: Topology) -> None:
        _clause(_checks.check_shards, contract, topology, self.driver.dataset_size)

    def test_shuffling_is_deterministic_per_epoch(self, contract: list[dict[str, Any]]) -> None:
        _clause(_checks.check_shuffling, contract)

    # -- (b) replicas --------------------------------------------------------------------------------
    def test_replicas_get_identical_batches(self, contract: list[dict[str, Any]]) -> None:
        _clause(_checks.check_replicas, contract)

    # -- (c) training parity ---------------------------------------------------------------------------
    def test_training_matches_single_process(self, contract: list[dict[str, Any]], topology: Topology) -> None:
        reference = self.driver.train_reference(topology.size("data"))
        _clause(_checks.check_training, contract, topology, reference, self.train_tolerance)

    # -- (d) metrics -----------------------------------------------------------------------------------
    def test_metrics_equal_single_process(self, contract: list[dict[str, Any]]) -> None:
        _clause(_checks.check_metrics, contract, self.driver.evaluate_reference(), self.metric_tolerance)

    # -- (e) states ---------------------------------------------------------------------------------------
    def test_states_follow_policy(self, contract: list[dict[str, Any]], topology: Topology) -> None:
        _clause(_checks.check_states, contract, topology)

    # -- (f) fail fast -------------------------------------------------------------------------------------
    def test_skipped_collective_fails_fast(self) -> None:
        strategy = self.strategy.replace(timeout=min(self.strategy.timeout, 5.0))
        _clause(_checks.check_fails_fast, self.driver, strategy, self.nprocs, self.world_size)

    # -- (g) refusal before launch ----------------------------------------------------------------------------
    def test_unsupported_topology_refused_before_launch(self) -> None:
        _clause(_checks.check_unsupported, self.driver, self.strategy)

    # -- (h) routing ------------------------------------------------------------------------------------------
    def test_operations_reach_only_the_sessions_runtime(self, contract: list[dict[str, Any]]) -> None:
        _clause(_checks.check_routing, contract)
