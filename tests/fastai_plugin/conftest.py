"""Skips of the fastai plugin tests (fastai is the ``fastai`` extra; tools/env.sh installs it).
Multi-process tests launch real gloo processes with a hard time limit and group several
scenarios into one launch, since each launch costs seconds of process start-up."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastai")
