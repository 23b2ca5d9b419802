"""The shared conformance kit through the XLA runtime at data=2 on 2 XLA CPU devices
(:class:`polyparallel_xla.testing.XlaDriver`). Each replica is a device served by a thread; the
kit's "processes" are the replicas, so the skipped-collective clause applies: the skipping
replica's peer must fail on the host check within the timeout, naming operation, axis and rank."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")

import polyparallel as pp  # noqa: E402
from polyparallel.testing import ConformanceSuite  # noqa: E402
from polyparallel_xla.testing import XlaDriver  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class TestXlaData2(ConformanceSuite):
    driver = XlaDriver()
    strategy = pp.Strategy(data=2, runtime="xla", timeout=30)
    nprocs = 2
