"""The scenarios that prove the "works" entries of :mod:`polyparallel_jax.surface`.

``run(name, strategy, tmp)`` runs scenario ``name`` under ``Strategy(**strategy)`` (``None``: one
device, no strategy) and returns what must not depend on the strategy: histories, evaluations
and predictions on a set of 203 rows (which divides by nothing here), parameters, statistics,
checkpoint positions. Training sets divide over the data axis (200 rows), so that padding repeats
no sample and every strategy trains on exactly the rows one device does.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np

TRAIN, EVAL = 200, 203


def _strategy(options: dict[str, Any] | None) -> Any:
    import polyparallel as pp
    from polyparallel_jax.conformance import plugin_manager

    return None if options is None else pp.Strategy(**options, runtime="jax", plugin_manager=plugin_manager())


def _data() -> tuple[np.ndarray, ...]:
    from polyparallel_jax.conformance import dataset

    return (*dataset(TRAIN), *dataset(EVAL, seed=1))


def _model(**options: Any) -> Any:
    import optax

    from polyparallel_jax import Model
    from polyparallel_jax.conformance import small_mlp

    module = small_mlp(**{k: options.pop(k) for k in ("batch_norm", "seed") if k in options})
    options.setdefault("optimizer", optax.adam(1e-2))
    options.setdefault("metrics", ["accuracy"])
    return Model(module, **options)


def _host(tree: Any) -> Any:
    import jax

    def one(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(leaf))
        return np.asarray(leaf) if hasattr(leaf, "dtype") else leaf

    return jax.tree.map(one, jax.device_get(tree))


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(jax.device_get(tree))


def _state(model: Any) -> dict[str, Any]:
    from flax import nnx

    return {"/".join(map(str, k)): np.asarray(v[...], np.float32) for k, v in nnx.to_flat_state(nnx.state(model.module))
            if np.issubdtype(np.asarray(v[...]).dtype, np.floating)}


def _outputs(model: Any, x: np.ndarray, y: np.ndarray, **options: Any) -> dict[str, Any]:
    return {"evaluate": model.evaluate(x, y, batch_size=24, **options),
            "predict": model.predict(x, batch_size=24, **options), "state": _state(model)}


def basic(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model()
    history = model.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=0, shuffle=True, seed=3)
    return {"history": history, "attribute": model.history, **_outputs(model, vx, vy),
            "optimizer": [np.asarray(leaf) for leaf in _leaves(model.checkpoint_state()["optimizer"])], "optimizer_kept": model.optimizer is not None}


def callables(strategy: Any, tmp: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p: Any, t: Any) -> Any:  # a per-sample loss of one's own
        return optax.softmax_cross_entropy_with_integer_labels(p, t) + 0.01 * jnp.sum(p ** 2, axis=-1)

    def top2(p: Any, t: Any) -> Any:
        return jnp.any(jax.lax.top_k(p, 2)[1] == t[:, None], axis=-1).astype(jnp.float32)

    x, y, vx, vy = _data()
    model = _model(loss=loss, metrics=[top2, "accuracy"])
    return {"history": model.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=0), **_outputs(model, vx, vy)}


def model_strategy(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model(strategy=strategy)
    history = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    return {"history": history, **_outputs(model, vx, vy, strategy=strategy), "placed": model.placed_strategy == model.strategy}


def plan(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model(plan=[("l2/kernel", ("tensor", None)), ("l1/kernel", (None, "tensor"))], batch_norm=False)
    return {"history": model.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=0), **_outputs(model, vx, vy),
            "plan": len(model.plan)}


def sync_every(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model(sync_every=1)
    return {"history": model.fit(x, y, epochs=1, batch_size=32, strategy=strategy, verbose=0), **_outputs(model, vx, vy),
            "sync_every": model.sync_every}


def verbose(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        history = model.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=1)
        outputs = {"evaluate": model.evaluate(vx, vy, batch_size=24, verbose=1),
                   "predict": model.predict(vx, batch_size=24, verbose=1)}
    titles = [line.split(" [")[0] for line in err.getvalue().splitlines()]
    return {"history": history, **outputs, "printed": titles}


def validation(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    model = _model()
    history = model.fit(x, y, epochs=3, batch_size=32, strategy=strategy, verbose=0, shuffle=False,
                        validation_data=(vx, vy), validation_batch_size=40, validation_freq=2)
    return {"history": history, "val_entries": len(history["val_loss"]), **_outputs(model, vx, vy)}


def validation_split(strategy: Any, tmp: str) -> dict[str, Any]:
    from polyparallel_jax.conformance import dataset

    x, y = dataset(250)  # the last 50 rows validate (50 do not divide over 4)
    model = _model()
    history = model.fit(x, y, epochs=2, batch_size=40, strategy=strategy, verbose=0, validation_split=0.2)
    return {"history": history, "same_as_given": model.evaluate(x[200:], y[200:], batch_size=40)["loss"]
            == history["val_loss"][-1]}


def callbacks(strategy: Any, tmp: str) -> dict[str, Any]:
    from polyparallel_jax.callbacks import Callback, EarlyStopping, ModelCheckpoint

    class Recorder(Callback):
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def on_train_begin(self, logs: Any = None) -> None:
            self.seen.append("begin")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seen.append((epoch, sorted(logs)))

        def on_train_end(self, logs: Any = None) -> None:
            self.seen.append(("end", self.model is not None))

    x, y, vx, vy = _data()
    model = _model()
    # No epoch improves val_accuracy by 1.0: best at epoch 0, stop after epoch 2 (patience 1),
    # the module put back to its epoch-0 state.
    stop = EarlyStopping(monitor="val_accuracy", min_delta=1.0, patience=1, mode="max", restore_best_weights=True)
    best = ModelCheckpoint(os.path.join(tmp, "best"), monitor="val_loss", save_best_only=True)
    every = ModelCheckpoint(os.path.join(tmp, "epoch-{epoch:02d}"))
    recorder = Recorder()
    history = model.fit(x, y, epochs=6, batch_size=32, strategy=strategy, verbose=0, validation_data=(vx, vy),
                        callbacks=[stop, best, every, recorder])
    first = _model(seed=7)
    first.load(every.saved[0], strategy=strategy)  # written after epoch 0
    restored = _state(model)
    for key, value in _state(first).items():  # restore_best_weights put epoch 0's state back
        np.testing.assert_allclose(restored[key], value, atol=1e-6, err_msg=key)
    return {"history": history, "stopped": (stop.stopped_epoch, model.stop_training), "seen": recorder.seen,
            "restored": restored, "saved": [os.path.basename(p) for p in every.saved + best.saved],
            "epoch0": _outputs(first, vx, vy)}


def resume(strategy: Any, tmp: str) -> dict[str, Any]:
    x, y, vx, vy = _data()
    directory = os.path.join(tmp, "run")
    _model().fit(x, y, epochs=1, batch_size=32, strategy=strategy, verbose=0, checkpoint=directory, checkpoint_every=3)
    resumed = _model(seed=4)
    history = resumed.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=0, checkpoint=directory,
                          checkpoint_every=3, resume=True)
    return {"history": history, **_outputs(resumed, vx, vy), "files": sorted(os.listdir(directory))}


def save_load(strategy: Any, tmp: str) -> dict[str, Any]:
    import polyparallel as pp
    from polyparallel_jax import ShardedArrays
    from polyparallel_jax.runtime import JaxRuntime

    x, y, vx, vy = _data()
    model = _model()
    model.fit(x, y, epochs=1, batch_size=32, strategy=strategy, verbose=0)
    path = model.save(os.path.join(tmp, "saved"), note="hello", step_count=7)
    loader = (strategy.shard_data((x, y), batch_size=32) if strategy is not None
              else ShardedArrays((x, y), JaxRuntime.single(), pp.DataPolicy(32), 0))
    other = _model(seed=5)
    info = other.load(path, strategy=strategy, loader=loader)
    return {"info": {k: info[k] for k in ("epoch", "step", "global_step", "note", "step_count")},
            "loader": {k: v for k, v in loader.state_dict().items()}, **_outputs(other, vx, vy)}


def state(strategy: Any, tmp: str) -> dict[str, Any]:
    import jax

    x, y, vx, vy = _data()
    model = _model()
    placed = model.place(strategy)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    snapshot = _host(model.checkpoint_state())
    progress = model.fit_progress
    at_snapshot = _outputs(model, vx, vy)
    model.fit(x, y, epochs=2, batch_size=32, verbose=0)  # moves on

    def read(targets: dict[str, Any]) -> dict[str, Any]:
        return {name: jax.tree.map(lambda t, v: jax.device_put(v, t.sharding), tree, snapshot[name])
                for name, tree in targets.items()}

    model.restore_state(read, optimizer=True, progress=progress)
    return {"placed": placed == strategy, "sections": sorted(snapshot), "progress": model.fit_progress["loader"],
            "back": _outputs(model, vx, vy), "at_snapshot": at_snapshot, "placed_after": model.placed_strategy == placed}


def local_stats(strategy: Any, tmp: str) -> dict[str, Any]:
    import optax

    x, y, vx, vy = _data()
    model = _model(optimizer=optax.sgd(0.0))
    if strategy is not None:
        strategy = strategy.replace(state_policy={"batch_stats*": "local"})
    model.fit(x, y, epochs=2, batch_size=32, strategy=strategy, verbose=0)
    rows = model.batch_stats_per_device
    size = 1 if strategy is None else strategy.session().topology.size("data")
    kept = rows is None if strategy is None else np.asarray(rows["bn"]["mean"][...]).shape[0] == size
    # lr 0: the parameters stay put, so the average of the per-device running means (EMAs of
    # local batch means) is one device's running mean (the EMA of global batch means). The
    # running variances are not: a local variance misses the spread between devices' means,
    # which is what "local" means (PyTorch DDP without SyncBatchNorm keeps the same).
    return {"per_device": kept, "running_mean": _state(model)["bn/mean"], "params": {
        k: v for k, v in _state(model).items() if not k.startswith("bn/") or k in ("bn/scale", "bn/bias")}}


SCENARIOS: dict[str, Callable[[Any, str], dict[str, Any]]] = {
    "basic": basic, "callables": callables, "model-strategy": model_strategy, "plan": plan, "sync-every": sync_every,
    "verbose": verbose, "validation": validation, "validation-split": validation_split, "callbacks": callbacks,
    "resume": resume, "save-load": save_load, "state": state, "local-stats": local_stats,
}


def run(name: str, options: dict[str, Any] | None, tmp: str) -> dict[str, Any]:
    """Scenario ``name`` under ``Strategy(**options)`` (``None``: one device), files under ``tmp``."""
    os.makedirs(tmp, exist_ok=True)
    return _host(SCENARIOS[name](_strategy(options), tmp))


def run_all(names: list[str], options: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Every scenario of ``names`` in this process (a launched one)."""
    return {name: run(name, options, os.path.join(tmp, name)) for name in names}
