"""The conformance kit through Lightning: data=2 (2 processes), data=2 x tensor=2 (4)."""

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_lightning.testing import LightningDriver

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class TestLightningData2(ConformanceSuite):
    driver = LightningDriver("lightning.pytorch")
    strategy = pp.Strategy(data=2, timeout=30)
    nprocs = 2


class TestLightningData2Tensor2(ConformanceSuite):
    driver = LightningDriver("lightning.pytorch")
    strategy = pp.Strategy(data=2, tensor=2, timeout=30)
    nprocs = 4
