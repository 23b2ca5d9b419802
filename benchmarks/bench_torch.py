"""Ratio benchmarks of the torch runtime against hand-written native code, side by side.

    python benchmarks/bench_torch.py [--quick] [--launches N] [--only check|grads|fresh|ddp-trace|fsdp-trace] [--json results.json]

(a) ``sync_grads`` throughput on a bare module (many small parameters; a few large ones) against
    one all_reduce of a flat buffer of the same bytes (the limit on this machine) and against
    one all_reduce per parameter;
(a2) a bare-module step with fresh ``.grad`` tensors each step (``zero_grad()``'s default
    ``set_to_none=True``) on 2,000 and on 600 small parameters (chains of ``Linear(16, 16)``):
    zero_grad + backward + ``sync_grads`` against zero_grad + backward + one all_reduce of a flat
    buffer of the same bytes
    (no packing at all: the limit), next to a same-vs-same control (that flat side against
    itself), interleaved, in ``--launches`` separate launches (median and spread of the ratios);
    also with ``GradPolicy(check=False)``, the main thread's CPU time alone, and the whole step
    (forward and optimizer step included). ``--only fresh --quick --launches 1`` is a smoke run
    of this part alone (about a minute);
(b) a training step through the strategy (shard_data + wrap_model + sync_grads) against a
    hand-written DDP loop on the same model, data and process group, runs interleaved;
(b2) the same training step on a *bare* module (the non-DDP path: tensor parallel with data > 1,
    pipelines), where ``sync_grads`` runs its identity check (one 16-byte all-reduce, travelling
    while the gradients are packed) before the gradient buckets: steps with the check against the
    same steps with ``GradPolicy(check=False)``, interleaved, in ``--launches`` separate launches
    (median and spread of the ratio);
(b3) a DDP training step (the model of (b2), batch 64 per rank) with DDP's bucket all-reduces
    recorded (:mod:`polyparallel_torch.ddp_trace`, the default: no comm hook), recorded and
    identity-checked (``GradPolicy(check_backward=True)``: the check started at the backward's
    start, answered after it), and off (``POLYPARALLEL_TRACE_DDP=0``), with a second
    "off" model as the same-vs-same control, interleaved, in ``--launches`` separate launches:
    here the figures are step-time ratios against "off" (> 1: slower), and the same ratios of the
    CPU time of the thread running the step (which the machine's scheduling hardly moves).
    ``--only ddp-trace --quick`` runs this part alone;
(b4) an FSDP2 training step at ``zero=3`` (the same model and batch) with FSDP's all-gathers and
    reduce-scatters recorded (:mod:`polyparallel_torch.fsdp_trace`, the default) and off
    (``POLYPARALLEL_TRACE_FSDP=0``), with a second "off" model as the control, interleaved, in
    ``--launches`` launches (step-time and CPU-time ratios against "off"); ``--only fsdp-trace --quick``;
(c) hook dispatch cost per call (a no-op plugin; and torch's own no-op ``sync_grads`` on a DDP
    model);
(d) ``import polyparallel`` time (fresh interpreters).

Every multi-process figure comes from the same 2 gloo processes, alternating the two sides so
that machine noise hits both alike. Ratios > 1 mean polyparallel is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from typing import Any

import polyparallel as pp


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _grad_sync_worker(quick: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    strategy = pp.Strategy(data=2, timeout=120)
    rt = __import__("polyparallel_torch.runtime", fromlist=["get_runtime"]).get_runtime(strategy.session())
    group = rt.group("data")
    repeats = 5 if quick else 15
    out = {}
    shapes = {"many small (2000 x 1 KiB)": [(256,)] * 2000, "few large (4 x 16 MiB)": [(4 * 1024 * 1024,)] * 4}
    for label, param_shapes in shapes.items():
        model = nn.Module()
        model.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in param_shapes])
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        flat = torch.ones(nbytes // 4)

        def ours() -> None:  # gradients zeroed in place between steps: they live in the buffers
            strategy.sync_grads(model)

        def ours_fresh() -> None:  # zero_grad(set_to_none=True): fresh gradient tensors every step
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            start = time.perf_counter()
            strategy.sync_grads(model)
            return time.perf_counter() - start

        def flat_buffer() -> None:
            dist.all_reduce(flat, group=group)
            flat.div_(2)

        def per_param() -> None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(2)

        for fn in (ours, flat_buffer, per_param):
            fn()  # warm up
        times: dict[str, list[float]] = {"ours": [], "ours_fresh": [], "flat": [], "per_param": []}
        for _ in range(repeats):  # interleaved
            for name, fn in (("ours", ours), ("flat", flat_buffer), ("per_param", per_param)):
                dist.barrier(group=group)
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            dist.barrier(group=group)
            times["ours_fresh"].append(ours_fresh())
        ours()  # leave the buffers' views in place for the next label's sanity
        out[label] = {k: statistics.median(v) for k, v in times.items()} | {"bytes": nbytes}
    return out


FRESH_SIZES = {"2,000 params": 1000, "600 params": 300}  # Linear(16, 16) layers: weight + bias each


def _fresh_step_worker(quick: bool) -> dict[str, dict[str, float]]:
    """(a2): backward + sync_grads vs backward + one flat all-reduce, fresh .grad tensors each step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    strategy = pp.Strategy(data=2, timeout=120)
    unchecked = strategy.replace(grad_policy=pp.GradPolicy(check=False))  # without the identity check
    rt = __import__("polyparallel_torch.runtime", fromlist=["get_runtime"]).get_runtime(strategy.session())
    group = rt.group("data")
    steps = 12 if quick else 40
    out = {}
    for label, layers in FRESH_SIZES.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(8, 16)
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))

        def flat_side() -> None:  # the limit: gradients not even packed, one all_reduce of their bytes
            dist.all_reduce(flat, group=group)
            flat.div_(2)

        sides = {"ours": lambda: strategy.sync_grads(model), "ours_unchecked": lambda: unchecked.sync_grads(model),
                 "flat": flat_side, "flat_again": flat_side, "hooked_flat": flat_side}

        def step(name: str) -> tuple[float, float, float]:
            # hooked_flat: the flat side with a no-op post-accumulate-grad hook per parameter, the
            # Python cost a DDP-style design (copy into buckets from per-parameter hooks) starts from
            hooks = [p.register_post_accumulate_grad_hook(lambda p: None)
                     for p in model.parameters()] if name == "hooked_flat" else []
            # zero_grad (set_to_none=True: fresh gradient tensors every step) is timed too: it frees
            # the last step's gradients on the flat side, while sync_grads frees them when it makes
            # the buffer's views the .grad (the same work, elsewhere).
            dist.barrier(group=group)
            start, cpu = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            elapsed, cpu_time = time.perf_counter() - start, time.thread_time() - cpu
            forward = time.perf_counter()
            loss = model(x).square().mean()
            forward = time.perf_counter() - forward
            dist.barrier(group=group)
            start, cpu = time.perf_counter(), time.thread_time()
            loss.backward()
            sides[name]()
            elapsed, cpu_time = elapsed + time.perf_counter() - start, cpu_time + time.thread_time() - cpu
            for hook in hooks:
                hook.remove()
            # The optimizer step is the first Python reader of fresh gradients on the flat side (it
            # wraps each one in a Python object); sync_grads reads them itself and hands the
            # optimizer views it already holds: the whole step (forward and optimizer step too)
            # shows where that work went.
            start = time.perf_counter()
            opt.step()
            return elapsed, cpu_time, elapsed + forward + time.perf_counter() - start

        for name in sides:  # warm up (and build the bucket layout)
            step(name)
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        whole: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for i in range(steps):  # interleaved, rotating who goes first
            for name in order[i % len(order):] + order[:i % len(order)]:
                elapsed, cpu_time, whole_step = step(name)
                times[name].append(elapsed)
                cpu[name].append(cpu_time)
                whole[name].append(whole_step)
        # Wall time is the figure; the main thread's CPU time (no waiting, no gloo threads) shows
        # the work each side adds, without the scheduling noise of a shared machine.
        out[label] = {name: statistics.median(v) for name, v in times.items()}
        out[label] |= {f"{name}_cpu": statistics.median(v) for name, v in cpu.items()}
        out[label] |= {f"{name}_whole": statistics.median(v) for name, v in whole.items()}
    return out


def grad_sync(quick: bool) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(a) in one launch: rows for the table and the figures."""
    rows, figures = [], {}
    grads = pp.launch(_grad_sync_worker, pp.Strategy(data=2, timeout=120), 2, args=(quick,), timeout=900)[0]
    for label, t in grads.items():
        mb = t["bytes"] / 2**20
        figures[f"sync_grads {label}"] = t
        rows.append((f"sync_grads, {label}", f"{mb / t['ours']:.0f} MiB/s vs flat {mb / t['flat']:.0f} MiB/s",
                     f"{t['flat'] / t['ours']:.2f}x flat, {t['per_param'] / t['ours']:.2f}x per-param"))
        rows.append(("  same, fresh .grad tensors each step", f"{mb / t['ours_fresh']:.0f} MiB/s",
                     f"{t['flat'] / t['ours_fresh']:.2f}x flat, {t['per_param'] / t['ours_fresh']:.2f}x per-param"))
    return rows, figures


def fresh_grads(quick: bool, launches: int) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(a2) over ``launches`` launches: rows for the table and the figures."""
    strategy = pp.Strategy(data=2, timeout=120)
    per_launch = [pp.launch(_fresh_step_worker, strategy, 2, args=(quick,), timeout=900)[0] for _ in range(launches)]
    rows, figures = [], {}
    for label in FRESH_SIZES:
        runs = [r[label] for r in per_launch]
        ours = sorted(r["flat"] / r["ours"] for r in runs)
        ours_unchecked = sorted(r["flat"] / r["ours_unchecked"] for r in runs)
        hooked = sorted(r["flat"] / r["hooked_flat"] for r in runs)
        cpu_ratios = sorted(r["flat_cpu"] / r["ours_cpu"] for r in runs)
        control = sorted(r["flat"] / r["flat_again"] for r in runs)
        whole = sorted(r["flat_whole"] / r["ours_whole"] for r in runs)
        whole_control = sorted(r["flat_whole"] / r["flat_again_whole"] for r in runs)
        figures[f"fresh grads {label}"] = {"ratios": ours, "control_ratios": control,
                                           "unchecked_ratios": ours_unchecked, "hooked_flat_ratios": hooked,
                                           "cpu_ratios": cpu_ratios, "whole_step_ratios": whole,
                                           "whole_step_control_ratios": whole_control,
                                           "ours_s": statistics.median(r["ours"] for r in runs),
                                           "flat_s": statistics.median(r["flat"] for r in runs)}
        rows.append((f"zero_grad + backward + sync_grads, fresh .grad, {label} ({launches} launches)",
                     f"{figures[f'fresh grads {label}']['ours_s'] * 1e3:.2f} ms vs backward + flat all_reduce "
                     f"{figures[f'fresh grads {label}']['flat_s'] * 1e3:.2f} ms",
                     f"{statistics.median(ours):.3f}x (min {ours[0]:.3f}, max {ours[-1]:.3f})"))
        rows.append(("  same, GradPolicy(check=False)", "-", f"{statistics.median(ours_unchecked):.3f}x "
                     f"(min {ours_unchecked[0]:.3f}, max {ours_unchecked[-1]:.3f})"))
        rows.append(("  same, main-thread CPU time only", "-",
                     f"{statistics.median(cpu_ratios):.3f}x (min {cpu_ratios[0]:.3f}, max {cpu_ratios[-1]:.3f})"))
        rows.append(("  flat + a no-op grad hook per parameter", "-",
                     f"{statistics.median(hooked):.3f}x (min {hooked[0]:.3f}, max {hooked[-1]:.3f})"))
        rows.append(("  control: flat vs the same flat", "-",
                     f"{statistics.median(control):.3f}x (min {control[0]:.3f}, max {control[-1]:.3f})"))
        rows.append(("  whole step (+ forward + optimizer step), control", "-",
                     f"{statistics.median(whole):.3f}x (min {whole[0]:.3f}, max {whole[-1]:.3f}); control "
                     f"{statistics.median(whole_control):.3f}x"))
    return rows, figures


def _train_step_worker(quick: bool) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    strategy = pp.Strategy(data=2, timeout=120, batch_size=128)
    rt = __import__("polyparallel_torch.runtime", fromlist=["get_runtime"]).get_runtime(strategy.session())
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))

    def model_() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    # hand-written: DDP on the default group of 2, DistributedSampler, the same global batch
    native_model = nn.parallel.DistributedDataParallel(model_())
    native_loader = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds, seed=0))
    native_opt = torch.optim.SGD(native_model.parameters(), lr=0.01)
    ours_model = strategy.wrap_model(model_())
    ours_loader = strategy.shard_data(ds)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01)

    def native_step(batch: Any) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(native_model(x), y)
        native_opt.zero_grad()
        loss.backward()
        native_opt.step()

    def ours_step(batch: Any) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(ours_model(x), y)
        ours_opt.zero_grad()
        loss.backward()
        strategy.sync_grads(ours_model)  # the documented no-op under DDP, paid for here
        ours_opt.step()

    epochs = 1 if quick else 3
    times: dict[str, list[float]] = {"native": [], "ours": []}
    for epoch in range(epochs):
        native_loader.sampler.set_epoch(epoch)
        for i, (native_batch, ours_batch) in enumerate(zip(native_loader, ours_loader)):
            pair = [("native", native_step, native_batch), ("ours", ours_step, ours_batch)]
            for name, step, batch in (pair if i % 2 else pair[::-1]):  # alternate who goes first
                dist.barrier()
                start = time.perf_counter()
                step(batch)
                times[name].append(time.perf_counter() - start)
    del rt
    return {k: statistics.median(v[5:]) for k, v in times.items()}


def _check_cost_worker(quick: bool) -> dict[str, float]:
    """(b2): bare-module training steps with and without the identity check of sync_grads."""
    import torch
    import torch.distributed as dist
    from torch import nn

    strategy = pp.Strategy(data=2, timeout=120)
    rt = __import__("polyparallel_torch.runtime", fromlist=["get_runtime"]).get_runtime(strategy.session())
    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    unchecked = strategy.replace(grad_policy=pp.GradPolicy(check=False))  # the same runtime and groups

    def step(s: pp.Strategy) -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        s.sync_grads(model)
        opt.step()

    check_alone: list[float] = []
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    steps = 20 if quick else 60
    for i in range(steps):
        pair = [("checked", strategy), ("unchecked", unchecked)]
        for name, s in (pair if i % 2 else pair[::-1]):  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            step(s)
            times[name].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        rt.check("bench", "data")
        check_alone.append(time.perf_counter() - start)
    skip = 5
    return {"checked": statistics.median(times["checked"][skip:]),
            "unchecked": statistics.median(times["unchecked"][skip:]),
            "check_alone": statistics.median(check_alone[skip:])}


def _recording_mlp() -> Any:
    """The model of (b3) and (b4): an MLP of 0.4M parameters, the same weights every call."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _interleaved_steps(models: dict[str, Any], quick: bool) -> dict[str, float]:
    """Training steps of ``models`` (batch 64 a rank), interleaved with the first side rotating,
    a barrier before each on both sides alike: the median step time of each (``<name>``) and the
    median CPU time of the thread running it (``<name> cpu``: the forward, the backward's kernels
    and every Python hook run there; DDP's bucket all-reduces run on the backend's threads, so a
    busy machine's scheduling, which moves the wall time by +-10 %, hardly moves this one)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}

    def step(name: str) -> None:
        loss = nn.functional.cross_entropy(models[name](x), y)
        opts[name].zero_grad()
        loss.backward()
        opts[name].step()

    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for i in range(30 if quick else 200):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
        for name in order:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            step(name)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    return {k: statistics.median(v[5:]) for k, v in times.items()} | {
        f"{k} cpu": statistics.median(v[5:]) for k, v in cpu.items()}


def _ratio_rows(per_launch: list[dict[str, float]], names: tuple[str, ...], label: str,
                launches: int) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """Median and spread over the launches of each side's step time, and of its thread's CPU time,
    against ``off``."""
    figures: dict[str, Any] = {"launches": per_launch}
    rows = []
    for suffix, what in (("", "time"), (" cpu", "CPU time")):
        for name in names:
            ratios = sorted(r[name + suffix] / r["off" + suffix] for r in per_launch)
            figures[f"{name} / off{suffix}"] = ratios
            rows.append((f"{label}: {name} vs off, {what} ({launches} launches)",
                         f"{statistics.median(r[name + suffix] for r in per_launch) * 1e3:.3f} ms vs "
                         f"{statistics.median(r['off' + suffix] for r in per_launch) * 1e3:.3f} ms",
                         f"{what} {statistics.median(ratios):.3f}x (min {ratios[0]:.3f}, max {ratios[-1]:.3f})"))
    return rows, figures


def _ddp_trace_worker(quick: bool) -> dict[str, float]:
    """(b3): DDP training steps with the backward recorded (polyparallel_torch.ddp_trace, the
    default), recorded and checked (GradPolicy(check_backward=True)), off, and off again (the
    same-vs-same control): four DDP models of the same weights on the same data group, steps
    interleaved."""
    from polyparallel_torch import ddp_trace

    strategy = pp.Strategy(data=2, timeout=120)
    checked = strategy.replace(grad_policy=pp.GradPolicy(check_backward=True))
    models = {"recorded": strategy.wrap_model(_recording_mlp()), "checked": checked.wrap_model(_recording_mlp())}
    os.environ[ddp_trace.ENV] = "0"
    models |= {"off": strategy.wrap_model(_recording_mlp()), "off again": strategy.wrap_model(_recording_mlp())}
    del os.environ[ddp_trace.ENV]
    assert ddp_trace.is_installed(models["recorded"]) and not ddp_trace.is_installed(models["off"])
    return _interleaved_steps(models, quick)


def ddp_trace_cost(quick: bool, launches: int) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(b3) over ``launches`` launches: median and spread of recorded/off, checked/off and the control."""
    strategy = pp.Strategy(data=2, timeout=120)
    per_launch = [pp.launch(_ddp_trace_worker, strategy, 2, args=(quick,), timeout=900)[0] for _ in range(launches)]
    rows, figures = _ratio_rows(per_launch, ("recorded", "checked", "off again"), "DDP step, backward recording",
                                launches)
    return rows, {"ddp trace": figures}


def _fsdp_trace_worker(quick: bool) -> dict[str, float]:
    """(b4): FSDP2 (zero=3) training steps with the recording comms (polyparallel_torch.fsdp_trace)
    on, off, and off again (the same-vs-same control): three models of the same weights on the same
    data group, steps interleaved."""
    from polyparallel_torch import fsdp_trace

    strategy = pp.Strategy(data=2, zero=3, timeout=120)
    models = {"on": strategy.wrap_model(_recording_mlp())}
    os.environ[fsdp_trace.ENV] = "0"
    models |= {"off": strategy.wrap_model(_recording_mlp()), "off again": strategy.wrap_model(_recording_mlp())}
    del os.environ[fsdp_trace.ENV]
    assert fsdp_trace.is_installed(models["on"]) and not fsdp_trace.is_installed(models["off"])
    return _interleaved_steps(models, quick)


def fsdp_trace_cost(quick: bool, launches: int) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(b4) over ``launches`` launches: median and spread of on/off and the control."""
    strategy = pp.Strategy(data=2, zero=3, timeout=120)
    per_launch = [pp.launch(_fsdp_trace_worker, strategy, 2, args=(quick,), timeout=900)[0] for _ in range(launches)]
    rows, figures = _ratio_rows(per_launch, ("on", "off again"), "FSDP2 zero=3 step, collective recording", launches)
    return rows, {"fsdp trace": figures}


def dispatch_cost() -> dict[str, float]:
    class Noop:
        @pp.hookimpl
        def polyparallel_sync_grads(self, target: Any) -> Any:
            return target

    pm = pp.PluginManager(autoload=False)
    pm.register(Noop(), name="noop")
    strategy = pp.Strategy(data=1, plugin_manager=pm)
    target = object()
    strategy.sync_grads(target)
    n = 100_000
    out = {"no-op plugin": min(timeit.repeat(lambda: strategy.sync_grads(target), number=n, repeat=5)) / n}
    import torch  # noqa: F401  (the torch plugin answers only once torch is loaded)
    from torch import nn

    torch_strategy = pp.Strategy(data=1)
    module = nn.Linear(2, 2)
    torch_strategy.sync_grads(module)
    out["torch sync_grads no-op"] = min(timeit.repeat(lambda: torch_strategy.sync_grads(module), number=n, repeat=5)) / n
    return out


def import_time(repeats: int = 5) -> float:
    code = "import time; t = time.perf_counter(); import polyparallel; print(time.perf_counter() - t)"
    return statistics.median(float(subprocess.check_output([sys.executable, "-c", code])) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--launches", type=int, default=None,
                        help="launches of the identity-check (b2) and fresh-gradient (a2) benchmarks; "
                             "default 10, 3 with --quick")
    parser.add_argument("--only", choices=["check", "grads", "fresh", "ddp-trace", "fsdp-trace"],
                        help="run only the identity-check benchmark (b2), only the sync_grads ones (a, a2), "
                             "only the fresh-gradient step (a2), only DDP's bucket recording on/off (b3), or only "
                             "FSDP2's collective recording on/off (b4)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    strategy = pp.Strategy(data=2, timeout=120)
    rows: list[tuple[str, str, str]] = []
    figures: dict[str, Any] = {}
    launches = args.launches or (3 if args.quick else 10)
    if args.only == "fresh":
        _print(*fresh_grads(args.quick, launches), args.json)
        return
    if args.only == "ddp-trace":
        _print(*ddp_trace_cost(args.quick, launches), args.json)
        return
    if args.only == "fsdp-trace":
        _print(*fsdp_trace_cost(args.quick, launches), args.json)
        return
    if args.only == "grads":
        rows, figures = fresh_grads(args.quick, launches)
        grad_rows, grad_figures = grad_sync(args.quick)
        _print(rows + grad_rows, figures | grad_figures, args.json)
        return
    per_launch = [pp.launch(_check_cost_worker, strategy, 2, args=(args.quick,), timeout=900)[0]
                  for _ in range(launches)]
    ratios = sorted(r["unchecked"] / r["checked"] for r in per_launch)
    checked = statistics.median(r["checked"] for r in per_launch)
    unchecked = statistics.median(r["unchecked"] for r in per_launch)
    alone = statistics.median(r["check_alone"] for r in per_launch)
    figures["identity check"] = {"ratios": ratios, "checked_s": checked, "unchecked_s": unchecked, "check_s": alone}
    rows.append((f"bare-module step, sync_grads check on/off ({launches} launches)",
                 f"{checked * 1e3:.2f} ms vs {unchecked * 1e3:.2f} ms; one check {alone * 1e6:.0f} us",
                 f"{statistics.median(ratios):.3f}x (min {ratios[0]:.3f}, max {ratios[-1]:.3f})"))
    if args.only == "check":
        _print(rows, figures, args.json)
        return

    for part in (fresh_grads(args.quick, launches), grad_sync(args.quick)):
        rows += part[0]
        figures |= part[1]
    steps = pp.launch(_train_step_worker, strategy, 2, args=(args.quick,), timeout=900)
    native, ours = statistics.mean(s["native"] for s in steps), statistics.mean(s["ours"] for s in steps)
    figures["train step"] = {"native_s": native, "ours_s": ours}
    rows.append(("training step (DDP, 2 ranks)", f"{ours * 1e3:.2f} ms vs hand-written {native * 1e3:.2f} ms",
                 f"{native / ours:.3f}x"))
    for label, seconds in dispatch_cost().items():
        figures[f"dispatch {label}"] = seconds
        rows.append((f"dispatch, {label}", f"{seconds * 1e6:.2f} us per call", "-"))
    t_import = import_time()
    figures["import polyparallel"] = t_import
    rows.append(("import polyparallel", f"{t_import * 1e3:.1f} ms", "-"))

    _print(rows, figures, args.json)


def _print(rows: list[tuple[str, str, str]], figures: dict[str, Any], json_path: str | None) -> None:
    width = [max(len(r[i]) for r in rows + [("benchmark", "figure", "ratio (ours/native speed)")]) for i in range(3)]
    print(f"{'benchmark':<{width[0]}}  {'figure':<{width[1]}}  ratio (ours/native speed)")
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
