"""The conformance kit: one contract, checked the same way for every plugin.

A plugin author writes a :class:`ConformanceDriver` (the framework-specific half: build the
reference problem in the framework, train it, evaluate it, sync its states) and subclasses
:class:`ConformanceSuite` once per topology. The kit launches the processes, runs the driver in
each, and checks the results against the contract in DESIGN.md and a single-process reference.
Everything here is framework-free.
"""

from __future__ import annotations

import abc
import math
import random
import time
from typing import Any

from .._errors import CollectiveError, UnsupportedTopologyError
from .._launch import launch
from .._strategy import Strategy
from .._topology import Topology

__all__ = ["ConformanceDriver", "reference_data", "run_contract", "run_skipped_collective", "check_states"]


def reference_data(n: int, features: int = 8, classes: int = 4, seed: int = 0) -> tuple[list[list[float]], list[int]]:
    """A deterministic classification data set as plain lists (no framework needed).

    Labels depend on the features (a fixed random linear map), so a model can learn them.
    """
    rng = random.Random(seed)
    weights = [[rng.gauss(0, 1) for _ in range(features)] for _ in range(classes)]
    xs = [[rng.gauss(0, 1) for _ in range(features)] for _ in range(n)]
    ys = [max(range(classes), key=lambda c: sum(w * v for w, v in zip(weights[c], x))) for x in xs]
    return xs, ys


class ConformanceDriver(abc.ABC):
    """The framework-specific half of the conformance kit. Instances are pickled into each
    launched process, so keep them small and their classes importable.

    The reference problem: :func:`reference_data` with :attr:`dataset_size` samples (chosen not
    to divide over 2, 4 or 8 ranks), an MLP with a BatchNorm layer, :attr:`global_batch`
    samples a step summed over data-parallel ranks, :attr:`steps` optimizer steps of SGD.
    """

    #: The runtime or adapter name whose capabilities the suite checks (``"torch"``).
    target: str = ""
    dataset_size: int = 37
    global_batch: int = 8
    steps: int = 4
    #: Topologies the plugin declared it cannot run (checked: refused before launch).
    unsupported: tuple[Topology, ...] = ()

    @abc.abstractmethod
    def shard_indices(self, strategy: Strategy, epoch: int) -> list[int]:
        """In a launched process: the sample indices this rank sees in ``epoch``, in order,
        through the framework's own data path (sharded with ``remainder="uneven"``)."""

    @abc.abstractmethod
    def train(self, strategy: Strategy) -> dict[str, list[float]]:
        """In a launched process: train :attr:`steps` steps; return the *full* parameters
        (tensor-parallel shards gathered) as name -> flat list of floats."""

    @abc.abstractmethod
    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        """In this process, single-process: the same training with the same global batches.
        ``data_size`` says how the plugin's per-replica statistics (BatchNorm without a
        synchronised variant) split each global batch, for a faithful reference."""

    @abc.abstractmethod
    def evaluate(self, strategy: Strategy) -> dict[str, float] | None:
        """In a launched process: evaluate the (untrained, seeded) model on the data set sharded
        ``uneven`` and return the metrics reduced through the framework (``None`` on ranks that
        hold no metrics)."""

    @abc.abstractmethod
    def evaluate_reference(self) -> dict[str, float]:
        """In this process: the same metrics computed on the whole data set at once."""

    @abc.abstractmethod
    def sync_states(self, strategy: Strategy) -> dict[str, dict[str, Any]]:
        """In a launched process: give the states rank-dependent values, sync them, and return
        ``name -> {"action": mean|broadcast|local, "before": [floats], "after": [floats]}``."""

    def skip_collective(self, strategy: Strategy, skip: bool) -> None:
        """In a launched process: take part in a metric reduction, or (``skip``) not. The default
        uses ``strategy.reduce_metrics``; an adapter overrides it with its framework's path."""
        if not skip:
            strategy.reduce_metrics({"loss": 1.0})


# -- what runs in each launched process ---------------------------------------------------------------
def _contract_worker(driver: ConformanceDriver, strategy: Strategy) -> dict[str, Any]:
    session = strategy.session()
    return {
        "rank": session.rank,
        "coords": session.coords,
        "roles": sorted(session.roles),
        "shards": {epoch: driver.shard_indices(strategy, epoch) for epoch in (0, 1)},
        "shards_again": driver.shard_indices(strategy, 0),
        "metrics": driver.evaluate(strategy),
        "states": driver.sync_states(strategy),
        "params": driver.train(strategy),
    }


def _skip_worker(driver: ConformanceDriver, strategy: Strategy, skipper: int) -> dict[str, Any]:
    rank = strategy.session().rank
    start = time.monotonic()
    try:
        driver.skip_collective(strategy, skip=rank == skipper)
    except CollectiveError as exc:
        return {"rank": rank, "outcome": "raised", "type": type(exc).__name__, "message": str(exc),
                "operation": exc.operation, "axis": exc.axis, "error_rank": exc.rank,
                "elapsed": time.monotonic() - start}
    if rank == skipper:
        # Stay alive for a while, as a rank busy elsewhere would, so peers hit the timeout.
        time.sleep(strategy.timeout + 2)
    return {"rank": rank, "outcome": "completed", "elapsed": time.monotonic() - start}


def run_contract(driver: ConformanceDriver, strategy: Strategy, nprocs: int, timeout: float = 240) -> list[dict[str, Any]]:
    """Launch ``nprocs`` processes and collect every rank's results for the contract checks."""
    return launch(_contract_worker, strategy, nprocs, args=(driver, strategy), timeout=timeout)


def run_skipped_collective(driver: ConformanceDriver, strategy: Strategy, nprocs: int) -> list[dict[str, Any]]:
    """Launch with the last rank skipping a collective; collect what every rank saw."""
    return launch(_skip_worker, strategy, nprocs, args=(driver, strategy, nprocs - 1),
                  timeout=3 * strategy.timeout + 60)


# -- checks ---------------------------------------------------------------------------------------------
def check_states(results: list[dict[str, Any]], topology: Topology, tol: float = 1e-6) -> None:
    """Assert that every state followed its action over the data group of each rank."""
    by_rank = {r["rank"]: r for r in results}
    for r in results:
        peers = topology.group_of(r["rank"], "data")
        for name, state in r["states"].items():
            action, after = state["action"], state["after"]
            if action == "local":
                expected = state["before"]
            elif action == "broadcast":
                expected = by_rank[peers[0]]["states"][name]["before"]
            else:
                befores = [by_rank[p]["states"][name]["before"] for p in peers]
                expected = [sum(v) / len(v) for v in zip(*befores)]
            _close(after, expected, tol, f"state {name!r} ({action}) on rank {r['rank']}")


def _close(got: list[float], want: list[float], tol: float, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    worst = max((abs(g - w) / max(1.0, abs(w)) for g, w in zip(got, want)), default=0.0)
    assert worst <= tol, f"{what}: differs by {worst:.3g} (tolerance {tol:g})"
