"""Strategy(precision=) and Strategy(accumulate=) through Lightning's own mechanisms.

- bf16-mixed at data=2 (gloo processes; zero=0 and zero=2) equals plain Lightning in one process with the same
  global batches (Trainer(precision="bf16-mixed"), no polyparallel), within the bf16 tolerance
  stated below, and differs from float32 by more than that (bfloat16 really computed);
- data=2 x accumulate=2 equals plain Lightning in one process with the same global batch (1e-5),
  with one gradient all-reduce per optimizer step;
- a Trainer(precision=), a precision plugin or accumulate_grad_batches that contradicts the
  Strategy is refused before fit, naming both; both Lightning namespaces.
"""

import pytest

import polyparallel as pp

NS = "lightning.pytorch"
N, PER_RANK, EPOCHS = 40, 4, 2  # 40 samples: 5 global batches of 8 per epoch at data=1 and data=2
#: bf16 tolerance on the parameters after 10 SGD steps (lr 0.1): one process and two ranks round
#: different bfloat16 products (8-bit mantissa). Measured: 1.3e-4 between them, 1.0e-3 between
#: bf16-mixed and float32; the tolerance sits in between.
BF16_ATOL = 5e-4


def _module(namespace=NS):
    from torch import nn

    from polyparallel_lightning.testing import reference_module_class

    class NoBatchNorm(reference_module_class(namespace)):
        """The reference MLP without BatchNorm (whose statistics are per rank): one process and
        data=2 then compute the same function of the same global batch."""

        def __init__(self):
            super().__init__(0)
            self.net[3] = nn.Identity()
            self.dtypes = set()

        def training_step(self, batch, batch_idx):
            self.dtypes.add(str(self.net(batch[0]).dtype))
            return super().training_step(batch, batch_idx)

    return NoBatchNorm()


def _loader(batch, sampler=None):
    from torch.utils.data import DataLoader

    from polyparallel_torch.testing import reference_dataset

    return DataLoader(reference_dataset(N), batch_size=batch, shuffle=sampler is None, sampler=sampler)


def _bf16_worker(strategy):
    from polyparallel_lightning.testing import make_trainer
    from polyparallel_torch.testing import flat_params

    module = _module()
    trainer = make_trainer(strategy, NS, max_epochs=EPOCHS, limit_val_batches=0)
    plugin = trainer.strategy.precision_plugin
    trainer.fit(module, _loader(PER_RANK))
    scaler = getattr(plugin, "scaler", None)
    return {"plugin": (type(plugin).__name__, plugin.precision), "dtypes": sorted(module.dtypes),
            "params": flat_params(module.net), "steps": len(module.losses),
            "scale": float(scaler.get_scale()) if scaler is not None else None}


def _plain_lightning(precision):
    """Lightning alone, one process, the global batches of TopologySampler (shard_data's order)."""
    import lightning.pytorch as L

    from polyparallel_torch import TopologySampler
    from polyparallel_torch.testing import flat_params

    module = _module()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, _loader(2 * PER_RANK, TopologySampler(N, 0, 1, seed=0, shuffle=True)))
    return flat_params(module.net), sorted(module.dtypes)


def _max_diff(a, b):
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))


def _worker(strategy):
    """Both scenarios in one launch (process start-up is most of a test's time here)."""
    return {"bf16": _bf16_worker(strategy.replace(precision="bf16-mixed")),
            "fp16": _bf16_worker(strategy.replace(precision="fp16-mixed")),
            "bf16_zero2": _bf16_worker(strategy.replace(precision="bf16-mixed", zero=2)),
            "accumulation": _accumulation_worker(strategy.replace(accumulate=2))}


@pytest.fixture(scope="module")
def launched():
    strategy = pp.Strategy(data=2, timeout=60, seed=0)
    return pp.launch(_worker, strategy, 2, args=(strategy,), runtime="lightning", timeout=200)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bf16_mixed_at_data_2_equals_plain_lightning_in_one_process(launched):
    results = [r["bf16"] for r in launched]
    reference, reference_dtypes = _plain_lightning("bf16-mixed")
    fp32, _ = _plain_lightning("32-true")
    for r in results:
        assert r["plugin"] == ("MixedPrecision", "bf16-mixed")
        assert r["dtypes"] == reference_dtypes == ["torch.bfloat16"]
        assert r["steps"] == 5 * EPOCHS
        assert _max_diff(r["params"], reference) < BF16_ATOL
    assert _max_diff(results[0]["params"], results[1]["params"]) == 0, "replicas diverged"
    for r in (r["bf16_zero2"] for r in launched):  # FSDP2 (ModelParallelStrategy) under the same plugin
        assert r["plugin"] == ("MixedPrecision", "bf16-mixed") and r["dtypes"] == ["torch.bfloat16"]
        assert _max_diff(r["params"], reference) < BF16_ATOL
    # bfloat16 was computed: float32 is further from it than the two bf16 runs are from each other.
    assert _max_diff(reference, fp32) > 4 * _max_diff(results[0]["params"], reference)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_a_contradicting_trainer_precision_is_refused_naming_both(namespace):
    import importlib

    from polyparallel_lightning.testing import make_trainer

    strategy = pp.Strategy(data=1, precision="bf16-mixed")
    trainer = make_trainer(strategy, namespace)  # no precision given: the Strategy's plugin
    assert (type(trainer.strategy.precision_plugin).__name__, trainer.strategy.precision_plugin.precision) == \
        ("MixedPrecision", "bf16-mixed")
    make_trainer(strategy, namespace, precision="bf16-mixed")  # the same precision: accepted
    with pytest.raises(pp.TopologyError, match=r"Trainer\(precision='bf16-true'\) contradicts "
                                               r"Strategy\(precision='bf16-mixed'\)"):
        make_trainer(strategy, namespace, precision="bf16-true")
    double = importlib.import_module(f"{namespace}.plugins").DoublePrecision()
    with pytest.raises(pp.TopologyError, match=r"precision='64-true'\) contradicts Strategy\(precision='bf16-mixed'\)"):
        make_trainer(strategy, namespace, plugins=[double])
    with pytest.raises(pp.TopologyError, match=r"Trainer\(precision='bf16-mixed'\) contradicts "
                                               r"Strategy\(precision='32'\)"):
        make_trainer(pp.Strategy(data=1, precision="32"), namespace, precision="bf16-mixed")
    # No Strategy precision: Lightning's own choice stands.
    plain = make_trainer(pp.Strategy(data=1), namespace, precision="bf16-true")
    assert plain.strategy.precision_plugin.precision == "bf16-true"


def test_precisions_lightning_has_no_plugin_for_are_refused_before_launch():
    custom = pp.PrecisionPolicy(compute_dtype="bfloat16", reduce_dtype="bfloat16")
    with pytest.raises(pp.UnsupportedTopologyError, match="has no plugin"):
        pp.Strategy(data=2, precision=custom).check("lightning", world_size=2)
    with pytest.raises(pp.UnsupportedTopologyError, match="ModelParallelStrategy refuses '16-mixed'"):
        pp.Strategy(data=2, zero=2, precision="fp16-mixed").adapt("lightning", namespace=NS)


def test_a_contradicting_accumulate_grad_batches_is_refused_before_any_step():
    from polyparallel_lightning.testing import make_trainer

    module = _module()
    trainer = make_trainer(pp.Strategy(data=1), NS, max_epochs=1, accumulate_grad_batches=3)
    with pytest.raises(pp.TopologyError, match=r"Trainer\(accumulate_grad_batches=3\) contradicts "
                                               r"Strategy\(accumulate=1\)"):
        trainer.fit(module, _loader(PER_RANK))
    assert module.losses == [], "refused before the first step"


def _accumulation_worker(strategy):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from polyparallel_lightning.testing import make_trainer
    from polyparallel_torch.testing import flat_params

    reductions = []

    def counting_hook(state, bucket):
        reductions.append(1)
        return allreduce_hook(state, bucket)

    class Counting(type(_module())):
        def on_train_start(self):
            self.trainer.strategy.model.register_comm_hook(dist.group.WORLD, counting_hook)

    module = Counting()
    trainer = make_trainer(strategy, NS, max_epochs=EPOCHS, limit_val_batches=0)
    trainer.fit(module, _loader(PER_RANK))  # PER_RANK a rank and optimizer step: micro-batches of 2
    return {"params": flat_params(module.net), "micro_batches": len(module.losses), "steps": trainer.global_step,
            "accumulate_grad_batches": trainer.accumulate_grad_batches, "reductions": len(reductions)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_data_2_accumulate_2_equals_one_process_with_the_global_batch(launched):
    results = [r["accumulation"] for r in launched]
    reference, _ = _plain_lightning("32-true")  # batches of 8 = 2 (micro) x 2 (accumulate) x 2 (data)
    for r in results:
        assert r["accumulate_grad_batches"] == 2, "set from Strategy(accumulate=)"
        assert (r["micro_batches"], r["steps"]) == (10 * EPOCHS, 5 * EPOCHS)
        assert r["reductions"] == r["steps"], "one gradient all-reduce per optimizer step (no_sync between)"
        assert _max_diff(r["params"], reference) < 1e-5


#: fp16 keeps 11 bits of mantissa: fp16-mixed at data=2 stays within this of float32 in one process.
FP16_ATOL = 2e-4


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fp16_mixed_at_data_2_scales_the_loss_and_trains_as_float32_within_fp16_tolerance(launched):
    fp32, _ = _plain_lightning("32-true")
    for r in (r["fp16"] for r in launched):
        assert r["plugin"] == ("MixedPrecision", "16-mixed")
        assert r["dtypes"] == ["torch.float16"]
        assert r["scale"] is not None and r["scale"] > 1, "dynamic loss scaling (GradScaler) on the CPU"
        assert _max_diff(r["params"], fp32) < FP16_ATOL


def test_a_gradient_accumulation_scheduler_is_refused_with_a_strategy_accumulation():
    import lightning.pytorch as L

    from polyparallel_lightning.precision import reconcile_accumulation

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[L.callbacks.GradientAccumulationScheduler({0: 2})])
    with pytest.raises(pp.TopologyError, match=r"GradientAccumulationScheduler\(\{0: 2\}\) contradicts "
                                               r"Strategy\(accumulate=2\)"):
        reconcile_accumulation(pp.Strategy(accumulate=2), trainer)
    reconcile_accumulation(pp.Strategy(), trainer)  # with accumulate=1 the scheduler decides, as in Lightning
