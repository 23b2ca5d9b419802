"""The clauses of the conformance contract, as plain functions (no pytest needed).

Each ``check_*`` raises ``AssertionError`` naming the rank and the numbers when a plugin breaks
its clause, and :class:`NotApplicable` (with the reason) when the topology gives the clause
nothing to check, so that a clause is never passed silently:

(a) :func:`check_shards`, :func:`check_shuffling` — shards disjoint and complete over a data set
    that does not divide evenly; shuffling deterministic from ``(seed, epoch)``;
(b) :func:`check_replicas` — ranks that share a data coordinate get identical batches;
(c) :func:`check_training` — every rank's parameters equal a single-process run;
(d) :func:`check_metrics` — reduced metrics equal the single-process value;
(e) :func:`check_states` — states follow the ``StatePolicy`` over each data group;
(f) :func:`check_fails_fast` — a rank skipping a collective makes its peers fail within the
    timeout (plus the time the same call takes when nobody skips, measured in the process:
    :func:`~polyparallel.testing._kit.fail_fast_bound`), naming operation, axis and rank;
(g) :func:`check_unsupported` — a topology the plugin declared it cannot run is refused before
    any process starts;
(h) :func:`check_routing` — the operations reach the session's own runtime only: another
    runtime's hooks, written without a ``session.runtime`` guard, are never called.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._errors import UnsupportedTopologyError, exception_summary
from .._launch import launch
from .._strategy import Strategy
from .._topology import Topology
from ._kit import run_skipped_collective, skipping_rank

if TYPE_CHECKING:
    from ._kit import ConformanceDriver

__all__ = ["NotApplicable", "check_fails_fast", "check_metrics", "check_replicas", "check_routing", "check_shards",
           "check_shuffling", "check_states", "check_training", "check_unsupported", "waiting_ranks"]

Results = list[dict[str, Any]]


class NotApplicable(Exception):
    """A clause has nothing to check under this topology (``ConformanceSuite`` reports it as a
    skip with this reason)."""


# -- (a) sharding ----------------------------------------------------------------------------------
def check_shards(contract: Results, topology: Topology, dataset_size: int) -> None:
    """(a) In epochs 0 and 1 the data coordinates' shards partition the ``dataset_size`` samples,
    and the driver's shards and training data came through ``strategy.shard_data``."""
    for r in contract:
        calls = r.get("shard_data_calls")
        if calls is not None:  # counted by the kit's own contract() (a driver may replace it)
            for phase, what in (("shards", "shard_indices()"), ("train", "train()")):
                assert calls[phase] > 0, (f"rank {r['rank']}: {what} did not shard its data through "
                                          "strategy.shard_data, so the checks would not test the plugin's sharding")
    for epoch in (0, 1):
        by_data: dict[int, list[int]] = {}
        for r in contract:
            by_data.setdefault(r["coords"]["data"], r["shards"][epoch])
        assert len(by_data) == topology.size("data"), (
            f"epoch {epoch}: shards of data coordinates {sorted(by_data)}, expected {topology.size('data')}")
        seen = sorted(i for shard in by_data.values() for i in shard)
        assert seen == list(range(dataset_size)), (
            f"epoch {epoch}: the data shards are not a partition of the {dataset_size} samples: "
            f"{len(seen)} indices, {len(set(seen))} distinct, "
            f"repeated {sorted({i for i in seen if seen.count(i) > 1})[:10]}, "
            f"missing {sorted(set(range(dataset_size)) - set(seen))[:10]}")


def check_shuffling(contract: Results) -> None:
    """(a) Sharding is deterministic per epoch and reshuffles between epochs."""
    for r in contract:
        assert r["shards_again"] == r["shards"][0], f"rank {r['rank']}: epoch 0 differs between two runs"
    assert any(r["shards"][0] != r["shards"][1] for r in contract), "epochs 0 and 1 were not reshuffled"


# -- (b) replicas ----------------------------------------------------------------------------------
def check_replicas(contract: Results) -> None:
    """(b) Ranks that share a data coordinate (tensor/pipeline replicas) get identical batches."""
    coords = [r["coords"]["data"] for r in contract]
    if len(set(coords)) == len(coords):
        raise NotApplicable("every data coordinate has a single rank (tensor = pipeline = 1): "
                            "there are no replicas to compare")
    for epoch in (0, 1):
        first: dict[int, tuple[int, list[int]]] = {}
        for r in contract:
            rank, shard = first.setdefault(r["coords"]["data"], (r["rank"], r["shards"][epoch]))
            assert r["shards"][epoch] == shard, (
                f"epoch {epoch}: ranks {rank} and {r['rank']} share data coordinate "
                f"{r['coords']['data']} but got different samples")


# -- (c) training parity -----------------------------------------------------------------------------
def check_training(contract: Results, topology: Topology, reference: dict[str, list[float]],
                   tolerance: float) -> None:
    """(c) Every rank returns parameters, each equal to the reference's, and the ranks of every
    pipeline group (one model replica) together hold the whole reference model."""
    assert reference, "the single-process reference has no parameters"
    by_rank = {r["rank"]: r for r in contract}
    for r in contract:
        params = r["params"]
        assert params, (f"rank {r['rank']} returned no parameters; every rank must return those it holds "
                        "(a pipeline stage its own stage's)")
        unknown = sorted(set(params) - set(reference))
        assert not unknown, f"rank {r['rank']}: parameters {unknown} are not in the reference model"
        for name, values in params.items():
            _close(values, reference[name], tolerance, f"parameter {name!r} on rank {r['rank']}")
    for group in topology.groups("pipeline"):
        held = {name for rank in group for name in by_rank[rank]["params"]}
        missing = sorted(set(reference) - held)
        assert not missing, f"ranks {group} (one model replica) hold none of the parameters {missing}"


# -- (d) metrics -----------------------------------------------------------------------------------
def check_metrics(contract: Results, reference: dict[str, float], tolerance: float) -> None:
    """(d) Every rank with the ``metrics`` role holds the single-process metrics."""
    assert reference, "the single-process reference has no metrics"
    holders = [r for r in contract if "metrics" in r["roles"]]
    assert holders, "no rank holds metrics"
    for r in holders:
        got = r["metrics"]
        assert got is not None and set(got) == set(reference), f"rank {r['rank']}: metrics {got} vs {reference}"
        for name, value in got.items():
            _close([value], [reference[name]], tolerance, f"metric {name!r} on rank {r['rank']}")


# -- (e) states ----------------------------------------------------------------------------------------
def check_states(results: Results, topology: Topology, tol: float = 1e-6) -> None:
    """(e) Every state followed its action over the data group of each rank: ``mean`` the
    replicas' average, ``broadcast`` data coordinate 0's value, ``local`` its own."""
    if topology.size("data") == 1:
        raise NotApplicable("the data axis has size 1: mean and broadcast leave every state as it was, "
                            "so a sync_states that ignores the policy could not be told apart")
    by_rank = {r["rank"]: r for r in results}
    actions = {s["action"] for r in results for s in r["states"].values()}
    assert {"mean", "broadcast"} <= actions, f"the driver's states exercise only {sorted(actions)}"
    varied = set()
    for r in results:
        peers = topology.group_of(r["rank"], "data")
        for name, state in r["states"].items():
            action, after = state["action"], state["after"]
            absent = [p for p in peers if name not in by_rank[p]["states"]]
            assert not absent, f"state {name!r} of rank {r['rank']} is missing on its data peers {absent}"
            befores = [by_rank[p]["states"][name]["before"] for p in peers]
            if any(b != befores[0] for b in befores):
                varied.add(action)
            if action == "local":
                expected = state["before"]
            elif action == "broadcast":
                expected = befores[0]
            else:
                expected = [sum(v) / len(v) for v in zip(*befores)]
            _close(after, expected, tol, f"state {name!r} ({action}) on rank {r['rank']}")
    assert {"mean", "broadcast"} <= varied, (
        f"the driver's states differ between data replicas only for actions {sorted(varied)}: give every "
        "mean and broadcast state a rank-dependent value, or a sync that does nothing passes")


# -- (f) fail fast ---------------------------------------------------------------------------------------
def waiting_ranks(topology: Topology, nprocs: int) -> set[int]:
    """The ranks that share a data group with the skipping process's ranks but run in another
    process (ranks are laid out process by process): those must fail."""
    world = topology.world_size
    per_process = world // nprocs
    skippers = set(range(world - per_process, world))
    peers = {p for r in skippers for p in topology.group_of(r, "data")}
    return peers - skippers


def check_fails_fast(driver: ConformanceDriver, strategy: Strategy, nprocs: int, world_size: int | None = None) -> None:
    """(f) The process of the last rank skips a collective: every process holding a rank of the
    same data group fails within the timeout with a ``CollectiveError`` naming the operation,
    the ``data`` axis and its rank. "Within the timeout" allows, besides the strategy's
    timeout, twice what the same call took in that process when nobody skipped (the
    driver's set-up before the collective: machine-dependent) plus 10 s."""
    world = nprocs if world_size is None else world_size
    topology = strategy.topology.resolve(world)
    waiting = waiting_ranks(topology, nprocs)
    if not waiting:
        reason = ("the data axis has size 1" if topology.size("data") == 1 else
                  f"the skipping process runs the whole data group of rank {skipping_rank(world)}")
        raise NotApplicable(f"{reason}: no other process takes part in a collective it skips")
    results = run_skipped_collective(driver, strategy, nprocs, world)
    concerned = [r for r in results if waiting & set(r["ranks"])]
    assert concerned, f"no process reported the ranks {sorted(waiting)} that wait for the skipping rank"
    for r in concerned:
        who = f"the process of ranks {r['ranks']}"
        assert r["outcome"] != "hung", (
            f"{who} was still waiting {r['elapsed']:.1f} s after rank {skipping_rank(world)} skipped the collective "
            f"(the bound: the strategy's timeout of {strategy.timeout:g} s + 2 x {r['work']:.1f} s, what the same "
            "call took when nobody skipped, + 10 s): the collective is not bounded by the strategy's timeout")
        assert r["outcome"] == "raised", (
            f"{who} completed although rank {skipping_rank(world)} skipped the collective: "
            "it must fail with a CollectiveError (CollectiveTimeout)")
        assert r["elapsed"] < r["bound"], (
            f"{who} took {r['elapsed']:.1f} s to fail (timeout {strategy.timeout:g} s; the same call took "
            f"{r['work']:.1f} s when nobody skipped)")
        assert r["error_rank"] in r["ranks"] and r["axis"] == "data" and r["operation"], (
            f"{who}: the error must name the operation, the 'data' axis and its rank; got {r}")
        assert f"rank {r['error_rank']}" in r["message"] and "data" in r["message"], (
            f"{who}: the message must name the rank and the axis: {r['message']!r}")


# -- (g) refusal before launch -------------------------------------------------------------------------
def _never_called() -> None:  # pragma: no cover - launch must refuse before starting it
    raise AssertionError("launch() started processes for a topology the target cannot run")


def check_unsupported(driver: ConformanceDriver, strategy: Strategy) -> None:
    """(g) Each topology the driver declares unsupported is refused by ``Strategy.check`` and by
    ``launch(..., runtime=)`` before any process starts (through ``strategy``'s plugin manager)."""
    assert driver.unsupported, "the driver declares no unsupported topology to check"
    for topology in driver.unsupported:
        refused = strategy.replace(topology=topology)
        try:
            refused.check(driver.target)
        except UnsupportedTopologyError:
            pass
        else:
            raise AssertionError(f"{driver.target!r} accepted {topology!r}, which the driver declares it cannot run")
        start = time.monotonic()
        try:
            launch(_never_called, refused, topology.world_size, runtime=driver.target, timeout=60)
        except UnsupportedTopologyError:
            pass
        except Exception as exc:
            raise AssertionError(f"launch() of {topology!r} was not refused before starting: "
                                 f"{exception_summary(exc, first_line=False)}") from exc
        else:
            raise AssertionError(f"launch() ran {topology!r}, which the driver declares unsupported")
        elapsed = time.monotonic() - start
        assert elapsed < 2.0, f"launch() refused {topology!r} only after {elapsed:.1f} s (processes started?)"


# -- (h) routing ---------------------------------------------------------------------------------------
def check_routing(contract: Results) -> None:
    """No rank's operations reached the decoy runtime (``_kit._DecoyRuntime``): a guard-less
    runtime plugin registered next to the tested one, asked first, is never called."""
    for record in contract:
        calls = record.get("decoy_calls", {})
        if calls:
            raise AssertionError(
                f"rank {record['rank']}: the core called another runtime's hooks for this runtime's session "
                f"({', '.join(f'{h} x{n}' for h, n in sorted(calls.items()))}): a runtime plugin that omits the "
                "session.runtime guard would have answered them. The core must route each operation to the "
                "session's runtime only (PluginManager.call_for_runtime).")


def _close(got: list[float], want: list[float], tol: float, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    # Written so that a NaN fails: every comparison with NaN is False.
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if not abs(g - w) <= tol * max(1.0, abs(w))]
    if bad:
        i, g, w = bad[0]
        raise AssertionError(f"{what}: {len(bad)} of {len(got)} values differ beyond the relative tolerance "
                             f"{tol:g}; first at [{i}]: {g!r} vs {w!r}")
