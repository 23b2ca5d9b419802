"""PyTorch runtime plugin for polyparallel (``pip install 'polyparallel[torch]'``).

Registered through the ``polyparallel`` entry point ``torch = "polyparallel_torch.plugin"``.
The operations are reached through a :class:`polyparallel.Strategy`; this package also exports
the few torch-specific helpers a training loop needs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["no_sync", "steps", "Step", "grad_scaler", "state_bytes",
           "get_runtime", "full_state", "TopologySampler", "ShardedLoader", "default_plan", "make_optimizer",
           "save_checkpoint", "load_checkpoint"]


def __getattr__(name: str) -> Any:
    # Lazy: `import polyparallel_torch` must not import torch.
    if name == "no_sync":
        from .grads import no_sync
        return no_sync
    if name in ("steps", "Step"):
        from . import accumulation
        return getattr(accumulation, name)
    if name in ("grad_scaler", "state_bytes"):
        from . import precision
        return getattr(precision, name)
    if name == "get_runtime":
        from .runtime import get_runtime
        return get_runtime
    if name == "full_state":
        from .tensors import full_state
        return full_state
    if name == "default_plan":
        from .model import default_plan
        return default_plan
    if name == "make_optimizer":
        from .sharding import make_optimizer
        return make_optimizer
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint
        return getattr(checkpoint, name)
    if name in ("TopologySampler", "ShardedLoader"):
        from . import data
        return getattr(data, name)
    raise AttributeError(f"module 'polyparallel_torch' has no attribute {name!r}")
