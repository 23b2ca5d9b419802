"""The conformance kit through Lightning: data=2 (2 processes), data=2 x tensor=2 (4), and data=2 at
sharding stage 3 (skipped, with the reason, while the torch runtime does not declare stage 3)."""

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


class TestLightningData2Zero3(ConformanceSuite):
    """Stage 3 (FSDP2 over the data axis, Lightning's ModelParallelStrategy underneath)."""

    driver = LightningDriver("lightning.pytorch")
    strategy = pp.Strategy(data=2, zero=3, timeout=30)
    nprocs = 2

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _runtime_runs_stage3(cls):
        from polyparallel_torch.capabilities import CAPABILITIES

        if 3 not in CAPABILITIES.stages:
            pytest.skip(f"the torch runtime declares sharding stages {sorted(CAPABILITIES.stages)}, not 3: "
                        "the adapter's sharded path needs the runtime's FSDP2 wrap_model")
