"""The conformance kit for the fastai adapter at data=2 on 2 gloo processes (the adapter declares
the data axis only; the kit's clause (g) checks that tensor and pipeline are refused)."""

import pytest

import polyparallel as pp
from polyparallel.testing import ConformanceSuite
from polyparallel_fastai.testing import FastaiDriver

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


class TestFastaiData2(ConformanceSuite):
    driver = FastaiDriver()
    strategy = pp.Strategy(data=2, timeout=30)
    nprocs = 2
