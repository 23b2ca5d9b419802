"""``plugins/polyparallel_torch/capabilities.py``: the torch runtime's declaration, at the bottom
of the plugin (framework-free: the adapters' hook modules import it without importing torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import polyparallel_torch.plugin as torch_plugin
from polyparallel_torch.capabilities import CAPABILITIES, RUNTIME


def test_the_declared_runtime():
    caps = CAPABILITIES
    assert (caps.target, caps.imports, caps.backends) == ("torch", {"torch"}, {"gloo", "nccl"})
    assert caps.axes == {"data", "tensor", "pipeline"} and caps.excludes == (frozenset({"tensor", "pipeline"}),)
    assert RUNTIME == caps.target
    assert torch_plugin.polyparallel_capabilities() is CAPABILITIES  # the hook declares this one


def test_the_declaration_and_the_hook_modules_import_no_torch():
    # A fresh interpreter: this test process imported torch long ago.
    probe = ("import json, sys\n"
             "import polyparallel_torch.capabilities, polyparallel_torch.plugin\n"
             "import polyparallel_lightning.plugin, polyparallel_ignite.plugin\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert not loaded & {"torch", "lightning", "pytorch_lightning", "ignite"}, sorted(loaded)
