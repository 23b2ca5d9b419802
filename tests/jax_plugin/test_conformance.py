"""The shared conformance kit through the JAX runtime (:class:`polyparallel_jax.conformance.JaxDriver`).

JAX ranks are devices: one process of 8 CPU devices (data=8; data=4 x tensor=2), where no rank
can skip a collective alone (the kit reports that clause as not applicable), and 2 processes of
one device each, where the skipped collective must time out in the peer.
"""

from __future__ import annotations

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_jax.conformance import JaxDriver, plugin_manager

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def jax_strategy(**sizes: int) -> pp.Strategy:
    return pp.Strategy(**sizes, runtime="jax", timeout=20, plugin_manager=plugin_manager())


class _JaxSuite(ConformanceSuite):
    driver = JaxDriver()
    # float32 forward passes summed in another order than the single-device reference.
    metric_tolerance = 1e-5


class TestJaxData8OneProcess(_JaxSuite):
    strategy = jax_strategy(data=8)
    nprocs, world_size = 1, 8


class TestJaxData4Tensor2OneProcess(_JaxSuite):
    strategy = jax_strategy(data=4, tensor=2)
    nprocs, world_size = 1, 8


class TestJaxData2TwoProcesses(_JaxSuite):
    strategy = jax_strategy(data=2)
    nprocs = 2


@pytest.mark.slow
class TestJaxData4TwoProcessesOfTwoDevices(_JaxSuite):
    strategy = jax_strategy(data=-1)
    nprocs, world_size = 2, 4
