"""The torch runtime's topology advisor (``polyparallel plan --model``, ``bench-comm``, ``--measure``).

Registered by :mod:`polyparallel_torch.plugin` through ``polyparallel_register_advisors``; the
estimator itself is framework-free (:mod:`polyparallel._advisor`). Here:

- :meth:`TorchAdvisor.profile` builds the model under ``torch.device("meta")`` (no memory) and
  runs one fake forward and backward of a one-sample batch on meta tensors: forward hooks on the
  leaf modules sum their output bytes (the activations kept for backward; tensors made inside a
  module's own ``forward``, such as attention scores, are not seen), ``FlopCounterMode`` counts
  the FLOPs of the whole forward and backward per module (:func:`layer_flops`: a top-level layer
  gets those of every module inside it, the layers of an ``nn.ModuleList`` included, and what the
  root computes itself is a layer of its own), and the tensor plan (the factory's ``options``, else the Megatron
  default for a Sequential MLP) says which parameters, activations and FLOPs split over
  ``tensor``: a column-wise module's outputs and everything computed after it until the next
  row-wise module are split; a row-wise output is all-reduced in forward and a column-wise input's
  gradient in backward. Pipelines cut where :func:`~polyparallel_torch.pipeline.split_sequential`
  cuts. A topology the runtime cannot run for this model is refused with
  :func:`polyparallel_torch.model.validate`'s message, the one ``wrap_model`` would raise.
- :meth:`TorchAdvisor.measure` runs candidates for real (``pp.launch``, ``wrap_model``,
  ``make_optimizer``) and reports the median step time and each rank's tensor bytes.
- :meth:`TorchAdvisor.bench_comm` times gloo all-reduce / all-gather and a matmul on every rank.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import polyparallel as pp
from polyparallel._advisor import LayerProfile, ModelProfile, RuntimeTraits, resolve_factory
from polyparallel._errors import exception_summary

__all__ = ["TorchAdvisor", "build", "layer_flops"]

BENCH = "bench_comm"
"""The operation name of the collectives benchmark (in the trace and in errors)."""

#: FSDP2 frees the gathered parameters between steps at stage 2 too (sharding.py); stage 1 is
#: torch's ZeroRedundancyOptimizer (whole parameters, sorted-greedy); pipelined stages keep
#: their units gathered from forward to backward.
TRAITS = RuntimeTraits(sharded_at_rest={0: frozenset(), 1: frozenset({"optimizer"}),
                                        2: frozenset({"optimizer", "gradients", "parameters"}),
                                        3: frozenset({"optimizer", "gradients", "parameters"})},
                       stage1_whole_params=True, regather_in_pipeline=False)


@dataclass
class Built:
    """A factory's model with how to feed it."""

    model: Any
    inputs: Callable[[int, int | None], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Any]
    options: Callable[[pp.Topology], dict[str, Any]]


def build(spec: str) -> Built:
    """Call the ``module:factory`` named by ``spec`` (on the current default device) and complete
    what it returns (see ``examples/advisor_models.py`` for the contract)."""
    import torch
    from torch import nn

    factory = resolve_factory(spec)
    try:
        made = factory()
    except Exception as exc:  # the user's factory: its failure is a bad --model, named as such
        raise TypeError(f"--model {spec}: calling the factory failed: {exception_summary(exc)}") from None
    given: dict[str, Any] = dict(made) if isinstance(made, dict) else {"model": made}
    model = given.get("model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec}: the factory must return an nn.Module or a dict with 'model' (an nn.Module); "
                        f"received {type(made).__name__}.")
    inputs = given.get("inputs")
    if inputs is None:
        linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not isinstance(model, nn.Sequential) or not linear:
            raise TypeError(f"--model {spec}: {type(model).__name__} needs 'inputs': return "
                            "{'model': m, 'inputs': inputs(batch, seq_len) -> (x, y)} from the factory.")
        first, last = linear[0].in_features, linear[-1].out_features

        def inputs(batch: int, seq_len: int | None) -> tuple[Any, Any]:
            return torch.randn(batch, first), torch.randn(batch, last)
    options = given.get("options") or {}
    opts: Callable[[pp.Topology], dict[str, Any]] = options if callable(options) else (lambda t: dict(options))
    return Built(model, inputs, given.get("loss_fn") or nn.functional.mse_loss, opts)


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _plan_styles(model: Any, plan: dict[str, Any]) -> dict[str, str]:
    """Module path -> ``"col"``/``"row"`` for the modules the plan splits."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {}
    for name, _ in model.named_modules():
        for pattern, style in plan.items():
            if name and fnmatch(name, pattern):
                if isinstance(style, ColwiseParallel):
                    styles[name] = "col"
                elif isinstance(style, RowwiseParallel):
                    styles[name] = "row"
    return styles


def layer_flops(counts: dict[str, dict[Any, int]], root: str, names: Sequence[str]) -> tuple[list[float], float]:
    """Forward + backward FLOPs per top-level layer (the children ``names`` of the root, ``""``
    for a root without children) from ``FlopCounterMode.get_flop_counts()``, and what the root
    computes outside them (in its own ``forward`` and the loss).

    A layer's FLOPs are those of its outermost modules the counter saw: the child itself when it
    ran its own ``forward``, else its descendants (the layers of an ``nn.ModuleList``, such as
    ``nn.TransformerEncoder``'s, never run the list's ``forward``)."""
    total = float(sum(counts.get("Global", {}).values()))
    if list(names) == [""]:
        return [total], 0.0
    per_layer = []
    for name in names:
        prefix = f"{root}.{name}"
        keys = [k for k in counts if k == prefix or k.startswith(prefix + ".")]
        outermost = [k for k in keys if not any(k.startswith(other + ".") for other in keys if other != k)]
        per_layer.append(float(sum(sum(counts[k].values()) for k in outermost)))
    return per_layer, max(0.0, total - sum(per_layer))


class TorchAdvisor:
    """The torch runtime's :class:`polyparallel._advisor.Advisor`."""

    def profile(self, model: str, batch: int, seq_len: int | None) -> ModelProfile | None:
        """Profile ``module:factory`` on the meta device (see the module documentation)."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from .model import default_plan, validate
        from .pipeline import split_sequential

        with torch.device("meta"):
            built = build(model)
            x, y = built.inputs(1, seq_len)
        net = built.model
        try:
            plan = built.options(pp.Topology(tensor=2)).get("plan") or default_plan(net)
        except TypeError:
            plan = {}  # no tensor plan: validate refuses tensor > 1 with the reason
        styles = _plan_styles(net, plan)
        children = list(net.named_children()) or [("", net)]
        layer_of = {}
        for index, (name, child) in enumerate(children):
            for sub, _ in child.named_modules():
                layer_of[f"{name}.{sub}".strip(".") if name else sub] = index
        stats = [dict(act=0, act_t=0, out=0, ar=0, n=0) for _ in children]
        region = [False]
        handles = []

        def leaf_hook(path: str) -> Callable[..., None]:
            def hook(module: Any, args: Any, output: Any) -> None:
                s, style = stats[layer_of[path]], styles.get(path)
                size = _nbytes(output)
                if style == "col":
                    region[0] = True
                    s["ar"] += _nbytes(args)  # its input's gradient is all-reduced in backward
                    s["n"] += 1
                elif style == "row":
                    region[0] = False
                    s["ar"] += size  # its output is all-reduced in forward
                    s["n"] += 1
                s["act_t" if region[0] and style != "row" else "act"] += size
            return hook

        for path, module in net.named_modules():
            if path in layer_of and next(module.children(), None) is None:
                handles.append(module.register_forward_hook(leaf_hook(path)))
        for index, (_, child) in enumerate(children):
            handles.append(child.register_forward_hook(
                lambda m, a, out, i=index: stats[i].__setitem__("out", _nbytes(out))))
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                loss = built.loss_fn(net(x), y)
                loss.backward()
        finally:
            for h in handles:
                h.remove()
        root = type(net).__name__
        per_layer, own_flops = layer_flops(counter.get_flop_counts(), root, [name for name, _ in children])
        layers = []
        for index, (name, child) in enumerate(children):
            prefix = f"{name}." if name else ""
            params = tuple((p.numel() * p.element_size(),
                            styles.get(f"{prefix}{n}".rpartition(".")[0]) == "col"
                            or (styles.get(f"{prefix}{n}".rpartition(".")[0]) == "row" and n.endswith("weight")))
                           for n, p in child.named_parameters())
            s = stats[index]
            layers.append(LayerProfile(name or root, params, s["act"], s["act_t"], s["out"],
                                       per_layer[index], any(layer_of.get(p) == index for p in styles), s["ar"],
                                       s["n"]))
        own = tuple(p.numel() * p.element_size() for p in net.parameters(recurse=False))
        if (own or own_flops) and children[0][0]:  # with no children, the root is the one layer already
            # what the root holds and computes itself (not a Sequential: no pipeline cuts to keep aligned)
            layers.append(LayerProfile(f"{root} (own parameters and computation)", tuple((b, False) for b in own),
                                       flops=own_flops))
        cuts: dict[int, tuple[int, ...]] = {}
        microbatches: dict[int, int] = {}
        if isinstance(net, torch.nn.Sequential):
            for p in range(2, len(children) + 1):
                try:
                    stages = split_sequential(net, p, built.options(pp.Topology(pipeline=p)).get("split_points"))
                except (TypeError, pp.PolyparallelError):
                    continue
                sizes = [len(list(s.children())) for s in stages]
                cuts[p] = tuple(sum(sizes[:i]) for i in range(1, p))
                microbatches[p] = int(built.options(pp.Topology(pipeline=p)).get("microbatches", p))
        dtype_bytes = next((p.element_size() for p in net.parameters()), 4)

        def refuse(topology: pp.Topology, stage: int) -> str | None:
            options = built.options(topology)
            try:
                validate(net, topology, options, stage)
            except (TypeError, ValueError, pp.PolyparallelError) as exc:
                return str(exc)
            p, d = topology.size("pipeline"), topology.size("data")
            m = int(options.get("microbatches", p))
            if p > 1 and (batch // d) % m:
                return (f"the per-rank batch {batch // d} does not split into microbatches={m} (pipeline={p}); "
                        f"use a global batch that is a multiple of {d * m}")
            return None

        return ModelProfile(model, "torch", layers, dtype_bytes, cuts, microbatches, TRAITS, refuse)

    def measure(self, model: str, batch: int, seq_len: int | None, runs: Sequence[tuple[pp.Topology, int]],
                steps: int, optimizer: str, timeout: float) -> list[dict[str, Any]]:
        """Run each ``(topology, stage)`` in ``topology.world_size`` gloo processes."""
        out = []
        for topology, stage in runs:
            strategy = pp.Strategy(topology=topology, zero=stage, timeout=min(timeout, 120.0), seed=0,
                                   runtime="torch", backend="gloo")
            ranks = pp.launch(measure_rank, strategy, topology.world_size,
                              args=(strategy, model, batch, seq_len, steps, optimizer), timeout=timeout)
            memory = [r["memory_bytes"] for r in ranks]
            out.append({"step_s": max(r["step_s"] for r in ranks), "memory_bytes": memory,
                        "memory_max": {k: max(m[k] for m in memory) for k in memory[0]}})
        return out

    def bench_comm(self, world: int, sizes: Sequence[int], iters: int, timeout: float) -> dict[str, Any]:
        """Time gloo all-reduce and all-gather (bus bandwidth, nccl-tests' definition) on ``world``
        processes, and a float32 matmul on every rank at once (FLOP/s, the slowest rank)."""
        strategy = pp.Strategy(data=world, timeout=min(timeout, 120.0), runtime="torch", backend="gloo")
        ranks = pp.launch(bench_rank, strategy, world, args=(strategy, list(sizes), iters), timeout=timeout)
        table = ranks[0]["table"]
        # On a shared machine one size can be slowed by other load: the best bandwidth and the
        # shortest time over the sizes are the least disturbed estimates of the link.
        return {"world": world, "backend": "gloo", "table": table,
                "allreduce_busbw": max(e["busbw"] for e in table["all_reduce"].values()),
                "allgather_busbw": max(e["busbw"] for e in table["all_gather"].values()),
                "latency": min(e["time_s"] for e in table["all_reduce"].values()),
                "flops": min(r["flops"] for r in ranks)}


def _tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def measure_rank(strategy: pp.Strategy, spec: str, batch: int, seq_len: int | None, steps: int,
                 optimizer: str) -> dict[str, Any]:
    """In each launched process: build, wrap, train ``steps`` timed steps after two warm-up steps;
    the median step time and this rank's parameter, gradient and optimizer-state bytes (local
    shards of DTensors) after the last optimizer step (gradients kept: not zeroed after it)."""
    import torch

    from .sharding import make_optimizer

    session = strategy.session()
    topology = session.topology
    torch.manual_seed(0)
    built = build(spec)
    model = strategy.wrap_model(built.model, **{**built.options(topology), "loss_fn": built.loss_fn}
                                if topology.size("pipeline") > 1 else built.options(topology))
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "momentum": torch.optim.SGD, "sgd": torch.optim.SGD}
    kwargs = {"momentum": 0.9} if optimizer == "momentum" else {}
    opt = make_optimizer(strategy, model, classes[optimizer], lr=1e-3, **kwargs)
    # Ranks sharing a data coordinate (tensor and pipeline peers) need the same batch.
    generator_seed = 1000 + session.coords["data"]
    local = batch // topology.size("data")
    times = []
    for step in range(steps + 2):
        torch.manual_seed(generator_seed + step)
        x, y = built.inputs(local, seq_len)
        start = time.perf_counter()
        opt.zero_grad()
        if topology.size("pipeline") > 1:
            model.train_step(x, y)
        else:
            built.loss_fn(model(x), y).backward()
            strategy.sync_grads(model)
        opt.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    state = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeroRedundancyOptimizer: its local part
    params = [p for p in model.parameters()]
    memory = {"parameters": _tensor_bytes(params), "gradients": _tensor_bytes(p.grad for p in params),
              "optimizer": _tensor_bytes(v for s in state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor) and v.dim() > 0)}
    return {"step_s": statistics.median(times), "memory_bytes": memory}


def bench_rank(strategy: pp.Strategy, sizes: list[int], iters: int) -> dict[str, Any]:
    """In each launched process: time the collectives (every rank the same calls) and a matmul.

    The collectives go through the runtime: one identity check and one trace entry for the whole
    benchmark (``bench_comm``), each wait bounded by the strategy's timeout, a failure raised as a
    :class:`polyparallel.CollectiveError` naming the rank."""
    import torch
    import torch.distributed as dist

    from .runtime import get_runtime

    rt = get_runtime(strategy.session())
    group, n = rt.group("data"), strategy.session().world_size
    table: dict[str, dict[str, dict[str, float]]] = {"all_reduce": {}, "all_gather": {}}

    def bounded(start: Callable[[], Any]) -> None:
        with rt.collective(BENCH, "data", label):
            work = start()
        rt.wait(work, BENCH, "data", label)

    with rt.operation(BENCH, "data", f"sizes {sizes}, {iters} iterations") as label:
        for size in sizes:
            x = torch.ones(size // 4)
            parts = [torch.empty(size // 4 // n) for _ in range(n)]
            calls: dict[str, Callable[[], Any]] = {
                "all_reduce": functools.partial(dist.all_reduce, x, group=group, async_op=True),
                "all_gather": functools.partial(dist.all_gather, parts, x[: len(parts[0])], group=group,
                                                async_op=True)}
            for op, once in calls.items():
                bounded(once)  # warm-up (connections, buffers)
                samples = []
                for _ in range(iters):
                    # every rank starts together: the time is the collective's
                    bounded(functools.partial(dist.barrier, group=group, async_op=True))
                    begin = time.perf_counter()
                    bounded(once)
                    samples.append(time.perf_counter() - begin)
                elapsed = statistics.median(samples)  # robust to a rank descheduled by other load
                factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
                table[op][str(size)] = {"time_s": elapsed, "busbw": size * factor / elapsed}
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    flops = 2 * 256**3 * reps / (time.perf_counter() - start)
    return {"table": table, "flops": flops}
