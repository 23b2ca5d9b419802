"""Checkpoint save/load time and size: ``Strategy.save``/``load`` (DCP, each rank writes its own
shards, atomic commit) against the hand-written alternative, ``torch.save`` of a gathered state
dict on rank 0 (every rank gathers the full model and optimizer state; every rank then reads the
file with ``torch.load(weights_only=True)`` and keeps its shards), at data=2 x tensor=2.

    python benchmarks/bench_checkpoint.py [--quick] [--width 1024] [--json results.json]

Model: an MLP of ``Linear(width, 4*width)`` / ``Linear(4*width, width)`` pairs (the default
tensor-parallel plan shards them), Adam after one step (its two moments per parameter). The two
sides run alternately in the same 4 gloo processes, so machine noise hits both alike; times are
medians, wall clock from a barrier to a barrier. Ratios > 1 mean polyparallel is faster. Bytes
are what each side leaves on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import polyparallel as pp


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _worker(width: int, repeats: int, tmp: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    strategy = pp.Strategy(data=2, tensor=2, timeout=300)
    torch.manual_seed(0)
    model = strategy.wrap_model(nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width),
                                              nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    strategy.sync_grads(model)
    opt.step()
    full = StateDictOptions(full_state_dict=True)
    rank = strategy.rank

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def ours_save(i: int) -> None:
        strategy.save(os.path.join(tmp, f"ours-{i}"), model=model, optimizer=opt)

    def ours_load(i: int) -> None:
        strategy.load(os.path.join(tmp, f"ours-{i}"), model=model, optimizer=opt)

    def native_save(i: int) -> None:
        model_state, optim_state = get_state_dict(model, opt, options=full)  # gathers on every rank
        if rank == 0:
            torch.save({"model": model_state, "optim": optim_state}, os.path.join(tmp, f"native-{i}.pt"))

    def native_load(i: int) -> None:
        state = torch.load(os.path.join(tmp, f"native-{i}.pt"), weights_only=True)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=full)

    times: dict[str, list[float]] = {k: [] for k in ("ours_save", "native_save", "ours_load", "native_load")}
    for i in range(repeats):
        times["ours_save"].append(timed(lambda: ours_save(i)))
        times["native_save"].append(timed(lambda: native_save(i)))
        times["ours_load"].append(timed(lambda: ours_load(i)))
        times["native_load"].append(timed(lambda: native_load(i)))
    if rank != 0:
        return None
    params = sum(p.numel() for p in nn.Sequential(nn.Linear(width, 4 * width), nn.Linear(4 * width, width)).parameters()) * 2
    return {"width": width, "parameters": params, "repeats": repeats,
            **{k: statistics.median(v) for k, v in times.items()},
            "ours_bytes": _du(os.path.join(tmp, "ours-0")), "native_bytes": _du(os.path.join(tmp, "native-0.pt"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, 2 repeats")
    parser.add_argument("--width", type=int, default=None, help="model width (default 1024, 256 with --quick)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    width = args.width or (256 if args.quick else 1024)
    repeats = 2 if args.quick else 7
    tmp = tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        (row,) = [r for r in pp.launch(_worker, pp.Strategy(data=2, tensor=2, timeout=300), 4, args=(width, repeats, tmp),
                                       timeout=1200) if r is not None]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mib = 1024 * 1024
    print(f"data=2 x tensor=2, MLP width {width} ({row['parameters'] / 1e6:.1f} M parameters) + Adam, "
          f"median of {repeats}")
    print(f"{'':8}{'Strategy.save/load (DCP)':>26}{'torch.save, gathered':>24}{'ratio':>8}")
    for what in ("save", "load"):
        ours, native = row[f"ours_{what}"], row[f"native_{what}"]
        print(f"{what:8}{ours * 1e3:>23.1f} ms{native * 1e3:>21.1f} ms{native / ours:>8.2f}")
    print(f"{'on disk':8}{row['ours_bytes'] / mib:>22.2f} MiB{row['native_bytes'] / mib:>20.2f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
