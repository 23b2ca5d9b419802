"""An Elegy-style ``Model`` on Flax NNX and optax, parallelised by one polyparallel ``Strategy``.

>>> model = Model(module, loss="cross_entropy", optimizer=optax.adam(1e-3), metrics=["accuracy"])  # doctest: +SKIP
>>> model.fit(x, y, epochs=5, batch_size=64, strategy=pp.Strategy(data=-1))              # doctest: +SKIP

The train step is one ``jax.jit`` program (:mod:`polyparallel_jax.steps`): a ``shard_map`` manual
over ``data`` (each device computes the gradient of its own rows; ``strategy.sync_grads`` averages
them) and automatic (GSPMD) over ``tensor`` (parameters split by partition rules), followed by the
optax update on the sharded parameters. Metrics and losses are reduced count-weighted by
``strategy.reduce_metrics``; BatchNorm statistics follow ``strategy.state_policy``:

- ``mean`` (the default for ``batch_stats*``): synchronised BatchNorm — batch statistics over the
  global batch at every step, so training equals single-device training on the same global batch;
- ``local``: each device keeps statistics of its own rows (as PyTorch DDP without SyncBN), across
  ``fit`` calls on the same strategy; they are averaged over ``data`` for ``evaluate``,
  ``predict``, ``save`` and ``model.module``. Under another strategy (another topology or policy)
  the per-device copies are averaged and dropped: every device of the new strategy starts from
  their average. A checkpoint holds the average, so a Model loaded under any strategy starts
  every device from it.

RNG keys are folded with the device's data coordinate (independent dropout per device); RNG
counters stay replicated.

``Strategy(precision=)``: parameters kept in its param dtype, forward and backward in its compute
dtype, the gradient reduction in its reduce dtype, the optimizer state in its optimizer dtype
(:mod:`polyparallel_jax.precision`); ``fp16-mixed`` (loss scaling) is refused before anything is
compiled. ``Strategy(accumulate=N)``: each step of ``batch_size`` rows is N micro-batches of
``batch_size / (data x N)`` rows per device, scanned inside the one compiled step, with one
gradient reduction and one optimizer update (:mod:`polyparallel_jax.steps`).

State. ``model.module`` holds the parameters, the BatchNorm statistics (averaged) and the RNG
state. The rest belongs to a *placement*, the state put on one strategy's mesh: the placement
itself, the optimizer state there, the per-device statistics (``local``) and the compiled steps.
:meth:`Model._reset` is the one way out of a placement, taken by every change of strategy and by
every load: per-device statistics are averaged into the module and dropped, the optimizer state
keeps its values until the next placement puts them into its shardings, the steps go.

``save``/``load`` write and read orbax-checkpoint directories (:mod:`polyparallel_jax.saving`,
through :meth:`Model.checkpoint_state` and :meth:`Model.restore_state`), resharded to the reading
mesh; ``fit(checkpoint=, checkpoint_every=, resume=)`` checkpoints and resumes mid-epoch exactly.

The module passed in keeps its own configuration: the train/eval mode and the BatchNorm
``axis_name`` a step needs are set only while that step's graph is taken (``nnx.split``; the
compiled step keeps them), then the module's own values are put back, so the user's
``axis_name`` for their own ``vmap``/``pmap`` survives ``fit``, ``evaluate`` and ``predict``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import polyparallel as pp

from . import callbacks as _callbacks
from . import losses as _losses
from . import precision, saving, steps, surface
from .data import ShardedArrays, host_rows, validation_rows
from .progress import ProgressBar
from .runtime import JaxRuntime, as_jax_strategy, resolve_for_devices, runtime_for
from .steps import DATA

__all__ = ["Model"]

#: Where a Model's state lives: (strategy or None for one device, its runtime, the wrapped module or None).
_Placement = tuple[pp.Strategy | None, JaxRuntime, Any]



class Model:
    """A trainable model: an NNX module with a loss, an optax optimizer and metrics.

    :param module: a ``flax.nnx.Module`` mapping a batch of inputs to predictions.
    :param loss: ``"cross_entropy"``, ``"mse"`` or ``fn(predictions, targets) -> per-sample loss``.
    :param optimizer: an ``optax.GradientTransformation`` (default: ``optax.adam(1e-3)``).
    :param metrics: names (``"accuracy"``) or callables ``fn(predictions, targets) -> per-sample``.
    :param strategy: the default :class:`polyparallel.Strategy` for ``fit``/``evaluate``/``predict``.
    :param plan: tensor-parallel partition rules (see :mod:`polyparallel_jax.partition`).
    :param sync_every: block on a step result every this many steps. Several CPU devices in one
        process deadlock when ~35+ steps containing collectives are queued; one wait every few
        steps costs nothing measurable (the device is still busy with the queued steps).
    """

    def __init__(self, module: Any, loss: Any = "cross_entropy", optimizer: Any = None, metrics: Sequence[Any] = (),
                 *, strategy: pp.Strategy | None = None, plan: Any = None, sync_every: int = 4):
        from flax import nnx

        if not isinstance(module, nnx.Module):
            raise TypeError(f"Model(module=) must be a flax.nnx.Module. Received: {type(module).__name__}.")
        if isinstance(metrics, str) or callable(metrics):
            metrics = [metrics]
        self.module = module
        _, self._loss_fn = _losses.resolve(loss, _losses.LOSSES, "loss")
        self._metric_fns = dict(_losses.resolve(m, _losses.METRICS, "metric") for m in metrics)
        if optimizer is None:
            import optax

            optimizer = optax.adam(1e-3)
        self.optimizer = optimizer
        self.strategy = strategy
        self.plan = plan
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive int. Received: {sync_every!r}.")
        self.sync_every = sync_every
        self.history: dict[str, list[float]] = {}
        self.stop_training = False  # a callback sets it to end fit after the epoch (Keras)
        # What belongs to the placement (set up by _place and its steps, cleared only by _reset):
        self._placed: _Placement | None = None
        self._opt_state: Any = None  # the optimizer state, sharded like the parameters there
        self._local_stats: Any = None  # per-device statistics under the "local" policy (leading axis: data)
        self._steps: dict[Any, Any] = {}  # the compiled steps
        # Outside any placement:
        self._unplaced_opt_state: Any = None  # optimizer values the next placement puts into its shardings
        self._fit_info: dict[str, Any] | None = None  # the last fit's data position, history, partial epoch

    # -- placement and state ---------------------------------------------------------------------
    def _place(self, strategy: pp.Strategy | None) -> _Placement:
        """Put the module's state on the strategy's mesh (once per strategy; see :meth:`place`)."""
        import jax

        if strategy is None and self._placed is not None:
            return self._placed  # keep the current placement (evaluate after a distributed fit)
        strategy = strategy if strategy is not None else self.strategy
        if strategy is not None:
            strategy = as_jax_strategy(strategy)
            resolve_for_devices(strategy.topology)  # a JAX-worded error before any session
            strategy.check("jax")  # pipeline > 1, precisions not run: refused before anything is compiled
            precision.check(strategy.precision, "polyparallel_jax.Model")
        if self._placed is not None and self._placed[0] == strategy:
            return self._placed
        self._reset()  # the module now holds everything the old placement had (averaged)
        if strategy is None:
            runtime = JaxRuntime.single()
            wrapped = None
            from flax import nnx

            nnx.update(self.module, jax.device_put(nnx.state(self.module), runtime.replicated))
        else:
            runtime = runtime_for(strategy)
            wrapped = strategy.wrap_model(self.module, plan=self.plan)
        self._placed = (strategy, runtime, wrapped)
        return self._placed

    def _reset(self, placement: _Placement | None = None) -> None:
        """The one reset of what belongs to a placement, for every path that leaves one (``fit``,
        ``evaluate``, ``predict``, ``save``, ``load`` under another strategy; every load, which
        replaces the state): per-device statistics of the ``local`` policy are averaged into the
        module and dropped, the optimizer state keeps its values, unplaced, until
        :meth:`_init_optimizer` puts them into the next placement's shardings, the compiled steps
        go. ``placement``: the placement afterwards (``None``: none until the next ``_place``)."""
        self._finish_local_stats()
        if self._opt_state is not None:
            self._unplaced_opt_state = self._opt_state
        self._placed, self._opt_state, self._local_stats, self._steps = placement, None, None, {}

    @property
    def _placement(self) -> _Placement:
        """The current placement: steps, data and optimizer state are built only after ``_place``
        (every public entry point calls it first)."""
        assert self._placed is not None, "Model._place() must run first"
        return self._placed

    def _split(self, train: bool) -> tuple[Any, Any, Any, Any]:
        """``nnx.split`` of the module configured for this step: train/eval mode, and BatchNorm
        synchronised over ``data`` for the ``mean`` policy. The configuration lives in the
        graphdef (static attributes); the user's module gets its own attributes back."""
        strategy = self._placed[0] if self._placed else None
        # Synchronised BatchNorm (global batch statistics) for the "mean" policy.
        sync = strategy is not None and train and self._stats_action(strategy) == "mean"
        return steps.split_configured(self.module, train, sync)

    @staticmethod
    def _stats_action(strategy: pp.Strategy) -> str:
        return strategy.state_policy.action_for("batch_stats")

    # -- steps ---------------------------------------------------------------------------------
    def _step(self, train: bool) -> Any:
        """The compiled train (or eval) step for the current placement, built once."""
        key = ("train" if train else "eval", self._local_stats is not None and train)
        if key not in self._steps:
            strategy, runtime, _ = self._placement
            graphdef, _, _, _ = self._split(train)
            self._steps[key] = steps.build(graphdef, strategy, runtime, self._loss_fn, self._metric_fns, self._tx,
                                           train=train, local_stats=key[1])
        return self._steps[key]

    # -- data --------------------------------------------------------------------------------------
    def _data(self, arrays: Any, batch_size: int, shuffle: bool, remainder: str, seed: int | None,
              train: bool = True) -> ShardedArrays:
        """Training data through ``strategy.shard_data`` (micro-batches of ``Strategy(accumulate=)``
        included); evaluation data in whole batches (nothing to accumulate)."""
        strategy, runtime, _ = self._placement
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int. Received: {batch_size!r}.")
        arrays = tuple(np.asarray(a) for a in arrays)
        if strategy is None or not train:
            return ShardedArrays(arrays, runtime, pp.DataPolicy(batch_size, shuffle, remainder),
                                 (strategy.seed if strategy is not None else 0) if seed is None else seed)
        if seed is not None:
            strategy = strategy.replace(seed=seed)
        return strategy.shard_data(arrays, batch_size=batch_size, shuffle=shuffle, remainder=remainder)

    # -- public API ------------------------------------------------------------------------------
    def fit(self, x: Any, y: Any, epochs: int = 1, batch_size: int = 32, validation_data: tuple[Any, Any] | None = None,
            strategy: pp.Strategy | None = None, *, shuffle: bool = True, verbose: int = 1,
            seed: int | None = None, checkpoint: str | None = None, checkpoint_every: int | None = None,
            resume: bool | str = False, callbacks: Sequence[Any] | None = None, validation_split: float = 0.0,
            validation_batch_size: int | None = None, validation_freq: int = 1,
            **unsupported: Any) -> dict[str, list[float]]:
        """Train until epoch ``epochs`` over ``(x, y)`` with global batch ``batch_size``.

        :param strategy: parallelise over devices (``Strategy(data=-1)``, ``Strategy(data=4,
            tensor=2)``); ``None`` uses the Model's strategy, or one device.
        :param validation_data: ``(x_val, y_val)`` evaluated after each epoch (``val_*`` keys),
            every row once, in batches of ``validation_batch_size`` (default ``batch_size``),
            every ``validation_freq`` epochs.
        :param validation_split: a fraction of ``(x, y)``: its last rows (before any shuffling,
            as Keras) are the validation data instead.
        :param callbacks: :mod:`polyparallel_jax.callbacks` (``EarlyStopping``,
            ``ModelCheckpoint``, a ``Callback`` of your own), called after every epoch.
        :param verbose: 0 silences the progress bar (it prints on the logger process only).
        :param seed: overrides ``strategy.seed`` for shuffling.
        :param checkpoint: a directory: :meth:`save` into ``checkpoint/step-<global step>`` after
            every epoch, and every ``checkpoint_every`` steps (counted over the run) within one;
            the two newest committed checkpoints are kept.
        :param resume: ``True`` (resume from the newest committed checkpoint in ``checkpoint``,
            or start from scratch if there is none: what a restarted job needs) or a checkpoint
            path. The run continues at the saved epoch and step with the saved parameters,
            optimizer, RNG state and history, on any topology with the same global batch: the
            rest of the interrupted epoch is exactly the batches an uninterrupted run would train
            on next, so it ends with the uninterrupted run's parameters. A different global
            batch, seed, shuffling or data length is refused. ``epochs`` counts from the start.
        :return: :attr:`history`, ``name -> per-epoch values`` (``loss``, metrics, ``val_*``).

        Keras arguments that are not supported (``sample_weight=``, ``class_weight=``,
        ``initial_epoch=``, ...) are refused before anything runs, saying what to do instead
        (:mod:`polyparallel_jax.surface`).
        """
        import jax
        from flax import nnx

        surface.refuse("fit", unsupported)
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int. Received: {epochs!r}.")
        x, y, validation_data = validation_rows(x, y, validation_data, validation_split, validation_freq)
        hooks = _callbacks.check(callbacks)
        every = saving.checkpoint_every(checkpoint, checkpoint_every)
        self._place(strategy)
        data = self._data((x, y), batch_size, shuffle, self._remainder(), seed)
        start_epoch, start_step, partial = saving.start_position(self, checkpoint, resume, data)
        graphdef, params, stats, rest = self._split(train=True)
        if self._opt_state is None:
            self._opt_state = self._init_optimizer(params)
        stats = self._local_stats if self._local_stats is not None else self._maybe_local(stats)
        step = self._step(train=True)  # after _maybe_local: the step's stats layout depends on it
        opt_state = self._opt_state
        logger = jax.process_index() == 0
        self.stop_training = False
        for hook in hooks:
            _callbacks.run([hook], "set_model", self)
        _callbacks.run(hooks, "on_train_begin", {})
        logs: dict[str, float] = {}
        for epoch in range(start_epoch, epochs):
            first = start_step if epoch == start_epoch else 0
            bar = ProgressBar(len(data), f"epoch {epoch + 1}/{epochs}", enabled=bool(verbose) and logger)
            results: list[Any] = list(partial) if epoch == start_epoch else []

            def save_now(state: tuple[Any, ...], results: list[Any] = results) -> None:
                if every and checkpoint is not None and data.global_step % every == 0:
                    self._opt_state = state[3]
                    self._store(*state[:3])
                    self._record_fit(data, results)
                    saving.fit_checkpoint(self, checkpoint, data.global_step)

            params, stats, rest, opt_state = steps.run_epoch(step, data, epoch, first, (params, stats, rest, opt_state),
                                                             results, self.sync_every, bar, save_now)
            logs = steps.weighted(jax.device_get(results))
            bar.update(len(data), logs, final=True)
            self._opt_state = opt_state
            self._store(params, stats, rest)
            if validation_data is not None and (epoch + 1) % validation_freq == 0:
                x_val, y_val = validation_data
                logs.update({f"val_{name}": value for name, value in self.evaluate(
                    x_val, y_val, batch_size=validation_batch_size or batch_size).items()})
            for name, value in logs.items():
                self.history.setdefault(name, []).append(value)
            self._record_fit(data, [])
            if checkpoint is not None:
                saving.fit_checkpoint(self, checkpoint, data.global_step)
            _callbacks.run(hooks, "on_epoch_end", epoch, dict(logs))
            if self.stop_training:  # the same decision on every process: the logs are global
                break
        nnx.update(self.module, params)  # in case epochs == 0 left nothing stored
        _callbacks.run(hooks, "on_train_end", dict(logs))
        return self.history

    def evaluate(self, x: Any, y: Any, batch_size: int = 32, strategy: pp.Strategy | None = None,
                 verbose: int = 0, **unsupported: Any) -> dict[str, float]:
        """Loss and metrics over every sample of ``(x, y)``, each counted exactly once (a
        progress bar with ``verbose``)."""
        surface.refuse("evaluate", unsupported)
        metrics, _ = self._run_eval((host_rows(x), host_rows(y)), batch_size, strategy, verbose)
        return metrics

    def predict(self, x: Any, batch_size: int = 32, strategy: pp.Strategy | None = None, verbose: int = 0,
                **unsupported: Any) -> np.ndarray:
        """Predictions for every row of ``x``, in order (a host numpy array; a progress bar with
        ``verbose``)."""
        surface.refuse("predict", unsupported)
        x = host_rows(x)
        _, predictions = self._run_eval((x, np.zeros(len(x), np.int32)), batch_size, strategy, verbose,
                                        need_predictions=True)
        return predictions

    def compile(self, *args: Any, **unsupported: Any) -> None:
        """Refused: Keras' ``compile`` step does not exist here (see :mod:`polyparallel_jax.surface`)."""
        raise TypeError(surface.refusal("compile"))

    def _run_eval(self, arrays: Any, batch_size: int, strategy: Any, verbose: int, need_predictions: bool = False) -> Any:
        import jax

        self._place(strategy)
        self._finish_local_stats()
        data = self._data(arrays, batch_size, False, "uneven", None, train=False)
        step = self._step(train=False)
        _, params, stats, rest = self._split(train=False)
        results, counts, outputs = [], [], []
        bar = ProgressBar(len(data), "predict" if need_predictions else "evaluate",
                          enabled=bool(verbose) and jax.process_index() == 0)
        for i, batch in enumerate(data.batches(0)):
            bx, by = batch.data
            metrics, predictions = step(params, stats, rest, bx, by, batch.mask)
            results.append(metrics)
            counts.append(batch.count)
            if need_predictions:
                if not predictions.is_fully_addressable:  # several processes: bounded, traced
                    predictions = self._gather_predictions(predictions)
                outputs.append((np.asarray(predictions), batch.indices))
            if (i + 1) % self.sync_every == 0:
                jax.block_until_ready(metrics)
        # Each batch's metrics are exact means over its real rows; weight them by real rows.
        host = list(zip(jax.device_get(results), counts))
        values = steps.weighted(host)
        bar.update(len(data), values, final=True)
        if not need_predictions:
            return values, None
        out = None
        for predictions, indices in outputs:
            if out is None:
                out = np.zeros((data.num_samples, *predictions.shape[1:]), predictions.dtype)
            out[indices] = predictions  # padding rows repeat a real index with the same value
        return values, out

    def _gather_predictions(self, predictions: Any) -> Any:
        from .ops import gather_rows

        strategy, runtime, _ = self._placement
        return gather_rows(predictions, runtime, "predict", strategy.session().rank if strategy is not None else 0)

    # -- state ---------------------------------------------------------------------------------
    def _remainder(self) -> str:
        strategy = self._placement[0]
        return strategy.data_policy.remainder if strategy is not None else "pad"

    def _init_optimizer(self, params: Any) -> Any:
        """The optimizer state on this placement, sharded like ``params``: the unplaced values
        (from another placement, or a restored file) if there are some, else freshly initialised."""
        import jax

        _, runtime, wrapped = self._placement
        if wrapped is not None:
            opt_state = wrapped.init_optimizer(self._tx, params)
        else:
            opt_state = jax.jit(self._tx.init)(params)
        saved, self._unplaced_opt_state = self._unplaced_opt_state, None
        if saved is not None:  # same values, placed like the fresh state
            fresh, treedef = jax.tree.flatten(opt_state)
            opt_state = jax.tree.unflatten(treedef, [jax.device_put(jax.numpy.asarray(old_value, new.dtype), new.sharding)
                                                     for old_value, new in zip(jax.tree.leaves(saved), fresh)])
        return opt_state

    @property
    def _tx(self) -> Any:
        """The optimizer as it runs on the placement: under a precision, its state kept in the
        optimizer dtype (:meth:`polyparallel_jax.ShardedModule.optimizer`)."""
        wrapped = self._placement[2]
        return wrapped.optimizer(self.optimizer) if wrapped is not None else self.optimizer

    def _maybe_local(self, stats: Any) -> Any:
        """Under the ``local`` policy, give every device its own copy of the statistics."""
        import jax
        import jax.numpy as jnp

        strategy, runtime, _ = self._placement
        if strategy is None or self._stats_action(strategy) != "local" or not jax.tree.leaves(stats):
            return stats
        size = runtime.data_size
        stacked = jax.tree.map(lambda s: jnp.broadcast_to(s[None], (size, *s.shape)), stats)
        self._local_stats = jax.device_put(stacked, runtime.sharding(DATA))
        return self._local_stats

    def _store(self, params: Any, stats: Any, rest: Any) -> None:
        from flax import nnx

        if self._local_stats is not None:
            self._local_stats = stats
            stats = steps.average(stats)
        nnx.update(self.module, params, stats, rest)

    def _finish_local_stats(self) -> None:
        """The module gets the average of the per-device statistics (``local`` policy)."""
        from flax import nnx

        if self._local_stats is not None:
            nnx.update(self.module, steps.average(self._local_stats))

    def _record_fit(self, data: ShardedArrays, results: list[Any]) -> None:
        """``fit``'s position: the data's, its history, and the partial epoch's metric sums (so
        that a resumed epoch's history is an uninterrupted one's)."""
        import jax

        partial = [({k: float(v) for k, v in m.items()}, int(c)) for m, c in jax.device_get(results)]
        self._fit_info = {"loader": data.state_dict(), "history": {k: list(v) for k, v in self.history.items()},
                          "partial": partial}

    @property
    def batch_stats_per_device(self) -> Any:
        """Per-device BatchNorm statistics (leading axis: data coordinate) under the ``local``
        policy, else ``None``. Kept while the Model stays on one strategy; another strategy (or
        a load) averages them into ``module`` and drops them."""
        return self._local_stats

    # -- placement and state, for saving ---------------------------------------------------------
    def place(self, strategy: pp.Strategy | None = None) -> pp.Strategy | None:
        """Put the Model's state on ``strategy``'s mesh (default: the current placement, else the
        Model's strategy, else one device) and return the strategy it is placed on (``None``: one
        device). ``fit``, ``evaluate``, ``predict`` and ``load`` call it first. Another strategy
        than the current one goes through :meth:`_reset`: ``local`` per-device statistics are
        averaged and dropped, the optimizer state moves with its values, steps are compiled again."""
        return self._place(strategy)[0]

    @property
    def placed_strategy(self) -> pp.Strategy | None:
        """The strategy the state is placed on (``None``: one device, or not placed yet)."""
        return self._placed[0] if self._placed is not None else None

    @property
    def fit_progress(self) -> dict[str, Any] | None:
        """The last ``fit``'s (or the loaded checkpoint's) position: ``{"loader": the data's
        state_dict, "history", "partial": the interrupted epoch's metric sums}``; ``None`` before."""
        return dict(self._fit_info) if self._fit_info is not None else None

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of this Model holds, as placed now, by section: ``module/params``,
        ``module/batch_stats`` (under the ``local`` policy the average of the per-device
        statistics), ``module/other`` (RNG state, other variables), and ``optimizer`` once there
        is an optimizer state (after ``fit`` or a load)."""
        self._finish_local_stats()
        state = saving.module_sections(self.module)
        optimizer = self._opt_state if self._opt_state is not None else self._unplaced_opt_state
        if optimizer is not None:
            state["optimizer"] = optimizer
        return state

    def restore_state(self, read: Callable[[dict[str, Any]], Mapping[str, Any]], *, optimizer: bool,
                      progress: Mapping[str, Any] | None = None) -> None:
        """Replace the state with ``read(targets)`` in the current placement (:meth:`place` first),
        through :meth:`_reset` (per-device statistics, compiled steps and the optimizer state go).
        ``targets`` are :meth:`checkpoint_state`'s sections as placed here, with a freshly
        initialised ``optimizer`` if ``optimizer`` (else the Model has no optimizer state until
        ``fit`` initialises one); ``read`` returns trees of the same structure, each array in its
        target's sharding (``module/other`` may be left out: it is kept). ``progress`` becomes
        :attr:`fit_progress`."""
        from flax import nnx

        self._reset(self._placement)
        self._unplaced_opt_state = None
        targets = saving.module_sections(self.module)
        if optimizer:
            targets["optimizer"] = self._init_optimizer(targets["module/params"])
        restored = read(targets)
        nnx.update(self.module, *(restored[name] for name in saving.MODULE_SECTIONS if name in restored))
        self._opt_state = restored.get("optimizer")
        self._fit_info = dict(progress) if progress is not None else None

    def save(self, path: str, **extras: Any) -> str:
        """Write a checkpoint directory at ``path`` (replacing an earlier checkpoint there):
        parameters, BatchNorm statistics, RNG state and the optimizer state with orbax-checkpoint
        (every process writes its own shards), and in the commit marker
        ``polyparallel-checkpoint.json`` the topology written at, the last ``fit``'s position
        (epoch, step, global batch), its history, and ``extras`` (numbers, strings, lists/dicts,
        arrays). Every process calls it. Returns the absolute path.

        Atomic: written into ``path.partial-<token>``, committed (the marker last) and renamed to
        ``path``, so a job killed while saving leaves nothing that loads. Under the ``local``
        BatchNorm policy the per-device statistics are saved averaged.
        """
        return saving.save_model(self, os.fspath(path), extras)

    def load(self, path: str, strategy: pp.Strategy | None = None, loader: ShardedArrays | None = None) -> dict[str, Any]:
        """Restore what :meth:`save` wrote into this model, resharded to ``strategy``'s mesh
        (default: the current placement, else the Model's strategy, else one device): each array
        is read straight into the sharding this model gives it there, so a checkpoint written at
        ``data=4, tensor=2`` loads at ``data=8`` or on one device. ``loader`` (host arrays
        sharded by ``strategy.shard_data``) continues at the saved position. Under the ``local``
        policy every device starts from the saved (averaged) statistics.

        Refused before anything is restored (``polyparallel.CheckpointError``): a directory
        without the commit marker (half-written) or with truncated files, one written by another
        model or optimizer (a leaf missing, unexpected, or of another shape: the error names it),
        a ``loader`` whose global batch, seed, shuffling or data length differ, a file that is
        not msgpack. A flax msgpack *file* written by the earlier ``Model.save`` is still read
        (into the same placement).

        :return: ``{"epoch", "step", "global_step", **extras}`` (the saved position: ``None``
            without one). ``fit(resume=path)`` continues from there exactly.
        """
        return saving.load_model(self, os.fspath(path), strategy, loader)
