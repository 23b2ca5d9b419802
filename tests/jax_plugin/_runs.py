"""Training runs the JAX tests compare, in this process or in a fresh one with its own device count.

``fit_in_process(devices, **options)`` runs :func:`fit` in one JAX process of ``devices`` CPU
devices (:func:`polyparallel_jax.launch.launch_processes`): a one-device run under a Strategy
(``data=1`` with a precision) is the single-process reference that the 8-device test process
cannot hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

TESTS = str(Path(__file__).parents[1])  # launched processes import this module as jax_plugin._runs


def fit(strategy: dict[str, Any] | None, *, samples: int = 200, epochs: int = 2, batch_size: int = 32,
        optimizer: tuple[str, float] = ("sgd", 0.1), batch_norm: bool = False, plan: Any = None) -> dict[str, Any]:
    """Train the conformance MLP with ``Model.fit`` under ``Strategy(**strategy)`` (``None``: one
    device, no strategy); return its parameters and BatchNorm statistics (float32 numpy, by
    path), the parameters' dtypes, the optimizer state's dtypes and the history."""
    import jax
    import optax
    from flax import nnx

    import polyparallel as pp
    from polyparallel_jax import Model
    from polyparallel_jax.conformance import dataset, plugin_manager, small_mlp

    x, y = dataset(samples)
    tx = getattr(optax, optimizer[0])(optimizer[1])
    model = Model(small_mlp(batch_norm=batch_norm), optimizer=tx, metrics=["accuracy"], plan=plan)
    placed = None if strategy is None else pp.Strategy(**strategy, runtime="jax", plugin_manager=plugin_manager())
    history = model.fit(x, y, epochs=epochs, batch_size=batch_size, strategy=placed, verbose=0)
    flat = nnx.to_flat_state(nnx.state(model.module, nnx.Param))
    stats = nnx.to_flat_state(nnx.state(model.module, nnx.BatchStat))
    return {"params": {"/".join(map(str, k)): np.asarray(v[...], np.float32) for k, v in flat},
            "stats": {"/".join(map(str, k)): np.asarray(v[...], np.float32) for k, v in stats},
            "param_dtypes": sorted({str(v[...].dtype) for _, v in flat}),
            "optimizer_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree.leaves(model.checkpoint_state()["optimizer"])}),
            "history": history}


def fit_in_process(devices: int, strategy: dict[str, Any], **options: Any) -> dict[str, Any]:
    """:func:`fit` in a fresh JAX process of ``devices`` CPU devices."""
    from polyparallel_jax.launch import launch_processes

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, *filter(None, [saved])])
    try:
        return launch_processes(fit, 1, kwargs={"strategy": strategy, **options}, devices_per_process=devices,
                                timeout=240)[0]
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)
