"""``polyparallel/testing`` (the conformance kit): every clause fails a plugin that breaks it.

The subject is a framework-free "records" runtime written here (samples in plain lists, a
linear model in plain Python, collectives through files in a shared directory, bounded by the
strategy's timeout, processes forked by its own ``polyparallel_launch``). Its correct version
passes the whole ``ConformanceSuite`` under pipeline=2 x data=2, where every clause applies; each
deliberately broken version (``FLAWS``) makes exactly its own clause (a)-(h) fail (for (h), routing,
the broken part is the plugin manager: it calls every runtime's hooks).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import random
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import polyparallel as pp
from polyparallel import testing as kit
from polyparallel.testing import ConformanceDriver, PerRank

#: flaw -> the clause it must (alone) make fail.
FLAWS = {
    "overlap": "a",      # shard_data gives the first sample of the epoch to every data coordinate
    "bypass": "a",       # the training data is sharded by hand, not through strategy.shard_data
    "replicas": "b",     # replicas of a data coordinate disagree about the epoch after the first
    "training": "c",     # sync_grads does not average: data replicas train apart
    "missing": "c",      # a pipeline stage returns no parameters (the old kit skipped such ranks)
    "metrics": "d",      # reduce_metrics averages the ranks' means instead of weighting by count
    "states": "e",       # sync_states averages every state, whatever the policy says
    "unbounded": "f",    # a collective waits forever for a peer that skipped it
    "accepts": "g",      # the capabilities accept tensor=2, which the driver declares unsupported
    "unrouted": "h",     # the plugin manager calls every runtime's hooks, not the session's runtime's only
}
DIR_ENV = "RECORDS_COLLECTIVE_DIR"
LR = 0.05


# -- the records runtime ----------------------------------------------------------------------------
class Records(tuple):  # type: ignore[type-arg]
    """An in-memory sequence of samples (the type the records runtime owns)."""


def epoch_order(n: int, data_size: int, seed: int, epoch: int, shuffle: bool, remainder: str) -> list[int]:
    """The epoch's order of sample indices, padded (cyclically) or cut to a multiple of ``data_size``."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    if remainder == "drop":
        return order[: n - n % data_size]
    if remainder == "pad" and n % data_size:
        pad = data_size - n % data_size
        order += (order * math.ceil(pad / n))[:pad]
    return order


class Loader:
    """``shard_data``'s result: this rank's batches of one epoch (data coordinate d gets the
    strided shard ``order[d::data]``)."""

    def __init__(self, records: Records, session: pp.Session, policy: pp.DataPolicy, seed: int, flaw: str | None):
        self.records, self.session, self.policy, self.seed, self.flaw = records, session, policy, seed, flaw

    def indices(self, epoch: int) -> list[int]:
        coords, data_size = self.session.coords, self.session.topology.size("data")
        if self.flaw == "replicas" and epoch > 0:
            epoch += coords["pipeline"]
        order = epoch_order(len(self.records), data_size, self.seed, epoch, self.policy.shuffle, self.policy.remainder)
        shard = order[coords["data"]::data_size]
        if self.flaw == "overlap" and self.policy.remainder == "uneven" and self.policy.shuffle and coords["data"]:
            shard = [order[0], *shard]
        return shard

    def batches(self, epoch: int) -> Iterator[list[Any]]:
        per_rank = (self.policy.batch_size or len(self.records)) // self.session.topology.size("data")
        shard = self.indices(epoch)
        for start in range(0, len(shard), per_rank):
            yield [self.records[i] for i in shard[start:start + per_rank]]


class Grads(dict):  # type: ignore[type-arg]
    """Gradients of a :class:`LinearModel`: name -> list of floats."""


class States(dict):  # type: ignore[type-arg]
    """Named states: name -> list of floats."""


class LinearModel:
    """``y ~ w.x + b`` trained by SGD on the squared error; stage s of a pipeline holds ``w``
    (s = 0) or ``b`` (the last stage). Every rank computes the whole model (this is a fake)."""

    names = ("w", "b")

    def __init__(self, features: int = 8, seed: int = 0):
        rng = random.Random(seed)
        self.params = {"w": [rng.gauss(0, 0.3) for _ in range(features)], "b": [0.0]}
        self.stage, self.stages = 0, 1

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.params["w"], x)) + self.params["b"][0]

    def grads(self, batch: list[tuple[list[float], int]]) -> Grads:
        gw, gb = [0.0] * len(self.params["w"]), 0.0
        for x, y in batch:
            err = 2 * (self.predict(x) - y) / len(batch)
            gw = [g + err * v for g, v in zip(gw, x)]
            gb += err
        return Grads(w=gw, b=[gb])

    def step(self, grads: Grads) -> None:
        for name, values in self.params.items():
            self.params[name] = [p - LR * g for p, g in zip(values, grads[name])]

    def held(self) -> dict[str, list[float]]:
        names = self.names if self.stages == 1 else self.names[self.stage::self.stages]
        return {n: list(self.params[n]) for n in names}


class FileCollectives:
    """All-gather over an axis group through files in the launch's shared directory, bounded by
    the strategy's timeout (``unbounded``: waits forever)."""

    def __init__(self, session: pp.Session, bounded: bool):
        self.session, self.bounded, self.sequence = session, bounded, {}  # type: ignore[var-annotated]
        self.directory = os.environ[DIR_ENV]

    def all_gather(self, value: Any, operation: str, axis: str) -> list[Any]:
        group, rank = self.session.group_ranks(axis), self.session.rank
        key = f"{axis}-{group[0]}"
        self.sequence[key] = seq = self.sequence.get(key, 0) + 1
        path = lambda r: os.path.join(self.directory, f"{key}-{seq}-{r}.pkl")
        with open(path(rank) + ".tmp", "wb") as f:
            pickle.dump((operation, value), f)
        os.replace(path(rank) + ".tmp", path(rank))
        timeout = self.session.strategy.timeout
        deadline = time.monotonic() + timeout
        while missing := [r for r in group if not os.path.exists(path(r))]:
            if self.bounded and time.monotonic() > deadline:
                raise pp.CollectiveTimeout(f"{operation} over axis {axis!r} timed out after {timeout:g} s on rank "
                                           f"{rank}: ranks {missing} did not join", operation=operation, axis=axis,
                                           rank=rank)
            time.sleep(0.01)
        gathered = []
        for r in group:
            with open(path(r), "rb") as f:
                theirs, value = pickle.load(f)
            if theirs != operation:
                raise pp.CollectiveError(f"rank {rank} ran {operation} over {axis!r} while rank {r} ran {theirs}",
                                         operation=operation, axis=axis, rank=rank)
            gathered.append(value)
        return gathered


class RecordsRuntime:
    """The hooks of the records runtime, broken as ``flaw`` says (``None``: correct)."""

    def __init__(self, flaw: str | None = None):
        self.flaw = flaw

    def _collectives(self, session: pp.Session) -> FileCollectives:
        return session.stash("records", lambda: FileCollectives(session, bounded=self.flaw != "unbounded"))

    @pp.hookimpl
    def polyparallel_capabilities(self) -> pp.Capabilities:
        axes = {"data", "pipeline"} | ({"tensor"} if self.flaw == "accepts" else set())
        return pp.Capabilities("records", axes=frozenset(axes))

    @pp.hookimpl
    def polyparallel_launch(self, fn: Callable[..., Any], nprocs: int, args: tuple, kwargs: dict,
                            timeout: float | None) -> list[Any]:
        return fork_processes(fn, nprocs, args, kwargs, timeout or 120.0)

    @pp.hookimpl
    def polyparallel_shard_data(self, strategy: pp.Strategy, session: pp.Session, data: Any, policy: pp.DataPolicy) -> Any:
        return Loader(data, session, policy, strategy.seed, self.flaw) if isinstance(data, Records) else None

    @pp.hookimpl
    def polyparallel_wrap_model(self, session: pp.Session, model: Any) -> Any:
        if not isinstance(model, LinearModel):
            return None
        model.stage, model.stages = session.coords["pipeline"], session.topology.size("pipeline")
        return model

    @pp.hookimpl
    def polyparallel_sync_grads(self, session: pp.Session, target: Any) -> Any:
        if not isinstance(target, Grads):
            return None
        if self.flaw == "training":
            return target
        gathered = self._collectives(session).all_gather(dict(target), "sync_grads", "data")
        return Grads({name: [sum(v) / len(v) for v in zip(*(g[name] for g in gathered))] for name in target})

    @pp.hookimpl
    def polyparallel_reduce_metrics(self, session: pp.Session, metrics: dict[str, Any]) -> dict[str, Any] | None:
        if not all(isinstance(v, (int, float, pp.Mean)) for v in metrics.values()):
            return None
        parts = {n: (v.total, v.count) if isinstance(v, pp.Mean) else (v, 1) for n, v in metrics.items()}
        gathered = self._collectives(session).all_gather(parts, "reduce_metrics", "data")
        if self.flaw == "metrics":
            return {n: sum(g[n][0] / g[n][1] for g in gathered) / len(gathered) for n in parts}
        return {n: sum(g[n][0] for g in gathered) / sum(g[n][1] for g in gathered) for n in parts}

    @pp.hookimpl
    def polyparallel_sync_states(self, strategy: pp.Strategy, session: pp.Session, states: Any) -> Any:
        if not isinstance(states, States):
            return None
        gathered = self._collectives(session).all_gather(dict(states), "sync_states", "data")
        out = States()
        for name, mine in states.items():
            action = "mean" if self.flaw == "states" else strategy.state_policy.action_for(name)
            values = [g[name] for g in gathered]
            out[name] = ([sum(v) / len(v) for v in zip(*values)] if action == "mean" else
                         values[0] if action == "broadcast" else list(mine))
        return out


class _UnroutedManager(pp.PluginManager):
    """A plugin manager with the routing flaw: every plugin's hooks see every session."""

    def call_for_runtime(self, hook_name: str, runtime: str | None, /, **kwargs: Any) -> Any:
        return self.call(hook_name, **kwargs)


def records_manager(flaw: str | None) -> pp.PluginManager:
    """A plugin manager with only the records runtime (broken as ``flaw`` says)."""
    pm = _UnroutedManager(autoload=False) if flaw == "unrouted" else pp.PluginManager(autoload=False)
    pm.register(RecordsRuntime(flaw), name="records")
    return pm


def fork_processes(fn: Callable[..., Any], nprocs: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    """The records launcher: forked processes (the job pickled, so a strategy arrives without its
    plugin manager, as over spawn), RANK/WORLD_SIZE in their environment, results in files."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="polyparallel-records-") as tmp:
        job = pickle.dumps((fn, args, kwargs))
        procs = [context.Process(target=_child, args=(job, rank, nprocs, tmp), daemon=True) for rank in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    with open(os.path.join(tmp, f"error-{failed[0]}.txt")) as f:
                        text = f.read()
                    raise pp.LaunchError(f"rank {failed[0]} failed:\n{text}", rank=failed[0], traceback=text)
                if all(p.exitcode == 0 for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise pp.LaunchError(f"the {nprocs} processes did not finish within {timeout:g} s")
                time.sleep(0.02)
        finally:
            for p in procs:  # only the processes started here
                if p.is_alive():
                    p.kill()
                p.join()
        results = []
        for rank in range(nprocs):
            with open(os.path.join(tmp, f"result-{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _child(job: bytes, rank: int, nprocs: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), **{DIR_ENV: tmp})
    try:
        fn, args, kwargs = pickle.loads(job)
        result = fn(*args, **kwargs)
        with open(os.path.join(tmp, f"result-{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # a forked child must not run the parent's (pytest's) exit handlers


# -- its conformance driver -----------------------------------------------------------------------------
class RecordsDriver(ConformanceDriver):
    """The kit's contract for the records runtime: plain-Python samples and model."""

    target = "records"
    unsupported = (pp.Topology(data=2, tensor=2),)
    startup_seconds = 15.0

    def __init__(self, flaw: str | None = None):
        self.flaw = flaw

    def bind(self, strategy: pp.Strategy) -> pp.Strategy:
        return kit.bind_plugin_manager(strategy, records_manager(self.flaw))

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> list[int]:
        loader = strategy.shard_data(Records(range(self.dataset_size)), batch_size=self.global_batch,
                                     remainder="uneven", shuffle=True)
        return [i for batch in loader.batches(epoch) for i in batch]

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]] | None:  # type: ignore[override]
        xs, ys = kit.reference_data(self.dataset_size)
        records, policy = Records(zip(xs, ys)), pp.DataPolicy(batch_size=self.global_batch, shuffle=True, remainder="pad")
        loader = (Loader(records, strategy.session(), policy, strategy.seed, None) if self.flaw == "bypass" else
                  strategy.shard_data(records, batch_size=self.global_batch, remainder="pad", shuffle=True))
        model = strategy.wrap_model(LinearModel(seed=strategy.seed))
        data_size = strategy.session().topology.size("data")
        step, epoch = 0, 0
        while step < self.steps:
            for batch in loader.batches(epoch):
                if len(batch) * data_size == self.global_batch and step < self.steps:
                    model.step(strategy.sync_grads(model.grads(batch)))
                    step += 1
            epoch += 1
        if self.flaw == "missing" and model.stage == 0:
            return None
        return model.held()

    def train_reference(self, data_size: int) -> dict[str, list[float]]:
        xs, ys = kit.reference_data(self.dataset_size)
        model, step, epoch = LinearModel(seed=0), 0, 0
        while step < self.steps:
            order = epoch_order(self.dataset_size, data_size, 0, epoch, True, "pad")
            for start in range(0, len(order) - self.global_batch + 1, self.global_batch):
                if step < self.steps:
                    model.step(model.grads([(xs[i], ys[i]) for i in order[start:start + self.global_batch]]))
                    step += 1
            epoch += 1
        return model.params

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float] | None:
        if "metrics" not in strategy.session().roles:
            return None
        xs, ys = kit.reference_data(self.dataset_size)
        loader = strategy.shard_data(Records(list(zip(xs, ys))), batch_size=self.global_batch, remainder="uneven",
                                     shuffle=False)
        model = LinearModel(seed=strategy.seed)
        errors = [model.predict(x) - y for batch in loader.batches(0) for x, y in batch]
        return strategy.reduce_metrics({"mse": pp.Mean(sum(e * e for e in errors), len(errors)),
                                        "mae": pp.Mean(sum(abs(e) for e in errors), len(errors))})

    def evaluate_reference(self) -> dict[str, float]:
        xs, ys = kit.reference_data(self.dataset_size)
        model = LinearModel(seed=0)
        errors = [model.predict(x) - y for x, y in zip(xs, ys)]
        return {"mse": sum(e * e for e in errors) / len(errors), "mae": sum(abs(e) for e in errors) / len(errors)}

    def sync_states(self, strategy: pp.Strategy) -> dict[str, dict[str, Any]]:
        rank = strategy.session().rank
        before = States({"bn.running_mean": [float(rank), rank + 0.5], "head.bias": [10.0 + rank],
                         "rng_key": [float(rank)]})
        after = strategy.sync_states(before)
        policy = strategy.state_policy
        return {n: {"action": policy.action_for(n), "before": before[n], "after": after[n]} for n in before}


STRATEGY = pp.Strategy(pipeline=2, data=2, timeout=2.0, plugin_manager=records_manager(None))


class TestRecordsPipeline2Data2(kit.ConformanceSuite):  # type: ignore[name-defined]
    """The correct records runtime passes every clause, and none is skipped (the control)."""

    driver = RecordsDriver()
    strategy = STRATEGY
    nprocs = 4
    train_tolerance = 1e-9
    launch_timeout = 60.0


# -- each flaw fails exactly its clause ---------------------------------------------------------------
def failing_clauses(flaw: str | None) -> set[str]:
    """Run every clause (a)-(h) on the records runtime broken by ``flaw``; the clauses that fail."""
    driver = RecordsDriver(flaw)
    strategy = pp.Strategy(pipeline=2, data=2, timeout=2.0, plugin_manager=records_manager(flaw))
    topology = strategy.topology.resolve(4)
    contract = kit.run_contract(driver, strategy, 4, timeout=60)

    def sharding() -> None:
        kit.check_shards(contract, topology, driver.dataset_size)
        kit.check_shuffling(contract)

    clauses: dict[str, Callable[[], None]] = {
        "a": sharding,
        "b": lambda: kit.check_replicas(contract),
        "c": lambda: kit.check_training(contract, topology, driver.train_reference(2), 1e-9),
        "d": lambda: kit.check_metrics(contract, driver.evaluate_reference(), 1e-9),
        "e": lambda: kit.check_states(contract, topology),
        "f": lambda: kit.check_fails_fast(driver, strategy, 4),
        "g": lambda: kit.check_unsupported(driver, strategy),
        "h": lambda: kit.check_routing(contract),
    }
    failed = set()
    for letter, clause in clauses.items():
        try:
            clause()
        except AssertionError:
            failed.add(letter)
    return failed


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("flaw", sorted(FLAWS))
def test_a_broken_runtime_fails_exactly_its_clause(flaw):
    assert failing_clauses(flaw) == {FLAWS[flaw]}


def test_every_clause_has_a_flaw_that_fails_it():
    assert set(FLAWS.values()) == set("abcdefgh")


# -- the fail-fast bound follows the machine it runs on ------------------------------------------------
class _SlowToSetUp(RecordsDriver):
    """A loaded machine: slow to set up before the collective."""

    def skip_collective(self, strategy: pp.Strategy, skip: bool) -> None:
        time.sleep(11.0)  # building the model and the loaders, before the collective
        super().skip_collective(strategy, skip)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_fail_fast_bound_is_measured_where_it_runs_not_a_constant():
    """A bounded collective behind 11 s of set-up passes clause (f): the old kit's fixed bound
    (timeout + 10 s from the start of the call) failed it. An unbounded one still fails, within
    the bound measured in the process (``test_a_broken_runtime_fails_exactly_its_clause[unbounded]``)."""
    kit.check_fails_fast(_SlowToSetUp(), pp.Strategy(data=2, timeout=2.0, plugin_manager=records_manager(None)), 2)


# -- clauses with nothing to check are reported, never passed ------------------------------------------
def _records(topology: pp.Topology, shards: Callable[[int], list[int]]) -> list[dict[str, Any]]:
    return [{"rank": r, "coords": topology.coords(r), "roles": sorted(topology.roles(r)),
             "shards": {0: shards(r), 1: shards(r)}, "shards_again": shards(r), "states": {}} for r in
            range(topology.world_size)]


class _NeverLaunches(RecordsDriver):
    def launch(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise AssertionError("the clause launched processes although it cannot apply")


@pytest.mark.parametrize("sizes, nprocs, world", [
    ({"pipeline": 2, "data": 1}, 2, 2),   # the old kit's pipeline suites: nothing was asserted
    ({"data": 4, "tensor": 2}, 1, 8),     # one process drives every rank (JAX devices)
])
def test_skipped_collective_is_not_applicable_without_a_peer_in_another_process(sizes, nprocs, world):
    strategy = pp.Strategy(**sizes, timeout=2.0, plugin_manager=records_manager(None))
    with pytest.raises(kit.NotApplicable, match="no other process"):
        kit.check_fails_fast(_NeverLaunches(), strategy, nprocs, world)


def test_waiting_ranks_are_the_skippers_data_peers_in_other_processes():
    assert kit.waiting_ranks(pp.Topology(pipeline=2, data=2).resolve(4), 4) == {2}
    assert kit.waiting_ranks(pp.Topology(data=4).resolve(4), 2) == {0, 1}
    assert kit.waiting_ranks(pp.Topology(data=2, tensor=2).resolve(4), 2) == {0, 1}  # processes hold tensor groups
    assert kit.waiting_ranks(pp.Topology(pipeline=2, data=1).resolve(2), 2) == set()


def test_replicas_and_states_are_not_applicable_without_replicas_or_data_peers():
    data_only = pp.Topology(data=2).resolve(2)
    with pytest.raises(kit.NotApplicable, match="no replicas"):
        kit.check_replicas(_records(data_only, lambda r: [r]))
    pipeline_only = pp.Topology(pipeline=2, data=1).resolve(2)
    with pytest.raises(kit.NotApplicable, match="data axis has size 1"):
        kit.check_states(_records(pipeline_only, lambda r: [0, 1]), pipeline_only)


def test_the_suite_reports_a_clause_that_cannot_apply_as_skipped():
    class Pipeline2(kit.ConformanceSuite):  # type: ignore[name-defined]
        driver = _NeverLaunches()
        strategy = pp.Strategy(pipeline=2, data=1, timeout=2.0, plugin_manager=records_manager(None))
        nprocs = 2

    with pytest.raises(pytest.skip.Exception, match="not applicable: the data axis has size 1"):
        Pipeline2().test_skipped_collective_fails_fast()


def test_states_that_do_not_differ_between_replicas_cannot_pass():
    topology = pp.Topology(data=2).resolve(2)
    same = {"bn.running_mean": {"action": "mean", "before": [1.0], "after": [1.0]},
            "head.bias": {"action": "broadcast", "before": [2.0], "after": [2.0]}}
    contract = [{**r, "states": same} for r in _records(topology, lambda r: [r])]
    with pytest.raises(AssertionError, match="differ between data replicas only for actions"):
        kit.check_states(contract, topology)


def test_training_requires_every_rank_and_every_pipeline_group_to_hold_parameters():
    topology = pp.Topology(pipeline=2, data=1).resolve(2)
    reference = {"w": [1.0], "b": [2.0]}
    contract = [{"rank": 0, "params": {"w": [1.0]}}, {"rank": 1, "params": None}]
    with pytest.raises(AssertionError, match="rank 1 returned no parameters"):
        kit.check_training(contract, topology, reference, 1e-9)
    contract[1]["params"] = {"w": [1.0]}
    with pytest.raises(AssertionError, match=r"hold none of the parameters \['b'\]"):
        kit.check_training(contract, topology, reference, 1e-9)
    contract[1]["params"] = {"b": [float("nan")]}
    with pytest.raises(AssertionError, match="'b' on rank 1"):
        kit.check_training(contract, topology, reference, 1e-9)
    contract[1]["params"] = {"b": [2.0]}
    kit.check_training(contract, topology, reference, 1e-9)


# -- a process that runs several ranks --------------------------------------------------------------------
class _TwoRanksPerProcess(RecordsDriver):
    def local_ranks(self, strategy: pp.Strategy) -> list[int]:
        return [0, 1]

    def shard_indices(self, strategy: pp.Strategy, epoch: int) -> PerRank:  # type: ignore[override]
        return PerRank({0: [epoch, 0], 1: [epoch, 1]})

    def evaluate(self, strategy: pp.Strategy) -> dict[str, float]:
        return {"loss": 1.0}

    def sync_states(self, strategy: pp.Strategy) -> PerRank:  # type: ignore[override]
        return PerRank({0: {"s": 0}, 1: {"s": 1}})

    def train(self, strategy: pp.Strategy) -> dict[str, list[float]]:
        return {"w": [0.5]}


def test_a_process_reports_each_of_its_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    strategy = pp.Strategy(data=2, plugin_manager=records_manager(None))
    results = _TwoRanksPerProcess().contract(strategy)
    assert [(r["rank"], r["coords"]["data"], r["shards"][1], r["states"]) for r in results] == [
        (0, 0, [1, 0], {"s": 0}), (1, 1, [1, 1], {"s": 1})]
    assert all(r["params"] == {"w": [0.5]} and r["metrics"] == {"loss": 1.0} for r in results)
    strategy.session().close()


# -- the declared surface (polyparallel.testing.surface) -------------------------------------------------
def _package(tmp_path, monkeypatch):
    """A framework of three modules: one imports a package that is not installed."""
    root = tmp_path / "toyframework"
    (root / "callbacks").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "core.py").write_text("class Callback:\n    pass\n\nclass _Private(Callback):\n    pass\n\n"
                                  "class Learner:\n    def fit(self): pass\n    def _hidden(self): pass\n")
    (root / "callbacks" / "__init__.py").write_text("")
    (root / "callbacks" / "logging.py").write_text(
        "import not_installed_anywhere\nfrom ..core import Callback, _Private, Learner\n\n"
        "class Logger(_Private):\n    pass\n\nclass Unrelated:\n    pass\n\n"
        "def lr_find(self: Learner, start=1e-7): pass\n\ndef helper(x): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "toyframework"


def test_discovery_reads_the_source_so_modules_that_cannot_import_are_listed(tmp_path, monkeypatch):
    from polyparallel.testing.surface import discover_classes, discover_methods

    package = _package(tmp_path, monkeypatch)
    assert discover_classes(package, ["Callback"]) == ["toyframework.callbacks.logging.Logger",
                                                       "toyframework.core.Callback"]
    assert "toyframework.core._Private" in discover_classes(package, ["Callback"], include_private=True)
    assert discover_methods(package, "Learner") == ["fit", "lr_find"]


def _toy_surface():
    from polyparallel.testing.surface import Surface, refused, works

    return Surface("toy", "1.0", [
        works("toy.Callback", "callback", "tests/core/test_kit.py::test_the_surface_table_counts_and_checks"),
        works("toy.Metric", "metric", "tests/core/test_kit.py::test_the_surface_table_counts_and_checks", "differs a bit"),
        refused("toy.Logger", "callback", "it logs from every rank", "log from the logger rank"),
    ], adapter="the toy adapter")


def test_coverage_names_what_is_missing_and_what_has_gone():
    surface = _toy_surface()
    surface.check_covers({"callback": ["toy.Callback", "toy.Logger"], "metric": ["toy.Metric"]})
    with pytest.raises(AssertionError, match=r"1 callback\(s\) of the installed toy are not classified: \['toy.New'\]"):
        surface.check_covers({"callback": ["toy.Callback", "toy.Logger", "toy.New"]})
    with pytest.raises(AssertionError, match=r"classified metric\(s\) are not in the installed toy: \['toy.Metric'\]"):
        surface.check_covers({"metric": []})


def test_the_surface_table_counts_and_checks(tmp_path):
    from polyparallel.testing.surface import Entry, SurfaceError, check_exercised, check_table

    surface = _toy_surface()
    assert surface.counts() == (2, 1, 3) and surface.counts("callback") == (1, 1, 2)
    text = surface.markdown()
    assert "**2 work, 1 are refused, 3 in all.**" in text and "| callback | 1 | 1 | 2 |" in text
    assert "| `toy.Logger` | refused | it logs from every rank | log from the logger rank |  |" in text
    with pytest.raises(SurfaceError, match=r"the toy adapter refuses toy.Logger \(callback\): it logs from every "
                                           r"rank. Instead: log from the logger rank."):
        surface.refuse("toy.Logger")
    surface.refuse("toy.Callback")
    path = tmp_path / "toy.md"
    with pytest.raises(AssertionError, match="missing"):
        check_table(surface, path)
    path.write_text(text)
    check_table(surface, path)
    path.write_text(text + "edited\n")
    with pytest.raises(AssertionError, match="regenerate it"):
        check_table(surface, path)
    check_exercised(surface, ["toy.Callback", "toy.Metric"])
    with pytest.raises(AssertionError, match=r"not run by this test: \['toy.Metric'\]"):
        check_exercised(surface, ["toy.Callback"])
    with pytest.raises(AssertionError, match=r"not declared as works: \['toy.Logger'\]"):
        check_exercised(surface, ["toy.Callback", "toy.Metric", "toy.Logger"])
    surface.check_tests_exist(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with pytest.raises(ValueError, match="name the test"):
        Entry("toy.X", "metric", "works")
    with pytest.raises(ValueError, match="say why"):
        Entry("toy.X", "metric", "refused", reason="because")
