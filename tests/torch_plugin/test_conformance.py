"""The conformance kit for the torch runtime: data=2 (2 processes), data=2 x tensor=2 (4) and
pipeline=2 x data=2 (4), where every clause applies (replicas along the pipeline, a data peer in
another process for the skipped collective); and at sharding stage 3 (FSDP2) for data=2 and
data=2 x tensor=2."""

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


class TestTorchPipeline2Data2(ConformanceSuite):
    driver = TorchDriver()
    strategy = pp.Strategy(pipeline=2, data=2, timeout=30)
    nprocs = 4


class TestTorchData2Zero3(ConformanceSuite):
    """Stage 3: FSDP2 over the data axis."""

    driver = TorchDriver()
    strategy = pp.Strategy(data=2, zero=3, timeout=30)
    nprocs = 2


class TestTorchData2Tensor2Zero3(ConformanceSuite):
    """Stage 3 with tensor parallelism: DTensor over tensor, then FSDP2 over data on the 2-D mesh."""

    driver = TorchDriver()
    strategy = pp.Strategy(data=2, tensor=2, zero=3, timeout=30)
    nprocs = 4
