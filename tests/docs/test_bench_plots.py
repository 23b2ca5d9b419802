"""``tools/bench_plots.py``: the Benchmarks page's figures and table from the benchmarks' JSON.

The inputs have the shapes the benchmarks write with ``--json`` (``benchmarks/bench_lightning.py``,
``bench_fastai.py``): a change there that the plot script does not follow fails here.
"""

from __future__ import annotations

import importlib.util
import json
import sys

from .codeblocks import ROOT

spec = importlib.util.spec_from_file_location("bench_plots", ROOT / "tools" / "bench_plots.py")
bench_plots = importlib.util.module_from_spec(spec)
sys.modules["bench_plots"] = bench_plots  # its dataclasses look their module up
spec.loader.exec_module(bench_plots)


def test_figures_and_table_from_results(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    (results / "lightning.json").write_text(json.dumps({
        "benchmark": "Lightning step", "rounds": 4, "adapter_ms": 5.0, "lightning_ddp_ms": 5.1, "ratio_ddp_over_adapter": 1.02,
        "ratio_per_round_median": 1.01, "ratio_per_round_min": 0.95, "ratio_per_round_max": 1.08}))
    (results / "fastai.json").write_text(json.dumps({
        "rounds_ms": {}, "ratio": [1.2, 1.3, 1.4], "same_work_ratio": [0.9, 1.0, 1.1], "control_ratio": [0.98, 1.0, 1.02], "rounds": 3,
        "per_rank": []}))
    bench_plots.main(["--results", str(results), "--out", str(out)])
    assert (out / "lightning.png").read_bytes()[:4] == b"\x89PNG" and (out / "fastai.png").exists()
    table = (out / "results.md").read_text()
    assert "| lightning | Lightning adapter vs Lightning's own ddp | 1.02 | 0.95-1.08 | - |" in table
    assert "| fastai | fastai callback vs a hand-written DDP callback (same work) | 1.00 | 0.90-1.10 | 1.00 (0.98-1.02) |" in table
    assert "![lightning: Lightning adapter vs Lightning's own ddp](assets/benchmarks/lightning.png)" in table
    assert "No results for `ignite.json`, `deepspeed.json`, `jax.json`, `sharding.json`" in table
