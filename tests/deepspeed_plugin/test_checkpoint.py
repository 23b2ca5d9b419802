"""strategy.save / strategy.load of a DeepSpeed engine, in the torch runtime's format: real gloo
processes, few launches (DeepSpeed's first initialize in a process costs seconds).

- ZeRO 0-3 at data=2: save -> load into a fresh engine (another initialisation): parameters and
  optimizer state equal, and both engines continue alike (same batches, the loader restored);
  the refusals, on every rank before any collective.
- ZeRO-3 at data=2 -> FSDP2 (torch runtime, zero=3) at data=4 -> a plain module in this process:
  parameters and optimizer state to 1e-6; the plain loop resumes the DeepSpeed run.
- pipeline=2 x data=2 (ZeRO-1) -> a plain nn.Sequential, and back into a fresh pipeline engine.
- The format's version 2 at ZeRO-3 data=2: async_save (the engine trains on while the files are
  written; what loads is the state at the call), CheckpointManager(keep=2, asynchronous), partial
  loads (keys=, strict=False into an engine with another head), a full disk on one rank (the same
  CheckpointError everywhere, no staging directory left), the marker (SHA-256 of every file, the
  save id, the tensors listed) and `checkpoint export` of the written checkpoint.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel_torch.checkpoint_files import read_dcp_metadata  # noqa: E402

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH, LR = 8, 1e-2
# Every parameter partitioned at ZeRO-3 (the issue: their placeholders were saved as [0]), tiny buckets.
ZERO = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
        "stage3_prefetch_bucket_size": 64}


def _model(seed=0, classes=3):
    torch.manual_seed(seed)  # odd sizes: ZeRO pads the last partition
    return nn.Sequential(nn.Linear(6, 15), nn.ReLU(), nn.Linear(15, 7), nn.ReLU(), nn.Linear(7, classes))


def _dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def _optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _engine(strategy, seed=0, classes=3, **config):
    model = _model(seed, classes)
    return strategy.adapt("deepspeed", model=model, optimizer=_optimizer(model),
                          config={"zero_optimization": ZERO, **config})


def _train(engine, batches, n):
    for _ in range(n):
        x, y = next(batches)
        engine.backward(_loss(engine(x), y))
        engine.step()


def _state(engine):
    """The engine's full state (gathered on every rank) as plain dicts of tensors."""
    from polyparallel_deepspeed.checkpoint import engine_state

    converted = engine_state(engine, with_optimizer=True)
    return {"model": dict(converted.model), "optim": {k: v for k, v in converted.optim.items()
                                                     if isinstance(v, torch.Tensor)}}


def _weights(engine):
    """The engine's full parameters and buffers (gathered on every rank), without its optimizer."""
    from polyparallel_deepspeed.checkpoint import engine_state

    return dict(engine_state(engine, with_optimizer=False).model)


def _max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((torch.as_tensor(a[k]).double() - torch.as_tensor(b[k]).double()).abs().max()) for k in a)


def _refused(fn):
    try:
        fn()
    except pp.CheckpointError as exc:
        return str(exc)
    return None


def _round_trips(strategy, root):
    from polyparallel_deepspeed.testing import engine_params

    # The issue: at ZeRO-3 the module's parameters are [0] placeholders; the model alone, first.
    s = strategy.replace(zero=3)
    engine = _engine(s)
    _train(engine, iter(s.shard_data(_dataset(), shuffle=True)), 1)
    s.save(f"{root}/zero3-model", model=engine)
    fresh = _engine(s, seed=1)
    s.load(f"{root}/zero3-model", model=fresh)
    model_only = engine_params(engine)
    out = {"model only": {"equal": model_only == engine_params(fresh)}}
    for stage in (0, 1, 2, 3):
        s = strategy.replace(zero=stage)
        engine, loader = _engine(s), s.shard_data(_dataset(), shuffle=True)
        batches = iter(loader)
        _train(engine, batches, 3)
        path = f"{root}/zero{stage}"
        s.save(path, model=engine, optimizer=engine.optimizer, loader=loader, note="kept")
        saved = _state(engine)
        fresh, fresh_loader = _engine(s, seed=1), s.shard_data(_dataset(), shuffle=True)
        progress = s.load(path, model=fresh, optimizer=fresh.optimizer, loader=fresh_loader)
        loaded = _state(fresh)
        _train(engine, batches, 2)  # both continue with the same (restored) batches
        _train(fresh, iter(fresh_loader), 2)
        out[stage] = {"saved": saved, "progress": progress, "steps": fresh.global_steps,
                      "loaded": (_max_diff(saved["model"], loaded["model"]), _max_diff(saved["optim"], loaded["optim"])),
                      "continued": _max_diff(_state(engine)["model"], _state(fresh)["model"]),
                      "final": _state(engine)["model"]}
    # Refused on every rank alike, before any collective (the next save still works).
    engine = _engine(strategy.replace(zero=3))
    other = _optimizer(_model())
    out["refused"] = {
        "no step yet": _refused(lambda: strategy.save(f"{root}/r0", model=engine, optimizer=engine.optimizer)),
        "other optimizer": _refused(lambda: strategy.save(f"{root}/r1", model=engine, optimizer=other)),
        "extra name": _refused(lambda: strategy.save(f"{root}/r2", model=engine, deepspeed=1)),
        "module": _refused(lambda: strategy.save(f"{root}/r3", model=engine.module)),
        "module load": _refused(lambda: strategy.load(f"{root}/zero3", model=engine.module)),
    }
    accumulating = _engine(strategy.replace(zero=2, accumulate=2))
    x, y = next(iter(strategy.shard_data(_dataset(), batch_size=16)))
    accumulating.backward(_loss(accumulating(x[:4]), y[:4]))
    accumulating.step()  # one micro-step of two
    out["refused"]["accumulating"] = _refused(lambda: strategy.save(f"{root}/r4", model=accumulating))
    strategy.save(f"{root}/model-only", model=engine)
    # The LR scheduler and the engine's counters come back; an engine without optimizer saves its model.
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 5}}}
    scheduled = [_engine(strategy.replace(zero=1), seed=seed, **warmup) for seed in (0, 1)]
    _train(scheduled[0], iter(strategy.shard_data(_dataset(), shuffle=True)), 2)
    strategy.save(f"{root}/scheduled", model=scheduled[0], optimizer=scheduled[0].optimizer)
    strategy.load(f"{root}/scheduled", model=scheduled[1], optimizer=scheduled[1].optimizer)
    out["scheduled"] = [(e.get_lr(), e.lr_scheduler.state_dict(), e.global_steps, e.global_samples) for e in scheduled]
    # (DeepSpeed's default persistence threshold: these small parameters stay whole on every rank too.)
    bare = strategy.replace(zero=3).adapt("deepspeed", model=_model(seed=5))
    for _ in range(2):  # the first forward traces the module; after it, persistent parameters stay gathered
        bare(torch.ones(2, 6))
    assert all(p.data.numel() == p.ds_numel for p in bare.module.parameters())
    strategy.load(f"{root}/zero3-model", model=bare)
    out["bare"] = engine_params(bare) == model_only
    return out


def _fsdp_leg(strategy, src, dst):
    """The ZeRO-3 DeepSpeed checkpoint into FSDP2 at data=4, saved again from there."""
    model = strategy.wrap_model(_model(seed=2))
    optimizer = _optimizer(model)
    strategy.load(src, model=model, optimizer=optimizer)
    strategy.save(dst, model=model, optimizer=optimizer)
    return strategy.session().rank


def _plain(path, loader=None):
    """A plain module and optimizer in this process, loaded from ``path``."""
    model = _model(seed=3)
    optimizer = _optimizer(model)
    progress = pp.Strategy(data=1).load(path, model=model, optimizer=optimizer, loader=loader)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {"model": {k: v.detach().clone() for k, v in model_state.items()},
             "optim": {k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)}}
    return model, optimizer, state, progress


@pytest.mark.timeout(900)
def test_round_trips_at_every_zero_stage_and_into_fsdp2_and_a_plain_module(tmp_path):
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = pp.launch(_round_trips, strategy, nprocs=2, args=(strategy, str(tmp_path)), runtime="deepspeed",
                        timeout=800)
    for rank in results:
        for stage in (0, 1, 2, 3):
            r = rank[stage]
            print(f"ZeRO-{stage} save -> fresh engine: max abs diff params/optimizer {r['loaded']}, after 2 more "
                  f"steps {r['continued']:.3g}")
            assert r["loaded"] == (0.0, 0.0), (stage, r["loaded"])
            assert r["continued"] <= 1e-6, (stage, r["continued"])
            assert r["progress"] == {"epoch": 0, "step": 3, "global_step": 3, "note": "kept"}, r["progress"]
            assert r["steps"] == 5
        refused = rank["refused"]
        assert "taken no step yet" in refused["no step yet"]
        assert "must be engine.optimizer" in refused["other optimizer"]
        assert "'deepspeed' holds the engine's counters" in refused["extra name"]
        assert "ZeRO-3 partitioned" in refused["module"] and "ZeRO-3 partitioned" in refused["module load"]
        assert "between gradient-accumulation boundaries (1 micro-steps" in refused["accumulating"]
        saved, loaded = rank["scheduled"]
        assert saved == loaded and saved[2] == 2 and saved[1]["last_batch_iteration"] == 1, rank["scheduled"]
        assert rank["bare"]
    zero3 = results[0][3]["saved"]
    shapes = {k: tuple(v.shape) for k, v in zero3["model"].items()}
    assert shapes == {k: tuple(v.shape) for k, v in _model().state_dict().items()}  # full tensors, not [0]
    index = read_dcp_metadata(str(tmp_path / "zero3")).state_dict_metadata  # what `checkpoint inspect` lists
    assert {k[len("model."):]: tuple(v.size) for k, v in index.items() if k.startswith("model.")} == shapes
    assert results[0]["model only"]["equal"], results[0]["model only"]
    # ZeRO-3 at data=2 -> FSDP2 at data=4 -> a plain module here: parameters and optimizer state.
    fsdp = pp.Strategy(data=4, zero=3, timeout=90)
    pp.launch(_fsdp_leg, fsdp, nprocs=4, args=(fsdp, str(tmp_path / "zero3"), str(tmp_path / "fsdp4")), timeout=400)
    _, _, plain, _ = _plain(str(tmp_path / "fsdp4"))
    diffs = (_max_diff(zero3["model"], plain["model"]), _max_diff(zero3["optim"], plain["optim"]))
    print(f"ZeRO-3 data=2 -> FSDP2 data=4 -> plain: max abs diff params {diffs[0]:.3g}, optimizer state {diffs[1]:.3g}")
    assert diffs[0] <= 1e-6 and diffs[1] <= 1e-6, diffs
    # A plain loop resumes the DeepSpeed run at the saved batch: its next two steps are the engine's.
    for stage in (1, 3):
        loader = pp.Strategy(data=1).shard_data(_dataset(), batch_size=GLOBAL_BATCH, shuffle=True)
        model, optimizer, _, progress = _plain(str(tmp_path / f"zero{stage}"), loader)
        assert progress["step"] == 3 and progress["deepspeed"]["global_steps"] == 3
        batches = iter(loader)
        for _ in range(2):
            x, y = next(batches)
            optimizer.zero_grad()
            _loss(model(x), y).backward()
            optimizer.step()
        final = {k: v.detach() for k, v in model.state_dict().items()}
        resumed = _max_diff(final, results[0][stage]["final"])
        print(f"ZeRO-{stage} data=2 -> plain loop, 2 more steps: max abs diff to the engine's {resumed:.3g}")
        assert resumed <= 1e-5
    # Saved without optimizer=: the model loads alone; an optimizer= is refused naming why.
    model = _model(seed=4)
    pp.Strategy(data=1).load(str(tmp_path / "model-only"), model=model)
    with pytest.raises(pp.CheckpointError, match="holds no optimizer state"):
        pp.Strategy(data=1).load(str(tmp_path / "model-only"), model=model, optimizer=_optimizer(model))


def _pipeline(strategy, root):
    def engine(seed):
        model = _model(seed)
        return strategy.adapt("deepspeed", model=model, optimizer=_optimizer(model), loss_fn=_loss)

    first, loader = engine(0), strategy.shard_data(_dataset(), shuffle=True)
    batches = iter(loader)
    for _ in range(3):  # drawn by every rank alike (a loader's pass starts with a collective over the world)
        first.train_batch(iter([next(batches)]))
    strategy.save(f"{root}/pipe", model=first, optimizer=first.optimizer, loader=loader)
    saved = _state(first)
    fresh = engine(1)
    strategy.load(f"{root}/pipe", model=fresh, optimizer=fresh.optimizer)
    loaded = _state(fresh)
    return {"saved": saved, "loaded": (_max_diff(saved["model"], loaded["model"]),
                                       _max_diff(saved["optim"], loaded["optim"]))}


@pytest.mark.timeout(600)
def test_a_pipeline_checkpoint_loads_into_a_plain_sequential(tmp_path):
    strategy = pp.Strategy(pipeline=2, data=2, zero=1, batch_size=GLOBAL_BATCH, timeout=90)
    results = pp.launch(_pipeline, strategy, nprocs=4, args=(strategy, str(tmp_path)), runtime="deepspeed",
                        timeout=500)
    whole = {"model": {}, "optim": {}}
    for r in results:
        assert r["loaded"] == (0.0, 0.0)
        for part in whole:
            whole[part].update(r["saved"][part])
    assert set(whole["model"]) == set(_model().state_dict())  # every stage's layers, under nn.Sequential's names
    _, _, plain, _ = _plain(str(tmp_path / "pipe"))
    assert _max_diff(whole["model"], plain["model"]) == 0.0
    assert _max_diff(whole["optim"], plain["optim"]) == 0.0


# -- the format's version 2: async_save, CheckpointManager, partial loads, failures, export ---------------------
def _version2(strategy, root):
    import resource
    import signal

    import torch.distributed as dist

    s = strategy.replace(zero=3)
    engine, loader = _engine(s), s.shard_data(_dataset(), shuffle=True)
    batches = iter(loader)
    _train(engine, batches, 2)
    saved = _state(engine)
    future = s.async_save(f"{root}/async", model=engine, optimizer=engine.optimizer, loader=loader, note="async")
    _train(engine, batches, 1)  # the engine trains on while the files are written
    out = {"future": type(future).__name__, "async": future.result(),
           "changed": _max_diff(saved["model"], _state(engine)["model"])}
    fresh = _engine(s, seed=1)
    progress = s.load(f"{root}/async", model=fresh, optimizer=fresh.optimizer)
    loaded = _state(fresh)
    out["async loaded"] = (_max_diff(saved["model"], loaded["model"]), _max_diff(saved["optim"], loaded["optim"]))
    out["async progress"] = {k: progress[k] for k in ("step", "note")}
    out["saved"] = saved
    # CheckpointManager: asynchronous saves, the two newest kept, the newest restored.
    manager = pp.CheckpointManager(s, f"{root}/managed", keep=2, asynchronous=True)
    for step in (4, 5, 6):
        _train(engine, batches, 1)
        last = _state(engine)
        manager.save(step, model=engine, optimizer=engine.optimizer, loader=loader)
    manager.wait()
    restored, restored_loader = _engine(s, seed=2), s.shard_data(_dataset(), shuffle=True)
    progress = manager.restore(model=restored, optimizer=restored.optimizer, loader=restored_loader)
    got = _state(restored)
    out["manager"] = {"kept": [os.path.basename(p) for p in manager.checkpoints()], "step": progress["step"],
                      "diff": (_max_diff(last["model"], got["model"]), _max_diff(last["optim"], got["optim"])),
                      "steps": restored.global_steps}
    # Partial loads: the first layer only; every layer but another head (strict=False); no optimizer.
    partial = _engine(s, seed=3)
    before = _weights(partial)
    result = s.load(f"{root}/async", model=partial, keys=["0.*"])
    after = _weights(partial)
    out["keys"] = {"report": result["load_report"], "steps": partial.global_steps,
                   "extra": result["deepspeed"]["global_steps"],
                   "selected": max(_max_diff({k: saved["model"][k]}, {k: after[k]}) for k in ("0.weight", "0.bias")),
                   "others": max(_max_diff({k: before[k]}, {k: after[k]}) for k in after if not k.startswith("0."))}
    head = _engine(s, seed=4, classes=4)
    head_before = _weights(head)
    report = s.load(f"{root}/async", model=head, strict=False)["load_report"]
    head_after = _weights(head)
    out["strict=False"] = {"report": report,
                           "loaded": max(_max_diff({k: saved["model"][k]}, {k: head_after[k]}) for k in report["loaded"]),
                           "head": _max_diff({k: head_before[k] for k in ("4.weight", "4.bias")},
                                             {k: head_after[k] for k in ("4.weight", "4.bias")})}
    stepped = _engine(s, seed=5)
    out["partial with optimizer"] = _refused(lambda: s.load(f"{root}/async", model=stepped, optimizer=stepped.optimizer,
                                                            keys=["0.*"]))
    out["partial optimizer state"] = len(stepped.basic_optimizer.state)  # no state was created by the refusal
    # A full disk on rank 1 (its JSON rank file cannot be written): the same error on every rank, sync and async.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    out["disk"] = {}
    for case in ("save", "async_save"):
        if dist.get_rank() == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        try:
            getattr(s, case)(f"{root}/full-{case}", model=engine, optimizer=engine.optimizer)
            message = "saved"
        except pp.CheckpointError as exc:
            message = str(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        dist.barrier()
        out["disk"][case] = [message, sorted(n for n in os.listdir(root) if n.startswith("full-"))]
        dist.barrier()
    out["after disk"] = s.save(f"{root}/after-full", model=engine)
    return out


def _export(*args):
    from click.testing import CliRunner

    from polyparallel import cli as cli_module

    return CliRunner().invoke(cli_module.cli, ["checkpoint", "export", *args], prog_name="polyparallel")


@pytest.mark.timeout(600)
def test_async_save_manager_partial_loads_failures_and_export_of_an_engine(tmp_path):
    from polyparallel import _checkpoints

    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = pp.launch(_version2, strategy, nprocs=2, args=(strategy, str(tmp_path)), runtime="deepspeed",
                        timeout=500)
    path = str(tmp_path / "async")
    for r in results:
        assert r["future"] == "CheckpointFuture", r["future"]  # the torch runtime's: written in the background
        assert r["async"] == path and r["changed"] > 0  # the engine moved on while its state was written
        print(f"async_save of ZeRO-3 data=2 -> fresh engine: max abs diff params/optimizer {r['async loaded']}")
        assert r["async loaded"] == (0.0, 0.0) and r["async progress"] == {"step": 2, "note": "async"}
        m = r["manager"]
        assert m["kept"] == ["step-00000005", "step-00000006"] and m["step"] == 6, m
        assert m["diff"] == (0.0, 0.0) and m["steps"] == 6, m
        k = r["keys"]
        assert k["report"]["loaded"] == ["0.bias", "0.weight"] and "2.weight" in k["report"]["excluded"], k["report"]
        assert k["selected"] == 0.0 and k["others"] == 0.0, k  # the rest keeps the engine's own values
        assert k["steps"] == 0 and k["extra"] == 2  # counters not applied, returned as the extra
        f = r["strict=False"]
        assert set(f["report"]["mismatched"]) == {"4.weight", "4.bias"}, f["report"]
        assert f["report"]["mismatched"]["4.weight"] == {"checkpoint": [3, 7], "model": [4, 7]}
        assert len(f["report"]["loaded"]) == 4 and f["loaded"] == 0.0 and f["head"] == 0.0, f
        assert "partial load" in r["partial with optimizer"] and "optimizer" in r["partial with optimizer"]
        assert r["partial optimizer state"] == 0
        for case in ("save", "async_save"):
            message, listing = r["disk"][case]
            assert str(tmp_path / f"full-{case}") in message and "rank 1" in message, message
            assert "File too large" in message and "/ranks/rank-00001.json" in message, message
            assert listing == [], f"{case}: a staging directory stays behind: {listing}"
        assert r["after disk"] == str(tmp_path / "after-full")
    assert results[0]["disk"] == results[1]["disk"]  # the same error on every rank
    # The marker: every file's SHA-256 (verified), the save id in every rank file, the tensors listed.
    meta = _checkpoints.read_marker(path)
    assert meta["version"] == 2 and meta["framework"] == "deepspeed" and meta["id"]
    assert set(meta["sha256"]) == set(meta["files"]) and len(meta["files"]) >= 4, meta["files"]
    _checkpoints.verify_files(path, meta)
    saved = results[0]["saved"]
    arrays = {a["name"]: a["shape"] for a in meta["arrays"]}
    assert {k: arrays[f"model.{k}"] for k in saved["model"]} == {k: list(v.shape) for k, v in saved["model"].items()}
    assert {f"optim.{k}" for k in saved["optim"]} <= set(arrays)
    # export: one file torch.load(weights_only=True) reads; a plain module takes its weights.
    result = _export(path, "--to", "torch")
    assert result.exit_code == 0, result.output
    exported = torch.load(path + ".pt", weights_only=True)
    module = _model(seed=6)
    module.load_state_dict(exported["model"])
    assert _max_diff(saved["model"], module.state_dict()) == 0.0
    assert _max_diff(saved["optim"], {k: v for k, v in exported["optimizer"].items() if isinstance(v, torch.Tensor)}) == 0.0
    assert exported["polyparallel"]["framework"] == "deepspeed" and exported["extras"]["deepspeed"]["global_steps"] == 2
