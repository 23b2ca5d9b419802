"""The declared surface of the DeepSpeed adapter (``polyparallel_deepspeed.surface``,
``docs/surface/deepspeed.md``): complete against the installed DeepSpeed, each refusal enforced
before anything runs, each "works" entry named by a test that exists, and those tests: config
variants and DeepSpeed's own checkpoints at data=2 (one launch), PipelineModule options at
pipeline=2 x data=2 (one launch), each against a single process with the same global batch and an
evaluation set that does not divide evenly."""

import ast
import inspect
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import polyparallel as pp  # noqa: E402
from polyparallel_deepspeed import UnsupportedConfigError, build_config, surface  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, LR, STEPS, EVAL = 8, 1e-2, 4, 37  # 37 evaluation samples: 19 and 18 at data=2


def _names(kind):
    return {e.name for e in surface.ENTRIES if e.kind == kind}


# -- complete against the installed DeepSpeed ------------------------------------------------------------
def _config_keys_deepspeed_reads():
    """Every top-level key DeepSpeedConfig looks up in a config (recorded on a dict that notes
    each lookup), for the installed DeepSpeed."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen = set()

    class Keys(set):
        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

    class Recording(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            return Keys(super().keys())

    DeepSpeedConfig(Recording(train_batch_size=8, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1))
    return seen


def test_every_config_key_deepspeed_reads_is_classified():
    read = _config_keys_deepspeed_reads()
    assert read - _names("config") == set(), "classify these in polyparallel_deepspeed/surface.py"
    assert _names("config") - read == set(), "the installed DeepSpeed reads these no more: drop them"


def test_every_zero_option_is_classified():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    assert set(fields) == _names("zero_optimization")
    assert {n: f.alias for n, f in fields.items() if f.alias} == surface.aliases()


def test_every_pipeline_module_argument_is_classified():
    from deepspeed.pipe import PipelineModule

    assert set(inspect.signature(PipelineModule.__init__).parameters) - {"self"} == _names("pipeline_module")


def test_the_declared_methods_exist_on_the_engines():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from polyparallel import cli as cli_module

    for name in _names("method"):
        method = name.split(" ")[0]
        if method.startswith("strategy."):  # polyparallel's own, taking the engine
            assert callable(getattr(pp.Strategy, method.split(".", 1)[1])), name
        elif method.startswith("pp."):
            assert callable(getattr(pp, method[len("pp."):])), name
        elif method == "polyparallel":  # a command of the CLI
            group, command = name.split(" ")[1:3]
            assert command in cli_module.cli.commands[group].commands, name
        else:
            assert callable(getattr(PipelineEngine if name.endswith("_batch") else DeepSpeedEngine, method)), name


def _defined(file, name):
    tree = ast.parse((ROOT / file).read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in ast.walk(tree))


@pytest.mark.parametrize("entry", [e for e in surface.ENTRIES if e.status == surface.WORKS], ids=lambda e: e.name)
def test_each_works_entry_names_a_test_that_exists(entry):
    file, _, name = entry.detail.partition("::")
    assert _defined(file, name.split("[")[0]), f"{entry.name}: {entry.detail} does not exist"


@pytest.mark.parametrize("entry", [e for e in surface.ENTRIES if e.status == surface.REFUSED
                                   and e.kind in ("config", "zero_optimization")], ids=lambda e: e.name)
def test_each_refused_config_entry_is_refused_before_anything_runs(entry):
    config = {entry.name: {"enabled": True}} if entry.kind == "config" else {"zero_optimization": {entry.name: True}}
    with pytest.raises(UnsupportedConfigError, match="is refused: " + re.escape(entry.detail)):
        build_config(pp.Strategy(data=2, zero=3, batch_size=8), config)


@pytest.mark.parametrize("entry", [e for e in surface.ENTRIES if e.status == surface.REFUSED
                                   and e.kind == "pipeline_module"], ids=lambda e: e.name)
def test_each_refused_pipeline_argument_is_refused(entry):
    assert entry.detail in surface.pipeline_refusal({entry.name: None})


def test_an_option_turned_off_and_the_stage3_aliases_are_accepted():
    config = build_config(pp.Strategy(data=2, zero=3, batch_size=8),
                          {"fp16": {"enabled": False}, "zero_optimization": {"stage3_param_persistence_threshold": 0}})
    assert config["fp16"] == {"enabled": False}


def test_the_committed_table_is_generated():
    committed = (ROOT / "docs" / "surface" / "deepspeed.md").read_text()
    assert committed == surface.render(), "regenerate: python -m polyparallel_deepspeed.surface > docs/surface/deepspeed.md"


# -- the tests of the "works" entries ------------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 15), nn.ReLU(), nn.Linear(15, 7), nn.ReLU(), nn.Linear(7, 3))


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


ADAM = {"lr": LR, "weight_decay": 0.01}
WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}
#: name -> (zero stage, config, micro-batches per rank per step); a torch Adam unless the config has one.
VARIANTS = {
    "gradient_accumulation_steps": (1, {"gradient_accumulation_steps": 2}, 2),
    "gradient_clipping": (2, {"gradient_clipping": 0.05}, 1),
    "optimizer": (1, {"optimizer": {"type": "Adam", "params": {**ADAM, "torch_adam": True}}}, 1),
    "scheduler": (0, {"scheduler": {"type": "WarmupLR", "params": WARMUP}}, 1),
    "logging": (0, {"steps_per_print": 1, "wall_clock_breakdown": True, "memory_breakdown": True, "dump_state": True}, 1),
    "zero2 options": (2, {"zero_optimization": {
        "contiguous_gradients": False, "reduce_scatter": False, "reduce_bucket_size": 64,
        "use_multi_rank_bucket_allreduce": False, "allgather_partitions": False, "allgather_bucket_size": 64,
        "overlap_comm": True, "round_robin_gradients": True}}, 1),
    "zero3 options": (3, {"zero_optimization": {
        "sub_group_size": 40, "stage3_prefetch_bucket_size": 64, "stage3_param_persistence_threshold": 20,
        "stage3_model_persistence_threshold": 200, "stage3_max_live_parameters": 100, "stage3_max_reuse_distance": 100,
        "overlap_comm": True, "reduce_bucket_size": 64}}, 1),
}


def _evaluate(strategy, forward):
    loader = strategy.shard_data(_data(EVAL, 2), batch_size=GLOBAL_BATCH, remainder="uneven", shuffle=False)
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = forward(x, y)
            if logits is None:
                continue
            total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            count += len(y)
    return total, correct, count


def _variants(strategy, root):
    from polyparallel_deepspeed.testing import engine_params

    out = {}
    for name, (stage, config, micro) in VARIANTS.items():
        s = strategy.replace(zero=stage)
        model = _model()
        optimizer = None if "optimizer" in config else torch.optim.Adam(model.parameters(), **ADAM)
        # Its accumulation is the Strategy's (a config value must agree with it); the batches are
        # the accumulate=1 strategy's, cut into the micro-batches here.
        engine = s.replace(accumulate=micro).adapt("deepspeed", model=model, optimizer=optimizer, config=config)
        batches = iter(s.shard_data(_data(64, 1), shuffle=True))
        for _ in range(STEPS):
            x, y = next(batches)
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                engine.backward(_loss(engine(xs), ys))
                engine.step()
        engine.eval()
        total, correct, count = _evaluate(s, lambda x, y, engine=engine: engine(x))
        out[name] = {"params": engine_params(engine), "lr": engine.get_lr(),
                     "metrics": s.reduce_metrics({"loss": pp.Mean(total, count), "accuracy": pp.Mean(correct, count)})}
    # DeepSpeed's own save_checkpoint / load_checkpoint (its files) under the Strategy's groups, at ZeRO-3.
    s = strategy.replace(zero=3)
    engines = []
    for seed in (0, 1):
        model = _model(seed)
        engines.append(s.adapt("deepspeed", model=model, optimizer=torch.optim.Adam(model.parameters(), **ADAM)))
    first, fresh = engines
    batches = list(zip(range(STEPS), s.shard_data(_data(64, 1), shuffle=True)))
    for _, (x, y) in batches[:2]:
        first.backward(_loss(first(x), y))
        first.step()
    first.save_checkpoint(f"{root}/deepspeed", tag="half")
    fresh.load_checkpoint(f"{root}/deepspeed", tag="half")
    for engine in (first, fresh):
        for _, (x, y) in batches[2:]:
            engine.backward(_loss(engine(x), y))
            engine.step()
    out["own checkpoints"] = {"first": engine_params(first), "fresh": engine_params(fresh)}
    return out


def _reference(name):
    """The single-process run of a variant: the same global batches, the same steps."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    stage, config, _ = VARIANTS.get(name, (0, {}, 1))
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    scheduler = WarmupLR(optimizer, **WARMUP) if "scheduler" in config else None
    batches = iter(pp.Strategy(data=1).shard_data(_data(64, 1), batch_size=GLOBAL_BATCH, shuffle=True))
    for _ in range(STEPS):
        x, y = next(batches)
        optimizer.zero_grad()
        _loss(model(x), y).backward()
        if "gradient_clipping" in config:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
            assert norm > config["gradient_clipping"]  # the clip is active
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    model.eval()
    total, correct, count = _evaluate(pp.Strategy(data=1), lambda x, y: model(x))
    params = {n: p.detach().reshape(-1).double().tolist() for n, p in model.named_parameters()}
    return params, {"loss": total / count, "accuracy": correct / count}, optimizer.param_groups[0]["lr"]


def _close(a, b, tol):
    assert a.keys() == b.keys()
    return max(abs(u - v) for k in a for u, v in zip(a[k], b[k])) <= tol


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    strategy = pp.Strategy(data=2, batch_size=GLOBAL_BATCH, timeout=90)
    return pp.launch(_variants, strategy, nprocs=2, args=(strategy, str(tmp_path_factory.mktemp("surface"))),
                     runtime="deepspeed", timeout=800)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variants_match_a_single_process(variants, name):
    params, metrics, lr = _reference(name)
    for rank in variants:
        got = rank[name]
        assert _close(got["params"], params, 1e-5), name
        assert got["metrics"].keys() == metrics.keys()
        assert all(abs(got["metrics"][k] - metrics[k]) <= 1e-6 for k in metrics), (got["metrics"], metrics)
        assert got["lr"] == [pytest.approx(lr)]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_deepspeeds_own_checkpoints_round_trip(variants):
    """engine.save_checkpoint / load_checkpoint (DeepSpeed's own files) work under the Strategy's
    process groups: the loaded engine continues as the saved one, and as the single process."""
    params, _, _ = _reference("own checkpoints")
    for rank in variants:
        got = rank["own checkpoints"]
        assert got["fresh"] == got["first"]
        assert _close(got["first"], params, 1e-5)


def _pipeline(strategy):
    from polyparallel_deepspeed.testing import engine_params

    model = _model()
    engine = strategy.adapt("deepspeed", model=model, optimizer=torch.optim.Adam(model.parameters(), **ADAM),
                            loss_fn=_loss, partition_method="uniform",
                            pipeline_options={"activation_checkpoint_interval": 1})
    batches = iter(strategy.shard_data(_data(64, 1), shuffle=True))
    for _ in range(STEPS):
        engine.train_batch(iter([next(batches)]))  # drawn by every rank alike
    assert engine.module.activation_checkpoint_interval == 1

    def forward(x, y):
        _, logits = engine.eval_batch(iter([(x, y)]), return_logits=True, bcast_loss=False, num_micro_batches=1)
        return logits if engine.is_last_stage() else None

    total, correct, count = _evaluate(strategy, forward)
    metrics = (strategy.reduce_metrics({"loss": pp.Mean(total, count), "accuracy": pp.Mean(correct, count)})
               if engine.is_last_stage() else None)
    return {"params": engine_params(engine), "metrics": metrics, "layers": engine.module.parts}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_pipeline_options_match_a_single_process():
    strategy = pp.Strategy(pipeline=2, data=2, zero=1, batch_size=GLOBAL_BATCH, timeout=90)
    results = pp.launch(_pipeline, strategy, nprocs=4, args=(strategy,), runtime="deepspeed", timeout=500)
    params, metrics, _ = _reference("pipeline")
    from deepspeed.runtime.utils import partition_uniform

    assert results[0]["layers"] == partition_uniform(num_items=5, num_parts=2)  # partition_method="uniform"
    whole = {}
    for rank in results:
        whole.update(rank["params"])
        if rank["metrics"] is not None:
            assert all(abs(rank["metrics"][k] - metrics[k]) <= 1e-6 for k in metrics), (rank["metrics"], metrics)
    assert sum(r["metrics"] is not None for r in results) == 2  # the last stage's data group
    assert _close(whole, params, 1e-5)
