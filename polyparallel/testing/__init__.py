"""Testing kit for polyparallel plugins: the conformance contract and pytest helpers.

- :class:`ConformanceDriver`: the framework-specific half a plugin author writes.
- :class:`ConformanceSuite`: the contract as pytest tests (imports pytest on first use).
- :func:`reference_data`: the deterministic reference data set, as plain lists.
- The pytest plugin ``polyparallel.testing.pytest_plugin`` (opt-in: ``-p
  polyparallel.testing.pytest_plugin``) adds ``--polyparallel-slow``, the ``polyparallel_slow``
  and ``polyparallel_multiprocess`` markers, and fixtures that restore the environment, close
  sessions and launch processes.
"""

from __future__ import annotations

from typing import Any

from ._kit import ConformanceDriver, check_states, reference_data, run_contract, run_skipped_collective

__all__ = ["ConformanceDriver", "ConformanceSuite", "check_states", "reference_data", "run_contract",
           "run_skipped_collective"]


def __getattr__(name: str) -> Any:
    if name == "ConformanceSuite":
        from ._suite import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(f"module 'polyparallel.testing' has no attribute {name!r}")
