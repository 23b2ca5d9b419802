"""Ignite's declared surface (:mod:`polyparallel_ignite.surface`): it covers everything the installed
ignite lists, its published table is the generated one, every "works" entry names a test that
exists, and every refused entry is refused when its engine is attached or starts, before any
collective, with a message naming it, why and what to do instead."""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch

import polyparallel as pp
from polyparallel.testing.surface import SurfaceError, check_table
from polyparallel_ignite import surface

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_entry_of_the_installed_ignite_is_classified() -> None:
    surface.SURFACE.check_covers(surface.discover())


def test_the_published_table_is_the_generated_one() -> None:
    check_table(surface.SURFACE, os.path.join(ROOT, "docs", "surface", "ignite.md"))


def test_every_works_entry_names_a_test_that_exists() -> None:
    surface.SURFACE.check_tests_exist(ROOT)


def _stand_in(name: str) -> Any:
    """An object of class ``name`` as the adapter sees it: the real class where it can be built
    here without its optional package, else a class of that module and name."""
    module, _, cls = name.rpartition(".")
    base = importlib.import_module(module)
    real = getattr(base, cls)
    stand_in = type(cls, (real,), {"__init__": lambda self, *a, **k: None, "__module__": real.__module__})
    stand_in.__qualname__ = real.__qualname__
    return stand_in()


def _attach(obj: Any, kind: str, engine: Any) -> None:
    from ignite.engine import Events
    from ignite.metrics import Metric

    if kind == "metric":
        engine.add_event_handler(Events.EPOCH_COMPLETED, Metric.completed.__get__(obj), "refused")
    else:
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e, o: None, obj)


@pytest.mark.parametrize("when", ["attach", "run"])
@pytest.mark.parametrize("entry", [e for e in surface.SURFACE.entries if e.status == "refused" and e.kind != "entry point"],
                         ids=lambda e: e.short)
def test_refused_metrics_and_handlers_are_refused_before_any_collective(entry: Any, when: str) -> None:
    from ignite.engine import Engine

    ignite = pp.Strategy(data=1).adapt("ignite")
    engine = Engine(lambda e, b: b)
    obj = _stand_in(entry.name)
    if when == "attach":
        _attach(obj, entry.kind, engine)
        with pytest.raises(SurfaceError) as info:
            ignite.attach(engine)
    else:
        ignite.attach(engine)
        _attach(obj, entry.kind, engine)
        ran = []
        from ignite.engine import Events

        engine.add_event_handler(Events.ITERATION_STARTED, lambda e: ran.append(1))
        with pytest.raises(SurfaceError) as info:
            engine.run([1, 2])
        assert ran == [], "the run started before the refusal"
    message = str(info.value)
    assert entry.name in message and entry.reason in message and entry.instead in message, message


@pytest.mark.parametrize("step", ["supervised_training_step_amp", "supervised_evaluation_step_amp",
                                  "supervised_training_step_apex", "supervised_training_step_tpu"])
def test_refused_step_functions_are_refused_when_their_engine_is_attached(step: str) -> None:
    from ignite.engine import Engine

    ignite = pp.Strategy(data=1).adapt("ignite")

    def update(engine: Any, batch: Any) -> Any:
        return batch

    update.__qualname__ = f"{step}.<locals>.update"
    with pytest.raises(SurfaceError, match=step):
        ignite.attach(Engine(update))


def test_model_checkpoint_is_refused_where_ranks_hold_shards(tmp_path: Any) -> None:
    from ignite.engine import Engine, Events
    from ignite.handlers import ModelCheckpoint

    saver = ModelCheckpoint(str(tmp_path), "m", require_empty=False)
    for strategy in (pp.Strategy(data=1, zero=2), pp.Strategy(data=1, tensor=2)):
        engine = Engine(lambda e, b: b)
        engine.add_event_handler(Events.COMPLETED, saver, {"model": torch.nn.Linear(1, 1)})
        with pytest.raises(SurfaceError, match="ModelCheckpoint"):
            surface.check_engine(engine, strategy)
    surface.check_engine(engine, pp.Strategy(data=2))  # replicas only: works


def test_deterministic_engine_is_refused_when_attached() -> None:
    from ignite.engine import DeterministicEngine

    with pytest.raises(SurfaceError, match="ReproducibleBatchSampler"):
        pp.Strategy(data=1).adapt("ignite").attach(DeterministicEngine(lambda e, b: b))
