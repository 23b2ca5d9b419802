"""``polyparallel.launch``: run a function in N processes through the strategy's runtime."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _payload, _routing, _trace
from ._errors import NoPluginError, TopologyError, UnsupportedTopologyError

if TYPE_CHECKING:
    from ._strategy import Strategy

__all__ = ["launch"]


def _adapters_running(pm: Any, runtime: str, topology: Any, strategy: Strategy) -> list[str]:
    """The installed adapters on ``runtime`` whose declared capabilities admit ``topology`` with
    ``strategy``'s sharding stage, precision and accumulation (what ``launch(runtime=<adapter>)``
    would check)."""
    names = []
    for name, adapter in sorted(pm.adapters().items()):
        caps = adapter.capabilities
        if caps is None or (caps.runtimes and runtime not in caps.runtimes):
            continue
        try:
            caps.check(topology, strategy.shard_policy.stage, strategy.precision, strategy.accumulate)
        except UnsupportedTopologyError:
            continue
        names.append(name)
    return names


def launch(
    fn: Callable[..., Any],
    strategy: Strategy,
    nprocs: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    runtime: str | None = None,
    timeout: float | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` new processes and return the results by rank.

    Inside ``fn`` the strategy's operations work with no setup call. Before any process starts,
    everything that can be checked is: the arguments, the topology against ``nprocs``, the
    runtime (:meth:`Strategy.resolve_runtime`, chosen here in the parent) and its declared
    capabilities and backends, and the global batch size against the data axis. The strategy
    is pickled into the processes with that runtime choice, so they run the same runtime. A
    failing rank raises :class:`LaunchError` with its traceback; the other ranks are stopped.

    :param fn: a picklable, module-level callable; or, from a notebook or ``python -``, a
        function defined there (the torch runtime then forks its processes; see
        docs/operations/launch.md#notebooks).
    :param strategy: the :class:`Strategy`; it is pickled into each process.
    :param nprocs: number of processes.
    :param args: positional arguments for ``fn`` (a tuple or list; pickled).
    :param kwargs: keyword arguments for ``fn`` (a mapping with string keys; pickled).
    :param runtime: a runtime (``"torch"``) or adapter (``"lightning"``) name whose capabilities
        must admit the topology; it also narrows the runtime choice when ``strategy.runtime`` is
        ``None`` (the processes then get the strategy with that runtime set).
    :param timeout: seconds after which every process is terminated and :class:`LaunchError`
        raised (a safety net for tests and scripts; collectives have the strategy's own timeout);
        ``None``: no limit.
    :param trace_dir: a directory where every process writes its collective trace
        (``rank<r>.jsonl``: the last collectives it issued, with their callers) when a collective
        fails and when it exits; read it with ``polyparallel trace DIR``. ``None``: not written
        (``POLYPARALLEL_TRACE_DIR`` in the environment does the same for any process). Only a
        runtime that records its collectives (feature ``"collective_trace"``: torch, JAX, XLA, one file
        per XLA replica) takes it; for another one it is refused with a ``TypeError`` before any
        process starts.
    :raises NoPluginError: no runtime is installed (with the extra to install), or the runtime
        cannot start processes.
    """
    from ._strategy import Strategy

    if not callable(fn):
        raise TypeError(f"launch(fn=) must be a callable (a module-level function). Received: {type(fn).__name__} "
                        f"{fn!r:.60}. For a script, use `polyparallel launch script.py` instead.")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"launch(strategy=) must be a polyparallel.Strategy. Received: {type(strategy).__name__} "
                        f"{strategy!r:.60}. Build one, e.g. polyparallel.Strategy(data=2).")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise TopologyError(f"launch(nprocs=) must be a positive int. Received: {nprocs!r}.")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"launch(args=) must be a tuple or list of arguments for fn. Received: {type(args).__name__} "
                        f"{args!r:.60}. For one argument write args=(value,).")
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise TypeError(f"launch(kwargs=) must be a mapping of argument name (str) -> value, or None. "
                        f"Received: {kwargs!r:.60}.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise TopologyError(f"launch(timeout=) must be None (no limit) or a positive, finite number of seconds. "
                            f"Received: {timeout!r}.")
    if trace_dir is not None:
        if not isinstance(trace_dir, (str, os.PathLike)) or not os.fspath(trace_dir):
            raise TypeError(f"launch(trace_dir=) must be a directory path (str or os.PathLike) or None. "
                            f"Received: {trace_dir!r:.60}.")
        trace_dir = os.path.abspath(os.fspath(trace_dir))
        if os.path.exists(trace_dir) and not os.path.isdir(trace_dir):
            raise TypeError(f"launch(trace_dir={trace_dir!r}) is a file; pass a directory (made if missing).")
    if runtime is not None and (not isinstance(runtime, str) or not runtime):
        raise TypeError(f"launch(runtime=) must be a runtime or adapter name, or None. Received: {runtime!r}.")
    topology = strategy.topology.resolve(nprocs)  # raises a TopologyError naming sizes and nprocs
    pm = strategy.plugin_manager
    among = None
    if runtime is not None:
        strategy.check(runtime, world_size=nprocs)
        runtimes, adapters = pm.runtimes(), pm.adapters()
        if runtime in runtimes:
            among = {runtime: f"launch(runtime={runtime!r})"}
        elif adapters[runtime].capabilities.runtimes:
            among = {rt: f"launch(runtime={runtime!r})" for rt in adapters[runtime].capabilities.runtimes}
    chosen = _routing.require(pm, strategy, among, needed_by="launch()")
    if among is not None and strategy.runtime is None and chosen != pm.resolve_runtime(strategy):
        strategy = strategy.replace(runtime=chosen)
    # The sharding stage is checked against whoever shards: the adapter named (checked above: it
    # may shard by itself, as DeepSpeed does), else the runtime; a refusal names the installed
    # adapters that would run it on this runtime (launch cannot see what fn will call).
    adapter_named = runtime is not None and runtime not in pm.runtimes()
    # Precision likewise: an adapter named maps it to its framework's mechanism (checked above).
    # Accumulation always: the micro-batches come from the runtime's shard_data. Both are checked
    # first, so the adapters named below are only ever suggested for the topology and stage.
    caps = pm.runtimes()[chosen]
    if not adapter_named and strategy.precision is not None:
        caps.check_precision(strategy.precision)
    caps.check_accumulation(strategy.accumulate)
    try:
        caps.check(topology, 0 if adapter_named else strategy.shard_policy.stage)
    except UnsupportedTopologyError as exc:
        if adapter_named:
            raise
        runs = _adapters_running(pm, chosen, topology, strategy)
        if not runs:
            raise
        raise UnsupportedTopologyError(
            f"{exc} The installed adapter{'s' if len(runs) > 1 else ''} {', '.join(map(repr, runs))} run{'' if len(runs) > 1 else 's'} "
            f"it on the {chosen!r} runtime, sharding by itself: if fn uses it, name it, "
            f"pp.launch(fn, strategy, runtime={runs[0]!r}), and its capabilities are checked instead.") from None
    if trace_dir is not None and _trace.FEATURE not in pm.runtimes()[chosen].features:
        raise TypeError(f"launch(trace_dir={trace_dir!r}): the {chosen!r} runtime does not record its collectives "
                        f"(its capabilities lack the {_trace.FEATURE!r} feature), so no trace would be written. "
                        "Drop trace_dir=, or use a runtime that records (torch, JAX, XLA).")
    _routing.check_batch(strategy.data_policy, topology, f"launch({strategy!r}, nprocs={nprocs})", strategy.accumulate)
    args, kwargs = tuple(args), dict(kwargs or {})
    # Here, not in a half-started job: the processes get them pickled. What an interactive
    # __main__ (a notebook cell, `python -`) defines cannot be imported by a fresh process: the
    # runtime's launcher decides (torch forks; the others refuse, _payload.refuse_interactive).
    payload = _payload.inspect_payload(fn, args, kwargs)
    if payload.problem is not None and not payload.main_names:
        raise TypeError(f"launch(): fn, args and kwargs must be picklable to reach the processes: {payload.problem}")
    results = pm.call_for_runtime("polyparallel_launch", chosen, fn=fn, strategy=strategy, runtime=chosen,
                                  nprocs=nprocs, args=args, kwargs=kwargs, timeout=timeout, trace_dir=trace_dir)
    if results is None:
        caps = pm.runtimes()[chosen]
        raise NoPluginError(
            f"The runtime {chosen!r} (plugin {caps.plugin!r}) cannot launch processes: no plugin implements "
            f"polyparallel_launch for it. Start the processes yourself (`polyparallel launch`, torchrun) or "
            f"choose a runtime that can: Strategy(runtime=...)."
        )
    return list(results)
