"""Model.fit under a polyparallel Strategy against the same program written by hand.

    python benchmarks/bench_jax.py [--quick] [--launches N] [--steps S] [--json out.json]

One MLP (256 -> 512 -> 512 -> 10, Adam), global batch 256, data=8 over 8 CPU devices in one
process, in float32 and in bf16-mixed. Sides, run interleaved (A B C A' ...) in every launch:

- ``Model.fit``: ``Model.fit(strategy=Strategy(data=8, precision=...))``, shuffle off;
- ``hand shard_map``: what fit runs, written by hand: one ``jax.jit`` of a ``shard_map`` over
  ``data`` taking per-device copies of the parameters (``pcast``), a masked, count-weighted loss,
  one ``pmean`` of the gradients, one ``psum`` of the row count and of the metric sums, the Adam
  update with donated buffers; under bf16-mixed the parameters and inputs cast to bfloat16
  inside, the loss on float32 predictions, the reduction in float32. Its host side is fit's: the
  rows of each data coordinate gathered, with a mask, into ``make_array_from_process_local_data``
  every step, and one wait every 4 steps;
- ``hand shard_map again``: the same hand-written side a second time: the same-vs-same control
  (its ratio to the first is the noise of the measurement);
- ``GSPMD jit``: the usual hand-written ``jax.jit`` of the global mean loss on a batch sharded
  ``P("data")``, where XLA's partitioner inserts the gradient reduction: a second, different
  program (see ``explain`` below), kept as a labelled comparison.

Each of ``--launches`` fresh processes times every side ``--repeats`` times (median per side)
and reports ratios other/fit; the table gives median and spread (min, max) over the launches.
Ratios > 1 mean Model.fit is faster. ``explain`` lists, for each compiled program, its
all-reduce instructions and its transposes/copies with the bytes they touch.

Why GSPMD's program differs (the earlier version of this benchmark, with only the GSPMD row,
showed Model.fit 1.32x *faster* than it): both programs have the same gradient all-reduce (one,
combined, the same bytes), but in GSPMD's the gradient of each kernel comes out of the
partitioned dot in the transposed layout, so the Adam update computes both moments there and
transposes and copies them back into the state's layout: 6 transposes and 6 copies of
kernel-sized arrays a step (about 2 x the parameters' bytes, twice) that the shard_map program,
whose gradients leave the ``shard_map`` in the parameters' layout, does not do. Against the
program it runs, written by hand, fit is not faster: its ratio is the cost of its host side
(ShardedArrays' batches and masks, the history) and of its dispatch.
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

DEVICES, FEATURES, CLASSES, SYNC_EVERY = 8, 256, 10, 4
PRECISIONS = ("32", "bf16-mixed")
SIDES = ("fit", "shard_map", "shard_map_again", "gspmd")


def make_module() -> Any:
    from flax import nnx

    return nnx.Sequential(nnx.Linear(FEATURES, 512, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(512, 512, rngs=nnx.Rngs(1)),
                          nnx.relu, nnx.Linear(512, CLASSES, rngs=nnx.Rngs(2)))


def _strategy(precision: str) -> Any:
    import polyparallel as pp
    import polyparallel_jax.plugin

    pm = pp.PluginManager(autoload=False)
    pm.register(polyparallel_jax.plugin, name="jax")
    return pp.Strategy(data=DEVICES, runtime="jax", plugin_manager=pm, precision=precision)


def _cast(tree: Any, dtype: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


class Fit:
    """``Model.fit`` for ``steps`` steps (compiled by a first, short fit)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, steps: int, precision: str):
        import optax

        from polyparallel_jax import Model

        self.model = Model(make_module(), loss="cross_entropy", optimizer=optax.adam(1e-3), sync_every=SYNC_EVERY)
        self.x, self.y, self.batch, self.steps = x[:steps * batch], y[:steps * batch], batch, steps
        self.model.fit(x[:4 * batch], y[:4 * batch], batch_size=batch, strategy=_strategy(precision), verbose=0,
                       shuffle=False)

    def run(self) -> float:
        begin = time.perf_counter()
        self.model.fit(self.x, self.y, batch_size=self.batch, verbose=0, shuffle=False)
        return (time.perf_counter() - begin) / self.steps * 1e3

    def hlo(self) -> str:
        model = self.model
        _, params, stats, rest = model._split(train=True)
        batch = next(iter(model._data((self.x, self.y), self.batch, False, "pad", None).batches(0)))
        return model._step(True).lower(params, stats, rest, model._opt_state, *batch.data, batch.mask).compile().as_text()


class Hand:
    """The hand-written loop around a jitted step ``(params, opt_state, x, y, mask) -> (params,
    opt_state, metrics)``, fed like fit: per-coordinate rows, a mask, one wait every 4 steps."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, steps: int, precision: str, kind: str):
        import jax
        import optax
        from flax import nnx
        from jax.sharding import AxisType, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
        graphdef, params = nnx.split(make_module(), nnx.Param)
        self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
        tx = optax.adam(1e-3)
        self.opt_state = jax.jit(tx.init)(self.params)
        self.rows = NamedSharding(self.mesh, P("data"))
        self.x, self.y, self.batch, self.steps = x, y, batch, steps
        # The rows of each data coordinate, as fit's shard_data takes them (shuffle off).
        self.order = [np.arange(d, steps * batch, DEVICES) for d in range(DEVICES)]
        step = (shard_map_step if kind == "shard_map" else gspmd_step)(graphdef, tx, self.mesh, precision)
        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.run(warm=4)  # compile

    def _batches(self, n: int) -> Any:
        import jax

        per = self.batch // DEVICES
        for i in range(n):
            rows = np.concatenate([shard[i * per:(i + 1) * per] for shard in self.order])
            mask = np.ones(len(rows), np.float32)
            yield [jax.make_array_from_process_local_data(self.rows, a) for a in (self.x[rows], self.y[rows], mask)]

    def run(self, warm: int = 0) -> float:
        import jax

        steps = warm or self.steps
        begin = time.perf_counter()
        pending, results = None, []
        for i, (xb, yb, mb) in enumerate(self._batches(steps)):
            self.params, self.opt_state, metrics = self.step(self.params, self.opt_state, xb, yb, mb)
            results.append(metrics)
            if (i + 1) % SYNC_EVERY == 0:  # the same deadlock guard as Model.fit
                if pending is not None:
                    jax.block_until_ready(pending)
                pending = metrics
        jax.device_get(results)
        return (time.perf_counter() - begin) / steps * 1e3

    def hlo(self) -> str:
        xb, yb, mb = next(iter(self._batches(1)))
        return self.step.lower(self.params, self.opt_state, xb, yb, mb).compile().as_text()


def _loss_sums(graphdef: Any, params: Any, x: Any, y: Any, mask: Any, precision: str) -> Any:
    import jax.numpy as jnp
    import optax
    from flax import nnx

    if precision == "bf16-mixed":
        params, x = _cast(params, jnp.bfloat16), x.astype(jnp.bfloat16)
    logits = nnx.merge(graphdef, params)(x).astype(jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * mask)


def shard_map_step(graphdef: Any, tx: Any, mesh: Any, precision: str) -> Any:
    """Model.fit's program by hand: local gradients, one pmean, one psum of counts and sums."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    def per_device(params: Any, x: Any, y: Any, mask: Any) -> Any:
        total = jax.lax.psum(jnp.sum(mask), "data")
        scale = jax.lax.axis_size("data") / jnp.maximum(total, 1)
        local = jax.lax.pcast(params, "data", to="varying")
        loss_sum, grads = jax.value_and_grad(lambda p: _loss_sums(graphdef, p, x, y, mask, precision) * scale)(local)
        grads = jax.lax.pmean(grads, "data")
        loss = jax.lax.psum(loss_sum / scale, "data") / total
        return grads, loss

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")), out_specs=(P(), P()))

    def step(params: Any, opt_state: Any, x: Any, y: Any, mask: Any) -> Any:
        grads, loss = mapped(params, x, y, mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def gspmd_step(graphdef: Any, tx: Any, mesh: Any, precision: str) -> Any:
    """The usual data-parallel jit: the global masked mean loss, GSPMD inserts the reductions."""
    import jax
    import jax.numpy as jnp
    import optax

    def step(params: Any, opt_state: Any, x: Any, y: Any, mask: Any) -> Any:
        def loss(p: Any) -> Any:
            return _loss_sums(graphdef, p, x, y, mask, precision) / jnp.maximum(jnp.sum(mask), 1)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value}

    return step


def program(hlo: str) -> dict[str, list[int]]:
    """What a compiled program does that the others may not: its all-reduce instructions and
    its transposes/copies (layout changes), each as [count, bytes]."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1}
    out = {"all-reduce": [0, 0], "transpose/copy": [0, 0]}
    for line in hlo.splitlines():
        match = re.search(r"= (.*?) (all-reduce|all-reduce-start|transpose|copy)\(", line)
        if match:
            key = "all-reduce" if match.group(2).startswith("all-reduce") else "transpose/copy"
            out[key][0] += 1
            for dtype, dims in re.findall(r"(f32|bf16|s32|f16|pred)\[([\d,]*)\]", match.group(1)):
                out[key][1] += sizes[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return out


def worker(steps: int, batch: int, repeats: int) -> dict[str, Any]:
    """One launch: every side of every precision, interleaved; median step time per side."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, len(x)).astype(np.int32)
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        sides = {"fit": Fit(x, y, batch, steps, precision),
                 "shard_map": Hand(x, y, batch, steps, precision, "shard_map"),
                 "shard_map_again": Hand(x, y, batch, steps, precision, "shard_map"),
                 "gspmd": Hand(x, y, batch, steps, precision, "gspmd")}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(repeats):
            names = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]  # rotate who goes first
            for name in names:
                times[name].append(sides[name].run())
        out[precision] = {"ms": {name: statistics.median(t) for name, t in times.items()},
                          "explain": {name: program(sides[name].hlo()) for name in ("fit", "shard_map", "gspmd")}}
    return out


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{statistics.median(values):.3f}x (min {values[0]:.3f}, max {values[-1]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 launches of 20 steps x 2 repeats (a smoke run)")
    parser.add_argument("--launches", type=int, default=None, help="fresh processes (default 10, 2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed run (default 100, 20 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each side per launch (default 5)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 100)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.worker:
        print(json.dumps(worker(steps, args.batch_size, repeats)))
        return
    launches = args.launches or (2 if args.quick else 10)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps), "--repeats", str(repeats),
               "--batch-size", str(args.batch_size)]
    runs = []
    for _ in range(launches):
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {"devices": DEVICES, "topology": f"data={DEVICES}", "batch_size": args.batch_size,
                              "steps": steps, "repeats": repeats, "launches": launches, "runs": runs}
    print(f"Model.fit vs the same program by hand, data={DEVICES} on {DEVICES} CPU devices, batch {args.batch_size}, "
          f"{launches} launches x {repeats} runs of {steps} steps (ratio other / fit: > 1 means fit is faster)")
    print(f"{'precision / side':<44}{'fit ms (median)':>16}   ratio, median (min, max) over launches")
    for precision in PRECISIONS:
        fit_ms = [run[precision]["ms"]["fit"] for run in runs]
        ratios = {name: [run[precision]["ms"][name] / run[precision]["ms"]["fit"] for run in runs]
                  for name in ("shard_map", "gspmd")}
        control = [run[precision]["ms"]["shard_map_again"] / run[precision]["ms"]["shard_map"] for run in runs]
        result[precision] = {"fit_ms": fit_ms, "ratios": ratios, "control": control}
        print(f"{precision + ': hand shard_map (the same program)':<44}{statistics.median(fit_ms):>16.3f}   "
              f"{_spread(ratios['shard_map'])}")
        print(f"{'  control: hand shard_map again / itself':<44}{'':>16}   {_spread(control)}")
        print(f"{'  GSPMD jit (a different program)':<44}{'':>16}   {_spread(ratios['gspmd'])}")
        for name, ops in runs[0][precision]["explain"].items():
            print(f"  explain, {name:<10} compiled: " + ", ".join(f"{op} {n} ({size / 2**20:.2f} MiB)"
                                                                for op, (n, size) in ops.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
