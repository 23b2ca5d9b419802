"""Testing kit for polyparallel plugins: the conformance contract and pytest helpers.

- :class:`ConformanceDriver`: the framework-specific half a plugin author writes.
- :class:`ConformanceSuite`: the contract as pytest tests (imports pytest on first use).
- The clauses as plain functions (``check_shards`` ... ``check_routing``), raising
  ``AssertionError`` when a plugin breaks them and :class:`NotApplicable` when the topology
  gives them nothing to check.
- :func:`reference_data`: the deterministic reference data set, as plain lists.
- The pytest plugin ``polyparallel.testing.pytest_plugin`` (opt-in: ``-p
  polyparallel.testing.pytest_plugin``) adds ``--polyparallel-slow``, the ``polyparallel_slow``
  and ``polyparallel_multiprocess`` markers, and fixtures that restore the environment, close
  sessions and launch processes.
"""

from __future__ import annotations

from typing import Any

from ._checks import (
    NotApplicable,
    check_fails_fast,
    check_metrics,
    check_replicas,
    check_routing,
    check_shards,
    check_shuffling,
    check_states,
    check_training,
    check_unsupported,
    waiting_ranks,
)
from ._kit import ConformanceDriver, PerRank, bind_plugin_manager, reference_data, run_contract, run_skipped_collective

__all__ = ["ConformanceDriver", "ConformanceSuite", "NotApplicable", "PerRank", "bind_plugin_manager",
           "check_fails_fast", "check_metrics", "check_replicas", "check_routing", "check_shards", "check_shuffling", "check_states",
           "check_training", "check_unsupported", "reference_data", "run_contract", "run_skipped_collective",
           "waiting_ranks"]


def __getattr__(name: str) -> Any:
    if name == "ConformanceSuite":
        from ._suite import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(f"module 'polyparallel.testing' has no attribute {name!r}")
