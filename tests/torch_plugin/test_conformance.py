"""The conformance kit for the torch runtime: data=2 (2 processes), data=2 x tensor=2 (4)."""

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_torch.testing import TorchDriver

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class TestTorchData2(ConformanceSuite):
    driver = TorchDriver()
    strategy = pp.Strategy(data=2, timeout=30)
    nprocs = 2


class TestTorchData2Tensor2(ConformanceSuite):
    driver = TorchDriver()
    strategy = pp.Strategy(data=2, tensor=2, timeout=30)
    nprocs = 4
