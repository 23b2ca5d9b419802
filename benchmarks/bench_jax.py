"""Model.fit under a polyparallel Strategy vs a hand-written ``jax.jit`` data-parallel step.

Both run the same MLP on the same mesh (8 CPU devices, data=8) in one process, side by side and
interleaved (A B A B ...), with host batches transferred every step in both; the table shows the
median step time of each and their ratio hand-written / fit (> 1 means polyparallel is faster, as
in bench_torch and bench_ignite).

    python benchmarks/bench_jax.py [--quick] [--steps 200] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import polyparallel as pp  # noqa: E402
import polyparallel_jax.plugin  # noqa: E402
from polyparallel_jax import Model  # noqa: E402


def make_module() -> nnx.Module:
    return nnx.Sequential(nnx.Linear(256, 512, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(512, 512, rngs=nnx.Rngs(1)),
                          nnx.relu, nnx.Linear(512, 10, rngs=nnx.Rngs(2)))


def hand_written(x: np.ndarray, y: np.ndarray, batch: int, steps: int, sync_every: int) -> float:
    """The usual hand-written data-parallel loop: replicated params, batch sharded P('data')."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    graphdef, params = nnx.split(make_module(), nnx.Param)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init)(params)
    data_sharding = NamedSharding(mesh, P("data"))

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # donation, as Model.fit does
    def step(params, opt_state, xb, yb):
        def loss(p):
            logits = nnx.merge(graphdef, p)(xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def epoch(n_steps: int) -> None:
        nonlocal params, opt_state
        pending = None
        for i in range(n_steps):
            start = (i * batch) % (len(x) - batch + 1)
            # The same host -> device path Model.fit uses (one process: local rows = global rows).
            xb = jax.make_array_from_process_local_data(data_sharding, x[start:start + batch])
            yb = jax.make_array_from_process_local_data(data_sharding, y[start:start + batch])
            params, opt_state, value = step(params, opt_state, xb, yb)
            if (i + 1) % sync_every == 0:  # the same deadlock guard as Model.fit
                if pending is not None:
                    jax.block_until_ready(pending)
                pending = value
        jax.block_until_ready(value)

    epoch(4)  # compile
    begin = time.perf_counter()
    epoch(steps)
    return (time.perf_counter() - begin) / steps * 1e3


def with_strategy(x: np.ndarray, y: np.ndarray, batch: int, steps: int, strategy: pp.Strategy) -> float:
    model = Model(make_module(), loss="cross_entropy", optimizer=optax.adam(1e-3))
    n = steps * batch
    model.fit(x[: 4 * batch], y[: 4 * batch], epochs=1, batch_size=batch, strategy=strategy, verbose=0, shuffle=False)
    begin = time.perf_counter()
    model.fit(x[:n], y[:n], epochs=1, batch_size=batch, verbose=0, shuffle=False)
    return (time.perf_counter() - begin) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 200, 40 with --quick)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=None, help="runs of each side (default 5, 2 with --quick)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 40 if args.quick else 200
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    pm = pp.PluginManager(autoload=False)
    pm.register(polyparallel_jax.plugin, name="jax")
    strategy = pp.Strategy(data=8, plugin_manager=pm)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch_size, 256)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    ours, theirs = [], []
    for _ in range(args.repeats):
        theirs.append(hand_written(x, y, args.batch_size, args.steps, 4))
        ours.append(with_strategy(x, y, args.batch_size, args.steps, strategy))
    fit_ms, jit_ms = statistics.median(ours), statistics.median(theirs)
    result = {"devices": jax.device_count(), "topology": "data=8", "batch_size": args.batch_size, "steps": args.steps,
              "repeats": args.repeats, "model_fit_ms": fit_ms, "hand_jit_ms": jit_ms, "ratio": jit_ms / fit_ms,
              "model_fit_all_ms": ours, "hand_jit_all_ms": theirs}
    print(f"{'implementation':<32}{'step time (ms, median)':>24}")
    print(f"{'hand-written jax.jit (GSPMD)':<32}{jit_ms:>24.3f}")
    print(f"{'Model.fit(strategy=data=8)':<32}{fit_ms:>24.3f}")
    print(f"{'ratio hand-written / fit':<32}{jit_ms / fit_ms:>24.3f}  (> 1: polyparallel faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
