"""The torch runtime: groups shared by every session with the same group definition, teardown
that leaves others' groups alone, identity checks of every operation, and the broken state."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.identity_checks import hash62
from polyparallel_torch.launchers.base import free_port
from polyparallel_torch.runtime import get_runtime, runtime_key


# -- single process ------------------------------------------------------------------------------------
def test_runtime_key_is_what_defines_the_groups():
    s = pp.Strategy(data=1, timeout=30)
    same = [s.replace(seed=7), s.replace(metric_policy=pp.MetricPolicy("sum")), s.replace(state_policy={"*": "mean"}),
            s.replace(grad_policy=pp.GradPolicy(bucket_mb=1))]
    assert {runtime_key(x.session()) for x in [s, *same]} == {runtime_key(s.session())}
    assert runtime_key(s.replace(timeout=31).session()) != runtime_key(s.session())
    assert runtime_key(s.replace(backend="gloo").session())[2] == "gloo"


def test_sessions_share_one_runtime_until_the_last_closes():
    s = pp.Strategy(data=1, timeout=30)
    other = s.replace(seed=1)
    rt = get_runtime(s.session())
    assert get_runtime(other.session()) is rt
    s.session().close()
    assert not rt.closed and get_runtime(other.session()) is rt
    assert other.reduce_metrics({"loss": pp.Mean(3.0, 2)})["loss"] == 1.5  # still usable
    other.session().close()
    assert rt.closed
    assert get_runtime(s.session()) is not rt  # a later session builds a fresh one


def test_broken_runtime_refuses_every_operation_and_says_why():
    s = pp.Strategy(data=1, timeout=30)
    rt = get_runtime(s.session())
    rt.mark_broken("reduce_metrics over the 'data' axis did not complete within 3 s")
    rt.mark_broken("a later failure")  # the first reason is kept
    assert rt.broken == "reduce_metrics over the 'data' axis did not complete within 3 s"
    model = nn.Linear(2, 2)
    calls = [lambda: s.reduce_metrics({"loss": 1.0}), lambda: s.sync_grads(model), lambda: s.sync_states(model),
             lambda: s.sync_grads([torch.ones(2)])]
    for call in calls:
        with pytest.raises(pp.CollectiveError, match=r"(?s)broken since an earlier collective failed "
                                                      r"\(reduce_metrics over .* within 3 s\).*Restart the processes"):
            call()


def test_identity_hash_is_the_same_in_every_process():
    # Python's hash() of a str is salted per process: two ranks would never agree with it.
    code = "from polyparallel_torch.identity_checks import hash62; print(hash62('sync_grads\\0data\\x003\\0layout'))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               timeout=120, check=True).stdout)
    assert other == hash62("sync_grads\0data\x003\0layout")
    assert 0 <= other < 2**62


@pytest.mark.parametrize("backend, match", [
    # refused by the core: no installed runtime declares it
    ("bogus", r"Strategy\(backend='bogus'\) is a backend of no installed runtime .*torch: gloo, nccl"),
    # a CPU-only build has no nccl at all; a CUDA build on a machine without a GPU has no device
    pytest.param("nccl", r"'nccl'.*(needs CUDA devices|available here: gloo)", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA: nccl can run")),
])
def test_a_backend_torch_cannot_run_is_refused_before_any_group(monkeypatch, backend, match):
    # Rank 0 of a 2-process world that was never started (no MASTER_ADDR): an error raised here
    # came before any collective or rendezvous.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(pp.TopologyError, match=match):
        pp.Strategy(data=2, backend=backend, timeout=5).reduce_metrics({"x": 1.0})


def test_a_list_with_none_is_refused_on_one_process_too():
    with pytest.raises(pp.PluginError, match=r"None at position\(s\) \[1\].*Pass the module"):
        pp.Strategy(data=1).sync_grads([torch.ones(2), None])


# -- groups shared, teardown scoped ---------------------------------------------------------------------
def _sharing_worker(launched: pp.Strategy) -> dict:
    import torch.distributed as dist

    pg_map = dist.distributed_c10d._world.pg_map
    rank = launched.rank
    rt = get_runtime(launched.session())
    groups = len(pg_map)
    seeded = launched.replace(seed=1)
    out = {"same_runtime": get_runtime(seeded.session()) is rt,
           "same_group": get_runtime(seeded.session()).group("data") is rt.group("data"),
           "new_groups": len(pg_map) - groups}
    # Only rank 0 uses the re-seeded strategy: it must not build groups of its own (which would hang).
    out["mixed"] = (seeded if rank == 0 else launched).reduce_metrics({"x": float(rank)})["x"]
    # Policies come from the strategy of each call, not from the runtime's first strategy.
    out["sum"] = launched.replace(metric_policy=pp.MetricPolicy("sum")).reduce_metrics({"x": 1.0})["x"]
    states = {"ema": torch.tensor([float(rank)])}
    launched.replace(state_policy={"*": "mean"}).sync_states(states)  # the default would broadcast
    out["mean_state"] = states["ema"].item()
    out["still_one_runtime"] = len({id(get_runtime(x.session())) for x in launched.plugin_manager._sessions})
    # Closing the session that created the default group leaves the others working.
    launched.session().close()
    out["after_close"] = seeded.reduce_metrics({"x": float(rank)})["x"]
    out["initialised_after_close"] = dist.is_initialized()
    launched.plugin_manager.close_sessions()
    # polyparallel made the default group and nobody uses it any more: all of it is gone.
    out["initialised_at_end"] = dist.is_initialized()
    out["groups_at_end"] = len(pg_map)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_strategies_differing_in_seed_share_groups_and_teardown_is_counted(run):
    launched = pp.Strategy(data=2, timeout=20)
    for r in run(_sharing_worker, launched, 2, launched, timeout=150):
        assert r["same_runtime"] and r["same_group"] and r["new_groups"] == 0, r
        assert r["mixed"] == 0.5 and r["sum"] == 2.0 and r["mean_state"] == 0.5 and r["after_close"] == 0.5, r
        assert r["still_one_runtime"] == 1, r
        assert r["initialised_after_close"], r
        assert not r["initialised_at_end"] and r["groups_at_end"] == 0, r


_USER_SCRIPT = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    import polyparallel as pp

    # The user's own default group (as torchrun-started code, Lightning or idist.Parallel make it).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    pg_map = dist.distributed_c10d._world.pg_map
    s = pp.Strategy(data=2, timeout=30)
    value = s.reduce_metrics({"x": float(dist.get_rank())})["x"]
    made = len(pg_map)
    pp.get_plugin_manager().close_sessions()
    t = torch.ones(1)
    dist.all_reduce(t)  # the user's group still works
    left = len(pg_map)
    # Without a backend override, DeviceMesh uses the default group itself for a dimension that
    # spans the world: tearing that dimension's group down must leave WORLD alone.
    import polyparallel_torch.process_groups as process_groups
    import polyparallel_torch.runtime as runtime
    process_groups.subgroup_options = lambda backend, timeout: None
    s = pp.Strategy(data=2, timeout=31)
    aliased = runtime.get_runtime(s.session()).group("data") is dist.group.WORLD
    value2 = s.reduce_metrics({"x": 2.0 * dist.get_rank()})["x"]
    pp.get_plugin_manager().close_sessions()
    t2 = torch.ones(1)
    dist.all_reduce(t2)
    print(json.dumps({"value": value, "made": made, "left": left, "initialised": dist.is_initialized(),
                      "user_sum": t.item(), "aliased": aliased, "value2": value2, "user_sum2": t2.item()}))
    dist.destroy_process_group()
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_default_group_of_the_user_survives_our_teardown(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(_USER_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["value"] == 0.5 and r["initialised"] and r["user_sum"] == 2.0, r
        # our mesh sub-groups were destroyed, the user's default group was not
        assert r["made"] > 1 and r["left"] == 1, r
        assert r["value2"] == 1.0 and r["user_sum2"] == 2.0, r
        # torch 2.13's DeviceMesh reuses the default group for a dimension spanning the world (the
        # case this checks); torch 2.9's (the XLA lane) makes a group of its own, which is torn down.
        assert r["aliased"] or torch.__version__ < "2.13", r


# -- operations out of step; the broken runtime ----------------------------------------------------------
def _fails(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what every rank saw is the result
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def _out_of_step_worker() -> dict:
    import torch.distributed as dist

    rank = pp.Strategy(data=2).rank
    out = {}
    # (a) sync_states on rank 0, sync_grads on rank 1, same sizes: before, silently averaged.
    s = pp.Strategy(data=2, timeout=20)
    state = {"bn.running_mean": torch.full((4,), 1.0)}
    grads = [torch.full((4,), 2.0)]
    out["a"] = _fails(lambda: s.sync_states(state) if rank == 0 else s.sync_grads(grads))
    out["a_values"] = state["bn.running_mean"].tolist() if rank == 0 else grads[0].tolist()
    out["a_then"] = _fails(lambda: s.reduce_metrics({"x": 1.0}))  # broken now: refused at once
    # (b) rank 1 skips one sync_grads of three, then both reduce metrics: reported at the pairing
    # of two different operations, naming both, instead of a timeout naming one.
    s = pp.Strategy(data=2, timeout=21)
    model = nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()

    def loop() -> None:
        for step in range(3):
            if not (rank == 1 and step == 1):
                s.sync_grads(model)
        s.reduce_metrics({"loss": 1.0})

    out["b"] = _fails(loop)
    # (c) a timeout breaks the runtime; every later collective on it is refused at once, and
    # closing it destroys no group (a peer may still wait in one).
    s = pp.Strategy(data=2, timeout=3)
    get_runtime(s.session())  # the groups, on both ranks (making them is collective too)
    if rank == 0:
        out["c"] = _fails(lambda: s.reduce_metrics({"x": 1.0}))
        out["c_broken"] = get_runtime(s.session()).broken
        out["c_then"] = _fails(lambda: s.sync_states({"ema": torch.ones(2)}))
    else:
        time.sleep(5)
        out["c"] = _fails(lambda: s.reduce_metrics({"x": 1.0}))
    # (f) pipeline stages at different steps (one trains, one evaluates): named, not a hang.
    s = pp.Strategy(pipeline=2, timeout=27)
    model = s.wrap_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), loss_fn=nn.functional.mse_loss)
    x, y = torch.ones(2, 4), torch.zeros(2, 2)
    out["f"] = _fails(lambda: model.train_step(x, y) if rank == 0 else model.eval_step(x))
    # (d) GradPolicy(check=False): sync_grads without its check, same result.
    s = pp.Strategy(data=2, timeout=23, grad_policy=pp.GradPolicy(check=False))
    grads = [torch.full((3,), float(rank))]
    s.sync_grads(grads)
    out["d"] = grads[0].tolist()
    out["d_seq"] = dict(get_runtime(s.session())._seq)  # only the runtime's start was checked
    # (e) ranks that make their runtimes differently (the timeout) are told so at once.
    out["e_timeout"] = _fails(lambda: pp.Strategy(data=2, timeout=25 + rank).reduce_metrics({"x": 1.0}))
    pp.get_plugin_manager().close_sessions()
    out["initialised_after_close"] = dist.is_initialized()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_operations_out_of_step_and_broken_runtime(run):
    r0, r1 = run(_out_of_step_worker, pp.Strategy(data=2, timeout=30), 2, timeout=150)
    for r in (r0, r1):
        assert r["a"]["type"] == "CollectiveError", r["a"]
        assert "sync_states #1 on rank 0" in r["a"]["message"] and "sync_grads #1 on rank 1" in r["a"]["message"]
        assert r["a"]["elapsed"] < 15, r["a"]
        assert r["a_then"]["type"] == "CollectiveError" and "broken" in r["a_then"]["message"]
        assert r["a_then"]["elapsed"] < 1
        assert r["b"]["type"] == "CollectiveError" and r["b"]["elapsed"] < 15, r["b"]
        assert "sync_grads #3" in r["b"]["message"] and "reduce_metrics #3" in r["b"]["message"], r["b"]
        assert r["initialised_after_close"]  # a broken runtime destroys no group when it closes
    assert r0["a_values"] == [1.0] * 4 and r1["a_values"] == [2.0] * 4  # no payload was exchanged
    assert "reduce_metrics #3 on rank 1 vs sync_grads #3 on rank 0" in r1["b"]["message"]
    assert r0["c"]["type"] == "CollectiveTimeout" and "reduce_metrics #1" in r0["c"]["message"], r0["c"]
    assert r0["c_broken"] and "did not complete" in r0["c_broken"]
    assert r0["c_then"]["type"] == "CollectiveError" and r0["c_then"]["elapsed"] < 1
    assert "broken" in r0["c_then"]["message"] and "Restart the processes" in r0["c_then"]["message"]
    assert r1["c"]["type"] in ("CollectiveTimeout", "CollectiveError"), r1["c"]
    for r in (r0, r1):
        assert r["f"]["type"] == "CollectiveError" and r["f"]["elapsed"] < 15, r["f"]
        assert "pipeline train_step (GPipe) #1 on rank 0" in r["f"]["message"], r["f"]
        assert "pipeline eval_step (GPipe) #1 on rank 1" in r["f"]["message"], r["f"]
        assert r["d"] == [0.5] * 3 and r["d_seq"] == {"world": 1}, r
        for case, sides in (("e_timeout", ("timeout 25 s", "timeout 26 s")),):
            assert r[case]["type"] == "CollectiveError", r[case]
            assert "start the torch runtime #1" in r[case]["message"], r[case]
            assert all(side in r[case]["message"] for side in sides), r[case]
