"""Checkpoint save/load time and size at data=2 x tensor=2 (4 gloo processes): ``Strategy.save``/
``load`` (DCP, each rank writes its own shards, SHA-256 of every file taken while writing, atomic
commit; the load verifies every file's SHA-256, shared by the ranks) against

- **DCP directly**: ``torch.distributed.checkpoint.save``/``load`` of the same flattened state
  dicts with DCP's own ``FileSystemWriter``/``FileSystemReader`` (no hashes, no marker, no rank
  files, no agreement): what polyparallel adds on top of DCP;
- **DCP + hashing writer**: the same with polyparallel's hashing writer: the cost of the hashes
  taken while writing, alone;
- **gathered torch.save**: every rank gathers the full model and optimizer state, rank 0
  ``torch.save``s it; on load every rank ``torch.load(weights_only=True)``s the file and keeps its
  shards (the hand-written alternative);
- **the same-vs-same control**: ``Strategy.save``/``load`` measured twice per repeat as two sides
  (A and A'); their ratio shows how far machine noise alone moves a ratio.

Asynchronous saves: the time ``Strategy.async_save`` blocks the caller (staging) and the time
until its future is done; and the step time lost to a save in a training loop (20 steps, one
save at step 5): no save vs ``save`` vs ``async_save``, per step of the loop.

    python benchmarks/bench_checkpoint.py [--quick] [--width 1024] [--repeats 7] [--json results.json]

Model: ``Linear(width, 4*width)`` / ``Linear(4*width, width)`` pairs (the default tensor-parallel
plan shards them), Adam after one step (its two moments per parameter). The sides run
interleaved in the same 4 processes, their order rotated every repeat, so that machine noise
hits all alike; times are wall clock from a barrier to a barrier, reported as the median and
[min, max] over the repeats (>= 7 by default). Ratios > 1: the other side is slower.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import polyparallel as pp

SIDES_SAVE = ("ours", "ours_again", "dcp", "dcp_hashing", "torch_save")
SIDES_LOAD = ("ours", "ours_again", "dcp", "torch_save")
LOOP_STEPS, SAVE_AT = 20, 5


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _worker(width: int, repeats: int, tmp: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from polyparallel_torch.checkpoint_files import hashing_writer

    strategy = pp.Strategy(data=2, tensor=2, timeout=600)
    torch.manual_seed(0)
    model = strategy.wrap_model(nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width),
                                              nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(8, width)).square().mean().backward()
        strategy.sync_grads(model)
        opt.step()

    train_step()
    full = StateDictOptions(full_state_dict=True)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    rank = strategy.rank

    def timed(fn: Callable[[], Any]) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def dcp_state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, opt, options=flat)
        return {**{f"model.{k}": v for k, v in model_state.items()},
                **{f"optim.{k}": v for k, v in optim_state.items() if isinstance(v, torch.Tensor)}}

    def save(side: str, i: int) -> None:
        path = os.path.join(tmp, f"{side}-{i}")
        if side in ("ours", "ours_again"):
            strategy.save(path, model=model, optimizer=opt)
        elif side in ("dcp", "dcp_hashing"):
            writer = hashing_writer(path, f"bench-{i}") if side == "dcp_hashing" else dcp.FileSystemWriter(path)
            dcp.save(dcp_state(), storage_writer=writer)
        else:
            model_state, optim_state = get_state_dict(model, opt, options=full)  # gathers on every rank
            if rank == 0:
                torch.save({"model": model_state, "optim": optim_state}, path + ".pt")

    def load(side: str, i: int) -> None:
        path = os.path.join(tmp, f"{side}-{i}")
        if side in ("ours", "ours_again"):
            strategy.load(path, model=model, optimizer=opt)
        elif side == "dcp":
            state = dcp_state()
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        else:
            state = torch.load(path + ".pt", weights_only=True)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=full)

    def loop(mode: str, i: int) -> float:
        """Seconds per step of LOOP_STEPS steps with one save of ``mode`` at step SAVE_AT (its
        asynchronous one finished at the end of the loop, inside the measured time)."""
        future = None

        def run() -> None:
            nonlocal future
            for step in range(LOOP_STEPS):
                if step == SAVE_AT and mode == "save":
                    strategy.save(os.path.join(tmp, f"loop-{i}"), model=model, optimizer=opt)
                elif step == SAVE_AT and mode == "async_save":
                    future = strategy.async_save(os.path.join(tmp, f"loop-{i}"), model=model, optimizer=opt)
                train_step()
            if future is not None:
                future.result()

        return timed(run) / LOOP_STEPS

    times: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        times.setdefault(key, []).append(value)

    # One unrecorded round first (index `repeats`): the first save's agreements, DCP's planners,
    # the async save's process group and the page cache are warm for every measured repeat.
    for side in SIDES_SAVE:
        save(side, repeats)
    for side in SIDES_LOAD:
        load(side, repeats)
    strategy.async_save(os.path.join(tmp, f"async-{repeats}"), model=model, optimizer=opt).result()
    dist.barrier()
    if rank == 0:
        _remove_repeat(tmp, repeats)
    dist.barrier()
    for i in range(repeats):
        shift = i % len(SIDES_SAVE)
        for side in SIDES_SAVE[shift:] + SIDES_SAVE[:shift]:
            record(f"save/{side}", timed(lambda: save(side, i)))
        shift = i % len(SIDES_LOAD)
        for side in SIDES_LOAD[shift:] + SIDES_LOAD[:shift]:
            record(f"load/{side}", timed(lambda: load(side, i)))
        holder: dict[str, Any] = {}
        record("async/blocking", timed(lambda: holder.setdefault(
            "f", strategy.async_save(os.path.join(tmp, f"async-{i}"), model=model, optimizer=opt))))
        record("async/until_done", timed(lambda: holder["f"].result()) + times["async/blocking"][-1])
        for mode in (("none", "save", "async_save") if i % 2 == 0 else ("async_save", "save", "none")):
            record(f"step/{mode}", loop(mode, i))
        # Hashing on load: the SHA-256 of this rank's share of the files (what a load verifies).
        from polyparallel import _checkpoint_files, _checkpoints

        meta = _checkpoints.read_marker(os.path.join(tmp, f"ours-{i}"))
        share = _checkpoint_files.shares(meta["files"], strategy.session().world_size)[rank]
        record("verify/share", timed(lambda: _checkpoint_files.problems(os.path.join(tmp, f"ours-{i}"), meta, share)))
        dist.barrier()
        if rank == 0 and i > 0:  # keep the disk use bounded; the first repeat's files are measured for bytes
            _remove_repeat(tmp, i)
        dist.barrier()
    if rank != 0:
        return None
    params = sum(p.numel() for p in nn.Sequential(nn.Linear(width, 4 * width), nn.Linear(4 * width, width)).parameters()) * 2
    sizes = {side: _du(os.path.join(tmp, f"{side}-0") + (".pt" if side == "torch_save" else ""))
             for side in SIDES_SAVE}
    return {"width": width, "parameters": params, "repeats": repeats, "times": times, "bytes": sizes}


def _remove_repeat(tmp: str, i: int) -> None:
    for name in os.listdir(tmp):
        if name.endswith((f"-{i}", f"-{i}.pt")):
            full = os.path.join(tmp, name)
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.remove(full)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cell(values: list[float], unit: float = 1e3) -> str:
    s = _stats(values)
    return f"{s['median'] * unit:8.1f} [{s['min'] * unit:.1f}, {s['max'] * unit:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, 3 repeats")
    parser.add_argument("--width", type=int, default=None, help="model width (default 1024, 128 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats (default 7, 3 with --quick)")
    parser.add_argument("--json", default=None, help="also write every measurement here")
    args = parser.parse_args()
    width = args.width or (128 if args.quick else 1024)
    repeats = args.repeats or (3 if args.quick else 7)
    tmp = tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        (row,) = [r for r in pp.launch(_worker, pp.Strategy(data=2, tensor=2, timeout=600), 4,
                                       args=(width, repeats, tmp), timeout=3600) if r is not None]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t, mib = row["times"], 1024 * 1024
    median = {k: statistics.median(v) for k, v in t.items()}
    print(f"data=2 x tensor=2 (4 gloo processes), MLP width {width} ({row['parameters'] / 1e6:.1f} M parameters) + "
          f"Adam; ms, median [min, max] of {repeats}")
    names = {"ours": "Strategy.save/load (A)", "ours_again": "Strategy.save/load (A', control)", "dcp": "DCP directly",
             "dcp_hashing": "DCP + hashing writer", "torch_save": "gathered torch.save"}
    print(f"{'':34}{'save':>28}{'load':>28}{'on disk':>12}{'A / side (save, load)':>26}")
    for side in SIDES_SAVE:
        load = t.get(f"load/{side}")
        ratio_load = f"{median['load/ours'] / median[f'load/{side}']:.2f}" if load else "-"
        print(f"{names[side]:34}{_cell(t[f'save/{side}']):>28}{_cell(load) if load else '-':>28}"
              f"{row['bytes'][side] / mib:>8.2f} MiB{median['save/ours'] / median[f'save/{side}']:>14.2f}, {ratio_load}")
    hashing = median["save/dcp_hashing"] - median["save/dcp"]
    print(f"hashing while writing: {hashing * 1e3:+.1f} ms a save ({hashing / median['save/dcp'] * 100:+.0f}% of DCP's "
          f"save); verifying on load (each rank hashes its share): {_cell(t['verify/share'])} ms")
    print(f"async_save: blocks {_cell(t['async/blocking'])} ms, done after {_cell(t['async/until_done'])} ms "
          f"(sync save {median['save/ours'] * 1e3:.1f} ms)")
    base = median["step/none"]
    for mode in ("save", "async_save"):
        lost = (median[f"step/{mode}"] - base) * LOOP_STEPS
        print(f"step time with one {mode:<10} in {LOOP_STEPS} steps: {_cell(t[f'step/{mode}'])} ms a step "
              f"(no save: {base * 1e3:.1f}); time lost to the save: {lost * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
