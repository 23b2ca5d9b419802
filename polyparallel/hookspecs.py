"""Hook specifications: the whole contract between the core and its plugins.

Every hook is named ``polyparallel_<what>``; a plugin implementing a ``polyparallel_*`` name that
is not specified here is refused when it is registered (a misspelling would otherwise never be
called). Implementations may accept any subset of a spec's arguments, so specs grow only by
adding keyword arguments.

Routing. A *runtime* plugin (torch, JAX) declares its runtime with ``polyparallel_capabilities``;
each strategy runs on one runtime, chosen once per process (``Strategy.resolve_runtime``) and
handed to the hooks as ``session.runtime`` (``runtime=`` for ``process_info`` and ``launch``). The
core calls the hooks that concern a session or a launch (the five operations, the checkpoints,
``process_info``, ``session_start``/``session_finish``, ``launch``) only on the plugins that serve
its runtime (``PluginManager.served_runtimes``): the plugin that declared it, and the plugins that
declare no runtime (a data type of their own, a wrapper), adapters only for the runtimes their
``Capabilities(runtimes=)`` name. So a runtime's hooks never see another runtime's session and need
no ``session.runtime`` guard; within a runtime a plugin answers by the object's type.

The five operations are ``firstresult``: a plugin that does not own the object returns ``None``
and the next plugin is asked; when nobody answers, the core raises
:class:`~polyparallel.NoPluginError` naming the installed plugins, a plugin that failed to load,
or the extra to install. Cross-cutting concerns (timing, tracing) are hook wrappers
(``@hookimpl(wrapper=True)``) ordered with ``tryfirst``/``trylast``; they see every call,
registry hooks included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ._capabilities import Capabilities
    from ._session import ProcessInfo, Session
    from ._strategy import Strategy

hookspec = pluggy.HookspecMarker("polyparallel")

# -------------------------------------------------------------------------------------------------
# registration: what a plugin offers
# -------------------------------------------------------------------------------------------------


@hookspec
def polyparallel_register_adapters(register: Callable[..., None]) -> None:
    """Register framework adapters, the objects ``Strategy.adapt(name)`` returns.

    Called once per plugin manager, lazily, on the first ``adapt`` or ``plugins`` listing.

    :param register: call ``register(name, factory, capabilities=Capabilities(...),
        description="...")``. ``factory(strategy, **kwargs)`` builds the framework-native object;
        it should import its framework lazily. ``capabilities`` says which axes the adapter can
        run, so an unsupported topology is refused before anything starts.
    :return: ignored.
    """


@hookspec
def polyparallel_capabilities() -> Capabilities | list[Capabilities] | None:
    """Declare which runtimes this plugin provides, what they need and what they can run.

    Called through pluggy once per implementing plugin (so each declaration is attributed to its
    plugin, with every wrapper around it), lazily, and cached until the plugins change.

    :return: a :class:`~polyparallel.Capabilities` (or a list of them) whose ``target`` names a
        runtime (``"torch"``), or ``None``. Fill in ``axes``/``excludes`` (what topologies it
        runs), ``imports`` (the modules it needs: ``{"torch"}``; the runtime counts as installed
        when they can be imported), ``backends`` (the values ``Strategy(backend=)`` may take) and
        ``priority`` (the automatic choice among several installed runtimes). ``pp.launch``,
        session creation and ``Strategy.check`` refuse a topology the runtime cannot run before
        any process or process group exists.
    """


@hookspec
def polyparallel_register_demos(register: Callable[..., None]) -> None:
    """Register entries of ``polyparallel demo``.

    :param register: call ``register(name, run)`` where ``run(strategy, nprocs)`` trains the demo
        problem in ``nprocs`` processes and returns a dict with the keys ``framework``,
        ``topology``, ``final_loss``, ``accuracy`` and ``step_time_ms``, and optionally ``losses``
        (the global training loss of every step, in order) with ``epochs`` (how many epochs they
        span), which the demo draws in its ``loss-curves.png``. While ``run`` runs, the process's
        standard output and error go to the demo's log (``demo-warnings.log``): print nothing the
        user must see; raise instead.
    :return: ignored.
    """


@hookspec
def polyparallel_register_advisors(register: Callable[..., None]) -> None:
    """Register a runtime's topology advisor (``polyparallel plan --model``, ``bench-comm``).

    Called on each ``plan --model`` and ``bench-comm``; only advisors of installed runtimes are used.

    :param register: call ``register(runtime, advisor)`` where ``advisor`` implements
        :class:`polyparallel._advisor.Advisor`: ``profile(model, batch, seq_len)`` returns a
        ``ModelProfile`` of the ``module:factory`` named (built without memory, e.g. on torch's
        meta device) or ``None`` when the model is not this runtime's; ``measure(...)`` runs
        candidates for real; ``bench_comm(...)`` measures the links. It should import its
        framework lazily.
    :return: ignored.
    """


@hookspec(firstresult=True)
def polyparallel_adapter_bridge(adapter: str, obj: Any) -> Any:
    """Help another plugin's adapter with an object this plugin owns. Stops at first non-None result.

    Adapters import no other adapter. When one meets an object it cannot drive itself (the
    Ignite adapter's ``create_supervised_trainer`` handed a DeepSpeed engine, which steps its own
    optimizer), it asks through ``PluginManager.bridge(adapter, obj)``, and the plugin that owns
    the object answers with what the asking adapter documents it needs (Ignite:
    ``create_trainer(model, loss_fn, device, **kwargs)`` and ``create_evaluator(model, metrics,
    device, **kwargs)``, each returning an ignite ``Engine``).

    :param adapter: the name of the asking adapter (``"ignite"``).
    :param obj: the object it was handed.
    :return: the bridge (any object offering what that adapter documents), or ``None`` when this
        plugin does not own ``obj`` or has no bridge to ``adapter``.
    """


# -------------------------------------------------------------------------------------------------
# lifecycle: processes and per-process runtime state
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_process_info(strategy: Strategy, runtime: str | None) -> ProcessInfo | None:
    """Tell this process's rank and the world size. Stops at first non-None result.

    The core's own implementation (``trylast``) reads the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``; rank 0 of 1 when unset). A runtime whose ranks are not
    processes (JAX: devices) answers; the core asks only the plugins that serve ``runtime``.

    :param strategy: the strategy whose session is being created.
    :param runtime: the runtime the session will run on (``None``: no runtime is installed).
    :return: a :class:`~polyparallel.ProcessInfo`, or ``None`` to let the next plugin answer.
    """


@hookspec
def polyparallel_session_start(session: Session) -> None:
    """A per-process session was created for a strategy (topology resolved and validated).

    Runtimes set up their process groups lazily, on their first operation; this hook is for
    plugins that must observe every session (logging, tracing). When one raises, the session is
    closed (``polyparallel_session_finish``, its finalizers) and not kept, and the error propagates.

    :param session: the new :class:`~polyparallel.Session`.
    :return: ignored.
    """


@hookspec
def polyparallel_session_finish(session: Session) -> None:
    """A session is being closed (explicitly, or at interpreter exit). Release resources here or
    through ``session.add_finalizer``.

    Also called when a ``polyparallel_session_start`` hook raised: that session is closed and
    forgotten (the next use makes a new one and runs the start hooks again), so a finish hook
    may see a session whose start it never saw.

    :param session: the closing :class:`~polyparallel.Session`.
    :return: ignored.
    """


@hookspec(firstresult=True)
def polyparallel_launch(
    fn: Callable[..., Any], strategy: Strategy, runtime: str, nprocs: int, args: tuple, kwargs: dict,
    timeout: float | None, trace_dir: str | None,
) -> list[Any] | None:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` fresh processes. Stops at first non-None result.

    The processes must find the strategy's operations ready to use (rank and world size in their
    environment). A failing rank's traceback is raised as :class:`~polyparallel.LaunchError`
    and the other ranks are stopped.

    :param fn: a picklable (module-level) callable.
    :param strategy: the strategy; its topology was already resolved against ``nprocs`` and
        checked against ``runtime``'s capabilities. Pickle it into the processes as it is: it
        carries the runtime choice.
    :param runtime: the runtime chosen for the strategy (only the plugins that serve it are asked).
    :param nprocs: number of processes on this machine.
    :param args: positional arguments for ``fn``.
    :param kwargs: keyword arguments for ``fn``.
    :param timeout: seconds after which all processes are terminated and ``LaunchError`` raised
        (``None``: no limit).
    :param trace_dir: an absolute directory where every process writes its collective trace
        (``polyparallel._trace``: ``configure(trace_dir=...)`` in each process), or ``None``.
    :return: the list of return values, indexed by rank; ``None`` if this plugin cannot launch.
    """


@hookspec(firstresult=True)
def polyparallel_launch_script(command: list[str], options: dict[str, Any]) -> int | None:
    """Run a script on many processes/nodes (``polyparallel launch``). Stops at first non-None result.

    :param command: the script and its arguments.
    :param options: ``nproc_per_node``, ``nnodes``, ``node_rank``, ``rdzv_endpoint`` (``None``:
        one node, pick a local port), ``rdzv_timeout`` (seconds for every node to join),
        ``max_restarts``, ``trace_dir`` (where every rank writes its collective trace, or
        ``None``), as given on the command line and already validated by it.
    :return: the exit code, or ``None`` if this plugin cannot launch.
    """


# -------------------------------------------------------------------------------------------------
# data
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_shard_data(strategy: Strategy, session: Session, data: Any, policy: Any) -> Any:
    """Shard ``data`` over the data axis. Stops at first non-None result.

    Every data coordinate gets a disjoint shard; ranks sharing a data coordinate get identical
    batches; the union over an epoch is the whole data set (``policy.remainder`` says how the tail
    is handled); shuffling is deterministic from ``(strategy.seed, epoch)``.

    :param strategy: the strategy.
    :param session: this process's session (rank, resolved topology, ``runtime``, stash). Only the
        plugins that serve ``session.runtime`` are asked.
    :param data: a data set or loader of some framework.
    :param policy: the :class:`~polyparallel.DataPolicy` with per-call overrides applied.
    :return: the sharded object, or ``None`` if this plugin does not own ``data``'s type.
    """


# -------------------------------------------------------------------------------------------------
# model
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_wrap_model(strategy: Strategy, session: Session, model: Any, options: dict[str, Any]) -> Any:
    """Parallelise ``model`` over the topology. Stops at first non-None result.

    Data axis: replicate and reduce gradients over the data group only (never a world-wide
    wrapper). Tensor axis: partition with a plan (``options["plan"]`` or the plugin's default).
    Pipeline axis: split into stages.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param model: a model of some framework.
    :param options: keyword arguments given to ``Strategy.wrap_model`` (e.g. ``plan``).
    :return: the wrapped model, or ``None`` if this plugin does not own ``model``'s type.
    """


# -------------------------------------------------------------------------------------------------
# gradients
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_sync_grads(strategy: Strategy, session: Session, target: Any) -> Any:
    """Reduce gradients over the data group (``strategy.grad_policy``). Stops at first non-None result.

    Where a wrapper already reduced them (DDP), this is a documented no-op that still answers.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param target: a model, or gradients (a pytree) of some framework.
    :return: the synced target (gradients for a pytree; the model for a model), or ``None`` if
        this plugin does not own ``target``'s type.
    """


# -------------------------------------------------------------------------------------------------
# metrics and states
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_reduce_metrics(strategy: Strategy, session: Session, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """Reduce a mapping of metrics over the data group. Stops at first non-None result.

    :class:`~polyparallel.Mean` values reduce count-weighted; plain values by
    ``strategy.metric_policy``. Bounded by the strategy's timeout; a peer that never joins makes
    this raise :class:`~polyparallel.CollectiveTimeout` naming the operation, axis and rank.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param metrics: name -> value (numbers, tensors/arrays of a runtime, ``Mean``).
    :return: name -> reduced float (or tensor/array for tensor/array inputs), or ``None`` if
        this plugin does not own the values' types.
    """


@hookspec(firstresult=True)
def polyparallel_sync_states(strategy: Strategy, session: Session, states: Any) -> Any:
    """Synchronise state collections per ``strategy.state_policy``. Stops at first non-None result.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param states: a model (its buffers and parameters) or a mapping of named state collections.
    :return: the synced states, or ``None`` if this plugin does not own ``states``' type.
    """


# -------------------------------------------------------------------------------------------------
# checkpoints
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def polyparallel_save_checkpoint(strategy: Strategy, session: Session, path: str, state: dict[str, Any],
                                 options: dict[str, Any]) -> Any:
    """Write one training state as a checkpoint directory (``Strategy.save``). Stops at first non-None result.

    Every rank calls it with the same ``path``. The checkpoint must be portable: loadable at any
    topology of the same model (another data size, no tensor/pipeline axis, one process), and
    committed atomically: write everything into a staging directory first and publish it as
    ``path`` (with the commit marker of :mod:`polyparallel._checkpoints`, whose JSON metadata
    ``polyparallel checkpoint inspect`` and :func:`polyparallel.latest_checkpoint` read) only
    after every rank finished, so a job killed while saving never leaves a half-written
    checkpoint under ``path``. The session's runtime answers (the core asks no other runtime); an
    adapter plugin may answer first for objects of its framework.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param path: the checkpoint directory to publish (absolute; its parent exists or is made).
    :param state: what to save, as given to ``Strategy.save`` and checked by the core: the
        objects ``model``, ``optimizer`` and ``loader`` (a loader ``Strategy.shard_data``
        returned: its epoch and position are saved), ``framework`` (a name for the metadata,
        default the runtime) and the user's extras (name -> numbers, strings, booleans, ``None``,
        lists/dicts of them, or tensors/arrays of the runtime; refuse any other object).
        Save the runtime's RNG states per rank as well.
    :param options: ``{"asynchronous": bool}`` (``Strategy.async_save``: return a
        ``concurrent.futures.Future`` of the published path once the state is staged, and commit
        in the background). An implementation that does not declare ``options`` (pluggy passes
        only the arguments an implementation names) saves synchronously; the core then returns a
        finished future.
    :return: the published path (a ``str``) or, asynchronously, a future of it; or ``None`` if
        this plugin does not own the state.
    """


@hookspec(firstresult=True)
def polyparallel_load_checkpoint(strategy: Strategy, session: Session, path: str,
                                 state: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    """Restore a checkpoint written by ``polyparallel_save_checkpoint`` (``Strategy.load``). Stops at first non-None result.

    Restores ``state``'s objects in place, resharding to this strategy's topology, and this
    rank's RNG states (when the checkpoint has the rank; a rank that the writing topology lacked
    keeps its own). Refuse, on every rank and before any collective, a checkpoint of another
    model (missing/unexpected keys, other shapes, naming the parameter), a truncated or corrupt
    file, and a loader whose global batch, data set length, seed or shuffling differ from the
    saved ones (exact resumption would consume other samples). Never unpickle arbitrary objects.
    The core already checked that ``path`` is committed and was written by this runtime.

    :param strategy: the strategy.
    :param session: this process's session (only the plugins that serve ``session.runtime`` are asked).
    :param path: the committed checkpoint directory (absolute).
    :param state: the objects to restore in place: ``model``, ``optimizer``, ``loader``.
    :param options: empty, or a partial load of the model asked explicitly: ``{"strict": bool,
        "keys": glob patterns | predicate | None}``; answer it with the result's ``load_report``
        (``loaded``, ``missing``, ``unexpected``, ``mismatched``, ``excluded``), or refuse it
        (a ``CheckpointError``) before loading anything. Never load part of a model otherwise.
    :return: ``{"epoch": int | None, "step": int | None, "global_step": int | None, **extras}``
        (progress of the saved loader: the epoch to continue, the batches of it already consumed,
        the batches consumed since the loader was made; ``None`` when saved without ``loader=``),
        or ``None`` if this plugin does not own the state.
    """


@hookspec(firstresult=True)
def polyparallel_export_checkpoint(path: str, metadata: dict[str, Any], to: str, output: str) -> str | None:
    """Write the committed checkpoint ``path`` as one consolidated file (``polyparallel checkpoint
    export``), loadable without polyparallel. Stops at first non-None result.

    Runs in one process, without a strategy: gather every shard (whatever topology wrote it) and
    write ``output`` in the format ``to`` (``"torch"``: a ``torch.load(weights_only=True)``-able
    dict; ``"safetensors"``: the model's tensors, :func:`polyparallel._checkpoint_export.write_safetensors`).
    The core has verified the files already (sizes and SHA-256), and asks only the plugins that
    serve the runtime that wrote the checkpoint (``metadata["runtime"]``).

    :param path: the committed checkpoint directory (absolute).
    :param metadata: its commit marker's metadata (:func:`polyparallel._checkpoints.read_marker`).
    :param to: ``"torch"`` or ``"safetensors"``.
    :param output: the file to write (absolute; write it whole or not at all: a temporary name, then a rename).
    :return: the path written, or ``None`` if this plugin does not export this runtime's checkpoints.
    """
