"""fastai's declared surface (:mod:`polyparallel_fastai.surface`): it covers everything the installed
fastai lists, its published table is the generated one, every "works" entry names a test that
exists, and every refused entry is refused before any operation of the strategy runs, with a
message naming it, why and what to do instead. (The "works" entries run in test_surface_works.py.)"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import polyparallel as pp
from polyparallel.testing.surface import SurfaceError, check_table
from polyparallel_fastai import surface
from polyparallel_fastai.testing import make_learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_entry_of_the_installed_fastai_is_classified() -> None:
    surface.SURFACE.check_covers(surface.discover())


def test_the_published_table_is_the_generated_one() -> None:
    check_table(surface.SURFACE, os.path.join(ROOT, "docs", "surface", "fastai.md"))


def test_every_works_entry_names_a_test_that_exists() -> None:
    surface.SURFACE.check_tests_exist(ROOT)


class _Counter:
    """Counts the strategy's operations dispatched (hook wrappers)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @pp.hookimpl(wrapper=True)
    def polyparallel_wrap_model(self) -> Any:
        self.calls.append("wrap_model")
        return (yield)

    @pp.hookimpl(wrapper=True)
    def polyparallel_sync_states(self) -> Any:
        self.calls.append("sync_states")
        return (yield)

    @pp.hookimpl(wrapper=True)
    def polyparallel_reduce_metrics(self) -> Any:
        self.calls.append("reduce_metrics")
        return (yield)


def _data(n: int = 11) -> TensorDataset:
    torch.manual_seed(0)
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def _instance(name: str, kind: str) -> Any:
    """An object of the refused class ``name`` — the class itself where it imports here, else a
    class of the same module and name (what the adapter matches) deriving from fastai's base."""
    import importlib

    from fastai.callback.core import Callback
    from fastai.learner import Metric

    module, _, cls = name.rpartition(".")
    try:
        real = getattr(importlib.import_module(module), cls)
    except Exception:  # torchvision, accelerate, wandb, ... are not installed here
        real = None
    if real is not None and not isinstance(real, type):  # a function metric (foreground_acc)
        return real
    if real is not None:
        try:
            return real()
        except TypeError:
            pass  # needs arguments: a stand-in of the same name is what the adapter sees
    base = Callback if kind == "callback" else Metric
    stand_in = type(cls, (real,) if real is not None else (base,), {"__module__": module, "__init__": lambda self: None})
    stand_in.__qualname__ = cls
    return stand_in()


def _refused_before_anything(obj: Any, kind: str, run: str) -> str:
    counter = _Counter()
    pm = pp.get_plugin_manager()
    pm.register(counter, name="fastai-surface-counter")
    try:
        strategy = pp.Strategy(data=1, timeout=10)
        cbs, metrics = ([obj], []) if kind == "callback" else ([], [obj])
        learn = make_learner(_data(), _data(), nn.Linear(4, 2), 4, cbs=[*cbs, strategy.adapt("fastai")], metrics=metrics)
        with pytest.raises(TypeError) as info:
            learn.fit(1) if run == "fit" else learn.validate()
    finally:
        pm.unregister("fastai-surface-counter")
    assert counter.calls == [], f"{obj!r}: operations ran before the refusal: {counter.calls}"
    assert isinstance(learn.model, nn.Linear)
    return str(info.value)


@pytest.mark.parametrize("run", ["fit", "validate"])
@pytest.mark.parametrize("entry", [e for e in surface.SURFACE.entries if e.status == "refused" and e.kind != "entry point"],
                         ids=lambda e: e.short)
def test_refused_callbacks_and_metrics_are_refused_before_any_operation(entry: Any, run: str,
                                                                        polyparallel_clean: Any) -> None:
    obj = _instance(entry.name, entry.kind)
    if entry.name == "fastai.metrics.optim_metric":
        from fastai.metrics import accuracy, optim_metric

        obj = optim_metric(lambda inp, targ, thresh: accuracy(inp, targ), "thresh", (0.0, 1.0))
    if entry.name == "fastai.metrics.MatthewsCorrCoefMulti":
        from fastai.metrics import MatthewsCorrCoefMulti

        obj = MatthewsCorrCoefMulti()
    message = _refused_before_anything(obj, entry.kind, run)
    assert entry.name in message and entry.reason in message and entry.instead in message, message


#: The refused Learner methods and the callback refusal that stops them (fastai.distributed
#: does not import without accelerate; the others add a refused callback).
ENFORCED_BY = {
    "to_distributed": "fastai.distributed.DistributedTrainer", "distrib_ctx": "fastai.distributed.DistributedTrainer",
    "detach_distributed": "fastai.distributed.DistributedTrainer", "to_parallel": "fastai.distributed.ParallelTrainer",
    "detach_parallel": "fastai.distributed.ParallelTrainer", "parallel_ctx": "fastai.distributed.ParallelTrainer",
    "to_non_native_fp16": "fastai.callback.fp16.NonNativeMixedPrecision",
    "to_non_native_fp32": "fastai.callback.fp16.NonNativeMixedPrecision",
    "gather_args": "fastai.callback.wandb.WandbCallback",
}


def test_refused_learner_methods_are_those_of_refused_callbacks(polyparallel_clean: Any) -> None:
    refused = {e.short for e in surface.SURFACE.of_kind("entry point", "refused")}
    assert refused == set(ENFORCED_BY)
    for method, callback in ENFORCED_BY.items():
        assert surface.SURFACE[callback].status == "refused", (method, callback)
    learn = make_learner(_data(), _data(), nn.Linear(4, 2), 4, cbs=[pp.Strategy(data=1).adapt("fastai")])
    learn.to_non_native_fp16()
    with pytest.raises(SurfaceError, match="ModelToHalf|NonNativeMixedPrecision"):
        learn.fit(1)
    if "fastai.distributed" not in sys.modules:
        with pytest.raises(NameError):  # fastai.distributed cannot import without accelerate
            import fastai.distributed  # noqa: F401


def test_a_subclass_of_your_own_follows_its_base(polyparallel_clean: Any) -> None:
    from fastai.callback.core import Callback
    from fastai.callback.fp16 import NonNativeMixedPrecision

    class Mine(NonNativeMixedPrecision):
        pass

    class Fine(Callback):
        pass

    assert surface.classify(Mine(), "callback").name == "fastai.callback.fp16.NonNativeMixedPrecision"
    assert surface.classify(Fine(), "callback").name == "fastai.callback.core.Callback"
    assert "(the Learner's callback 'Mine')" in _refused_before_anything(Mine(), "callback", "fit")
