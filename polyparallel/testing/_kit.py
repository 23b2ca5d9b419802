"""The conformance kit: one contract, checked the same way for every plugin.

A plugin author writes a :class:`ConformanceDriver` (the framework-specific half: build the
reference problem in the framework, train it, evaluate it, sync its states) and subclasses
:class:`ConformanceSuite` once per topology. The kit launches the processes (through the
driver, so a runtime whose processes drive several ranks can launch its own way), runs the
driver in each, and checks the per-rank results against the contract and a single-process
reference (:mod:`polyparallel.testing._checks`). Everything here is framework-free.
"""

from __future__ import annotations

import _thread
import abc
import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._capabilities import Capabilities
from .._errors import CollectiveError, LaunchError
from .._launch import launch
from .._manager import hookimpl
from .._strategy import Strategy
from .._topology import Topology

__all__ = ["ConformanceDriver", "PerRank", "bind_plugin_manager", "fail_fast_bound", "reference_data", "run_contract",
           "run_skipped_collective"]

#: What :meth:`ConformanceDriver.contract` reports for each rank.
CONTRACT_KEYS = ("shards", "shards_again", "metrics", "states", "params")


def reference_data(n: int, features: int = 8, classes: int = 4, seed: int = 0) -> tuple[list[list[float]], list[int]]:
    """A deterministic classification data set as plain lists (no framework needed).

    Labels depend on the features (a fixed random linear map), so a model can learn them.
    """
    rng = random.Random(seed)
    weights = [[rng.gauss(0, 1) for _ in range(features)] for _ in range(classes)]
    xs = [[rng.gauss(0, 1) for _ in range(features)] for _ in range(n)]
    ys = [max(range(classes), key=lambda c: sum(w * v for w, v in zip(weights[c], x))) for x in xs]
    return xs, ys


class PerRank(dict[int, Any]):
    """A driver result that differs between the ranks one process runs: ``rank -> value``.

    Return it from a driver method when a process drives several ranks (JAX: one process, many
    devices); a plain return value is taken as the value of every rank of the process.
    """


def bind_plugin_manager(strategy: Strategy, plugin_manager: Any) -> Strategy:
    """``strategy`` (same value) dispatching through ``plugin_manager``: what a driver's
    :meth:`~ConformanceDriver.bind` returns to test a plugin registered on its own
    ``PluginManager(autoload=False)`` (a pickled strategy arrives without its manager)."""
    rebuild, args = strategy.__reduce__()  # the pickled form: the value and its chosen runtime
    bound = rebuild(*args)
    object.__setattr__(bound, "_pm", plugin_manager)
    return bound


class ConformanceDriver(abc.ABC):
    """The framework-specific half of the conformance kit. Instances are pickled into each
    launched process, so keep them small and their classes importable.

    The reference problem: :func:`reference_data` with :attr:`dataset_size` samples (chosen not
    to divide over 2, 4 or 8 ranks), an MLP with a BatchNorm layer, :attr:`global_batch`
    samples a step summed over data-parallel ranks, :attr:`steps` optimizer steps of SGD.

    The methods marked "in a launched process" answer for the rank of their process; a process
    that drives several ranks (:meth:`local_ranks`) returns a :class:`PerRank` where ranks differ.
    """

    #: The runtime or adapter name whose capabilities the suite checks (``"torch"``).
    target: str = ""
    dataset_size: int = 37
    global_batch: int = 8
    steps: int = 4
    #: Topologies the plugin declared it cannot run (checked: refused before launch).
    unsupported: tuple[Topology, ...] = ()
    #: Seconds a launch may take on a quiet machine besides the collectives themselves (starting
    #: the processes, importing the framework, compiling). Only the skipped-collective launch's
    #: safety net uses it (``3 * strategy.timeout + 4 * startup_seconds``): how fast the peers
    #: fail is measured inside the processes, against the time the same work takes there
    #: (:func:`fail_fast_bound`), so a loaded machine does not fail the clause.
    startup_seconds: float = 60.0

    @abc.abstractmethod
    def shard_indices(self, strategy: Strategy, epoch: int) -> list[int] | PerRank:
        """In a launched process: the sample indices this rank sees in ``epoch``, in order,
        through the framework's own data path (``strategy.shard_data``, ``remainder="uneven"``)."""

    @abc.abstractmethod
    def train(self, strategy: Strategy) -> dict[str, list[float]] | PerRank:
        """In a launched process: train :attr:`steps` steps; return the parameters this rank
        holds as name -> flat list of floats: the *full* parameters (tensor-parallel shards
        gathered); a pipeline stage returns its own stage's parameters under their names in the
        reference model. Every rank must return some, and every pipeline group (one model
        replica) must cover the reference model."""

    @abc.abstractmethod
    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        """In this process, single-process: the same training with the same global batches.
        ``data_size`` says how the plugin's per-replica statistics (BatchNorm without a
        synchronised variant) split each global batch, for a faithful reference."""

    @abc.abstractmethod
    def evaluate(self, strategy: Strategy) -> dict[str, float] | PerRank | None:
        """In a launched process: evaluate the (untrained, seeded) model on the data set sharded
        ``uneven`` and return the metrics reduced through the framework (``None`` on ranks that
        hold no metrics: those without the ``metrics`` role)."""

    @abc.abstractmethod
    def evaluate_reference(self) -> dict[str, float]:
        """In this process: the same metrics computed on the whole data set at once."""

    @abc.abstractmethod
    def sync_states(self, strategy: Strategy) -> dict[str, dict[str, Any]] | PerRank:
        """In a launched process: give the states values that differ between data replicas,
        sync them, and return ``name -> {"action": mean|broadcast|local, "before": [floats],
        "after": [floats]}``."""

    def skip_collective(self, strategy: Strategy, skip: bool) -> None:
        """In a launched process: take part in a metric reduction, or (``skip``) not. The default
        uses ``strategy.reduce_metrics``; an adapter overrides it with its framework's path."""
        if not skip:
            strategy.reduce_metrics({"loss": 1.0})

    # -- how the kit runs the driver (override where the framework differs) ---------------------
    def bind(self, strategy: Strategy) -> Strategy:
        """In a launched process, first: the strategy the driver's methods get there. The default
        keeps the process's default plugin manager; return :func:`bind_plugin_manager` to test a
        plugin registered on a manager of its own."""
        return strategy

    def launch(self, fn: Callable[..., Any], strategy: Strategy, nprocs: int, *, args: tuple[Any, ...],
               timeout: float, world_size: int) -> list[Any]:
        """Run ``fn(*args)`` in ``nprocs`` processes that together run ``world_size`` ranks;
        return the results by process. The default is :func:`polyparallel.launch` (one rank per
        process, checked against :attr:`target`'s capabilities as ``launch(runtime=target)`` does: an
        adapter that shards by itself is checked for the sharding stage, not its runtime); a
        runtime whose processes drive several ranks (devices) overrides it."""
        if world_size != nprocs:
            raise ValueError(f"{type(self).__name__} runs one rank per process, but the suite asks for "
                             f"{world_size} ranks on {nprocs} processes: override launch() and local_ranks().")
        return launch(fn, strategy, nprocs, args=args, timeout=timeout, runtime=self.target or None)

    def local_ranks(self, strategy: Strategy) -> list[int]:
        """In a launched process: the ranks this process runs (default: its session's rank)."""
        return [strategy.session().rank]

    def contract(self, strategy: Strategy) -> list[dict[str, Any]]:
        """In a launched process: one dict per local rank with the results the checks compare
        (``rank``, ``coords``, ``roles`` and :data:`CONTRACT_KEYS`)."""
        topology = strategy.session().topology
        ranks = self.local_ranks(strategy)
        start = _counter.calls
        values: dict[str, Any] = {
            "shards": {epoch: self.shard_indices(strategy, epoch) for epoch in (0, 1)},
            "shards_again": self.shard_indices(strategy, 0),
        }
        calls = {"shards": _counter.calls - start}
        values.update(metrics=self.evaluate(strategy), states=self.sync_states(strategy))
        start = _counter.calls
        values["params"] = self.train(strategy)
        calls["train"] = _counter.calls - start
        return [{"rank": rank, "coords": topology.coords(rank), "roles": sorted(topology.roles(rank)),
                 "shard_data_calls": calls, **{key: _for_rank(value, rank, key) for key, value in values.items()}}
                for rank in ranks]


def _for_rank(value: Any, rank: int, what: str) -> Any:
    if isinstance(value, PerRank):
        if rank not in value:
            raise AssertionError(f"the driver's {what} has no value for rank {rank} (it has {sorted(value)})")
        return value[rank]
    if what == "shards":  # epoch -> indices, each possibly per rank
        return {epoch: _for_rank(v, rank, what + f"[{epoch}]") for epoch, v in value.items()}
    return value


# -- what runs in each launched process ---------------------------------------------------------------
class _ShardDataCounter:
    """A hook wrapper counting ``polyparallel_shard_data`` calls in a launched process: the
    checks require the driver's data to go through ``strategy.shard_data``. Counted per thread:
    a runtime may run several ranks as threads of one process (torch_xla on CPU devices)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def calls(self) -> int:
        return getattr(self._local, "calls", 0)

    @hookimpl(wrapper=True)
    def polyparallel_shard_data(self) -> Any:
        self._local.calls = self.calls + 1
        return (yield)


_counter = _ShardDataCounter()  # per process; registered on the bound strategy's plugin manager
_COUNTER = "polyparallel.testing.shard_data_counter"


class _DecoyRuntime:
    """A second runtime in every launched process: declared (never installed, so never chosen),
    with operation hooks that omit the ``session.runtime`` guard and are asked first
    (``tryfirst``). The core routes a session's operations to its own runtime's plugin only, so
    none of them may ever be called; each call is counted (per thread, as ``_ShardDataCounter``)
    and :func:`polyparallel.testing._checks.check_routing` fails on any. They answer ``None``,
    so a routing fault shows as a count, not as a crash inside the driver."""

    NAME = "polyparallel-conformance-decoy"
    HOOKS = ("shard_data", "wrap_model", "sync_grads", "reduce_metrics", "sync_states", "save_checkpoint",
             "load_checkpoint")

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def calls(self) -> dict[str, int]:
        return dict(getattr(self._local, "calls", {}))

    def _called(self, hook: str) -> None:
        calls = self._local.__dict__.setdefault("calls", {})
        calls[hook] = calls.get(hook, 0) + 1

    @hookimpl
    def polyparallel_capabilities(self) -> Capabilities:
        return Capabilities(self.NAME, axes={"data", "tensor", "pipeline"}, imports={"polyparallel_conformance_decoy_absent"})

    @hookimpl(tryfirst=True)
    def polyparallel_shard_data(self) -> None:
        self._called("shard_data")

    @hookimpl(tryfirst=True)
    def polyparallel_wrap_model(self) -> None:
        self._called("wrap_model")

    @hookimpl(tryfirst=True)
    def polyparallel_sync_grads(self) -> None:
        self._called("sync_grads")

    @hookimpl(tryfirst=True)
    def polyparallel_reduce_metrics(self) -> None:
        self._called("reduce_metrics")

    @hookimpl(tryfirst=True)
    def polyparallel_sync_states(self) -> None:
        self._called("sync_states")

    @hookimpl(tryfirst=True)
    def polyparallel_save_checkpoint(self) -> None:
        self._called("save_checkpoint")

    @hookimpl(tryfirst=True)
    def polyparallel_load_checkpoint(self) -> None:
        self._called("load_checkpoint")


_decoy = _DecoyRuntime()
_DECOY = "polyparallel.testing.decoy_runtime"


_register_lock = threading.Lock()  # replica threads of one process register the counter once


def _contract_worker(driver: ConformanceDriver, strategy: Strategy) -> list[dict[str, Any]]:
    strategy = driver.bind(strategy)
    manager = strategy.plugin_manager
    with _register_lock:
        names = {p.name for p in manager.plugins()}
        if _COUNTER not in names:
            manager.register(_counter, name=_COUNTER)
        if _DECOY not in names:
            manager.register(_decoy, name=_DECOY)
    records = driver.contract(strategy)
    for record in records:
        record["decoy_calls"] = _decoy.calls
    return records


def fail_fast_bound(timeout: float, work: float) -> float:
    """Seconds within which a process waiting on a skipped collective must have failed: the
    strategy's ``timeout``, plus twice ``work`` (what the same call took in this process when
    nobody skipped: setting up, then the collectives), plus 10 s. Measured where it runs, so it
    holds on a loaded machine, and still fails a collective that is not bounded."""
    return timeout + 2 * work + 10.0


@contextlib.contextmanager
def _watchdog(bound: float, what: str) -> Iterator[threading.Event]:
    """Interrupt the main thread (``KeyboardInterrupt``) if the block runs longer than
    ``bound`` seconds; a main thread blocked outside Python past 10 s more ends the process
    (exit status 70), with ``what`` on stderr."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(bound):
            return
        _thread.interrupt_main()
        if not done.wait(10.0):
            sys.stderr.write(f"polyparallel.testing: {what} still waiting {bound + 10:.0f} s after the skipped "
                             "collective started: the collective is not bounded by the strategy's timeout\n")
            sys.stderr.flush()
            os._exit(70)

    thread = threading.Thread(target=watch, name="polyparallel-fail-fast-watchdog", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        done.set()


def _skip_worker(driver: ConformanceDriver, strategy: Strategy, skipper: int) -> dict[str, Any]:
    strategy = driver.bind(strategy)
    ranks = driver.local_ranks(strategy)
    skip = skipper in ranks
    # First the same call with nobody skipping: how long the work takes here, now.
    start = time.monotonic()
    driver.skip_collective(strategy, skip=False)
    work = time.monotonic() - start
    bound = fail_fast_bound(strategy.timeout, work)
    facts = {"ranks": ranks, "skipped": skip, "work": work, "bound": bound}
    start = time.monotonic()
    try:
        with _watchdog(bound, f"the process of ranks {ranks}") as done:
            try:
                driver.skip_collective(strategy, skip=skip)
                if skip:
                    # Stay alive for a while, as a rank busy elsewhere would, so peers hit the timeout.
                    time.sleep(strategy.timeout + 2)
            finally:
                done.set()
    except CollectiveError as exc:
        return {**facts, "outcome": "raised", "type": type(exc).__name__, "message": str(exc),
                "operation": exc.operation, "axis": exc.axis, "error_rank": exc.rank,
                "elapsed": time.monotonic() - start}
    except KeyboardInterrupt:
        return {**facts, "outcome": "hung", "elapsed": time.monotonic() - start}
    return {**facts, "outcome": "completed", "elapsed": time.monotonic() - start}


def run_contract(driver: ConformanceDriver, strategy: Strategy, nprocs: int, timeout: float = 240,
                 world_size: int | None = None) -> list[dict[str, Any]]:
    """Launch ``nprocs`` processes (``world_size`` ranks; default one per process) and collect
    every rank's results for the contract checks, ordered by rank."""
    world = nprocs if world_size is None else world_size
    per_process = driver.launch(_contract_worker, strategy, nprocs, args=(driver, strategy), timeout=timeout,
                                world_size=world)
    results = [r for records in per_process for r in records]
    ranks = sorted(r["rank"] for r in results)
    assert ranks == list(range(world)), (
        f"the driver reported ranks {ranks}; expected each of 0..{world - 1} exactly once "
        "(local_ranks() must name every rank of its process)")
    return sorted(results, key=lambda r: r["rank"])


def skipping_rank(world_size: int) -> int:
    """The rank whose process skips the collective: the last one."""
    return world_size - 1


def run_skipped_collective(driver: ConformanceDriver, strategy: Strategy, nprocs: int,
                           world_size: int | None = None) -> list[dict[str, Any]]:
    """Launch with the process of the last rank skipping a collective; collect what every
    process saw. A launch that does not finish in time (a peer waited past the strategy's
    timeout) is an ``AssertionError``: the collective was not bounded."""
    world = nprocs if world_size is None else world_size
    # A safety net only: each process bounds its own wait (fail_fast_bound, measured there).
    limit = 3 * strategy.timeout + 4 * driver.startup_seconds
    try:
        return driver.launch(_skip_worker, strategy, nprocs, args=(driver, strategy, skipping_rank(world)),
                             timeout=limit, world_size=world)
    except LaunchError as exc:
        raise AssertionError(
            f"with rank {skipping_rank(world)} skipping a collective, the launch did not complete within "
            f"{limit:g} s (3 x the strategy's timeout of {strategy.timeout:g} s + 4 x {driver.startup_seconds:g} s "
            f"to start): a peer did not fail within the strategy's timeout, or a process did not start. {exc}") from exc
