"""Multi-process JAX: processes joined by jax.distributed on 127.0.0.1 (gloo collectives).

The conformance contract across processes (data=2 on two processes, with a skipped collective;
data=4 on two processes of two devices) runs through the shared kit in ``test_conformance.py``.
"""

from __future__ import annotations

import pytest

import polyparallel as pp
from polyparallel_jax.launch import launch_processes


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_failing_process_raises_launch_error_naming_it():
    # Topology(data="two") raises TopologyError in every process, after jax.distributed joined.
    with pytest.raises(pp.LaunchError, match=r"JAX process [01] of 2 failed(.|\n)*TopologyError"):
        launch_processes(pp.Topology, 2, kwargs={"data": "two"}, timeout=90)
