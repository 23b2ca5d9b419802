"""Skips of the Ignite plugin tests. Multi-process tests launch real gloo processes with a
hard time limit (the ``run`` fixture of tests/conftest.py) and group several scenarios into one
launch, since each launch costs seconds of process start-up on a 2-core machine."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("ignite")

