"""Testing kit for polyparallel plugins: the conformance contract and pytest helpers.

- :class:`ConformanceDriver`: the framework-specific half a plugin author writes.
- :class:`ConformanceSuite`: the contract as pytest tests (imports pytest on first use).
- :func:`reference_data`: the deterministic reference data set, as plain lists.
- The pytest plugin ``polyparallel.testing.pytest_plugin`` (auto-loaded via the ``pytest11``
  entry point) adds ``--runslow``, the ``slow``/``multiprocess`` markers and a fixture that
  restores the environment and closes sessions.
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
