"""``polyparallel/_advisor.py``: the framework-free estimator, candidates and the link cache.

The formulas are checked on hand-made profiles whose figures can be worked out by hand; the
estimate against measured runs is in ``tests/torch_plugin/test_advisor.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyparallel import Topology
from polyparallel._advisor import (
    LayerProfile,
    LinkModel,
    ModelProfile,
    RuntimeTraits,
    advise,
    cache_path,
    candidates,
    estimate,
    load_links,
    resolve_factory,
    save_links,
)

LINKS = LinkModel(allreduce_busbw=1e9, allgather_busbw=5e8, latency=0.0, flops=1e9, source="test")


def two_layers(traits: RuntimeTraits | None = None) -> ModelProfile:
    # layer a: 1000 B split over tensor + 200 B replicated; layer b: 600 B and 200 B replicated
    a = LayerProfile("a", ((1000, True), (200, False)), act_bytes=10, act_tensor_bytes=40, out_bytes=8,
                     flops=1e6, tensor_split=True, tensor_allreduce_bytes=16, tensor_allreduces=2)
    b = LayerProfile("b", ((600, False), (200, False)), act_bytes=20, out_bytes=4, flops=2e6)
    return ModelProfile("m", "rt", [a, b], pipeline_cuts={2: (1,)}, microbatches={2: 2},
                        traits=traits or RuntimeTraits())


def test_candidates_cover_every_factorisation_and_skip_sharding_without_data():
    got = candidates(4, [0, 1, 2, 3])
    tops = {(t.size("pipeline"), t.size("data"), t.size("tensor")) for t, _ in got}
    assert tops == {(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 2), (4, 1, 1)}
    assert all(stage == 0 or t.size("data") > 1 for t, stage in got)
    assert len(got) == 3 * 4 + 3  # three topologies with data > 1 at 4 stages, three at stage 0
    assert {(t.size("data"), s) for t, s in candidates(4, [2], {"tensor": 2})} == {(2, 2)}


def test_replicated_data_parallel_memory_and_all_reduce_volume():
    c = estimate(two_layers(), Topology(data=2), 0, batch=8, links=LINKS, optimizer_states=2)
    P = 2000
    assert c.memory["parameters"] == c.memory["gradients"] == P
    assert c.memory["optimizer"] == 2 * P
    assert c.memory["activations"] == 4 * (10 + 40 + 20)  # 4 samples per data rank
    assert c.memory["buffers"] == P  # DDP's flat buckets: one copy of the gradients
    assert c.comm_bytes["data"] == 2 * (2 - 1) / 2 * P
    assert c.time_s["data"] == pytest.approx(P / 1e9)
    assert c.time_s["compute"] == pytest.approx(4 * 3e6 / 1e9)


def test_sharding_stages_divide_what_the_runtime_declares():
    zero = {s: estimate(two_layers(), Topology(data=4), s, 8, LINKS) for s in (1, 2, 3)}
    assert zero[1].memory["optimizer"] == 2 * 2000 / 4 and zero[1].memory["gradients"] == 2000
    assert zero[2].memory["gradients"] == 500 and zero[2].memory["parameters"] == 2000
    assert zero[3].memory["parameters"] == 500
    assert zero[2].comm_bytes["data"] == 2 * 3 / 4 * 2000  # reduce-scatter + one all-gather
    assert zero[3].comm_bytes["data"] == 3 * 3 / 4 * 2000  # and the all-gather again in backward
    # A runtime that frees gathered parameters at stage 2 too (torch's FSDP2), and gives stage 1
    # whole parameters greedily: 1200, 800, 200 (split) ... over 2 ranks.
    traits = RuntimeTraits(sharded_at_rest={**RuntimeTraits().sharded_at_rest,
                                            2: frozenset({"optimizer", "gradients", "parameters"})},
                           stage1_whole_params=True)
    assert estimate(two_layers(traits), Topology(data=4), 2, 8, LINKS).memory["parameters"] == 500
    greedy = estimate(two_layers(traits), Topology(data=2), 1, 8, LINKS)
    assert greedy.memory["optimizer"] == 2 * 1000  # [1000] on one rank, [600, 200, 200] on the other


def test_tensor_parallel_splits_the_split_parts_and_all_reduces_activations():
    c = estimate(two_layers(), Topology(tensor=2), 0, 8, LINKS)
    assert c.memory["parameters"] == 500 + 200 + 800
    assert c.memory["activations"] == 8 * (10 + 20 + 40 / 2)
    assert c.comm_bytes["tensor"] == 2 * 1 / 2 * 8 * 16
    assert c.time_s["compute"] == pytest.approx(8 * (1e6 / 2 + 2e6) / 1e9)


def test_pipeline_reports_the_fullest_stage_and_the_slowest_step():
    c = estimate(two_layers(), Topology(pipeline=2), 0, 8, LINKS)
    assert c.microbatches == 2
    assert c.memory["parameters"] == 1200  # stage 0 holds layer a, the larger one
    assert c.comm_bytes["pipeline"] == 8 * 8  # its output, forward (the gradient comes back to it)
    # stage 1 is slower: 2e6 FLOPs per sample, times GPipe's bubble (m + p - 1) / m
    assert c.step_s >= 8 * 2e6 / 1e9 * 3 / 2


def test_advise_ranks_accepted_and_lists_refused_with_reasons():
    profile = two_layers()
    profile.refuse = lambda t, s: "no pipeline here" if t.size("pipeline") > 1 else None
    rows = advise(profile, 2, 6, [0, 3], LINKS, lambda t, s: "tensor unsupported" if t.size("tensor") > 1 else None)
    accepted = [r for r in rows if r.refused is None]
    assert [r.step_s for r in accepted] == sorted(r.step_s for r in accepted)
    assert {(r.topology.size("data"), r.stage) for r in accepted} == {(2, 0), (2, 3)}
    reasons = {r.label(): r.refused for r in rows if r.refused}
    assert reasons == {"data=1 tensor=2 pipeline=1 zero=0": "tensor unsupported",
                       "data=1 tensor=1 pipeline=2 zero=0": "no pipeline here"}
    odd = advise(two_layers(), 2, 5, [0], LINKS, lambda t, s: None)
    assert "does not divide over data=2" in next(r.refused for r in odd if r.topology.size("data") == 2)


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("POLYPARALLEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "polyparallel" / "comm.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == tmp_path / "home" / ".cache" / "polyparallel" / "comm.json"
    monkeypatch.setenv("POLYPARALLEL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_path() == tmp_path / "mine" / "comm.json"


def test_links_round_trip_and_defaults_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYPARALLEL_CACHE_DIR", str(tmp_path))
    absent = load_links(4)
    assert absent == LinkModel(source=absent.source) and "polyparallel bench-comm --world 4" in absent.source
    save_links(2, {"allreduce_busbw": 2e9, "allgather_busbw": 1e9, "latency": 1e-5, "flops": 3e10, "table": {}})
    got = load_links(2)
    assert (got.allreduce_busbw, got.allgather_busbw, got.latency, got.flops) == (2e9, 1e9, 1e-5, 3e10)
    assert "measured" in got.source and "not" not in got.source
    assert "measured on 2 ranks, not 8" in load_links(8).source
    (tmp_path / "comm.json").write_text("{not json")
    assert load_links(2).source.startswith("defaults")


def test_importing_polyparallel_writes_no_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(sys.path)}
    code = "import polyparallel, polyparallel.cli, polyparallel._advisor; print(polyparallel._advisor.cache_path())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(tmp_path / "xdg" / "polyparallel" / "comm.json")
    assert list(tmp_path.iterdir()) == []


def test_a_factory_importing_from_the_current_directory_when_called_still_works(tmp_path, monkeypatch):
    (tmp_path / "lazy_models.py").write_text("def net():\n    from lazy_layers import width\n    return width\n")
    (tmp_path / "lazy_layers.py").write_text("width = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    factory = resolve_factory("lazy_models:net")
    assert sys.path == before
    assert factory() == 7 and sys.path == before


def test_resolve_factory_names_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text("def net():\n    return 'net'\nvalue = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert resolve_factory("my_models:net")() == "net"  # found from the current directory, as python -m does
    assert sys.path == before  # the current directory was on it for the import only
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        resolve_factory("my_models")
    with pytest.raises(ValueError, match="cannot import 'nowhere_models'"):
        resolve_factory("nowhere_models:net")
    with pytest.raises(ValueError, match="no callable 'value'"):
        resolve_factory("my_models:value")
    json.dumps(two_layers().summary())  # JSON-ready
