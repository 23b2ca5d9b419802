"""The conformance driver of the JAX runtime for the shared kit (:mod:`polyparallel.testing`).

Where JAX differs from one-rank-per-process runtimes, the driver extends the kit rather than
copying it: a JAX rank is a *device*, so :meth:`JaxDriver.launch` starts JAX processes of
``world_size / nprocs`` CPU devices each (:func:`polyparallel_jax.launch.launch_processes`),
:meth:`JaxDriver.local_ranks` names the ranks of this process's devices (their positions in the
mesh), and results that differ between devices come back as :class:`~polyparallel.testing.PerRank`.
The problem is this module's :func:`small_mlp` on :func:`dataset`, trained with
``Model.fit(strategy=...)`` against ``Model.fit()`` on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

import polyparallel as pp
from polyparallel.testing import ConformanceDriver, PerRank, bind_plugin_manager

from .runtime import JaxRuntime, as_jax_strategy, runtime_for

__all__ = ["JaxDriver", "dataset", "plugin_manager", "small_mlp"]

#: Samples of the training run: 200 divide over 8 data coordinates, so ``remainder="pad"``
#: repeats no sample and the global batches are exactly the single-device ones.
TRAIN_SAMPLES, EPOCHS, TRAIN_BATCH, LR = 200, 2, 32, 1e-2


def dataset(n: int = 203, features: int = 12, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A reproducible classification set (``n`` need not divide by anything)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, :classes].argmax(axis=1) + (rng.random(n) < 0.1)).astype(np.int32) % classes
    return x, y


def small_mlp(features: int = 12, hidden: int = 16, classes: int = 4, batch_norm: bool = True, seed: int = 0) -> Any:
    """Linear (no bias before BatchNorm: its gradient is exactly 0 and only float noise is left) ->
    BatchNorm -> relu -> Linear -> relu -> Linear, as an NNX module."""
    import jax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(features, hidden, use_bias=not batch_norm, rngs=rngs)
            self.bn = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs) if batch_norm else None
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.l3 = nnx.Linear(hidden, classes, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            h = self.l1(x)
            if self.bn is not None:
                h = self.bn(h)
            return self.l3(jax.nn.relu(self.l2(jax.nn.relu(h))))

    return MLP(nnx.Rngs(seed))


@functools.cache
def plugin_manager() -> pp.PluginManager:
    """A plugin manager holding only the JAX plugin (works before its entry point is installed)."""
    from . import plugin

    pm = pp.PluginManager(autoload=False)
    pm.register(plugin, name="jax")
    return pm


def _gather(x: Any) -> Any:
    """A host numpy copy of ``x``, gathered from every process when it spans several."""
    import jax
    from jax.experimental import multihost_utils

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _device_ranks(runtime: JaxRuntime) -> dict[int, int]:
    """Device id -> topology rank (its row-major position in the mesh) for this process's devices."""
    import jax

    here = jax.process_index()
    shape = runtime.mesh.devices.shape
    return {device.id: int(np.ravel_multi_index(position, shape))
            for position, device in np.ndenumerate(runtime.mesh.devices) if device.process_index == here}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def _trained(strategy: pp.Strategy | None) -> dict[str, list[float]]:
    import optax
    from flax import nnx

    from .model import Model

    x, y = dataset(TRAIN_SAMPLES)
    model = Model(small_mlp(), loss="cross_entropy", optimizer=optax.adam(LR), metrics=["accuracy"])
    model.fit(x, y, epochs=EPOCHS, batch_size=TRAIN_BATCH, strategy=strategy, verbose=0)
    state = nnx.to_pure_dict(nnx.state(model.module, (nnx.Param, nnx.BatchStat)))
    return {name: _gather(value).reshape(-1).astype(np.float64).tolist() for name, value in _flat(state).items()}


def _host_loss(module: Any, x: Any, y: Any) -> tuple[float, int]:
    """Sum of the cross-entropy over ``(x, y)`` computed on this process's first device."""
    import optax

    logits = module(x)
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()), len(y)


class JaxDriver(ConformanceDriver):
    """The kit's contract through the JAX runtime: ``shard_data`` of numpy arrays, ``Model.fit``
    and ``Model.evaluate`` (in-program ``sync_grads``/``reduce_metrics``/``sync_states`` in
    ``shard_map``), and the cross-process host path of ``reduce_metrics``."""

    target = "jax"
    unsupported = (pp.Topology(pipeline=2, data=2),)

    # -- launching: devices, not processes ----------------------------------------------------------
    def launch(self, fn: Callable[..., Any], strategy: pp.Strategy, nprocs: int, *, args: tuple[Any, ...],
               timeout: float, world_size: int) -> list[Any]:
        """``nprocs`` JAX processes of ``world_size / nprocs`` CPU devices each."""
        from .launch import launch_processes

        if world_size % nprocs:
            raise ValueError(f"{world_size} ranks (devices) do not split over {nprocs} processes")
        return launch_processes(fn, nprocs, args=args, devices_per_process=world_size // nprocs, timeout=timeout)

    def bind(self, strategy: pp.Strategy) -> pp.Strategy:
        return bind_plugin_manager(as_jax_strategy(strategy), plugin_manager())

    def local_ranks(self, strategy: pp.Strategy) -> list[int]:
        return sorted(_device_ranks(runtime_for(strategy)).values())

    # -- the contract ------------------------------------------------------------------------------------
    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> PerRank:
        """The real rows (mask 1) each local device holds over ``epoch``'s batches."""
        runtime = runtime_for(strategy)
        ranks = _device_ranks(runtime)
        x = np.arange(self.dataset_size, dtype=np.float32)[:, None]
        data = strategy.shard_data(x, batch_size=self.global_batch, remainder="uneven", shuffle=True)
        seen: dict[int, list[int]] = {rank: [] for rank in ranks.values()}
        for batch in data.batches(epoch):
            masks = {s.device.id: np.asarray(s.data) for s in batch.mask.addressable_shards}
            for shard in batch.data.addressable_shards:
                rows = np.asarray(shard.data)[:, 0]
                seen[ranks[shard.device.id]].extend(int(r) for r in rows[masks[shard.device.id] > 0])
        return PerRank(seen)

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        """``Model.fit`` under ``strategy``; the parameters and BatchNorm statistics, gathered."""
        return _trained(strategy)

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        """``Model.fit`` on one device (synchronised BatchNorm: the ``mean`` policy's statistics
        are the global batch's, whatever ``data_size`` is)."""
        return _trained(None)

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float]:
        """``loss``/``accuracy`` from ``Model.evaluate`` (count-weighted in ``shard_map``), and
        ``host_loss``: each process's own rows reduced by ``reduce_metrics`` outside ``jit``
        (across processes, one value per data replica)."""
        import jax.numpy as jnp

        from .model import Model

        x, y = dataset(self.dataset_size)
        model = Model(small_mlp(), loss="cross_entropy", metrics=["accuracy"])
        metrics = model.evaluate(x, y, batch_size=self.global_batch, strategy=strategy)
        runtime = runtime_for(strategy)
        shards = strategy.shard_data((x, y), batch_size=self.global_batch, remainder="uneven", shuffle=False)
        rows = np.concatenate([shards.indices(0)[d] for d in runtime.local_data_coords()])
        module = small_mlp()
        module.eval()
        total, count = _host_loss(module, x[rows], y[rows])
        host = strategy.reduce_metrics({"host_loss": pp.Mean(jnp.asarray(total, jnp.float32),
                                                             jnp.asarray(count, jnp.float32))})
        return {"loss": float(metrics["loss"]), "accuracy": float(metrics["accuracy"]),
                "host_loss": float(host["host_loss"])}

    def evaluate_reference(self) -> dict[str, float]:
        x, y = dataset(self.dataset_size)
        module = small_mlp()
        module.eval()
        total, count = _host_loss(module, x, y)
        accuracy = float((np.asarray(module(x)).argmax(-1) == y).mean())
        return {"loss": total / count, "accuracy": accuracy, "host_loss": total / count}

    def sync_states(self, strategy: pp.Strategy) -> PerRank:
        """Per device, inside ``shard_map``: a ``batch_stats`` (mean), an ``rngs`` key (local) and
        a parameter (broadcast), each depending on the device's data coordinate."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        runtime = runtime_for(strategy)

        def per_device(seed: Any) -> Any:
            index = jax.lax.axis_index("data").astype(jnp.float32)
            states = {"batch_stats": {"bn": {"mean": seed + index}}, "rngs": {"dropout": {"key": seed + index}},
                      "params": {"w": seed + 10 * index + 1}}
            return jax.tree.map(lambda a: a[None], (states, strategy.sync_states(states)))

        fn = jax.jit(jax.shard_map(per_device, mesh=runtime.mesh, in_specs=P(), out_specs=P("data"),
                                   axis_names={"data"}))
        before, after = (_flat(jax.tree.map(_gather, tree)) for tree in fn(jnp.asarray([0.0, 0.5], jnp.float32)))
        policy, topology = strategy.state_policy, runtime.topology
        out = PerRank()
        for rank in self.local_ranks(strategy):
            d = topology.coords(rank)["data"]
            out[rank] = {name: {"action": policy.action_for(name), "before": before[name][d].astype(float).tolist(),
                                "after": after[name][d].astype(float).tolist()} for name in before}
        return out

    def skip_collective(self, strategy: pp.Strategy, skip: bool) -> None:
        """The cross-process path of ``reduce_metrics`` (process-local values, outside ``jit``)."""
        import jax.numpy as jnp

        if not skip:
            strategy.reduce_metrics({"loss": pp.Mean(jnp.asarray(1.0), jnp.asarray(1.0))})
