"""``polyparallel demo`` entry ``jax``: the digits MLP trained with ``Model.fit(strategy=...)``.

:func:`run` starts ``python -m polyparallel_jax.demo_process`` with ``nprocs`` CPU devices
(XLA_FLAGS is read once, when jax is imported, so a fresh interpreter keeps the caller's JAX state
untouched) and reads one JSON line back: :func:`train`'s result row.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import polyparallel as pp

__all__ = ["run", "train"]


def run(strategy: pp.Strategy, nprocs: int) -> dict[str, Any]:
    """Train the demo on ``nprocs`` CPU devices in a subprocess; return its result row."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.update(XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={nprocs}".strip(), JAX_PLATFORMS="cpu",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    spec = json.dumps({"sizes": strategy.topology.sizes, "seed": strategy.seed, "timeout": strategy.timeout})
    done = subprocess.run([sys.executable, "-m", "polyparallel_jax.demo_process", spec], env=env, capture_output=True,
                          text=True, timeout=max(300.0, 4 * strategy.timeout))
    sys.stderr.write(done.stderr)  # JAX's own warnings: `polyparallel demo` logs them with the other frameworks'
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the JAX demo failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def train(strategy: pp.Strategy, epochs: int = 8, batch_size: int = 64) -> dict[str, Any]:
    """Train a 64-128-10 MLP on scikit-learn's bundled digits (no download) and evaluate it."""
    import optax
    from flax import nnx
    from sklearn.datasets import load_digits

    from .model import Model

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    split = 1440  # divisible by 8 and by every batch size used here
    module = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), lambda h: nnx.relu(h),
                            nnx.Linear(128, 10, rngs=nnx.Rngs(1)))
    model = Model(module, loss="cross_entropy", optimizer=optax.adam(3e-3), metrics=["accuracy"])
    model.fit(x[:split], y[:split], epochs=1, batch_size=batch_size, strategy=strategy, verbose=0)  # compiles
    steps = epochs * (split // batch_size)
    start = time.perf_counter()
    history = model.fit(x[:split], y[:split], epochs=epochs, batch_size=batch_size, verbose=0)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    result = model.evaluate(x[split:], y[split:], batch_size=batch_size)
    from .runtime import runtime_for

    # history holds every epoch trained, the compiling one first: the loss curve, one point per epoch.
    return {"framework": "jax (flax nnx)", "topology": repr(runtime_for(strategy).topology),
            "final_loss": history["loss"][-1], "accuracy": result["accuracy"], "step_time_ms": step_ms,
            "losses": [float(v) for v in history["loss"]], "epochs": len(history["loss"])}
