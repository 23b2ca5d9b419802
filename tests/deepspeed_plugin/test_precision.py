"""Strategy(precision=, accumulate=) on DeepSpeed, on real gloo processes.

- fp32: data=2 x accumulate=2 equals data=2 x accumulate=1 (same global batch) and a single plain-torch
  process (1e-5); the slow variant adds data=4 x accumulate=1 and ZeRO 1-3.
- bf16-mixed: the adapter's engine equals a hand-written ``deepspeed.initialize`` with a hand-written
  bf16 config (bit for bit: the same program), and a single process within the bf16 tolerance below.
- checkpoints of a bf16 engine: ``strategy.save`` / ``strategy.load`` round-trip its float32 master
  weights and optimizer state.

The training set has 30 samples (the global batch of 8 does not divide it; the short last batch
is not trained on, as a DataLoader with ``drop_last`` does). The loops cut the micro-batches
themselves, so one launch compares several accumulations (``replace(accumulate=)`` inside it).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from torch import nn  # noqa: E402

import polyparallel as pp  # noqa: E402

GLOBAL_BATCH, LR, STEPS, SAMPLES = 8, 0.1, 3, 30
#: bf16-mixed against one process: the two runs round different partial sums to bfloat16 (each rank's
#: half batch vs the whole batch), so after STEPS SGD steps the weights differ by a few bfloat16 ulps
#: (bfloat16 has 8 bits of mantissa: an ulp is 2**-8 relative, ~4e-3).
BF16_TOL = {"rtol": 2e-2, "atol": 1e-2}
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _loss(out, y):
    return (out.float() - y).square().mean()


def _micro_batches(step, accumulate, data, rank):
    """The micro-batches rank ``rank`` takes at optimizer step ``step``: the global batch's rows cut
    into accumulate x data equal parts."""
    x, y = _data()
    micro = GLOBAL_BATCH // (accumulate * data)
    start = step * GLOBAL_BATCH
    for k in range(accumulate):
        lo = start + (k * data + rank) * micro
        yield x[lo:lo + micro], y[lo:lo + micro]


def _train(engine, accumulate, data, rank, dtype=torch.float32):
    for step in range(STEPS):
        for x, y in _micro_batches(step, accumulate, data, rank):
            engine.backward(_loss(engine(x.to(dtype)), y))
            engine.step()
    assert engine.global_steps == STEPS
    from polyparallel_deepspeed.testing import engine_params

    return engine_params(engine)


def reference():
    """One plain-torch process, fp32, the whole global batch per step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        _loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return {n: p.detach().reshape(-1).double().tolist() for n, p in model.named_parameters()}


def _adapted(strategy):
    model = _model()
    return strategy.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                          config={"steps_per_print": 10_000})


def _hand_written(zero, data, config_extra):
    """``deepspeed.initialize`` with a config written by hand (on the default process group: the
    whole world is the data group here)."""
    import deepspeed

    model = _model()
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // data,
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "steps_per_print": 10_000,
              "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True, **config_extra}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config,
                                      dist_init_required=False)
    return engine


def _equivalence(strategy, stages, precision_stages):
    rank, data = strategy.session().rank, strategy.topology.size("data")
    out = {"fp32": {}, "bf16": {}, "hand": {}}
    for zero in stages:
        for accumulate in (1, 2):
            engine = _adapted(strategy.replace(zero=zero, accumulate=accumulate))
            assert engine.gradient_accumulation_steps() == accumulate
            assert engine.train_micro_batch_size_per_gpu() == GLOBAL_BATCH // (accumulate * data)
            out["fp32"][(zero, accumulate)] = _train(engine, accumulate, data, rank)
    for zero in precision_stages:
        engine = _adapted(strategy.replace(zero=zero, precision="bf16-mixed"))
        assert engine.bfloat16_enabled() and engine.communication_data_type == torch.float32
        assert next(engine.module.parameters()).dtype == torch.bfloat16
        out["bf16"][zero] = _train(engine, 1, data, rank, torch.bfloat16)
        hand = _hand_written(zero, data, {"bf16": {"enabled": True}, "communication_data_type": "fp32"})
        out["hand"][zero] = _train(hand, 1, data, rank, torch.bfloat16)
    return out


def _close(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(torch.tensor(a[name]), torch.tensor(b[name]), **tol, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_accumulation_and_bf16_data2_zero0(run):
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = run(_equivalence, strategy, 2, strategy, (0,), (0,), timeout=400)
    ref = reference()
    for r in results:
        _close(r["fp32"][(0, 2)], ref, **FP32_TOL)  # data=2 x accumulate=2 = one process
        _close(r["fp32"][(0, 2)], r["fp32"][(0, 1)], **FP32_TOL)  # = data=2 x accumulate=1
        assert r["bf16"][0] == r["hand"][0]  # the adapter's engine is the hand-written bf16 one, bit for bit
        _close(r["bf16"][0], ref, **BF16_TOL)
    assert results[0] == results[1]


def _one_process_bf16(strategy, stages):
    out = {}
    for zero in stages:
        engine = _adapted(strategy.replace(zero=zero, precision="bf16-mixed"))
        out[zero] = _train(engine, 1, 1, 0, torch.bfloat16)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_bf16_mixed_data2_matches_one_process_and_a_hand_written_config(run):
    """At ZeRO 0-3: data=2 against one DeepSpeed process (within BF16_TOL) and against the
    hand-written config (bit for bit); fp32 accumulation at every stage."""
    stages = (0, 1, 2, 3)
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = run(_equivalence, strategy, 2, strategy, stages, stages, timeout=600)
    single = pp.Strategy(data=1, batch_size=GLOBAL_BATCH, timeout=90)
    one = run(_one_process_bf16, single, 1, single, stages, timeout=280)[0]
    ref = reference()
    for r in results:
        for zero in stages:
            _close(r["fp32"][(zero, 2)], ref, **FP32_TOL)
            _close(r["fp32"][(zero, 1)], ref, **FP32_TOL)
            assert r["bf16"][zero] == r["hand"][zero], zero
            _close(r["bf16"][zero], one[zero], **BF16_TOL)
            _close(r["bf16"][zero], ref, **BF16_TOL)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_fp32_data4_equals_data2_accumulate2(run):
    strategy = pp.Strategy(data=4, batch_size=GLOBAL_BATCH, timeout=90)
    results = run(_equivalence, strategy, 4, strategy, (0, 2), (), timeout=500)
    two = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    pairs = run(_equivalence, two, 2, two, (0, 2), (), timeout=400)
    ref = reference()
    for zero in (0, 2):
        _close(results[0]["fp32"][(zero, 1)], pairs[0]["fp32"][(zero, 2)], **FP32_TOL)  # data=4 = data=2 x accumulate=2
        _close(results[0]["fp32"][(zero, 2)], ref, **FP32_TOL)  # data=4 x accumulate=2 (micro-batches of 1)


# -- checkpoints of a bf16 engine ----------------------------------------------------------------------
def _max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((x.float() - y.float()).abs().max().item() if isinstance(x, torch.Tensor) else float(x != y))
               for x, y in ((a[k], b[k]) for k in a))


def _bf16_round_trips(strategy, root, stages):
    from polyparallel_deepspeed.checkpoint import engine_state

    rank, data = strategy.session().rank, strategy.topology.size("data")
    out = {}

    def adapted(s):
        model = _model()
        return s.adapt("deepspeed", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                       config={"steps_per_print": 10_000})

    def step(engine, index, dtype=torch.bfloat16):
        for x, y in _micro_batches(index, 1, data, rank):
            engine.backward(_loss(engine(x.to(dtype)), y))
            engine.step()

    for zero in stages:
        s = strategy.replace(zero=zero, precision="bf16-mixed")
        path = f"{root}/bf16-zero{zero}"
        engine = adapted(s)
        step(engine, 0)
        s.save(path, model=engine, optimizer=engine.optimizer)
        saved = engine_state(engine, True)
        step(engine, 1)
        after = engine_state(engine, True).model
        fresh = adapted(s)
        s.load(path, model=fresh, optimizer=fresh.optimizer)
        loaded = engine_state(fresh, True)
        step(fresh, 1)
        # into an fp32 engine: the float32 master weights
        plain = adapted(strategy.replace(zero=zero))
        s.load(path, model=plain)
        out[zero] = {"dtypes": sorted({str(t.dtype) for t in saved.model.values()}),
                     "momentum": sorted(k.rsplit(".", 1)[-1] for k in saved.optim if k.startswith("state.")),
                     "weights": _max_diff(loaded.model, saved.model), "optimizer": _max_diff(loaded.optim, saved.optim),
                     "next step": _max_diff(engine_state(fresh, False).model, after),
                     "into fp32": _max_diff(engine_state(plain, False).model, saved.model),
                     "module is bf16": next(fresh.module.parameters()).dtype == torch.bfloat16}
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_bf16_engine_round_trips_its_float32_master_weights_zero0(run, tmp_path):
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = run(_bf16_round_trips, strategy, 2, strategy, str(tmp_path), (0,), timeout=400)
    _check_round_trips(results, (0,))


def _check_round_trips(results, stages):
    for r in results:
        for zero in stages:
            info = r[zero]
            assert info["dtypes"] == ["torch.float32"], info  # the master copy, not the bfloat16 module
            assert set(info["momentum"]) == {"momentum_buffer"}, info
            assert info["weights"] == 0 and info["optimizer"] == 0 and info["next step"] == 0, (zero, info)
            assert info["into fp32"] == 0 and info["module is bf16"], (zero, info)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_bf16_engine_round_trips_at_zero_1_2_3(run, tmp_path):
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    results = run(_bf16_round_trips, strategy, 2, strategy, str(tmp_path), (1, 2, 3), timeout=550)
    _check_round_trips(results, (1, 2, 3))
