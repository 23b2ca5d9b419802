"""The conformance kit for the DeepSpeed adapter: ZeRO 0-3 with data=2, and pipeline=2 x data=2
at ZeRO 0 and 1 (where every clause applies: replicas along the pipeline, a data peer for the
skipped collective). Training parity is checked against a single-process torch run with the same
global batch (1e-5); metrics to 1e-9 (float64), at ZeRO-3 to 1e-6 (float32, the widest dtype ZeRO-3
holds). Running-variance statistics are broadcast instead of averaged
(``state_policy``), so that the states clause sees both actions at every stage: from ZeRO 1 on
parameters are DeepSpeed's to keep in step (``engine_states``)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import polyparallel as pp  # noqa: E402
from polyparallel.testing import ConformanceSuite  # noqa: E402
from polyparallel_deepspeed.testing import DeepSpeedDriver  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STATES = {"*running_var": "broadcast"}


class _DeepSpeedSuite(ConformanceSuite):
    driver = DeepSpeedDriver()
    launch_timeout = 400.0


class TestDeepSpeedZero0Data2(_DeepSpeedSuite):
    strategy = pp.Strategy(data=2, zero=0, timeout=30, state_policy=STATES)


@pytest.mark.slow
class TestDeepSpeedZero1Data2(_DeepSpeedSuite):
    strategy = pp.Strategy(data=2, zero=1, timeout=30, state_policy=STATES)


@pytest.mark.slow
class TestDeepSpeedZero2Data2(_DeepSpeedSuite):
    strategy = pp.Strategy(data=2, zero=2, timeout=30, state_policy=STATES)


class TestDeepSpeedZero3Data2(_DeepSpeedSuite):
    strategy = pp.Strategy(data=2, zero=3, timeout=30, state_policy=STATES)
    metric_tolerance = 1e-6  # evaluated in float32: ZeRO-3 holds no float64 (the reference is float64)


class TestDeepSpeedPipeline2Data2Zero0(_DeepSpeedSuite):
    strategy = pp.Strategy(pipeline=2, data=2, zero=0, timeout=30, state_policy=STATES)
    nprocs = 4


@pytest.mark.slow
class TestDeepSpeedPipeline2Data2Zero1(_DeepSpeedSuite):
    strategy = pp.Strategy(pipeline=2, data=2, zero=1, timeout=30, state_policy=STATES)
    nprocs = 4
