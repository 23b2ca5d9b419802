"""The topology advisor against real runs: does its ranking pick the fastest topology here?

For each example model (``examples/advisor_models.py``: an MLP and a small transformer) on
``--world`` gloo processes: measure the links (as ``polyparallel bench-comm`` does, into a
temporary cache), estimate every accepted topology (as ``polyparallel plan --model`` does), run
the ``--top`` best estimated ones for real, and print estimated vs measured step time and memory
(parameters + gradients + optimizer state of the largest rank), and whether the estimated best is
the measured fastest.

    python benchmarks/bench_advisor.py [--quick] [--world 4] [--top 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples.advisor_models, in the spawned ranks too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and candidates (a smoke run)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--top", type=int, default=4, help="candidates measured per model")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    os.environ["POLYPARALLEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="pp-advisor-")  # never the user's cache

    import polyparallel as pp
    from polyparallel._advisor import advise, load_links, save_links
    from polyparallel_torch.advisor import TorchAdvisor

    advisor = TorchAdvisor()
    steps, top = (3, min(args.top, 3)) if args.quick else (10, args.top)
    save_links(args.world, advisor.bench_comm(args.world, [4096, 262144, 4194304], 5 if args.quick else 20, 600))
    links = load_links(args.world)
    print(f"links: all-reduce {links.allreduce_busbw / 1e9:.3f} GB/s, all-gather {links.allgather_busbw / 1e9:.3f} GB/s, "
          f"latency {links.latency * 1e6:.0f} us, {links.flops / 1e9:.1f} GFLOP/s per rank")
    runtime = pp.get_plugin_manager().runtimes()["torch"]

    def check(topology: pp.Topology, stage: int) -> str | None:
        try:
            runtime.check(topology, stage)
        except pp.PolyparallelError as exc:
            return str(exc)
        return None

    figures = []
    for spec, batch, seq in (("examples.advisor_models:mlp", 32, None), ("examples.advisor_models:transformer", 8, 32)):
        profile = advisor.profile(spec, batch, seq)
        assert profile is not None
        accepted = [c for c in advise(profile, args.world, batch, [0, 1, 2, 3], links, check) if c.refused is None]
        chosen = accepted[:top]
        measured = advisor.measure(spec, batch, seq, [(c.topology, c.stage) for c in chosen], steps, "adam", 600)
        print(f"\n{spec}  world {args.world}  batch {batch}" + (f"  seq {seq}" if seq else ""))
        print(f"{'topology':36} {'est ms':>8} {'measured ms':>12} {'est MiB':>8} {'measured MiB':>13}")
        rows = []
        for c, m in zip(chosen, measured):
            est_mem = sum(c.memory[k] for k in ("parameters", "gradients", "optimizer"))
            got_mem = sum(m["memory_max"].values())
            rows.append({"topology": c.label(), "estimated_step_s": c.step_s, "measured_step_s": m["step_s"],
                         "estimated_bytes": est_mem, "measured_bytes": got_mem})
            print(f"{c.label():36} {c.step_s * 1e3:8.2f} {m['step_s'] * 1e3:12.2f} {est_mem / 2**20:8.2f} "
                  f"{got_mem / 2**20:13.2f}")
        fastest = min(rows, key=lambda r: r["measured_step_s"])["topology"]
        right = fastest == rows[0]["topology"]
        print(f"estimated best: {rows[0]['topology']}; measured fastest: {fastest}; top choice right: "
              f"{'yes' if right else 'no'}")
        figures.append({"model": spec, "world": args.world, "rows": rows, "top_choice_right": right})
    if args.json:
        Path(args.json).write_text(json.dumps({"links": vars(links), "models": figures}, indent=2))


if __name__ == "__main__":
    main()
