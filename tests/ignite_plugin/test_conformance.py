"""The conformance kit for the Ignite adapter: data=2, data=2 x tensor=2 and pipeline=2 x data=2
(where every clause applies: replicas along the pipeline, a data peer for the skipped collective);
and at each sharding stage the torch runtime runs (the adapter declares the runtime's stages):
zero=1, 2, 3 with data=2 and zero=3 with data=2 x tensor=2, skipped where the runtime does not
run the stage."""

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_ignite.testing import IgniteDriver
from polyparallel_torch.capabilities import CAPABILITIES as TORCH_CAPABILITIES

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


def _stage(stage: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(stage not in TORCH_CAPABILITIES.stages,
                              reason=f"the torch runtime here does not run sharding stage zero={stage}")


@_stage(1)
class TestIgniteData2Zero1(_IgniteSuite):
    """DDP, and auto_optim's ZeroRedundancyOptimizer over the data group."""

    strategy = pp.Strategy(data=2, zero=1, timeout=30)
    nprocs = 2


@_stage(2)
class TestIgniteData2Zero2(_IgniteSuite):
    strategy = pp.Strategy(data=2, zero=2, timeout=30)
    nprocs = 2


@_stage(3)
class TestIgniteData2Zero3(_IgniteSuite):
    strategy = pp.Strategy(data=2, zero=3, timeout=30)
    nprocs = 2


@_stage(3)
class TestIgniteData2Tensor2Zero3(_IgniteSuite):
    strategy = pp.Strategy(data=2, tensor=2, zero=3, timeout=30)
    nprocs = 4
