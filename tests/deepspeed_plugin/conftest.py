"""Settings of the DeepSpeed plugin tests (each module skips itself when deepspeed is missing).

DeepSpeed compiles its CPU communication op on first use (~45-80 s): the tests keep that build in
the project's ``.torch_extensions/`` (as ``tools/env.sh`` does), so CI compiles it once and later
runs reuse it. ``DS_ACCELERATOR=cpu`` skips DeepSpeed's accelerator probe. Both are set for this
test session (and the processes it launches) only, and only where not set already.
"""

import os
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
