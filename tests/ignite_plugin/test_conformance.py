"""The conformance kit for the Ignite adapter: data=2, data=2 x tensor=2 and pipeline=2 x data=2
(where every clause applies: replicas along the pipeline, a data peer for the skipped collective)."""

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_ignite.testing import IgniteDriver

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class _IgniteSuite(ConformanceSuite):
    driver = IgniteDriver()


class TestIgniteData2(_IgniteSuite):
    strategy = pp.Strategy(data=2, timeout=30)
    nprocs = 2


class TestIgniteData2Tensor2(_IgniteSuite):
    strategy = pp.Strategy(data=2, tensor=2, timeout=30)
    nprocs = 4


class TestIgnitePipeline2Data2(_IgniteSuite):
    strategy = pp.Strategy(pipeline=2, data=2, timeout=30)
    nprocs = 4
