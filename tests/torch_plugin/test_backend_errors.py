"""``plugins/polyparallel_torch/backend_errors.py``: what a torch.distributed exception means.

The timeout texts are the ones gloo raised here (torch 2.13); the real timeouts run in
test_runtime.py and test_tracing.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import polyparallel as pp
from polyparallel_torch.backend_errors import is_collective_failure, is_timeout

GLOO_TIMEOUTS = [
    "Operation timed out!",  # Work.wait(timeout)
    "Application timeout caused pair closure",  # a blocking collective
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms "
    "for recv operation to complete",  # a mesh sub-group
]


@pytest.mark.parametrize("text", GLOO_TIMEOUTS)
def test_the_backend_timeouts_are_timeouts(text):
    assert is_timeout(RuntimeError(text))
    assert is_timeout(dist.DistBackendError(f"Watchdog caught collective operation timeout: {text}"))


def test_a_lost_peer_is_not_a_timeout_but_a_collective_failure():
    lost = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:17128: Connection reset by peer.")
    assert not is_timeout(lost)
    assert is_collective_failure(lost)


def test_collective_failures_by_type_in_the_exception_or_its_causes():
    assert is_collective_failure(dist.DistNetworkError("whatever the text"))
    assert is_collective_failure(pp.CollectiveError("sync_grads #3 failed", operation="sync_grads", axis="data", rank=0))
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as inner:
            raise ValueError("while reading the batch") from inner
    except ValueError as outer:
        assert is_collective_failure(outer)  # its cause is one
    assert not is_collective_failure(ValueError("a bad batch"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
