"""The JAX row of ``polyparallel demo``: ``demo.run`` starts ``polyparallel_jax.demo_process`` in a
fresh interpreter with its own device count, as the CLI does."""

from __future__ import annotations

import pytest

import polyparallel as pp
from polyparallel_jax import demo

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_demo_row_at_data2_in_its_own_process_equals_one_device(plugin_manager):
    row = demo.run(pp.Strategy(data=2, timeout=60, runtime="jax", plugin_manager=plugin_manager), 2)
    assert row["framework"] == "jax (flax nnx)" and "data=2" in row["topology"]
    assert row["accuracy"] > 0.8 and row["step_time_ms"] > 0  # 8 epochs of a small MLP: about 0.88
    # The same global batch, data order and optimizer on one device: the same numbers.
    single = demo.run(pp.Strategy(data=1, timeout=60, runtime="jax", plugin_manager=plugin_manager), 1)
    assert "data=1" in single["topology"]
    assert row["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)
    assert row["accuracy"] == pytest.approx(single["accuracy"], abs=1e-9)
