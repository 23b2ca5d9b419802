"""The conformance kit for the fastai adapter on the XLA runtime at data=2 on 2 XLA CPU devices
(:class:`polyparallel_fastai.testing.FastaiXlaDriver`: the fastai driver unchanged, ranks as
device threads). The skipped-collective clause: the replica whose Learner has no recorder never
joins the metric reduction, and its peer fails on the host check within the timeout, naming
operation, axis and rank."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytest.importorskip("fastai")

import polyparallel as pp  # noqa: E402
from polyparallel.testing import ConformanceSuite  # noqa: E402
from polyparallel_fastai.testing import FastaiXlaDriver  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class TestFastaiXlaData2(ConformanceSuite):
    driver = FastaiXlaDriver()
    strategy = pp.Strategy(data=2, runtime="xla", timeout=30)
    nprocs = 2
