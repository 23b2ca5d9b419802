"""XLA runtime tests (the XLA lane: ``bash tools/test-xla.sh``). Skipped where torch_xla is not
installed (the default environment has torch 2.13; torch_xla 2.9.0 needs torch 2.9.0 exactly).

Replicas run on 2 XLA CPU devices served by threads of one process (``PJRT_DEVICE=CPU``,
``CPU_NUM_DEVICES=2``), with the test-only settings of :mod:`polyparallel_xla.testing`
(pytorch/xla issue 9089). The root conftest's JAX device flag is removed: torch_xla reads
``XLA_FLAGS`` too.
"""

from __future__ import annotations

import importlib.util
import os
import re

if importlib.util.find_spec("torch_xla") is not None:  # each test module skips itself otherwise
    from polyparallel_xla.testing import cpu_env

    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                     os.environ.get("XLA_FLAGS", "")).strip()
    os.environ.update(cpu_env(2))
