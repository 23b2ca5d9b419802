"""JAX runtime plugin for polyparallel, with an Elegy-style ``Model.fit(strategy=...)`` on Flax NNX.

``pip install 'polyparallel[jax]'``. The plugin is found through the ``polyparallel`` entry point
``jax = "polyparallel_jax.plugin"``. Importing this package does not import JAX: :class:`Model`
and :class:`ShardedArrays` are loaded on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Model", "ShardedArrays", "ShardedModule"]
__version__ = "0.1.0"

_LAZY = {"Model": ".model", "ShardedArrays": ".data", "ShardedModule": ".ops"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
