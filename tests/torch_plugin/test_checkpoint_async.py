"""``Strategy.async_save`` of the torch runtime (plugins/polyparallel_torch/checkpoint_async.py), in
real gloo processes: training goes on while the files are written; the checkpoint holds the
state at the call; the commit comes only after every rank's files are written; a failure in the
background is the same CheckpointError on every rank (and is never lost: the next save raises an
unretrieved one); a job that ends with a save in flight leaves it committed or unpublished,
never half committed."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel_torch.tensors import full_state


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _async_worker(tmp: str):
    import resource
    import signal

    strategy = pp.Strategy(data=2, timeout=30)
    model = strategy.wrap_model(_net(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()

    step()
    at_save = full_state(model)
    future = strategy.async_save(f"{tmp}/step-1", model=model, optimizer=opt)
    step()  # training goes on at once: the checkpoint holds the state at the call
    step()
    assert future.result(timeout=120) == f"{tmp}/step-1" and future.done()
    fresh = strategy.wrap_model(_net(1))
    strategy.load(f"{tmp}/step-1", model=fresh)
    loaded = full_state(fresh)

    # A failure in the background (rank 1 cannot write its shard) is every rank's CheckpointError.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # 64 KiB: rank 1's JSON file (written before the call returns) fits, its DCP shard does not.
    if strategy.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    failed = strategy.async_save(f"{tmp}/step-2", model=model, optimizer=opt)
    try:
        failed.result(timeout=120)
        outcome = ["saved", ""]
    except Exception as exc:
        outcome = [type(exc).__name__, str(exc)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    torch.distributed.barrier()
    listing = sorted(os.listdir(tmp))
    torch.distributed.barrier()

    # Unretrieved: the next save raises it (on every rank) instead of starting.
    if strategy.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    strategy.async_save(f"{tmp}/step-3", model=model)
    try:
        strategy.save(f"{tmp}/step-4", model=model)  # waits for step-3, which failed unobserved
        unobserved = ["saved", ""]
    except Exception as exc:
        unobserved = [type(exc).__name__, str(exc)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    # A load in between waits for the failed save but leaves its error to the next save.
    if strategy.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    strategy.async_save(f"{tmp}/step-5", model=model)
    try:
        strategy.load(f"{tmp}/step-1", model=fresh)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        strategy.save(f"{tmp}/step-6", model=model)
        after_load = "saved"
    except Exception as exc:
        after_load = str(exc)

    # A manager of asynchronous saves keeps the newest two.
    manager = pp.CheckpointManager(strategy, f"{tmp}/managed", keep=2, asynchronous=True)
    for n in range(4):
        manager.save(n, model=model)
        step()
    manager.wait()
    torch.distributed.barrier()  # rank 0 applies the retention
    kept = sorted(os.listdir(f"{tmp}/managed"))
    # The job ends with a save in flight: it is committed before the runtime closes.
    last = full_state(model)
    strategy.async_save(f"{tmp}/last", model=model, optimizer=opt)
    return {"rank": strategy.rank, "at_save": at_save, "loaded": loaded, "outcome": outcome, "listing": listing,
            "unobserved": unobserved, "after_load": after_load, "kept": kept, "last": last}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_async_save_commits_after_every_write_and_fails_alike(run, tmp_path):
    results = run(_async_worker, pp.Strategy(data=2, timeout=30), 2, str(tmp_path), timeout=300)
    for r in results:
        for name, value in r["at_save"].items():
            torch.testing.assert_close(r["loaded"][name], value, rtol=0, atol=0, msg=name)
        assert r["outcome"][0] == "CheckpointError", r["outcome"]
        assert "failed on rank 1" in r["outcome"][1] and "File too large" in r["outcome"][1], r["outcome"]
        assert r["unobserved"][0] == "CheckpointError" and "no one retrieved its error" in r["unobserved"][1], r
        assert "no one retrieved its error" in r["after_load"] and "step-5" in r["after_load"], r["after_load"]
        assert r["kept"] == ["step-00000002", "step-00000003"], r["kept"]
    assert results[0]["outcome"] == results[1]["outcome"]
    assert results[0]["listing"] == ["step-1"], "the failed save's staging directory stays"
    assert not (tmp_path / "step-4").exists() and not (tmp_path / "step-6").exists()
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
    model = _net(2)
    pp.Strategy(data=1).load(str(tmp_path / "last"), model=model)
    for name, value in results[0]["last"].items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_a_process_killed_during_an_async_save_never_publishes_half_a_checkpoint(tmp_path):
    script = textwrap.dedent(f"""
        import os, torch, polyparallel as pp
        strategy = pp.Strategy(data=1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        strategy.save({str(tmp_path / 'step-1')!r}, model=model)
        strategy.async_save({str(tmp_path / 'step-2')!r}, model=model)
        os._exit(0)  # killed: no interpreter shutdown, no runtime close
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # Either the save finished before the kill (committed, and every file verifies) or it is not
    # published at all; never a directory at step-2 that is half written.
    latest = pp.latest_checkpoint(tmp_path)
    assert latest in (str(tmp_path / "step-1"), str(tmp_path / "step-2"))
    if (tmp_path / "step-2").exists():
        from polyparallel import _checkpoints

        _checkpoints.verify_files(str(tmp_path / "step-2"), _checkpoints.read_marker(str(tmp_path / "step-2")))
    else:  # at most its staging directory, which nothing loads
        assert all(".partial-" in n for n in os.listdir(tmp_path) if n.startswith("step-2")), os.listdir(tmp_path)
