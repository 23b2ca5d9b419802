"""The topology advisor's estimator (``polyparallel plan --model``): framework-free.

A runtime plugin describes a model as a :class:`ModelProfile` (built on its framework's meta
device: no memory, no process) and registers an :class:`Advisor` through the
``polyparallel_register_advisors`` hook. This module enumerates the topologies of a world size
(data x tensor x pipeline x sharding stage), asks the runtime and the advisor which of them they
refuse (and why), and estimates for each accepted one the per-rank memory, the communication
volume per axis and a step time from a :class:`LinkModel` (measured by ``polyparallel bench-comm``
and cached as JSON, or defaults).

The model of a step (every figure is per rank, for the rank that holds the most):

- parameters ``P`` = replicated bytes + tensor-split bytes / tensor, of the rank's pipeline stage;
  gradients the same; optimizer state ``k * P`` (``k`` states per parameter: Adam 2, momentum 1,
  plain SGD 0; in the parameters' dtype). What a sharding stage divides by ``data`` is declared by
  the runtime (:class:`RuntimeTraits`; ZeRO: 1 optimizer, 2 + gradients, 3 + parameters).
- activations: the per-sample bytes the profile reports for the stage's layers (the parts inside
  tensor-parallel regions / tensor) times the rank's whole batch (GPipe keeps every micro-batch).
- communication buffers: at stages 0/1 one flat copy of the gradients (DDP's buckets); at stage 2
  the gathered parameters of the whole stage plus one layer's unsharded gradients; at stage 3 two
  gathered layers (the current one and the prefetched one) plus one layer's gradients; with a
  pipeline, one received activation and one received gradient per micro-batch.
- communication per step: data all-reduce ``2(d-1)/d * G`` at stages 0/1 (plus a ``(d-1)/d * P``
  broadcast at stage 1), reduce-scatter ``(d-1)/d * G`` and one or two all-gathers ``(d-1)/d * P``
  at stages 2/3; tensor all-reduces ``2(t-1)/t`` of the activations the profile lists; pipeline
  sends of the stage's boundary activation (forward) and its gradient (backward), per micro-batch.
- step time = compute (FLOPs / FLOP rate, times ``(m + p - 1) / m`` for GPipe's bubble) + each
  axis' volume / bus bandwidth + latency per collective. No overlap of communication with compute
  is assumed, so the estimate is an upper bound where the runtime overlaps (DDP's buckets).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ._topology import Topology

__all__ = ["Advisor", "Candidate", "LayerProfile", "LinkModel", "ModelProfile", "RuntimeTraits", "OPTIMIZER_STATES",
           "advise", "cache_path", "candidates", "estimate", "load_links", "resolve_factory", "save_links"]

#: optimizer name -> state tensors kept per parameter (the ``--optimizer`` choices).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}
#: the bucket size DDP and the hand-bucketed sync use (25 MiB): one latency per bucket.
BUCKET_BYTES = 25 * 1024 * 1024
CACHE_ENV = "POLYPARALLEL_CACHE_DIR"


@dataclass(frozen=True)
class LayerProfile:
    """One top-level layer of a model (a pipeline cuts between them; an FSDP unit is one).

    All sizes are in bytes, activations and FLOPs per sample.

    :param params: ``(bytes, split_over_tensor)`` per parameter.
    :param act_bytes: activations kept for backward, replicated over tensor.
    :param act_tensor_bytes: activations kept for backward inside tensor-parallel regions (split).
    :param out_bytes: the layer's output (what a pipeline stage ending here sends).
    :param flops: forward + backward FLOPs.
    :param tensor_split: the FLOPs split over tensor (the layer holds tensor-parallel modules).
    :param tensor_allreduce_bytes: activation bytes all-reduced over tensor (forward + backward).
    :param tensor_allreduces: all-reduces over tensor per micro-batch.
    """

    name: str
    params: tuple[tuple[int, bool], ...]
    act_bytes: int = 0
    act_tensor_bytes: int = 0
    out_bytes: int = 0
    flops: float = 0.0
    tensor_split: bool = False
    tensor_allreduce_bytes: int = 0
    tensor_allreduces: int = 0

    def param_bytes(self, tensor: int = 1) -> float:
        """Bytes of parameters one tensor rank holds."""
        return sum(b / tensor if split else b for b, split in self.params)


@dataclass(frozen=True)
class RuntimeTraits:
    """How a runtime shards, as the estimator needs it.

    :param sharded_at_rest: stage -> what it divides over ``data`` between steps (``"optimizer"``,
        ``"gradients"``, ``"parameters"``).
    :param stage1_whole_params: stage 1 gives each rank whole parameters (sorted-greedy, largest
        first to the lightest rank: torch's ``ZeroRedundancyOptimizer``) rather than even slices.
    :param regather_in_pipeline: stage 3 gathers parameters again in backward under a pipeline.
    """

    sharded_at_rest: Mapping[int, frozenset[str]] = field(default_factory=lambda: {
        0: frozenset(), 1: frozenset({"optimizer"}), 2: frozenset({"optimizer", "gradients"}),
        3: frozenset({"optimizer", "gradients", "parameters"})})
    stage1_whole_params: bool = False
    regather_in_pipeline: bool = True


@dataclass
class ModelProfile:
    """What an advisor measured of a model on the meta device, for one global batch.

    :param pipeline_cuts: pipeline size -> index of the first layer of stages 1..p-1 (absent: the
        runtime cannot cut the model into that many stages; ``refuse`` says why).
    :param microbatches: pipeline size -> micro-batches per step.
    :param refuse: ``refuse(topology, stage)`` -> the reason the runtime cannot run this model
        there, or ``None``.
    """

    name: str
    runtime: str
    layers: list[LayerProfile]
    dtype_bytes: int = 4
    pipeline_cuts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    microbatches: dict[int, int] = field(default_factory=dict)
    traits: RuntimeTraits = field(default_factory=RuntimeTraits)
    refuse: Callable[[Topology, int], str | None] = field(default=lambda topology, stage: None, repr=False)

    def summary(self) -> dict[str, Any]:
        """JSON-ready totals (per sample for activations and FLOPs)."""
        return {"model": self.name, "runtime": self.runtime, "layers": len(self.layers),
                "parameters_bytes": sum(layer.param_bytes() for layer in self.layers),
                "activation_bytes_per_sample": sum(x.act_bytes + x.act_tensor_bytes for x in self.layers),
                "flops_per_sample": sum(x.flops for x in self.layers)}


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths (bus bandwidth, bytes/s, as nccl-tests define it), per-collective latency (s)
    and the per-rank compute rate (FLOP/s) a step-time estimate uses."""

    allreduce_busbw: float = 1e9
    allgather_busbw: float = 1e9
    latency: float = 1e-4
    flops: float = 5e9
    source: str = "defaults (no `polyparallel bench-comm` result cached)"


@dataclass
class Candidate:
    """One topology and sharding stage, refused (``refused`` says why) or estimated."""

    runtime: str
    topology: Topology
    stage: int
    refused: str | None = None
    microbatches: int = 1
    memory: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """Estimated step time (infinite when refused)."""
        return self.time_s.get("step", math.inf)

    def label(self) -> str:
        """``data=2 tensor=2 pipeline=1 zero=0``."""
        t = self.topology
        return f"data={t.size('data')} tensor={t.size('tensor')} pipeline={t.size('pipeline')} zero={self.stage}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        t = self.topology
        return {"runtime": self.runtime, "data": t.size("data"), "tensor": t.size("tensor"),
                "pipeline": t.size("pipeline"), "zero": self.stage, "refused": self.refused,
                "microbatches": self.microbatches, "memory_bytes": self.memory, "comm_bytes": self.comm_bytes,
                "time_s": self.time_s}


class Advisor(Protocol):
    """What a runtime plugin registers with ``polyparallel_register_advisors``."""

    def profile(self, model: str, batch: int, seq_len: int | None) -> ModelProfile | None:
        """Profile ``module:factory`` for a global batch, or ``None`` if the model is not this runtime's."""

    def measure(self, model: str, batch: int, seq_len: int | None, runs: Sequence[tuple[Topology, int]],
                steps: int, optimizer: str, timeout: float) -> list[dict[str, Any]]:
        """Run each ``(topology, stage)`` for ``steps`` steps in real processes; per run a dict with
        ``step_s`` and per-rank ``memory_bytes`` (``parameters``, ``gradients``, ``optimizer``)."""

    def bench_comm(self, world: int, sizes: Sequence[int], iters: int, timeout: float) -> dict[str, Any]:
        """Measure all-reduce / all-gather bus bandwidth and latency, and the FLOP rate, on
        ``world`` processes; the dict :func:`save_links` stores."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(world: int, stages: Sequence[int], fixed: Mapping[str, int] | None = None) -> list[tuple[Topology, int]]:
    """Every ``(topology, stage)`` of ``world`` ranks; ``fixed`` pins axis sizes. Stages above 0
    need ``data > 1`` (nothing to shard otherwise) and are left out there."""
    fixed = dict(fixed or {})
    out = []
    for p in _divisors(world):
        for t in _divisors(world // p):
            d = world // (p * t)
            sizes = {"pipeline": p, "data": d, "tensor": t}
            if any(sizes[a] != v for a, v in fixed.items()):
                continue
            for stage in stages:
                if stage == 0 or d > 1:
                    out.append((Topology(**sizes), stage))
    return out


def _greedy_max(sizes: Sequence[float], ranks: int) -> float:
    """Largest share of the sorted-greedy partition (largest item first, to the lightest rank)."""
    loads = [0.0] * ranks
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return max(loads)


def _stages(profile: ModelProfile, pipeline: int) -> list[list[LayerProfile]]:
    if pipeline == 1:
        return [profile.layers]
    cuts = [0, *profile.pipeline_cuts[pipeline], len(profile.layers)]
    return [profile.layers[a:b] for a, b in zip(cuts, cuts[1:])]


def estimate(profile: ModelProfile, topology: Topology, stage: int, batch: int, links: LinkModel,
             optimizer_states: int = 2) -> Candidate:
    """Per-rank memory, per-axis communication and step time of ``profile`` under ``topology``
    at sharding ``stage`` for a global ``batch`` (accepted topologies only: see :func:`advise`)."""
    d, t, p = (topology.size(a) for a in ("data", "tensor", "pipeline"))
    m = profile.microbatches.get(p, p) if p > 1 else 1
    local = batch / d
    shards = profile.traits.sharded_at_rest[stage] if d > 1 else frozenset()
    per_stage: list[Candidate] = []
    layers_by_stage = _stages(profile, p)
    for index, layers in enumerate(layers_by_stage):
        sizes = [b / t if split else b for layer in layers for b, split in layer.params]
        P = float(sum(sizes))
        params = P / d if "parameters" in shards else P
        grads = P / d if "gradients" in shards else P
        if "optimizer" not in shards:
            opt = optimizer_states * P
        elif stage == 1 and profile.traits.stage1_whole_params:
            opt = optimizer_states * _greedy_max(sizes, d)
        else:
            opt = optimizer_states * P / d
        acts = local * sum(x.act_bytes + x.act_tensor_bytes / t for x in layers)
        unit = max((x.param_bytes(t) for x in layers), default=0.0)
        if d == 1 or stage < 2:
            buffers = grads if d > 1 and t == 1 else (min(P, BUCKET_BYTES) if d > 1 else 0.0)
        elif stage == 2:
            buffers = P + unit
        else:
            buffers = 3 * unit
        send_fwd = layers[-1].out_bytes if index < p - 1 else 0
        send_bwd = layers_by_stage[index - 1][-1].out_bytes if index > 0 else 0
        buffers += 2 * (send_fwd + send_bwd) * local / m if p > 1 else 0.0
        memory = {"parameters": params, "gradients": grads, "optimizer": opt, "activations": acts,
                  "buffers": buffers}
        memory["total"] = sum(memory.values())
        # communication per step
        comm = {"data": 0.0, "tensor": 0.0, "pipeline": 0.0}
        times = {"data": 0.0, "tensor": 0.0, "pipeline": 0.0}
        if d > 1:
            f = (d - 1) / d
            if stage < 2:
                comm["data"] = 2 * f * P
                times["data"] = comm["data"] / links.allreduce_busbw + math.ceil(P / BUCKET_BYTES) * links.latency
                if stage == 1:
                    comm["data"] += f * P
                    # the owners broadcast their updated parameters, issued asynchronously: the
                    # latencies overlap, about one per owner
                    times["data"] += f * P / links.allgather_busbw + d * links.latency
            else:
                gathers = 2 if stage == 3 and (p == 1 or profile.traits.regather_in_pipeline) else 1
                comm["data"] = (gathers + 1) * f * P
                units = sum(1 for x in layers if x.params)  # one collective per unit holding parameters
                times["data"] = comm["data"] / links.allgather_busbw + (gathers + 1) * units * links.latency
        if t > 1:
            comm["tensor"] = 2 * (t - 1) / t * local * sum(x.tensor_allreduce_bytes for x in layers)
            times["tensor"] = (comm["tensor"] / links.allreduce_busbw
                               + m * sum(x.tensor_allreduces for x in layers) * links.latency)
        if p > 1:
            comm["pipeline"] = local * (send_fwd + send_bwd)
            times["pipeline"] = comm["pipeline"] / links.allgather_busbw + 2 * m * links.latency
        flops = local * sum(x.flops / t if x.tensor_split else x.flops for x in layers)
        times["compute"] = flops / links.flops * ((m + p - 1) / m if p > 1 else 1.0)
        times["step"] = sum(times.values())
        per_stage.append(Candidate(profile.runtime, topology, stage, None, m, memory, comm, times))
    # The rank holding the most memory is reported; the slowest stage paces every step.
    worst = max(per_stage, key=lambda c: c.memory["total"])
    worst.time_s["step"] = max(c.step_s for c in per_stage)
    return worst


def advise(profile: ModelProfile, world: int, batch: int, stages: Sequence[int], links: LinkModel,
           runtime_check: Callable[[Topology, int], str | None], fixed: Mapping[str, int] | None = None,
           optimizer_states: int = 2) -> list[Candidate]:
    """Every candidate of ``world`` ranks, the accepted ones estimated and ranked by step time
    (then memory), followed by the refused ones with their reasons.

    :param runtime_check: the runtime's verdict on ``(topology, stage)`` (its capabilities), before
        the profile's own (``profile.refuse``: what this model cannot do there).
    """
    accepted, refused = [], []
    for topology, stage in candidates(world, stages, fixed):
        reason = runtime_check(topology, stage)
        if reason is None and batch % topology.size("data"):
            reason = (f"the global batch {batch} does not divide over data={topology.size('data')}; use a multiple "
                      f"of {topology.size('data')}")
        if reason is None:
            reason = profile.refuse(topology, stage)
        if reason is not None:
            refused.append(Candidate(profile.runtime, topology, stage, reason))
        else:
            accepted.append(estimate(profile, topology, stage, batch, links, optimizer_states))
    accepted.sort(key=lambda c: (c.step_s, c.memory["total"]))
    return accepted + refused


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """The current directory first on ``sys.path`` for the block only (unless already there)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def resolve_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``module:factory`` (``examples.advisor_models:mlp``). The module is
    imported as ``python -m`` would find it: the current directory comes first on ``sys.path``,
    while it is imported and while the returned callable runs (for the imports the factory
    makes), and only then: ``sys.path`` is left as it was. The processes ``--measure`` spawns
    resolve the name themselves, from the same directory."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must be MODULE:FACTORY (e.g. examples.advisor_models:mlp). Received: {spec!r}.")
    try:
        with _cwd_importable():
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({exc}); give a module importable from the "
                         f"current directory or the Python path.") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: {module_name!r} has no callable {attr!r}.")

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        with _cwd_importable():
            return factory(*args, **kwargs)

    return build


# -- the cache of measured links -----------------------------------------------------------------------------


def cache_path() -> Path:
    """Where ``bench-comm`` stores its results: ``$POLYPARALLEL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/polyparallel``, else ``~/.cache/polyparallel``; file ``comm.json``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "comm.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "polyparallel" / "comm.json"


def save_links(world: int, result: Mapping[str, Any]) -> Path:
    """Store one ``bench-comm`` result for ``world`` ranks (others kept); returns the file."""
    path = cache_path()
    data = _read(path)
    data.setdefault("worlds", {})[str(world)] = {**result, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # readers never see half a file
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_links(world: int) -> LinkModel:
    """The cached measurement for ``world`` ranks (else the nearest world measured), or defaults
    whose ``source`` says that ``polyparallel bench-comm`` has not run."""
    path = cache_path()
    worlds = _read(path).get("worlds") or {}
    usable = {int(k): v for k, v in worlds.items() if str(k).isdigit() and isinstance(v, dict)}
    if not usable:
        return LinkModel(source=f"defaults: no measurement in {path} (run `polyparallel bench-comm --world {world}`)")
    near = min(usable, key=lambda w: (abs(w - world), w))
    entry = usable[near]
    try:
        links = LinkModel(float(entry["allreduce_busbw"]), float(entry["allgather_busbw"]), float(entry["latency"]),
                          float(entry["flops"]), "")
    except (KeyError, TypeError, ValueError):
        return LinkModel(source=f"defaults: {path} holds no usable measurement (run `polyparallel bench-comm`)")
    note = "" if near == world else f"; measured on {near} ranks, not {world}"
    return LinkModel(**{**asdict(links), "source": f"measured {entry.get('measured_at', '?')} ({path}{note})"})
